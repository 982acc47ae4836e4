"""Plain, materialising attention in jax.numpy: the same signature and semantics as
`jaxflash.attention`. It builds the full [..., H, Sq, Sk] score matrix, so it is the oracle for tests and
benchmarks (and `backend="reference"`), not a fast path. Its gradients come from JAX autodiff."""
from __future__ import annotations

import jax.numpy as jnp


def visible(sq: int, sk: int, causal: bool):
    """[sq, sk] bool mask: query i sees key j iff j <= i + (sk - sq) when causal (bottom-right)."""
    i = jnp.arange(sq)[:, None]
    j = jnp.arange(sk)[None, :]
    return (j <= i + (sk - sq)) if causal else jnp.ones((sq, sk), bool)


def attention_with_lse(query, key, value, *, causal: bool = False, scale: float | None = None):
    """Returns (out, lse) computed in the inputs' dtype; rows that see no key give 0 and -inf."""
    d = query.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    group = query.shape[-2] // key.shape[-2]
    k = jnp.repeat(key, group, axis=-2)
    v = jnp.repeat(value, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", query, k) * jnp.asarray(scale, query.dtype)
    mask = visible(query.shape[-3], key.shape[-3], causal)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0).astype(s.dtype)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l > 0, l, 1).astype(l.dtype)
    out = jnp.einsum("...hqk,...khd->...qhd", p, v).astype(query.dtype)
    l32 = l[..., 0].astype(jnp.float32)
    lse = jnp.where(l32 > 0, jnp.log(jnp.where(l32 > 0, l32, 1)) + m[..., 0].astype(jnp.float32), -jnp.inf)
    return out, lse


def attention(query, key, value, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """Reference attention; see `jaxflash.attention` for shapes and semantics."""
    out, lse = attention_with_lse(query, key, value, causal=causal, scale=scale)
    return (out, lse) if return_lse else out
