"""Decoding with a paged KV cache: `paged_attention` reads keys and values through a block table, `append_kv`
writes new ones into their pages, `simple_block_tables` hands out pages. The layout is vLLM's and
FlashAttention's: caches ``[num_pages, page_size, Hkv, D]`` and an int32 block table ``[B, pages_per_seq]``."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from .attention import (_FLOAT_DTYPES, MAX_HEAD_DIM, _check_bool, _check_scale, _check_softcap, _check_window,
                        _resolve_backend)
from .mask import Mask

_NAME = "jaxflash.paged_attention"
_APPEND = "jaxflash.append_kv"
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 256


def paged_attention(query, key_cache, value_cache, block_tables, kv_lengths, *, causal: bool = False, window=None,
                    softcap: float | None = None, scale: float | None = None, return_lse: bool = False,
                    num_splits: int | None = None, backend: str | None = None):
    """Attention of new queries against each sequence's tokens in a paged KV cache (forward only).

    Sequence ``b``'s token ``t`` lives in page ``block_tables[b, t // page_size]``, slot ``t % page_size``; its
    first ``kv_lengths[b]`` tokens are its keys. The result equals ``jaxflash.attention(query[b], keys, values,
    ...)`` on those tokens laid out contiguously, for every ``b``; the kernel reads the pages where they lie
    (no gather of the cache).

    Args:
      query: ``[B, Sq, Hq, D]``, ``Sq >= 1`` (1 for one decoding step, more for a chunk of a prompt).
      key_cache, value_cache: ``[num_pages, page_size, Hkv, D]``, ``Hq`` a multiple of ``Hkv`` (GQA / MQA);
        ``page_size`` a multiple of 8 in [8, 256].
      block_tables: int32 ``[B, pages_per_seq]``. Entries past a sequence's last page are never read and may
        hold anything (e.g. -1).
      kv_lengths: int32 ``[B]``, tokens in each sequence's cache, at most ``pages_per_seq * page_size``. The
        queries are its last ``Sq`` positions: ``causal`` and ``window`` align bottom-right per sequence,
        query ``i`` sitting at ``kv_lengths[b] - Sq + i`` (causal: it sees keys ``j <= kv_lengths[b] - Sq + i``).
        A sequence of length 0 gives 0 and LSE ``-inf``.
      causal, window, softcap, scale, return_lse: as in `jaxflash.attention`; ``lse`` is ``[B, Hq, Sq]`` float32.
      num_splits: how many parts of each sequence's keys the GPU kernel attends to in parallel before merging
        them (split-KV, FlashDecoding): None picks from the GPU's size and the shape (static per shape), an int
        in [1, 64] forces it (results agree up to rounding). The CPU kernel does not split; its result does
        not depend on it.
      backend: ``None`` (where the inputs are), ``"cpu"`` or ``"cuda"`` (bfloat16 or float16 on the GPU).

    Returns:
      ``out`` shaped and typed like ``query``, or ``(out, lse)`` when ``return_lse``. Not differentiable.

    Under ``jit`` the block table and lengths are checked by the kernel when it runs: a length past the
    table's capacity, or a page outside the cache among a sequence's pages, is a runtime error on the CPU; on
    the GPU, which cannot raise without stopping the stream, that sequence's output and LSE are NaN (the
    kernel never reads outside the cache).
    """
    causal = _check_bool(_NAME, "causal", causal)
    return_lse = _check_bool(_NAME, "return_lse", return_lse)
    _check_cache(_NAME, key_cache, value_cache)
    _check_array(_NAME, "query", query, 4, "[B, Sq, Hq, D]")
    b, sq, hq, d = query.shape
    num_pages, page_size, hkv, dk = key_cache.shape
    if sq < 1:
        raise ValueError(f"{_NAME}: query must hold at least one position (Sq >= 1); got shape {query.shape}")
    if dk != d:
        raise ValueError(f"{_NAME}: query and key_cache must have the same head dim; got query {d}, "
                         f"key_cache {dk}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{_NAME}: head dim must be in [1, {MAX_HEAD_DIM}]; got {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{_NAME}: query heads must be a multiple of key/value heads; got {hq} query heads and "
                         f"{hkv} key/value heads")
    if jnp.dtype(query.dtype) != jnp.dtype(key_cache.dtype):
        raise TypeError(f"{_NAME}: query and the caches must share a dtype; got query={jnp.dtype(query.dtype)}, "
                        f"key_cache={jnp.dtype(key_cache.dtype)}")
    block_tables, kv_lengths = _check_table(_NAME, block_tables, kv_lengths, b, num_pages, page_size)
    scale = _check_scale(_NAME, scale, d)
    softcap = _check_softcap(_NAME, softcap, scale)
    _check_window(_NAME, window)
    _check_splits(num_splits)
    left, right = Mask(causal, window).sides()
    backend = _check_backend(backend, query)

    out, lse = _paged_fwd(query, key_cache, value_cache, block_tables, kv_lengths,
                          (float(scale), float(softcap), int(left), int(right), backend,
                           None if num_splits is None else int(num_splits)))
    return (out, lse) if return_lse else out


def append_kv(key_cache, value_cache, block_tables, kv_lengths, new_key, new_value):
    """Writes ``new_key`` / ``new_value`` ``[B, S_new, Hkv, D]`` at positions ``kv_lengths[b] ..
    kv_lengths[b] + S_new - 1`` of each sequence, through the block table, and returns
    ``(key_cache, value_cache, kv_lengths + S_new)``. No other slot changes.

    The block table must already name the pages the new tokens go to (`simple_block_tables` allocates them all
    up front). Under ``jit`` with the caches donated (``donate_argnums``) XLA updates them in place; without
    donation it copies each cache once. Tokens past the table's capacity, or aimed at a page outside the cache,
    are dropped, never written into another sequence's page (eager calls raise instead). Forward only.
    """
    _check_cache(_APPEND, key_cache, value_cache)
    num_pages, page_size, hkv, d = key_cache.shape
    for name, x in (("new_key", new_key), ("new_value", new_value)):
        _check_array(_APPEND, name, x, 4, "[B, S_new, Hkv, D]")
        if x.shape[2:] != (hkv, d):
            raise ValueError(f"{_APPEND}: {name} must have shape [B, S_new, {hkv}, {d}] (the caches' heads and head "
                             f"dim); got {x.shape}")
        if jnp.dtype(x.dtype) != jnp.dtype(key_cache.dtype):
            raise TypeError(f"{_APPEND}: {name} must have the caches' dtype {jnp.dtype(key_cache.dtype)}; got "
                            f"{jnp.dtype(x.dtype)}")
    if new_key.shape != new_value.shape:
        raise ValueError(f"{_APPEND}: new_key and new_value must have the same shape; got new_key {new_key.shape}, "
                         f"new_value {new_value.shape}")
    b, s_new = new_key.shape[:2]
    block_tables, kv_lengths = _check_table(_APPEND, block_tables, kv_lengths, b, num_pages, page_size, s_new)

    pos = kv_lengths[:, None] + jnp.arange(s_new, dtype=jnp.int32)[None, :]  # [B, S_new]
    capacity = block_tables.shape[1] * page_size
    page = jnp.take_along_axis(block_tables, jnp.clip(pos // page_size, 0, block_tables.shape[1] - 1), axis=1)
    ok = (pos < capacity) & (page >= 0) & (page < num_pages)
    # Flat slots of the [num_pages * page_size] row axis; rejected tokens aim one past the end and are dropped
    # (a negative index would wrap around to the last page).
    slot = jnp.where(ok, page * page_size + pos % page_size, num_pages * page_size).reshape(-1)
    rows = (num_pages * page_size, hkv, d)
    key_cache = key_cache.reshape(rows).at[slot].set(new_key.reshape(-1, hkv, d), mode="drop").reshape(
        key_cache.shape)
    value_cache = value_cache.reshape(rows).at[slot].set(new_value.reshape(-1, hkv, d), mode="drop").reshape(
        value_cache.shape)
    return key_cache, value_cache, kv_lengths + s_new


def simple_block_tables(batch: int, max_len: int, page_size: int):
    """A block table that gives each of ``batch`` sequences its own ``ceil(max_len / page_size)`` pages, in order:
    sequence ``b`` owns pages ``b * n .. (b + 1) * n - 1``. Returns ``(block_tables int32 [batch, n],
    num_pages)``; make the caches ``[num_pages, page_size, Hkv, D]``. A serving engine would hand pages out on
    demand instead; any table whose sequences own disjoint pages works."""
    for name, x in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"jaxflash.paged.simple_block_tables: {name} must be a positive int; got {x!r}")
    n = -(-int(max_len) // int(page_size))
    return jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n), batch * n


# --- the kernel call: forward only --------------------------------------------------------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _paged_fwd(query, key_cache, value_cache, block_tables, kv_lengths, opts):
    *attrs, backend, num_splits = opts
    return _ffi.paged_fwd(query, key_cache, value_cache, block_tables, kv_lengths, attrs, backend, num_splits)


@_paged_fwd.defjvp
def _paged_fwd_jvp(opts, primals, tangents):
    raise NotImplementedError(f"{_NAME} is forward only (decoding); it cannot be differentiated. Train with "
                              f"jaxflash.attention on contiguous keys and values")


# --- validation -------------------------------------------------------------------------------------------------

def _check_array(fn, name, x, ndim, layout):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{fn}: {name} must be an array; got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{fn}: {name} must have shape {layout}; got {x.shape}")


def _check_cache(fn, key_cache, value_cache):
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_array(fn, name, x, 4, "[num_pages, page_size, Hkv, D]")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"{fn}: key_cache and value_cache must have the same shape; got key_cache "
                         f"{key_cache.shape}, value_cache {value_cache.shape}")
    dtypes = jnp.dtype(key_cache.dtype), jnp.dtype(value_cache.dtype)
    if dtypes[0] != dtypes[1]:
        raise TypeError(f"{fn}: key_cache and value_cache must share a dtype; got key_cache={dtypes[0]}, "
                        f"value_cache={dtypes[1]}")
    if dtypes[0] not in [jnp.dtype(t) for t in _FLOAT_DTYPES]:
        raise TypeError(f"{fn}: dtype must be float32, bfloat16 or float16; got {dtypes[0]}")
    page_size = key_cache.shape[1]
    if not (MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE and page_size % 8 == 0):
        raise ValueError(f"{fn}: page size (key_cache.shape[1]) must be a multiple of 8 in [{MIN_PAGE_SIZE}, "
                         f"{MAX_PAGE_SIZE}]; got {page_size}")


def _check_table(fn, block_tables, kv_lengths, batch, num_pages, page_size, s_new=0):
    """(block_tables, kv_lengths) as int32 after the shape checks, and, when their values are concrete, the
    checks the kernel would make at run time (lengths within capacity, pages within the cache)."""
    for name, x, shape in (("block_tables", block_tables, (batch, None)), ("kv_lengths", kv_lengths, (batch,))):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{fn}: {name} must be an int32 array; got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{fn}: {name} must have an integer dtype; got {x.dtype}")
        if x.ndim != len(shape) or x.shape[0] != batch:
            want = "[B, pages_per_seq]" if name == "block_tables" else "[B]"
            raise ValueError(f"{fn}: {name} must have shape {want} with B = {batch} (the batch of the queries or "
                             f"new tokens); got {x.shape}")
    capacity = block_tables.shape[1] * page_size
    if not isinstance(kv_lengths, jax.core.Tracer) and batch:
        lengths = np.asarray(kv_lengths, np.int64)
        worst = int(np.argmax(lengths))
        if lengths.min() < 0:
            raise ValueError(f"{fn}: kv_lengths must be >= 0; got {int(lengths.min())}")
        if lengths[worst] + s_new > capacity:
            grown = f" + {s_new} new tokens" if s_new else ""
            raise ValueError(f"{fn}: kv_lengths[{worst}] = {int(lengths[worst])}{grown} exceeds the block table's "
                             f"capacity, pages_per_seq x page_size = {block_tables.shape[1]} x {page_size}")
        if not isinstance(block_tables, jax.core.Tracer):
            table = np.asarray(block_tables, np.int64)
            for seq in range(batch):
                pages = (int(lengths[seq]) + s_new + page_size - 1) // page_size
                used = table[seq, :pages]
                bad = (used < 0) | (used >= num_pages)
                if bad.any():
                    i = int(np.argmax(bad))
                    raise ValueError(f"{fn}: block_tables[{seq}, {i}] = {int(used[i])} is not a page of the cache "
                                     f"(0 <= page < {num_pages})")
    return jnp.asarray(block_tables, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)


def _check_splits(num_splits):
    if num_splits is None:
        return
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"{_NAME}: num_splits must be a positive int or None; got {num_splits!r}")
    if not 1 <= num_splits <= _ffi.MAX_SPLITS:
        raise ValueError(f"{_NAME}: num_splits must be in [1, {_ffi.MAX_SPLITS}] or None; got {int(num_splits)}")


def _check_backend(backend, query) -> str:
    """"cpu" or "cuda": where the kernel runs (the inputs' platform when backend is None)."""
    if backend not in (None, "cpu", "cuda"):
        raise ValueError(f"{_NAME}: backend must be None, 'cpu' or 'cuda'; got {backend!r}")
    decode = {(t, d) for f, _, t, d in _ffi.cuda_configs() if f == "decode"}
    return _resolve_backend(_NAME, backend, query, supported=decode, remedy="cast or pad the head dim")
