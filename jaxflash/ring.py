"""`jaxflash.ring_attention`: one long sequence split over the devices of a mesh axis (context parallelism).

Inside ``shard_map``, each device holds a slice of the queries and of the keys/values. The K/V slices travel
around the ring (``ppermute``, one array per collective) while every device attends its queries to the slice
that is visiting, and the partial results merge through their log-sum-exp (`jaxflash.combine`'s math). The
gradient is the autodiff of that loop: the reverse ring, through each step's attention kernel (which takes
the LSE's cotangent too).

Where a visiting slice sits relative to the local queries is a position offset on the causal diagonal
(`Mask.offset`). It depends on the device, so each step picks, with ``lax.switch`` on the device index, one of
the few static masks the slice pairs of that step can need: none at all (skipped, no kernel), every key
visible (no mask), or the diagonal at a given offset.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .attention import _check_bool, _check_window, attend
from .combine import combine
from .mask import Mask

_NAME = "jaxflash.ring_attention"
_LAYOUTS = ("contiguous", "zigzag")


def zigzag_order(num_shards: int) -> np.ndarray:
    """Chunk order of the zigzag layout for n shards: shard r holds chunks r and 2n - 1 - r."""
    n = num_shards
    return np.array([c for r in range(n) for c in (r, 2 * n - 1 - r)])


def _check_split(fn, x, num_shards, axis):
    if not (hasattr(x, "shape") and hasattr(x, "ndim")):
        raise TypeError(f"{fn}: x must be an array; got {type(x).__name__}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"{fn}: num_shards must be a positive int; got {num_shards!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: axis {axis} is out of range for an array of rank {x.ndim}")
    length = x.shape[axis]
    if length % (2 * num_shards):
        raise ValueError(f"{fn}: the length of axis {axis} ({length}) must be a multiple of 2 * num_shards "
                         f"= {2 * num_shards}")
    return int(num_shards), axis % x.ndim


def _permute_chunks(x, order, axis):
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def zigzag(x, num_shards: int, axis: int = -3):
    """The zigzag layout of a global sequence for ``ring_attention(..., layout="zigzag")``: axis ``axis`` split
    into ``2 * num_shards`` equal chunks, reordered so that shard ``r`` of an even split holds chunks ``r`` and
    ``2 * num_shards - 1 - r``. Under a causal mask every shard then has the same amount of work. Apply it to
    query, key, value and the segment ids (``axis=-1``) alike; `unzigzag` restores the order."""
    n, axis = _check_split("jaxflash.zigzag", x, num_shards, axis)
    return _permute_chunks(x, zigzag_order(n), axis)


def unzigzag(x, num_shards: int, axis: int = -3):
    """The inverse of `zigzag`."""
    n, axis = _check_split("jaxflash.unzigzag", x, num_shards, axis)
    return _permute_chunks(x, np.argsort(zigzag_order(n)), axis)


def _axis_size_and_index(axis_name):
    try:
        return jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    except NameError as e:
        raise ValueError(f"{_NAME}: axis_name {axis_name!r} is not bound here; call ring_attention inside "
                         f"jax.shard_map over a mesh axis of that name, with the sequence axis (-3) of query, "
                         f"key and value sharded over it") from e


def _pieces(layout, n, length, what):
    """Global chunk index (as a function of the shard index) and size of each piece of a shard's slice."""
    if layout == "contiguous":
        return [lambda r: r], length
    if length % 2:
        raise ValueError(f"{_NAME}: layout='zigzag' splits each shard's {what} into two chunks; its local length "
                         f"must be even, got {length}")
    return [lambda r: r, lambda r: 2 * n - 1 - r], length // 2


def _block_mask(causal, left, right, delta, cq, ck):
    """The static mask of a (query piece, key piece) pair whose diagonal is at key ``delta`` for query 0:
    ``None`` when no key is visible, ``"all"`` when every key is, else the offset to pass (``delta``)."""
    if causal:
        right = 0 if right < 0 else min(right, 0)
    # Visible: c <= r + delta + right (if right >= 0) and c >= r + delta - left (if left >= 0).
    lo_any = -np.inf if left < 0 else delta - left            # smallest visible c of row 0
    hi_any = np.inf if right < 0 else (cq - 1) + delta + right  # largest visible c of the last row
    if hi_any < 0 or lo_any > ck - 1 or (right >= 0 and left >= 0 and left + right < 0):
        return None
    hi_all = np.inf if right < 0 else delta + right             # every row sees [lo_all, hi_all]
    lo_all = -np.inf if left < 0 else (cq - 1) + delta - left
    if lo_all <= 0 and hi_all >= ck - 1:
        return "all"
    return int(delta)


def _vma(x):
    """The mesh axes over which `x` differs between devices (the spelling moved between jax versions)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    return set(manual.varying) if manual is not None else set(getattr(t, "vma", ()))


def _like(x, value):
    """`value` typed as varying over every mesh axis `x` varies over: shard_map types a constant (and the
    kernels' results) as equal on every device, and the branches of a switch must agree."""
    missing = tuple(sorted(_vma(x) - _vma(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


def ring_attention(query, key, value, *, axis_name, layout: str = "contiguous", causal: bool = False, window=None,
                   q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None, softcap=None,
                   dropout_rate: float = 0.0, dropout_key=None, scale=None, return_lse: bool = False,
                   deterministic: bool = False, backend=None):
    """`jaxflash.attention` over a sequence sharded on mesh axis ``axis_name``; call it inside ``jax.shard_map``.

    Each device passes its slice: ``query`` ``[..., Sq/n, Hq, D]``, ``key``/``value`` ``[..., Sk/n, Hkv, D]``,
    the segment ids' last axis and nothing else sharded over ``axis_name`` (n devices); lengths ``[...]`` are the
    global ones. The result is this device's slice of `jaxflash.attention` over the whole sequence (and its LSE
    ``[..., Hq, Sq/n]`` with ``return_lse``), for every option of it but dropout, gradients included.

    Args:
      layout: ``"contiguous"``: shard ``r`` holds the ``r``-th block of the sequence. ``"zigzag"``: the sequence
        was permuted with `jaxflash.zigzag` (shard ``r`` holds chunks ``r`` and ``2n - 1 - r`` of ``2n``), which
        balances causal work across the devices; `jaxflash.unzigzag` restores the order of the result.
      Everything else: as `jaxflash.attention` (causal is bottom-right aligned over the global lengths).
      dropout_rate: must be 0: the kernels draw dropout by position within their call, and do not yet take a
        block's global offsets as runtime operands.

    K/V slices of shards whose keys no local query can see (causal, windows) are not computed, only passed on.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"{_NAME}: layout must be one of {_LAYOUTS}; got {layout!r}")
    if dropout_rate:
        raise NotImplementedError(f"{_NAME}: dropout_rate > 0 is not supported yet (the kernels would need each "
                                  f"block's global row and column offsets as runtime operands); got {dropout_rate}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{_NAME}: q_segment_ids and kv_segment_ids must be given together")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not (hasattr(x, "shape") and hasattr(x, "ndim")) or x.ndim < 3:
            raise ValueError(f"{_NAME}: {name} must be an array of rank >= 3 ([..., S, H, D]); got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    # The rest (scale, softcap, shapes, dtypes, segment ids, lengths) is checked by each step's call.
    causal = _check_bool(_NAME, "causal", causal)
    _check_window(_NAME, window)
    left, right = Mask(causal, window).sides()
    n, me = _axis_size_and_index(axis_name)
    lq, lk = query.shape[-3], key.shape[-3]
    q_pieces, cq = _pieces(layout, n, lq, "queries")
    k_pieces, ck = _pieces(layout, n, lk, "keys")
    diag = n * lk - n * lq  # bottom-right alignment over the global lengths

    def piece(x, p, c, axis):
        return jax.lax.slice_in_dim(x, p * c, (p + 1) * c, axis=axis % x.ndim) if len(q_pieces) > 1 else x

    def local_lengths(lengths, start, size):
        return None if lengths is None else jnp.clip(lengths - start, 0, size).astype(jnp.int32)

    perm = [(j, (j + 1) % n) for j in range(n)]
    kv = (key, value, kv_segment_ids)
    acc = [None] * len(q_pieces)  # per query piece: (out, lse) so far
    for step in range(n):
        src = (me - step) % n  # the shard whose K/V slice is here now
        # Start passing the slice on before computing with it, one array per collective.
        nxt = tuple(None if x is None else jax.lax.ppermute(x, axis_name, perm) for x in kv) if step + 1 < n else kv
        k_cur, v_cur, kseg_cur = kv
        for qi, q_chunk in enumerate(q_pieces):
            q = piece(query, qi, cq, -3)
            qseg = None if q_segment_ids is None else piece(q_segment_ids, qi, cq, -1)
            for ki, k_chunk in enumerate(k_pieces):
                k, v = piece(k_cur, ki, ck, -3), piece(v_cur, ki, ck, -3)
                kseg = None if kseg_cur is None else piece(kseg_cur, ki, ck, -1)
                # Per shard index r (static): this pair's diagonal offset and the static mask it needs.
                masks = []
                for r in range(n):
                    s = (r - step) % n
                    delta = q_chunk(r) * cq - k_chunk(s) * ck + diag
                    masks.append(_block_mask(causal, left, right, delta, cq, ck))
                kinds = sorted(set(masks), key=lambda m: (m is None, m == "all", m if isinstance(m, int) else 0))
                q_start = q_chunk(me) * cq
                k_start = k_chunk(src) * ck
                qlen = local_lengths(q_lengths, q_start, cq)
                klen = local_lengths(kv_lengths, k_start, ck)

                def branch(kind, q=q, k=k, v=v, qseg=qseg, kseg=kseg, qlen=qlen, klen=klen):
                    def run(_):
                        if kind is None:
                            return (_like(q, jnp.zeros(q.shape, q.dtype)),
                                    _like(q, jnp.full(q.shape[:-3] + (q.shape[-2], q.shape[-3]), -jnp.inf,
                                                      jnp.float32)))
                        if kind == "all":
                            mask = Mask(False, None, qseg, kseg, qlen, klen)
                        else:
                            mask = Mask(causal, (left, right), qseg, kseg, qlen, klen, bottom_right=False,
                                        offset=kind)
                        out, lse = attend(q, k, v, mask, softcap=softcap, scale=scale, return_lse=True,
                                          deterministic=deterministic, backend=backend, name=_NAME)
                        return _like(q, out), _like(q, lse)
                    return run

                if len(kinds) == 1:  # the same mask on every shard
                    out, lse = branch(kinds[0])(None)
                else:
                    index = jnp.asarray([kinds.index(m) for m in masks], jnp.int32)[me]
                    out, lse = jax.lax.switch(index, [branch(m) for m in kinds], None)
                if acc[qi] is None:
                    acc[qi] = (out, lse)
                else:
                    acc[qi] = combine(jnp.stack([acc[qi][0], out]), jnp.stack([acc[qi][1], lse]))
        kv = nxt
    outs = [a[0] for a in acc]
    lses = [a[1] for a in acc]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-3)
    lse = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=-1)
    return (out, lse) if return_lse else out
