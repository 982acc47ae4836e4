"""Plain, materialising attention in jax.numpy: the same semantics as `jaxflash.attention`. It builds the
full [..., H, Sq, Sk] score matrix and mask, so it is the oracle for tests and benchmarks (and
`backend="reference"`), not a fast path. Its gradients come from JAX autodiff."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .dropout import dropout_mask, keep_scale
from .mask import Mask


def visible(sq: int, sk: int, *, causal: bool = False, window=None, bottom_right: bool = True,
            q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None):
    """Bool mask [..., 1, Sq, Sk] (leading dims only when an array argument has them): query i sees key j
    iff c - left <= j <= c + right with c = i + (Sk - Sq if bottom_right else 0) (a side of -1 or None is
    unbounded; causal sets right = 0), the segment ids are equal, j < kv_lengths and i < q_lengths. Bottom-right
    with lengths aligns per sequence: c = i + kv_lengths - q_lengths (a missing one is Sk or Sq)."""
    return mask_matrix(sq, sk, Mask(causal, window, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths,
                                    bottom_right))


def mask_matrix(sq: int, sk: int, mask: Mask):
    """`visible` of a `Mask`."""
    left, right = mask.sides()
    i = jnp.arange(sq)[:, None]
    j = jnp.arange(sk)[None, :]
    c = i + mask.diagonal(sq, sk)
    if mask.bottom_right and (mask.q_lengths is not None or mask.kv_lengths is not None):
        # Bottom-right per sequence: its last valid query sits on its last valid key (lengths as given, also
        # outside [0, S]: they then place the block within a longer sequence, as in a ring step).
        ql = sq if mask.q_lengths is None else jnp.asarray(mask.q_lengths)
        kl = sk if mask.kv_lengths is None else jnp.asarray(mask.kv_lengths)
        c = c + (jnp.asarray(kl - ql) - (sk - sq))[..., None, None, None]  # [..., 1 (heads), Sq, 1]
    else:
        c = c[None]
    out = jnp.ones(c.shape[:-1] + (sk,), bool)
    if right >= 0:
        out &= j <= c + right
    if left >= 0:
        out &= j >= c - left
    if mask.q_segment_ids is not None:
        out = out & (mask.q_segment_ids[..., None, :, None] == mask.kv_segment_ids[..., None, None, :])
    if mask.kv_lengths is not None:
        out = out & (j < jnp.asarray(mask.kv_lengths)[..., None, None, None])
    if mask.q_lengths is not None:
        out = out & (i < jnp.asarray(mask.q_lengths)[..., None, None, None])
    return out


def attention_with_lse(query, key, value, *, causal: bool = False, scale: float | None = None, window=None,
                       softcap: float | None = None, bottom_right: bool = True, q_segment_ids=None,
                       kv_segment_ids=None, q_lengths=None, kv_lengths=None, dropout_rate: float = 0.0,
                       dropout_key=None):
    """Returns (out, lse) computed in the inputs' dtype; rows that see no key give 0 and -inf. Dropout uses
    `jaxflash.dropout.dropout_mask`, the kernels' rule; the LSE is that of the undropped softmax."""
    mask = Mask(causal, window, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, bottom_right)
    return attend(query, key, value, mask, scale=scale, softcap=softcap, dropout_rate=dropout_rate,
                  dropout_key=dropout_key)


def attend(query, key, value, mask: Mask, *, scale: float | None = None, softcap: float | None = None,
           dropout_rate: float = 0.0, dropout_key=None, positions=(0, 0)):
    """`attention_with_lse` with the mask as one `Mask`; `positions`: the (row, column) of this block in the
    sequence whose dropout mask it draws."""
    d = query.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    group = query.shape[-2] // key.shape[-2]
    k = jnp.repeat(key, group, axis=-2)
    v = jnp.repeat(value, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", query, k) * jnp.asarray(scale, query.dtype)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask_matrix(query.shape[-3], key.shape[-3], mask), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0).astype(s.dtype)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l > 0, l, 1).astype(l.dtype)
    if dropout_rate > 0:
        lead, (h, sq, sk) = query.shape[:-3], p.shape[-3:]
        keep = dropout_mask(dropout_key, int(np.prod(lead, dtype=np.int64)), h, sq, sk, dropout_rate,
                            row_offset=positions[0], col_offset=positions[1])
        p = jnp.where(keep.reshape(lead + (h, sq, sk)), p * jnp.asarray(keep_scale(dropout_rate), p.dtype), 0)
    out = jnp.einsum("...hqk,...khd->...qhd", p, v).astype(query.dtype)
    l32 = l[..., 0].astype(jnp.float32)
    lse = jnp.where(l32 > 0, jnp.log(jnp.where(l32 > 0, l32, 1)) + m[..., 0].astype(jnp.float32), -jnp.inf)
    return out, lse


def attention(query, key, value, *, causal: bool = False, scale: float | None = None, window=None,
              softcap: float | None = None, q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
              kv_lengths=None, dropout_rate: float = 0.0, dropout_key=None, return_lse: bool = False):
    """Reference attention; see `jaxflash.attention` for shapes and semantics."""
    mask = Mask(causal, window, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths)
    out, lse = attend(query, key, value, mask, scale=scale, softcap=softcap, dropout_rate=dropout_rate,
                      dropout_key=dropout_key)
    return (out, lse) if return_lse else out
