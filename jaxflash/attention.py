"""`jaxflash.attention`: the public entry point. Owns the contract: layout, defaults, validation and
the choice of backend. Kernels are reached through `_vjp.flash` (custom_vjp over the FFI calls)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, _vjp, dropout, reference
from .mask import Mask

MAX_HEAD_DIM = 256
BACKENDS = (None, "cpu", "cuda", "reference")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def attention(query, key, value, *, causal: bool = False, window=None, q_segment_ids=None, kv_segment_ids=None,
              q_lengths=None, kv_lengths=None, softcap: float | None = None, dropout_rate: float = 0.0,
              dropout_key=None, scale: float | None = None, return_lse: bool = False, deterministic: bool = False,
              backend: str | None = None):
    """FlashAttention-2: softmax(scale * Q K^T) V without materialising the score matrix.

    Args:
      query: ``[..., Sq, Hq, D]``; every leading dim is a batch dim.
      key, value: ``[..., Sk, Hkv, D]`` with the same leading dims; ``Hq`` a multiple of ``Hkv``
        (grouped-query / multi-query attention: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
      causal: mask aligned bottom-right, as FlashAttention aligns it: query ``i`` sees key ``j`` iff
        ``j <= i + (Sk - Sq)`` (with lengths, per sequence: ``j <= i + kv_lengths - q_lengths``, a missing
        length the full one). For Sq=3, Sk=5 (``x`` = visible)::

            q0  x x x . .
            q1  x x x x .
            q2  x x x x x

        A query row that sees no key (possible when Sq > Sk) returns 0 and LSE ``-inf``, never NaN.
      window: ``(left, right)``: query ``i`` sees key ``j`` iff ``c - left <= j <= c + right`` with
        ``c = i + (Sk - Sq)`` the causal diagonal; ``None`` or ``-1`` leaves a side unbounded. Combines
        with ``causal`` (``causal=True`` is ``window=(None, 0)``).
      q_segment_ids, kv_segment_ids: int ``[..., Sq]`` and ``[..., Sk]``, given together: a query sees a
        key only when their ids are equal (packed documents).
      q_lengths, kv_lengths: int ``[...]`` (one per batch element): keys at or past ``kv_lengths`` are
        invisible; query rows at or past ``q_lengths`` return 0 (LSE ``-inf``) and get zero gradients.
      softcap: ``c > 0``: scores become ``c * tanh(s / c)`` before the softmax (exact backward).
      dropout_rate, dropout_key: dropout of the attention probabilities inside the kernels, drawn from the JAX
        PRNG key ``dropout_key`` (required when the rate is positive). The kernels draw one byte per element,
        so the rate is rounded to the nearest multiple of 1/256 (``jaxflash.dropout.effective_rate``; 0.1 drops
        26/256 = 0.1016); a positive rate must round to 1/256 .. 255/256 (``1/512 <= rate < 255.5/256``).
        Kept probabilities are scaled by ``1 / (1 - effective_rate)``, so the output's expectation is the
        undropped one; the LSE is that of the undropped softmax. The keep decision of element
        (batch, head, row, column) is a pure function of the key and those indices (Philox4x32-7, see
        `jaxflash.dropout_mask`), so the backward pass redraws exactly the forward's mask and the result does
        not depend on tiling or on vmap over the other inputs. Batch indices count the flattened leading dims
        of one call: under ``jit`` with sharded inputs they stay global and the mask equals the unsharded
        call's (with dropout, sharded heads are gathered), while inside ``shard_map`` each shard counts from 0,
        so fold the shard index into the key there.
      scale: multiplies the scores; defaults to ``1 / sqrt(D)``. Must be finite and positive.
      return_lse: also return the log-sum-exp of the (capped, masked) scores, ``[..., Hq, Sq]`` float32
        (natural log). It is differentiable.
      deterministic: make the backward pass bitwise reproducible run to run. The CUDA backward kernel
        otherwise accumulates dQ with atomics, whose order varies; the CPU kernel is always deterministic.
      backend: ``None`` runs the FFI kernel of the platform the computation is placed on (the CUDA kernel
        on a GPU, the C++ kernel on the CPU); ``"cpu"`` requires the C++ kernel; ``"cuda"`` requires the
        CUDA kernel; ``"reference"`` runs the materialising pure-JAX implementation.

    Returns:
      ``out`` shaped and typed like ``query``, or ``(out, lse)`` when ``return_lse``.

    Dtypes: float32, bfloat16 and float16 on the CPU; bfloat16 and float16 on a GPU. Accumulation is
    float32. Gradients come from the FlashAttention-2 backward kernel, not from autodiff of the reference.

    Sharding: under ``jax.jit``, inputs sharded on leading (batch) dims and/or the heads (GQA: in whole groups)
    run the kernels shard by shard, with no communication, and the results (and gradients) keep the inputs'
    shardings. Sharded sequence or head_dim axes are gathered first.
    """
    mask = Mask(causal, window, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths)
    return attend(query, key, value, mask, softcap=softcap, dropout_rate=dropout_rate, dropout_key=dropout_key,
                  scale=scale, return_lse=return_lse, deterministic=deterministic, backend=backend)


class Plan(NamedTuple):
    """One validated call: the backend and what it takes. For the kernels, `cfg` and `operands` are what the
    forward and backward FFI calls take; `mask` is the checked mask (explicit sides, alignment folded)."""
    backend: str
    mask: Mask
    scale: float
    softcap: float
    dropout_rate: float
    dropout_words: Any
    cfg: Any
    operands: tuple


def plan(query, key, value, mask: Mask, *, softcap=None, dropout_rate=0.0, dropout_key=None, scale=None,
         deterministic=False, backend=None, name="jaxflash.attention", positions=(0, 0)) -> Plan:
    """Validates one call (every error names `name`, the public function called) and resolves its backend.
    `positions`: the (row, column) of this call's first query and key in a longer sequence (ring attention's
    slices; ints or traced scalars, the column a multiple of 16), so dropout draws that sequence's mask."""
    _check_arrays(name, query, key, value)
    causal = _check_bool(name, "causal", mask.causal)
    bottom_right = _check_bool(name, "bottom_right", mask.bottom_right)
    deterministic = _check_bool(name, "deterministic", deterministic)
    scale = _check_scale(name, scale, query.shape[-1])
    softcap = _check_softcap(name, softcap, scale)
    _check_window(name, mask.window)
    offset = _check_offset(name, mask.offset)
    left, right = mask.sides()
    lead, sq, sk = query.shape[:-3], query.shape[-3], key.shape[-3]
    lengths_given = mask.q_lengths is not None or mask.kv_lengths is not None
    bottom_right = bottom_right or (sq == sk and not lengths_given)  # the two alignments coincide
    seg = _check_segment_ids(name, mask.q_segment_ids, mask.kv_segment_ids, lead, sq, sk)
    lengths = _check_lengths(name, mask.q_lengths, mask.kv_lengths, lead, sq, sk)
    dropout_rate, key_words = _check_dropout(name, dropout_rate, dropout_key)
    backend = _resolve_backend(name, backend, query)
    checked = Mask(causal, (left, right), *(seg or (None, None)), *(lengths or (None, None)), bottom_right, offset)
    cfg, operands = None, ()
    if backend != "reference":
        # Unused mask operands are empty arrays (the kernels ignore them by flag): filling full-size placeholders
        # cost every call a few small XLA kernels, a few microseconds (1.5 % of a long decode step).
        empty = jnp.zeros(lead + (0,), jnp.int32)
        seg_ops = seg or (empty, empty)
        len_ops = lengths or (empty, empty)
        state = (_dropout_state(key_words, lead, positions) if dropout_rate > 0 else
                 jnp.zeros(lead + (0,), jnp.uint32))
        cfg = _vjp.Config(scale=scale, softcap=softcap, window_left=left, window_right=right,
                          bottom_right=bottom_right, diagonal_shift=offset, segment_ids=seg is not None,
                          lengths=lengths is not None, dropout_rate=dropout_rate, deterministic=deterministic,
                          backend=backend)
        operands = (*seg_ops, *len_ops, state)
    return Plan(backend, checked, scale, softcap, dropout_rate, key_words, cfg, operands)


def attend(query, key, value, mask: Mask, *, softcap=None, dropout_rate=0.0, dropout_key=None, scale=None,
           return_lse=False, deterministic=False, backend=None, name="jaxflash.attention", positions=(0, 0)):
    """`attention` with the mask as one `Mask`, of either alignment: the entry of `attention`, the jax.nn
    drop-in and the Flax adapters. `name` is the public function called, the prefix of every error."""
    return_lse = _check_bool(name, "return_lse", return_lse)
    pl = plan(query, key, value, mask, softcap=softcap, dropout_rate=dropout_rate, dropout_key=dropout_key,
              scale=scale, deterministic=deterministic, backend=backend, name=name, positions=positions)
    if pl.backend == "reference":
        out, lse = reference.attend(query, key, value, pl.mask, scale=pl.scale, softcap=pl.softcap or None,
                                    dropout_rate=pl.dropout_rate, dropout_key=pl.dropout_words, positions=positions)
    elif 0 in query.shape or 0 in key.shape:
        # Nothing to compute (or nothing to attend to): zeros and -inf, without launching a kernel.
        out = jnp.zeros(query.shape, query.dtype)
        lse = jnp.full(query.shape[:-3] + (query.shape[-2], query.shape[-3]), -jnp.inf, jnp.float32)
    else:
        out, lse = _vjp.flash(query, key, value, pl.operands, pl.cfg)
    return (out, lse) if return_lse else out


# --- validation -------------------------------------------------------------------------------------------

def _fail(fn, cls, msg):
    raise cls(f"{fn}: {msg}")


def _check_arrays(fn, query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            _fail(fn, TypeError, f"{name} must be an array; got {type(x).__name__}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            _fail(fn, ValueError, f"{name} must have rank >= 3 ([..., seq, heads, head_dim]); got shape {x.shape}")
    if not (query.ndim == key.ndim == value.ndim):
        _fail(fn, ValueError, f"query, key and value must have the same rank; got query {query.shape}, "
                              f"key {key.shape}, value {value.shape}")
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        _fail(fn, ValueError, f"query, key and value must share leading (batch) dims; got query {query.shape}, "
                              f"key {key.shape}, value {value.shape}")
    if key.shape != value.shape:
        _fail(fn, ValueError, f"key and value must have the same shape; got key {key.shape}, value {value.shape}")
    d = query.shape[-1]
    if key.shape[-1] != d:
        _fail(fn, ValueError, f"query and key must have the same head dim; got query {d}, key {key.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        _fail(fn, ValueError, f"head dim must be in [1, {MAX_HEAD_DIM}]; got {d}")
    hq, hk = query.shape[-2], key.shape[-2]
    if hk == 0 or hq % hk:
        _fail(fn, ValueError, f"query heads must be a multiple of key/value heads; got {hq} query heads and {hk} "
                              f"key/value heads")
    dtypes = (jnp.dtype(query.dtype), jnp.dtype(key.dtype), jnp.dtype(value.dtype))
    if not (dtypes[0] == dtypes[1] == dtypes[2]):
        _fail(fn, TypeError, f"query, key and value must share a dtype; got query={dtypes[0]}, key={dtypes[1]}, "
                             f"value={dtypes[2]}")
    if dtypes[0] not in [jnp.dtype(t) for t in _FLOAT_DTYPES]:
        _fail(fn, TypeError, f"dtype must be float32, bfloat16 or float16; got {dtypes[0]}")


def _check_bool(fn, name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(fn, TypeError, f"{name} must be a Python bool; got {value!r}")
    return bool(value)


def _static_number(fn, name, x) -> float:
    """x as a float; it must be a static Python number, since it is compiled into the kernel call."""
    if isinstance(x, jax.core.Tracer):
        _fail(fn, TypeError, f"{name} must be a static Python number, not a traced value")
    try:
        return float(x)
    except (TypeError, ValueError):
        _fail(fn, TypeError, f"{name} must be a number; got {x!r}")


def _check_scale(fn, scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = _static_number(fn, "scale", scale)
    if not math.isfinite(value) or value <= 0:
        _fail(fn, ValueError, f"scale must be finite and positive; got {scale!r}")
    return value


def _check_softcap(fn, softcap, scale) -> float:
    """0.0 when off. The kernels multiply scores by scale / softcap and 1 / softcap in float32: a cap so large
    that either is below the smallest normal float would be flushed to 0 and every score with it."""
    if softcap is None:
        return 0.0
    value = _static_number(fn, "softcap", softcap)
    if not math.isfinite(value) or value <= 0:
        _fail(fn, ValueError, f"softcap must be finite and positive (None: off); got {softcap!r}")
    tiny = np.finfo(np.float32).tiny
    if np.float32(min(scale, 1.0)) / np.float32(value) < tiny:
        _fail(fn, ValueError, f"softcap is too large for the scale: min(scale, 1) / softcap must be at least "
                              f"{tiny:.3g} (a normal float32); got softcap={value:g}, scale={scale:g} (None turns "
                              f"softcap off)")
    return value


def _check_offset(fn, offset):
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, (int, np.integer)):
        _fail(fn, TypeError, f"the mask's offset must be a static int; got {type(offset).__name__} {offset!r}")
    if abs(int(offset)) >= 2**62:
        _fail(fn, ValueError, f"the mask's offset must be below 2^62 in magnitude; got {int(offset)}")
    return int(offset)


def _check_window(fn, window):
    """The form of a window; what it means is `Mask.sides`."""
    if window is None:
        return
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        _fail(fn, ValueError, f"window must be a pair (left, right); got {window!r}")
    for name, w in zip(("left", "right"), window):
        if w is None:
            continue
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            _fail(fn, TypeError, f"window {name} side must be an int or None; got {w!r}")
        if w < -1:
            _fail(fn, ValueError, f"window {name} side must be >= -1 (-1 or None: unbounded); got {int(w)}")


def _check_dropout(fn, rate, key):
    """(rate as a float, the key's two uint32 words or None)."""
    value = _static_number(fn, "dropout_rate", rate)
    if not 0.0 <= value < 1.0:
        _fail(fn, ValueError, f"dropout_rate must be in [0, 1); got {rate!r}")
    if value == 0.0:
        return 0.0, None
    steps = dropout.threshold(value)
    if not 1 <= steps <= 255:
        _fail(fn, ValueError, f"dropout_rate={value} rounds to {steps}/256: the kernels draw the rate in steps of "
                              "1/256 (one byte per element), so a positive rate must round to 1/256 .. 255/256 "
                              "(1/512 <= rate < 255.5/256)")
    if key is None:
        _fail(fn, ValueError, f"dropout_rate={value} needs a dropout_key (a JAX PRNG key); got None")
    try:
        words = dropout.key_words(key)
    except (TypeError, ValueError) as e:
        _fail(fn, ValueError, f"dropout_key must be a JAX PRNG key with two 32-bit words; {e}")
    return value, words


def _dropout_state(words, lead, positions):
    """[..., 5] uint32 operand: the key's words, each batch element's index in the flattened leading dims, and
    the call's first row and column in the sequence. Under vmap it is broadcast with the other operands, so
    every vmapped call draws the same mask."""
    n = int(np.prod(lead, dtype=np.int64))
    index = jnp.arange(n, dtype=jnp.uint32).reshape(lead + (1,))
    where = jnp.stack([jnp.asarray(x, jnp.uint32) for x in positions])
    return jnp.concatenate([jnp.broadcast_to(words, lead + (2,)), index, jnp.broadcast_to(where, lead + (2,))],
                           axis=-1)


def _int_array(fn, name, x, shape):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        _fail(fn, TypeError, f"{name} must have an integer dtype; got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        _fail(fn, ValueError, f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}")
    return jnp.asarray(x, jnp.int32)


def _check_segment_ids(fn, q_ids, kv_ids, lead, sq, sk):
    if (q_ids is None) != (kv_ids is None):
        given = "q_segment_ids" if kv_ids is None else "kv_segment_ids"
        _fail(fn, ValueError, f"q_segment_ids and kv_segment_ids must be given together; got only {given}")
    if q_ids is None:
        return None
    return (_int_array(fn, "q_segment_ids", q_ids, lead + (sq,)),
            _int_array(fn, "kv_segment_ids", kv_ids, lead + (sk,)))


def _check_lengths(fn, q_lengths, kv_lengths, lead, sq, sk):
    """(q_lengths, kv_lengths) as int32 [...], a missing one filled with the full length; None if neither."""
    if q_lengths is None and kv_lengths is None:
        return None
    out = []
    for name, x, full in (("q_lengths", q_lengths, sq), ("kv_lengths", kv_lengths, sk)):
        if x is None:
            out.append(jnp.full(lead, full, jnp.int32))
            continue
        if not isinstance(x, jax.core.Tracer) and np.size(x) and np.min(np.asarray(x)) < 0:  # checkable values
            _fail(fn, ValueError, f"{name} must be >= 0; got {int(np.min(np.asarray(x)))}")
        out.append(_int_array(fn, name, x, lead))
    return tuple(out)


def _platform(x) -> str:
    """Platform the computation on x runs on: its devices when concrete, else JAX's default backend."""
    if not isinstance(x, jax.core.Tracer):
        try:
            return next(iter(x.devices())).platform
        except (AttributeError, StopIteration):
            pass
    return jax.default_backend()


def _resolve_backend(fn, backend, query, supported=None, remedy="cast, pad the head dim, or use backend='reference'"
                     ) -> str:
    """"cpu", "cuda" or "reference" for `backend` (None: where the inputs are); for "cuda", the module must be
    built and (dtype name, head dim) among `supported` (default: the compiled forward configurations)."""
    if backend not in BACKENDS:
        _fail(fn, ValueError, f"backend must be one of None, 'cpu', 'cuda', 'reference'; got {backend!r}")
    if backend == "reference":
        return backend
    platform = _platform(query)
    on_gpu = platform in ("gpu", "cuda")
    if backend is None:
        backend = "cuda" if on_gpu else "cpu"
    if backend == "cpu" and on_gpu:
        _fail(fn, ValueError, "backend='cpu' needs the inputs on the CPU (jax.device_put(x, jax.devices('cpu')[0])); "
                              f"they are on {platform}")
    if backend == "cuda":
        if not _ffi.cuda_built():
            _fail(fn, RuntimeError, "backend 'cuda' is not available: jaxflash was built without its CUDA module "
                                    "(reinstall on a machine with nvcc; see the README's build notes)")
        if not on_gpu:
            _fail(fn, ValueError, f"backend='cuda' needs the inputs on a GPU; they are on {platform}")
        dtype, d = jnp.dtype(query.dtype), query.shape[-1]
        supported = _ffi.cuda_supported("fwd") if supported is None else supported
        if (dtype.name, d) not in supported:
            _fail(fn, NotImplementedError, f"the CUDA kernel supports {_ffi.describe_configs(supported)}; got "
                                           f"{dtype} with head dim {d} ({remedy})")
    return backend
