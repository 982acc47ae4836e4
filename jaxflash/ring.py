"""`jaxflash.ring_attention`: one long sequence split over the devices of a mesh axis (context parallelism).

Inside ``shard_map``, each device holds a slice of the queries and of the keys/values. The K/V slices travel
around the ring (``ppermute``, one array per collective) while every device attends its queries to the slice
that is visiting, and the partial results merge through their log-sum-exp (`jaxflash.combine`'s math). The
backward pass sends the slices around once more with their dK/dV accumulators (see `_ring_bwd`), so memory
stays at one slice per device in both passes.

Where a visiting slice sits relative to the local queries is a position offset on the causal diagonal
(`Mask.offset`). It depends on the device, so each step picks, with ``lax.switch`` on the device index, one of
the few static masks the slice pairs of that step can need: none at all (skipped, no kernel), every key
visible (no mask), or the diagonal at a given offset. Dropout needs no switch: where the slices start in the
sequence reaches the kernels at run time, in the dropout state operand, so each draws the single-device mask.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _partition
from .attention import _check_bool, _check_dropout, _check_window, _resolve_backend, attend, plan
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
    ``[..., Hq, Sq/n]`` with ``return_lse``), for every option of it, gradients included; dropout draws the
    same mask as the single-device call (each step tells the kernel where its slices lie in the sequence).

    Args:
      layout: ``"contiguous"``: shard ``r`` holds the ``r``-th block of the sequence. ``"zigzag"``: the sequence
        was permuted with `jaxflash.zigzag` (shard ``r`` holds chunks ``r`` and ``2n - 1 - r`` of ``2n``), which
        balances causal work across the devices; `jaxflash.unzigzag` restores the order of the result.
      Everything else: as `jaxflash.attention` (causal is bottom-right aligned over the global sequence; with
        lengths, over each sequence's). Lengths together with a causal mask or a window make that diagonal a
        run-time shift, so every step then runs a kernel (inside it, hidden blocks are still skipped).
      dropout_rate, dropout_key: as `jaxflash.attention`; with dropout the keys of a shard (of each of its two
        chunks with zigzag) must be a multiple of 16, the width of one draw.

    K/V slices of shards whose keys no local query can see (causal, windows) are not computed, only passed on.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"{_NAME}: layout must be one of {_LAYOUTS}; got {layout!r}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{_NAME}: q_segment_ids and kv_segment_ids must be given together")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not (hasattr(x, "shape") and hasattr(x, "ndim")) or x.ndim < 3:
            raise ValueError(f"{_NAME}: {name} must be an array of rank >= 3 ([..., S, H, D]); got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    # The rest (scale, softcap, shapes, dtypes, segment ids, lengths) is checked by each step's call.
    causal = _check_bool(_NAME, "causal", causal)
    return_lse = _check_bool(_NAME, "return_lse", return_lse)
    _check_window(_NAME, window)
    left, right = Mask(causal, window).sides()
    # With lengths the diagonal follows each sequence's (c = i + kv_lengths - q_lengths): a run-time shift.
    follow_lengths = (q_lengths is not None or kv_lengths is not None) and (left >= 0 or right >= 0)
    dropout_rate, key_words = _check_dropout(_NAME, dropout_rate, dropout_key)
    st = _Static(axis_name, layout, causal, left, right, softcap, scale, deterministic, backend, dropout_rate,
                 follow_lengths)
    _axis_size_and_index(axis_name)  # a clear error outside shard_map
    if dropout_rate:
        zigzag = layout == "zigzag"
        chunk = key.shape[-3] // (2 if zigzag else 1)
        if chunk % 16:
            raise ValueError(f"{_NAME}: with dropout, a shard's keys{' per zigzag chunk' if zigzag else ''} must be "
                             f"a multiple of 16 (the width of one dropout draw); got {chunk}")
    mask_arrays = (q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, key_words)
    if _resolve_backend(_NAME, backend, query) == "reference" or 0 in query.shape or 0 in key.shape:
        out, lse = _ring_forward(st, query, key, value, *mask_arrays)  # differentiated by JAX
    else:
        out, lse = _ring(st, query, key, value, *mask_arrays)
    return (out, lse) if return_lse else out


class _Static(NamedTuple):
    axis_name: Any
    layout: str
    causal: bool
    left: int
    right: int
    softcap: Any
    scale: Any
    deterministic: bool
    backend: Any
    dropout_rate: float
    follow_lengths: bool  # lengths with a causal mask or window: every pair computed (see _pairs)


class _Geometry(NamedTuple):
    n: int      # devices on the ring
    me: Any     # this device's index (traced)
    q_pieces: list  # per piece of a shard's queries: shard index -> global chunk index
    k_pieces: list
    cq: int     # rows of a query piece
    ck: int     # rows of a key piece
    diag: int   # bottom-right alignment over the global lengths


def _geometry(st, query, key):
    n, me = _axis_size_and_index(st.axis_name)
    q_pieces, cq = _pieces(st.layout, n, query.shape[-3], "queries")
    k_pieces, ck = _pieces(st.layout, n, key.shape[-3], "keys")
    return _Geometry(n, me, q_pieces, k_pieces, cq, ck, n * key.shape[-3] - n * query.shape[-3])


def _piece(g, x, p, seq_axis):
    """Piece p of a shard's slice along `seq_axis` (-3 for q/k/v/o, -1 for segment ids and the LSE)."""
    if len(g.q_pieces) == 1:
        return x
    c = x.shape[seq_axis] // len(g.q_pieces)
    return jax.lax.slice_in_dim(x, p * c, (p + 1) * c, axis=seq_axis % x.ndim)


def _pairs(st, g, step):
    """For one ring step: (query piece, key piece, the distinct static masks, index of this shard's) per pair.
    A mask is None (no key visible: skipped), "all" (every key visible) or the diagonal offset to pass; or
    "lengths" for every pair when the diagonal follows each sequence's lengths, a shift known only at run time
    (the kernel skips the blocks that shift hides)."""
    for qi, q_chunk in enumerate(g.q_pieces):
        for ki, k_chunk in enumerate(g.k_pieces):
            if st.follow_lengths:
                yield qi, ki, ["lengths"], None
                continue
            masks = [_block_mask(st.causal, st.left, st.right, q_chunk(r) * g.cq - k_chunk((r - step) % g.n) * g.ck
                                 + g.diag, g.cq, g.ck) for r in range(g.n)]
            kinds = sorted(set(masks), key=lambda m: (m is None, m == "all", m if isinstance(m, int) else 0))
            index = None if len(kinds) == 1 else jnp.asarray([kinds.index(m) for m in masks], jnp.int32)[g.me]
            yield qi, ki, kinds, index


def _select(kinds, index, branch):
    """branch(kind)() on this shard: one call when every shard needs the same mask, else a switch."""
    if index is None:
        return branch(kinds[0])()
    return jax.lax.switch(index, [lambda _, m=m: branch(m)() for m in kinds], None)


def _positions(g, qi, ki, step):
    """Where a pair's query and key pieces start in the whole sequence (traced: they depend on the shard)."""
    return g.q_pieces[qi](g.me) * g.cq, g.k_pieces[ki]((g.me - step) % g.n) * g.ck


def _pair_mask(st, g, kind, qi, ki, step, qseg, kseg, q_lengths, kv_lengths):
    """The Mask of a visible pair: segment ids of both pieces, lengths made local to them."""

    def local(lengths, start, size):
        return None if lengths is None else jnp.clip(lengths - start, 0, size).astype(jnp.int32)

    q0, k0 = _positions(g, qi, ki, step)
    if kind == "lengths":
        # The lengths counted from the pieces' starts and left unclipped: the kernels clip them for validity and
        # take their difference, kv_lengths - q_lengths + (q0 - k0), as the bottom-right diagonal of the pair.
        lead = (q_lengths if q_lengths is not None else kv_lengths).shape
        q_all = jnp.full(lead, g.n * g.cq * len(g.q_pieces)) if q_lengths is None else q_lengths
        kv_all = jnp.full(lead, g.n * g.ck * len(g.k_pieces)) if kv_lengths is None else kv_lengths
        return Mask(st.causal, (st.left, st.right), qseg, kseg, (q_all - q0).astype(jnp.int32),
                    (kv_all - k0).astype(jnp.int32), bottom_right=True)
    qlen, klen = local(q_lengths, q0, g.cq), local(kv_lengths, k0, g.ck)
    if kind == "all":
        return Mask(False, None, qseg, kseg, qlen, klen)
    return Mask(st.causal, (st.left, st.right), qseg, kseg, qlen, klen, bottom_right=False, offset=kind)


def _kv_ring(st, g, arrays):
    """The K/V-side arrays passed one shard on around the ring, one array per collective (XLA may not combine
    mixed dtypes in one collective-permute)."""
    perm = [(j, (j + 1) % g.n) for j in range(g.n)]
    return tuple(None if x is None else jax.lax.ppermute(x, st.axis_name, perm) for x in arrays)


def _ring_forward(st, query, key, value, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, key_words):
    g = _geometry(st, query, key)
    kv = (key, value, kv_segment_ids)
    acc = [None] * len(g.q_pieces)  # per query piece: (out, lse) so far
    for step in range(g.n):
        # Start passing the slice on before computing with it.
        nxt = _kv_ring(st, g, kv) if step + 1 < g.n else kv
        k_cur, v_cur, kseg_cur = kv
        for qi, ki, kinds, index in _pairs(st, g, step):
            q = _piece(g, query, qi, -3)
            k, v = _piece(g, k_cur, ki, -3), _piece(g, v_cur, ki, -3)
            qseg = None if q_segment_ids is None else _piece(g, q_segment_ids, qi, -1)
            kseg = None if kseg_cur is None else _piece(g, kseg_cur, ki, -1)

            def branch(kind, q=q, k=k, v=v, qseg=qseg, kseg=kseg, qi=qi, ki=ki):
                def run():
                    if kind is None:
                        return (_like(q, jnp.zeros(q.shape, q.dtype)),
                                _like(q, jnp.full(q.shape[:-3] + (q.shape[-2], q.shape[-3]), -jnp.inf, jnp.float32)))
                    mask = _pair_mask(st, g, kind, qi, ki, step, qseg, kseg, q_lengths, kv_lengths)
                    out, lse = attend(q, k, v, mask, softcap=st.softcap, dropout_rate=st.dropout_rate,
                                      dropout_key=key_words, scale=st.scale, return_lse=True,
                                      deterministic=st.deterministic, backend=st.backend, name=_NAME,
                                      positions=_positions(g, qi, ki, step))
                    return _like(q, out), _like(q, lse)
                return run

            out, lse = _select(kinds, index, branch)
            if acc[qi] is None:
                acc[qi] = (out, lse)
            else:
                acc[qi] = combine(jnp.stack([acc[qi][0], out]), jnp.stack([acc[qi][1], lse]))
        kv = nxt
    out = jnp.concatenate([a[0] for a in acc], axis=-3) if len(acc) > 1 else acc[0][0]
    lse = jnp.concatenate([a[1] for a in acc], axis=-1) if len(acc) > 1 else acc[0][1]
    return out, lse


# The gradient, as FlashAttention's ring backward: the K/V slices go around the ring once more, each with its
# fp32 dK and dV accumulators; at every step each device runs the backward kernel of its queries against the
# visiting slice with the *global* output and LSE (so P and rowsum(dO * O) are the final ones), adds to its dQ
# and to the visiting accumulators, and passes them on. After n passes the accumulators are home. Memory stays
# at a shard's slice, where JAX's autodiff of the forward loop would keep every visiting slice.
_ring = jax.custom_vjp(_ring_forward, nondiff_argnums=(0,))


def _ring_fwd(st, query, key, value, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, key_words):
    out, lse = _ring_forward(st, query, key, value, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, key_words)
    return (out, lse), (query, key, value, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, key_words, out, lse)


def _ring_bwd(st, res, cotangents):
    query, key, value, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, key_words, out, lse = res
    dout, dlse = cotangents
    g = _geometry(st, query, key)
    f32 = jnp.float32
    dq = [_like(query, jnp.zeros(_piece(g, query, p, -3).shape, f32)) for p in range(len(g.q_pieces))]
    kv = (key, value, kv_segment_ids)
    dkv = (_like(key, jnp.zeros(key.shape, f32)), _like(value, jnp.zeros(value.shape, f32)))
    for step in range(g.n):
        nxt = _kv_ring(st, g, kv) if step + 1 < g.n else kv  # on its way before this step's kernels run
        k_cur, v_cur, kseg_cur = kv
        dk_acc = [_piece(g, dkv[0], p, -3) for p in range(len(g.k_pieces))]
        dv_acc = [_piece(g, dkv[1], p, -3) for p in range(len(g.k_pieces))]
        for qi, ki, kinds, index in _pairs(st, g, step):
            q, do, o = (_piece(g, x, qi, -3) for x in (query, dout, out))
            l, dl = _piece(g, lse, qi, -1), _piece(g, dlse, qi, -1)
            k, v = _piece(g, k_cur, ki, -3), _piece(g, v_cur, ki, -3)
            qseg = None if q_segment_ids is None else _piece(g, q_segment_ids, qi, -1)
            kseg = None if kseg_cur is None else _piece(g, kseg_cur, ki, -1)

            def branch(kind, q=q, do=do, o=o, l=l, dl=dl, k=k, v=v, qseg=qseg, kseg=kseg, qi=qi, ki=ki):
                def run():
                    if kind is None:
                        return tuple(_like(x, jnp.zeros(x.shape, f32)) for x in (q, k, v))
                    mask = _pair_mask(st, g, kind, qi, ki, step, qseg, kseg, q_lengths, kv_lengths)
                    pl = plan(q, k, v, mask, softcap=st.softcap, dropout_rate=st.dropout_rate, dropout_key=key_words,
                              scale=st.scale, deterministic=st.deterministic, backend=st.backend, name=_NAME,
                              positions=_positions(g, qi, ki, step))
                    grads = _partition.bwd(do, q, k, v, o, l, dl, pl.operands, pl.cfg)[:3]
                    return tuple(_like(x, gr.astype(f32)) for x, gr in zip((q, k, v), grads))
                return run

            dq_p, dk_p, dv_p = _select(kinds, index, branch)
            dq[qi] = dq[qi] + dq_p
            dk_acc[ki] = dk_acc[ki] + dk_p
            dv_acc[ki] = dv_acc[ki] + dv_p
        dkv = tuple(jnp.concatenate(a, axis=-3) if len(a) > 1 else a[0] for a in (dk_acc, dv_acc))
        # The accumulators travel with their slice; after the last step one more pass brings them home.
        dkv = _kv_ring(st, g, dkv)
        kv = nxt
    dq = jnp.concatenate(dq, axis=-3) if len(dq) > 1 else dq[0]
    return (dq.astype(query.dtype), dkv[0].astype(key.dtype), dkv[1].astype(value.dtype), None, None, None, None,
            None)


_ring.defvjp(_ring_fwd, _ring_bwd)
