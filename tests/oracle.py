"""Float64 NumPy attention: the independent oracle for every kernel test (no JAX involved)."""
from __future__ import annotations

import numpy as np


def visible_mask(sq: int, sk: int, causal: bool = False, *, window=None, bottom_right=True, offset=0,
                 q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None) -> np.ndarray:
    """Bool [..., 1, Sq, Sk]: query i sees key j iff c - left <= j <= c + right, c = i + (sk - sq) (bottom
    right) or i (top left), plus `offset`, a negative side unbounded, causal meaning right = min(right, 0); segment ids
    equal; j < kv_lengths; i < q_lengths. Bottom right with lengths: c = i + kv_lengths - q_lengths + offset, per
    sequence (a missing length is the full one)."""
    left, right = (-1, -1) if window is None else (-1 if w is None else w for w in window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    c = (i + (sk - sq if bottom_right else 0) + offset)[None]  # [1 (heads), Sq, 1]
    if bottom_right and (q_lengths is not None or kv_lengths is not None):
        ql = sq if q_lengths is None else np.asarray(q_lengths).astype(np.int64)
        kl = sk if kv_lengths is None else np.asarray(kv_lengths).astype(np.int64)
        c = c + (np.asarray(kl - ql) - (sk - sq))[..., None, None, None]
    mask = np.ones(c.shape[:-1] + (sk,), bool)
    if right >= 0:
        mask &= j <= c + right
    if left >= 0:
        mask &= j >= c - left
    if q_segment_ids is not None:
        qs, ks = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
        mask = mask & (qs[..., None, :, None] == ks[..., None, None, :])
    if kv_lengths is not None:
        mask = mask & (j < np.asarray(kv_lengths)[..., None, None, None])
    if q_lengths is not None:
        mask = mask & (i < np.asarray(q_lengths)[..., None, None, None])
    return mask


def attention(q, k, v, *, causal=False, scale=None, do=None, softcap=None, keep=None, rate=0.0, **mask_kwargs):
    """q [..., Sq, Hq, D], k/v [..., Sk, Hk, D] -> (o, lse) and, when `do` is given, (dq, dk, dv).

    All math in float64. Rows that see no key give o = 0, lse = -inf, zero gradients. `mask_kwargs`: the
    keywords of `visible_mask` (window, bottom_right, segment ids, lengths). `keep` (bool [..., Hq, Sq, Sk])
    and `rate`: dropout, kept probabilities scaled by 1 / (1 - the rate rounded to a multiple of 1/256, the
    kernels' step); the lse is the undropped one."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    hq, hk = q.shape[-2], k.shape[-2]
    g = hq // hk
    # Work in [..., H, S, D] so every product is a batched matmul (BLAS), not an einsum loop.
    qt = np.swapaxes(q, -2, -3)
    kt = np.swapaxes(np.repeat(k, g, axis=-2), -2, -3)
    vt = np.swapaxes(np.repeat(v, g, axis=-2), -2, -3)
    s = (qt @ np.swapaxes(kt, -1, -2)) * scale
    t = None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
    mask = visible_mask(q.shape[-3], k.shape[-3], causal, **mask_kwargs)
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    dropped = np.floor(float(np.float32(rate)) * 256.0 + 0.5) / 256.0
    z = 1.0 if keep is None else np.asarray(keep, np.float64) / (1.0 - dropped)
    o = np.swapaxes((p * z) @ vt, -2, -3)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m_safe[..., 0], -np.inf)
    if do is None:
        return o, lse
    dot = np.swapaxes(np.asarray(do, np.float64), -2, -3)
    dp = (dot @ np.swapaxes(vt, -1, -2)) * z
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if t is not None:
        ds = ds * (1 - t * t)
    dq = np.swapaxes(ds @ kt, -2, -3) * scale
    dkr = np.swapaxes(np.swapaxes(ds, -1, -2) @ qt, -2, -3) * scale  # [..., Sk, Hq, D]
    dvr = np.swapaxes(np.swapaxes(p * z, -1, -2) @ dot, -2, -3)
    shape_k = k.shape[:-2] + (hk, g, d)
    dk = dkr.reshape(shape_k).sum(-2)
    dv = dvr.reshape(shape_k).sum(-2)
    return o, lse, dq, dk, dv
