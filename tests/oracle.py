"""Float64 NumPy attention: the independent oracle for every kernel test (no JAX involved)."""
from __future__ import annotations

import numpy as np


def visible_mask(sq: int, sk: int, causal: bool) -> np.ndarray:
    """[sq, sk] bool: query i sees key j iff j <= i + (sk - sq) when causal (bottom-right aligned)."""
    if not causal:
        return np.ones((sq, sk), bool)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j <= i + (sk - sq)


def attention(q, k, v, *, causal=False, scale=None, do=None):
    """q [..., Sq, Hq, D], k/v [..., Sk, Hk, D] -> (o, lse) and, when `do` is given, (dq, dk, dv).

    All math in float64. Rows that see no key give o = 0, lse = -inf, zero gradients."""
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
    mask = visible_mask(q.shape[-3], k.shape[-3], causal)
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    o = np.swapaxes(p @ vt, -2, -3)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m_safe[..., 0], -np.inf)
    if do is None:
        return o, lse
    dot = np.swapaxes(np.asarray(do, np.float64), -2, -3)
    dp = dot @ np.swapaxes(vt, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.swapaxes(ds @ kt, -2, -3) * scale
    dkr = np.swapaxes(np.swapaxes(ds, -1, -2) @ qt, -2, -3) * scale  # [..., Sk, Hq, D]
    dvr = np.swapaxes(np.swapaxes(p, -1, -2) @ dot, -2, -3)
    shape_k = k.shape[:-2] + (hk, g, d)
    dk = dkr.reshape(shape_k).sum(-2)
    dv = dvr.reshape(shape_k).sum(-2)
    return o, lse, dq, dk, dv
