"""The AD rule: forward saves (q, k, v, o, lse) and the mask arrays; backward calls the backward kernel."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from . import _ffi


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q, k, v, mask_arrays, cfg: Config):
    return _ffi.fwd(q, k, v, mask_arrays, cfg)


def _fwd(q, k, v, mask_arrays, cfg):
    o, lse = _ffi.fwd(q, k, v, mask_arrays, cfg)
    return (o, lse), (q, k, v, o, lse, mask_arrays)


def _bwd(cfg, res, cotangents):
    do, dlse = cotangents
    q, k, v, o, lse, mask_arrays = res
    no_grad = tuple(None for _ in mask_arrays)  # integer operands: zero cotangents
    return (*_ffi.bwd(do, q, k, v, o, lse, dlse, mask_arrays, cfg), no_grad)


flash.defvjp(_fwd, _bwd)
