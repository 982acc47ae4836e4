"""The AD rule: forward saves (q, k, v, o, lse); backward calls the backward kernel."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from . import _ffi, reference


class Config(NamedTuple):
    """Static (hashable) options of one attention call."""
    scale: float
    causal: bool
    deterministic: bool   # backward without atomics: bitwise-reproducible gradients
    reference_bwd: bool  # GPU only, until the CUDA backward kernel lands: VJP of the reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash(q, k, v, cfg: Config):
    return _ffi.fwd(q, k, v, scale=cfg.scale, causal=cfg.causal)


def _fwd(q, k, v, cfg):
    o, lse = _ffi.fwd(q, k, v, scale=cfg.scale, causal=cfg.causal)
    return (o, lse), (q, k, v, o, lse)


def _bwd(cfg, res, cotangents):
    do, dlse = cotangents
    q, k, v, o, lse = res
    if cfg.reference_bwd:
        _, vjp = jax.vjp(
            lambda q, k, v: reference.attention_with_lse(q, k, v, causal=cfg.causal, scale=cfg.scale), q, k, v)
        return vjp((do, dlse))
    return _ffi.bwd(do, q, k, v, o, lse, dlse, scale=cfg.scale, causal=cfg.causal, deterministic=cfg.deterministic)


flash.defvjp(_fwd, _bwd)
