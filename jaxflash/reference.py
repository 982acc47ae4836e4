"""Plain, materialising attention in jax.numpy: the same semantics as `jaxflash.attention`. It builds the
full [..., H, Sq, Sk] score matrix and mask, so it is the oracle for tests and benchmarks (and
`backend="reference"`), not a fast path. Its gradients come from JAX autodiff."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .dropout import dropout_mask


def visible(sq: int, sk: int, *, causal: bool = False, window=None, bottom_right: bool = True,
            q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None):
    """Bool mask [..., 1, Sq, Sk] (leading dims only when an array argument has them): query i sees key j
    iff c - left <= j <= c + right with c = i + (Sk - Sq if bottom_right else 0) (a side of -1 or None is
    unbounded; causal sets right = 0), the segment ids are equal, j < kv_lengths and i < q_lengths."""
    left, right = _window(window, causal)
    i = jnp.arange(sq)[:, None]
    j = jnp.arange(sk)[None, :]
    c = i + (sk - sq if bottom_right else 0)
    mask = jnp.ones((sq, sk), bool)
    if right >= 0:
        mask &= j <= c + right
    if left >= 0:
        mask &= j >= c - left
    mask = mask[None]  # the heads axis
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[..., None, :, None] == kv_segment_ids[..., None, None, :])
    if kv_lengths is not None:
        mask = mask & (j < jnp.asarray(kv_lengths)[..., None, None, None])
    if q_lengths is not None:
        mask = mask & (i < jnp.asarray(q_lengths)[..., None, None, None])
    return mask


def _window(window, causal):
    left, right = (-1, -1) if window is None else (-1 if w is None else int(w) for w in window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def attention_with_lse(query, key, value, *, causal: bool = False, scale: float | None = None, window=None,
                       softcap: float | None = None, bottom_right: bool = True, q_segment_ids=None,
                       kv_segment_ids=None, q_lengths=None, kv_lengths=None, dropout_rate: float = 0.0,
                       dropout_key=None):
    """Returns (out, lse) computed in the inputs' dtype; rows that see no key give 0 and -inf. Dropout uses
    `jaxflash.dropout.dropout_mask`, the kernels' rule; the LSE is that of the undropped softmax."""
    d = query.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    group = query.shape[-2] // key.shape[-2]
    k = jnp.repeat(key, group, axis=-2)
    v = jnp.repeat(value, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", query, k) * jnp.asarray(scale, query.dtype)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    mask = visible(query.shape[-3], key.shape[-3], causal=causal, window=window, bottom_right=bottom_right,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
                   kv_lengths=kv_lengths)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0).astype(s.dtype)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l > 0, l, 1).astype(l.dtype)
    if dropout_rate > 0:
        lead, (h, sq, sk) = query.shape[:-3], p.shape[-3:]
        keep = dropout_mask(dropout_key, int(np.prod(lead, dtype=np.int64)), h, sq, sk, dropout_rate)
        p = jnp.where(keep.reshape(lead + (h, sq, sk)), p / jnp.asarray(1 - dropout_rate, p.dtype), 0)
    out = jnp.einsum("...hqk,...khd->...qhd", p, v).astype(query.dtype)
    l32 = l[..., 0].astype(jnp.float32)
    lse = jnp.where(l32 > 0, jnp.log(jnp.where(l32 > 0, l32, 1)) + m[..., 0].astype(jnp.float32), -jnp.inf)
    return out, lse


def attention(query, key, value, *, causal: bool = False, scale: float | None = None, window=None,
              softcap: float | None = None, q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
              kv_lengths=None, dropout_rate: float = 0.0, dropout_key=None, return_lse: bool = False):
    """Reference attention; see `jaxflash.attention` for shapes and semantics."""
    out, lse = attention_with_lse(query, key, value, causal=causal, scale=scale, window=window, softcap=softcap,
                                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                  q_lengths=q_lengths, kv_lengths=kv_lengths, dropout_rate=dropout_rate,
                                  dropout_key=dropout_key)
    return (out, lse) if return_lse else out
