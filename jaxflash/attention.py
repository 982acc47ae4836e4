"""`jaxflash.attention`: the public entry point. Owns the contract: layout, defaults, validation and
the choice of backend. Kernels are reached through `_vjp.flash` (custom_vjp over the FFI calls)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, _vjp, reference

MAX_HEAD_DIM = 256
BACKENDS = (None, "cpu", "cuda", "reference")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def attention(query, key, value, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              deterministic: bool = False, backend: str | None = None):
    """FlashAttention-2: softmax(scale * Q K^T) V without materialising the score matrix.

    Args:
      query: ``[..., Sq, Hq, D]``; every leading dim is a batch dim.
      key, value: ``[..., Sk, Hkv, D]`` with the same leading dims; ``Hq`` a multiple of ``Hkv``
        (grouped-query / multi-query attention: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
      causal: mask aligned bottom-right, as FlashAttention aligns it: query ``i`` sees key ``j`` iff
        ``j <= i + (Sk - Sq)``. For Sq=3, Sk=5 (``x`` = visible)::

            q0  x x x . .
            q1  x x x x .
            q2  x x x x x

        A query row that sees no key (possible when Sq > Sk) returns 0 and LSE ``-inf``, never NaN.
      scale: multiplies the scores; defaults to ``1 / sqrt(D)``. Must be finite and positive.
      return_lse: also return the log-sum-exp of the scaled scores, ``[..., Hq, Sq]`` float32 (natural
        log). It is differentiable.
      deterministic: make the backward pass bitwise reproducible run to run. The CUDA backward kernel
        otherwise accumulates dQ with atomics, whose order varies; the CPU kernel is always deterministic.
      backend: ``None`` runs the FFI kernel of the platform the computation is placed on (the CUDA kernel
        on a GPU, the C++ kernel on the CPU); ``"cpu"`` requires the C++ kernel; ``"cuda"`` requires the
        CUDA kernel; ``"reference"`` runs the materialising pure-JAX implementation.

    Returns:
      ``out`` shaped and typed like ``query``, or ``(out, lse)`` when ``return_lse``.

    Dtypes: float32, bfloat16 and float16 on the CPU; bfloat16 and float16 on a GPU. Accumulation is
    float32. Gradients come from the FlashAttention-2 backward kernel, not from autodiff of the reference.
    """
    _check_arrays(query, key, value)
    causal = _check_bool("causal", causal)
    return_lse = _check_bool("return_lse", return_lse)
    deterministic = _check_bool("deterministic", deterministic)
    scale = _check_scale(scale, query.shape[-1])
    backend = _resolve_backend(backend, query)

    if backend == "reference":
        out, lse = reference.attention_with_lse(query, key, value, causal=causal, scale=scale)
    elif 0 in query.shape or 0 in key.shape:
        # Nothing to compute (or nothing to attend to): zeros and -inf, without launching a kernel.
        out = jnp.zeros(query.shape, query.dtype)
        lse = jnp.full(query.shape[:-3] + (query.shape[-2], query.shape[-3]), -jnp.inf, jnp.float32)
    else:
        cfg = _vjp.Config(scale=scale, causal=causal, deterministic=deterministic,
                          reference_bwd=backend == "cuda" and not _ffi.cuda_has_bwd())
        out, lse = _vjp.flash(query, key, value, cfg)
    return (out, lse) if return_lse else out


# --- validation -------------------------------------------------------------------------------------------

def _fail(cls, msg):
    raise cls(f"jaxflash.attention: {msg}")


def _check_arrays(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            _fail(TypeError, f"{name} must be an array; got {type(x).__name__}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            _fail(ValueError, f"{name} must have rank >= 3 ([..., seq, heads, head_dim]); got shape {x.shape}")
    if not (query.ndim == key.ndim == value.ndim):
        _fail(ValueError, f"query, key and value must have the same rank; got query {query.shape}, "
                          f"key {key.shape}, value {value.shape}")
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        _fail(ValueError, f"query, key and value must share leading (batch) dims; got query {query.shape}, "
                          f"key {key.shape}, value {value.shape}")
    if key.shape != value.shape:
        _fail(ValueError, f"key and value must have the same shape; got key {key.shape}, value {value.shape}")
    d = query.shape[-1]
    if key.shape[-1] != d:
        _fail(ValueError, f"query and key must have the same head dim; got query {d}, key {key.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        _fail(ValueError, f"head dim must be in [1, {MAX_HEAD_DIM}]; got {d}")
    hq, hk = query.shape[-2], key.shape[-2]
    if hk == 0 or hq % hk:
        _fail(ValueError, f"query heads must be a multiple of key/value heads; got {hq} query heads and {hk} "
                          f"key/value heads")
    dtypes = (jnp.dtype(query.dtype), jnp.dtype(key.dtype), jnp.dtype(value.dtype))
    if not (dtypes[0] == dtypes[1] == dtypes[2]):
        _fail(TypeError, f"query, key and value must share a dtype; got query={dtypes[0]}, key={dtypes[1]}, "
                         f"value={dtypes[2]}")
    if dtypes[0] not in [jnp.dtype(t) for t in _FLOAT_DTYPES]:
        _fail(TypeError, f"dtype must be float32, bfloat16 or float16; got {dtypes[0]}")


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(TypeError, f"{name} must be a Python bool; got {value!r}")
    return bool(value)


def _check_scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        _fail(TypeError, "scale must be a static Python number, not a traced value")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        _fail(TypeError, f"scale must be a number; got {scale!r}")
    if not math.isfinite(value) or value <= 0:
        _fail(ValueError, f"scale must be finite and positive; got {scale!r}")
    return value


def _platform(x) -> str:
    """Platform the computation on x runs on: its devices when concrete, else JAX's default backend."""
    if not isinstance(x, jax.core.Tracer):
        try:
            return next(iter(x.devices())).platform
        except (AttributeError, StopIteration):
            pass
    return jax.default_backend()


def _resolve_backend(backend, query) -> str:
    if backend not in BACKENDS:
        _fail(ValueError, f"backend must be one of None, 'cpu', 'cuda', 'reference'; got {backend!r}")
    if backend == "reference":
        return backend
    platform = _platform(query)
    on_gpu = platform in ("gpu", "cuda")
    if backend is None:
        backend = "cuda" if on_gpu else "cpu"
    if backend == "cpu" and on_gpu:
        _fail(ValueError, "backend='cpu' needs the inputs on the CPU (jax.device_put(x, jax.devices('cpu')[0])); "
                          f"they are on {platform}")
    if backend == "cuda":
        if not _ffi.cuda_built():
            _fail(RuntimeError, "backend 'cuda' is not available: jaxflash was built without its CUDA module "
                                "(reinstall on a machine with nvcc; see the README's build notes)")
        if not on_gpu:
            _fail(ValueError, f"backend='cuda' needs the inputs on a GPU; they are on {platform}")
        dtype, d = jnp.dtype(query.dtype), query.shape[-1]
        supported = _ffi.cuda_supported()
        if (dtype.name, d) not in supported:
            have = sorted({hd for _, hd in supported})
            _fail(NotImplementedError, f"the CUDA kernel supports bfloat16 and float16 with head dims {have}; got "
                                       f"{dtype} with head dim {d} (cast, pad the head dim, or use "
                                       f"backend='reference')")
    return backend
