"""The AD rule: forward saves (q, k, v, o, lse) and the option operands; backward calls the backward kernel."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from . import _ffi


class Config(NamedTuple):
    """Static (hashable) options of one attention call; mask arrays and the dropout key travel as operands."""
    scale: float
    softcap: float        # 0: off
    window_left: int      # -1: unbounded
    window_right: int     # -1: unbounded; causal is 0
    bottom_right: bool    # causal diagonal at Sk - Sq (FlashAttention) rather than 0 (jax.nn)
    segment_ids: bool     # the segment-id operands are meaningful
    lengths: bool         # the length operands are meaningful
    dropout_rate: float   # 0: off
    deterministic: bool   # backward without atomics: bitwise-reproducible gradients


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q, k, v, operands, cfg: Config):
    return _ffi.fwd(q, k, v, operands, cfg)


def _fwd(q, k, v, operands, cfg):
    o, lse = _ffi.fwd(q, k, v, operands, cfg)
    return (o, lse), (q, k, v, o, lse, operands)


def _bwd(cfg, res, cotangents):
    do, dlse = cotangents
    q, k, v, o, lse, operands = res
    no_grad = tuple(None for _ in operands)  # integer operands: no cotangents
    return (*_ffi.bwd(do, q, k, v, o, lse, dlse, operands, cfg), no_grad)


flash.defvjp(_fwd, _bwd)
