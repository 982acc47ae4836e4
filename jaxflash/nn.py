"""`jaxflash.dot_product_attention`: `jax.nn.dot_product_attention`'s signature and semantics on the jaxflash
kernels. Only argument translation lives here; validation of the arrays and the kernels are `attention.py`'s."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .attention import attend
from .mask import Mask

# jaxflash backends by `implementation`; jax.nn's own names ("xla", "cudnn") are refused, not remapped.
IMPLEMENTATIONS = (None, "cpu", "cuda", "reference")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: str | None = None, return_residual: bool = False):
    """Drop-in for `jax.nn.dot_product_attention` that runs the jaxflash kernels (forward and backward).

    Same layout, GQA rule, causal alignment and window convention as ``jax.nn.dot_product_attention``:

    Args:
      query: ``[B, T, N, H]`` or ``[T, N, H]``.
      key, value: ``[B, S, K, H]`` or ``[S, K, H]``; ``N`` a multiple of ``K`` (GQA/MQA).
      bias, mask: must be None. An arbitrary bias or boolean mask would need the ``[B, N, T, S]`` matrix the
        kernels never build, so either raises ``NotImplementedError``; express the mask with ``is_causal``,
        ``local_window_size`` and the sequence lengths here, or with segment ids (packed documents) in
        `jaxflash.attention`.
      scale: multiplies the logits; default ``1 / sqrt(H)``. A static positive number.
      is_causal: query ``i`` sees key ``j`` iff ``j <= i``: aligned top-left, as in jax.nn (`jaxflash.attention`
        aligns it bottom-right; the two agree when ``T == S``).
      query_seq_lengths, key_value_seq_lengths: int ``[B]`` (``[1]`` or a scalar for 3-D input): keys at or past
        ``key_value_seq_lengths`` are invisible; output rows at or past ``query_seq_lengths`` are 0.
      local_window_size: ``(left, right)``, or an int ``w`` for ``(w, w)``: query ``i`` sees key ``j`` iff
        ``i - left <= j <= i + right``. Both sides ``>= 0``. Combines with ``is_causal``.
      implementation: a jaxflash backend: ``None`` (the kernel of the platform the inputs are on), ``"cpu"``,
        ``"cuda"`` or ``"reference"`` (see `jaxflash.attention`'s ``backend``). jax.nn's ``"xla"`` and
        ``"cudnn"`` raise ``ValueError``: for those call ``jax.nn.dot_product_attention`` itself.
      return_residual: also return the log-sum-exp of the scaled, masked logits, ``[B, T, N]`` (or ``[T, N]``)
        in the query's dtype, like jax.nn.

    Returns:
      The output shaped and typed like ``query``, or ``(output, residual)``.

    Differences from jax.nn's ``"xla"`` implementation, all in rows where a query sees no key at all
    (e.g. ``key_value_seq_lengths == 0``, or a window that misses every key when ``T > S``): jax.nn fills masked
    logits with a large negative number, so such a row gets a uniform softmax over all ``S`` keys, i.e. the mean
    of ``value``; jaxflash returns 0 there, with zero gradients, and a residual of ``-inf`` (jax.nn: about
    ``-0.7 * float32 max``). Rows past ``query_seq_lengths`` are 0 in both (residual ``-inf`` here). Everywhere
    else the two agree to rounding; jaxflash accumulates in float32 throughout, while jax.nn rounds the
    probabilities to the input dtype before multiplying by ``value``.
    """
    name = "jaxflash.dot_product_attention"
    if bias is not None:
        raise NotImplementedError(
            f"{name}: an arbitrary bias is not supported (the kernels never build the [B, N, T, S] logits); got "
            f"bias of shape {np.shape(bias)}. Supported masks: is_causal, local_window_size, query_seq_lengths, "
            f"key_value_seq_lengths, and segment ids (jaxflash.attention's q_segment_ids/kv_segment_ids)")
    if mask is not None:
        raise NotImplementedError(
            f"{name}: an arbitrary mask array is not supported (the kernels never build the [B, N, T, S] mask); "
            f"got mask of shape {np.shape(mask)}. Express it with is_causal, local_window_size, query_seq_lengths "
            f"or key_value_seq_lengths, or with segment ids for packed documents (jaxflash.attention's "
            f"q_segment_ids/kv_segment_ids)")
    if implementation not in IMPLEMENTATIONS:
        hint = " (jax.nn's own implementations: call jax.nn.dot_product_attention)" \
            if implementation in ("xla", "cudnn") else ""
        raise ValueError(f"{name}: implementation must be None, 'cpu', 'cuda' or 'reference'; got "
                         f"{implementation!r}{hint}")
    for arg, flag in (("is_causal", is_causal), ("return_residual", return_residual)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: {arg} must be a Python bool; got {flag!r}")

    ranks = tuple(getattr(x, "ndim", None) for x in (query, key, value))
    if ranks not in ((3, 3, 3), (4, 4, 4)):
        shapes = ", ".join(f"{n} {getattr(x, 'shape', type(x).__name__)}"
                           for n, x in (("query", query), ("key", key), ("value", value)))
        raise ValueError(f"{name}: query, key and value must all be 4-D [B, T|S, N|K, H] or all 3-D "
                         f"[T|S, N|K, H]; got {shapes}")
    batched = ranks[0] == 4
    if not batched:  # the kernels take any leading dims; one batch element keeps the lengths' shape [B]
        query, key, value = query[None], key[None], value[None]
    q_lengths = _lengths(name, "query_seq_lengths", query_seq_lengths, query.shape[0], batched)
    kv_lengths = _lengths(name, "key_value_seq_lengths", key_value_seq_lengths, query.shape[0], batched)

    mask = Mask(bool(is_causal), _window(name, local_window_size), q_lengths=q_lengths, kv_lengths=kv_lengths,
                bottom_right=False)
    result = attend(query, key, value, mask, scale=scale, return_lse=bool(return_residual), backend=implementation,
                    name=name)
    out, lse = result if return_residual else (result, None)
    if not batched:
        out = out[0]
    if not return_residual:
        return out
    residual = lse.swapaxes(-1, -2).astype(out.dtype)  # [B, N, T] -> jax.nn's [B, T, N]
    return out, (residual if batched else residual[0])


def _window(name, size):
    """jax.nn's local_window_size as jaxflash's (left, right) window; the top-left diagonal makes them equal."""
    if size is None:
        return None
    sides = (size, size) if isinstance(size, (int, np.integer)) and not isinstance(size, bool) else size
    if not isinstance(sides, (tuple, list)) or len(sides) != 2:
        raise ValueError(f"{name}: local_window_size must be an int or a pair (left, right); got {size!r}")
    for w in sides:
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"{name}: local_window_size sides must be ints; got {size!r}")
        if w < 0:
            raise ValueError(f"{name}: local_window_size sides must be >= 0; got {size!r}")
    return int(sides[0]), int(sides[1])


def _lengths(name, arg, x, batch, batched):
    """x as int [B]; for 3-D input jax.nn's [1] (a scalar is accepted too)."""
    if x is None:
        return None
    shape = tuple(np.shape(x))
    if shape != (batch,) and (batched or shape != ()):
        raise ValueError(f"{name}: {arg} must have shape ({batch},); got {shape}")
    if not np.issubdtype(getattr(x, "dtype", np.asarray(x).dtype), np.integer):
        raise TypeError(f"{name}: {arg} must have an integer dtype; got {getattr(x, 'dtype', type(x).__name__)}")
    return x if shape else jnp.reshape(x, (1,))
