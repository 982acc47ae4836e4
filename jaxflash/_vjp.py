"""The AD rule: forward saves (q, k, v, o, lse) and the option operands; backward calls the backward kernel."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _ffi, _partition


class Config(NamedTuple):
    """Static (hashable) options of one attention call; mask arrays and the dropout key travel as operands."""
    scale: float
    softcap: float        # 0: off
    window_left: int      # -1: unbounded
    window_right: int     # -1: unbounded; causal is 0
    bottom_right: bool    # causal diagonal at Sk - Sq (FlashAttention) rather than 0 (jax.nn)
    diagonal_shift: int   # added to that diagonal (Mask.offset)
    segment_ids: bool     # the segment-id operands are meaningful
    lengths: bool         # the length operands are meaningful
    dropout_rate: float   # 0: off
    deterministic: bool   # backward summing dQ in a fixed order: bitwise-reproducible gradients
    backend: str          # "cpu" or "cuda": the kernels XLA will run


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q, k, v, operands, cfg: Config):
    return _partition.fwd(q, k, v, operands, cfg)


def _fwd(q, k, v, operands, cfg):
    # This rule runs only under differentiation: the place to refuse, at trace time, a configuration whose
    # backward kernel was not compiled.
    if cfg.backend == "cuda":
        _check_cuda_backward(q)
    o, lse = _partition.fwd(q, k, v, operands, cfg)
    return (o, lse), (q, k, v, o, lse, operands)


def _bwd(cfg, res, cotangents):
    do, dlse = cotangents
    q, k, v, o, lse, operands = res
    no_grad = tuple(None for _ in operands)  # integer operands: no cotangents
    return (*_partition.bwd(do, q, k, v, o, lse, dlse, operands, cfg), no_grad)


flash.defvjp(_fwd, _bwd)


def _check_cuda_backward(q):
    dtype, d = jnp.dtype(q.dtype).name, q.shape[-1]
    compiled = _ffi.cuda_supported("bwd")
    if (dtype, d) in compiled:
        return
    raise NotImplementedError(f"jaxflash.attention: the CUDA backward pass is not compiled for {dtype} with head "
                              f"dim {d}, only the forward; the backward is compiled for "
                              f"{_ffi.describe_configs(compiled)} (cast, pad the head dim, or differentiate with "
                              "backend='reference')")
