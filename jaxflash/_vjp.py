"""The AD rule: forward saves (q, k, v, o, lse) and the mask arrays; backward calls the backward kernel."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from . import _ffi, reference


class Config(NamedTuple):
    """Static (hashable) options of one attention call; the mask arrays travel as operands."""
    scale: float
    softcap: float        # 0: off
    window_left: int      # -1: unbounded
    window_right: int     # -1: unbounded; causal is 0
    bottom_right: bool    # causal diagonal at Sk - Sq (FlashAttention) rather than 0 (jax.nn)
    segment_ids: bool     # the segment-id operands are meaningful
    lengths: bool         # the length operands are meaningful
    deterministic: bool   # backward without atomics: bitwise-reproducible gradients
    reference_bwd: bool   # GPU only, until the CUDA backward kernel lands: VJP of the reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q, k, v, mask_arrays, cfg: Config):
    return _ffi.fwd(q, k, v, mask_arrays, cfg)


def _fwd(q, k, v, mask_arrays, cfg):
    o, lse = _ffi.fwd(q, k, v, mask_arrays, cfg)
    return (o, lse), (q, k, v, o, lse, mask_arrays)


def _bwd(cfg, res, cotangents):
    do, dlse = cotangents
    q, k, v, o, lse, mask_arrays = res
    no_grad = jax.tree.map(lambda _: None, mask_arrays)  # integer operands: zero cotangents
    if cfg.reference_bwd:
        _, vjp = jax.vjp(lambda q, k, v: reference.attention_with_lse(q, k, v, **reference_kwargs(cfg, mask_arrays)),
                         q, k, v)
        return (*vjp((do, dlse)), no_grad)
    return (*_ffi.bwd(do, q, k, v, o, lse, dlse, mask_arrays, cfg), no_grad)


def reference_kwargs(cfg: Config, mask_arrays) -> dict:
    """The keywords of `reference.attention_with_lse` that describe the same computation as cfg."""
    q_seg, kv_seg, q_len, kv_len = mask_arrays
    return dict(scale=cfg.scale, softcap=cfg.softcap or None, window=(cfg.window_left, cfg.window_right),
                bottom_right=cfg.bottom_right, q_segment_ids=q_seg if cfg.segment_ids else None,
                kv_segment_ids=kv_seg if cfg.segment_ids else None, q_lengths=q_len if cfg.lengths else None,
                kv_lengths=kv_len if cfg.lengths else None)


flash.defvjp(_fwd, _bwd)
