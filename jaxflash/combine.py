"""`jaxflash.combine`: attention over disjoint key sets merged into the attention over their union, through the
log-sum-exp each part returns. The building block of split-KV decoding, ring attention and prefix caching."""
from __future__ import annotations

import jax.numpy as jnp

_NAME = "jaxflash.combine"


def combine(outs, lses):
    """Merges attention outputs computed over disjoint sets of keys (same queries) into the attention over all.

    With ``lse = logsumexp_i lses[i]``, the result is ``out = sum_i exp(lses[i] - lse) * outs[i]``, computed in
    float32: exactly what one attention call over the union of the keys returns (up to rounding), as
    ``jaxflash.attention(..., return_lse=True)`` gives each part.

    Args:
      outs: ``[n, ..., Sq, H, D]``: part ``i``'s output, in any float dtype.
      lses: ``[n, ..., H, Sq]``: part ``i``'s log-sum-exp (natural log), ``-inf`` where a row saw no key of
        that part.

    Returns:
      ``(out, lse)``: ``out`` ``[..., Sq, H, D]`` in the outs' dtype and ``lse`` ``[..., H, Sq]`` float32. Parts
      whose LSE is ``-inf`` contribute nothing; a row that is ``-inf`` in every part gives 0 and ``-inf``, never
      NaN (its gradients are 0 too).
    """
    for arg, x in (("outs", outs), ("lses", lses)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{_NAME}: {arg} must be an array; got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{_NAME}: {arg} must have a floating dtype; got {x.dtype}")
    if outs.ndim < 4:
        raise ValueError(f"{_NAME}: outs must have rank >= 4 ([n, ..., Sq, H, D]); got shape {outs.shape}")
    want = outs.shape[:-3] + (outs.shape[-2], outs.shape[-3])
    if lses.shape != want:
        raise ValueError(f"{_NAME}: lses must have shape [n, ..., H, Sq] = {want} for outs of shape {outs.shape}; "
                         f"got {lses.shape}")
    if outs.shape[0] == 0:
        raise ValueError(f"{_NAME}: need at least one part; got outs of shape {outs.shape}")

    lses = lses.astype(jnp.float32)
    top = jnp.max(lses, axis=0)
    seen = jnp.isfinite(top)  # a row with no key in any part stays 0 / -inf
    safe_top = jnp.where(seen, top, 0.0)
    # exp(-inf - finite) = 0 drops empty parts; rows seen nowhere are masked so no inf - inf reaches exp.
    weights = jnp.where(seen, jnp.exp(lses - safe_top), 0.0)
    total = jnp.sum(weights, axis=0)
    safe_total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, safe_top + jnp.log(safe_total), -jnp.inf)
    scale = jnp.swapaxes(weights / safe_total, -1, -2)[..., None]  # [n, ..., Sq, H, 1]
    # A part of weight 0 is skipped outright: its output may hold anything (0 * NaN would be NaN).
    out = jnp.sum(jnp.where(scale > 0, scale * outs.astype(jnp.float32), 0.0), axis=0)
    return out.astype(outs.dtype), lse
