"""How the FFI calls split over devices: `custom_partitioning` with a Shardy sharding rule, so that `jax.jit` over
inputs sharded on the batch (leading) dims and/or the head dim runs the kernel on each shard, with no collective.

XLA cannot look inside a custom call; without a rule it gathers every operand onto every device and computes the
whole batch everywhere. The rule says which dims are independent: every leading dim (batch) and the heads. A
grouped-query q's head dim is the compound factor (kv head, group), so that a shard holds whole groups with their
key/value heads. Sequence and head_dim are contracted or mixed inside the kernel and are replicated. The mask
operands (segment ids, lengths) and the dropout state follow the batch dims; the dropout state carries each batch
element's global index, so a batch shard draws the same mask as the unsharded call. The kernels count heads from 0
within a call, so with dropout the heads stay whole (XLA gathers head-sharded inputs, as it would without a rule).

`custom_partitioning` has no batching rule, so each call is also a `custom_vmap` whose rule moves the vmapped axis
to the front as one more batch dim (a reshape into the existing batch dim would make XLA gather) and calls the
partitioned function again. Both sit below `_vjp.flash`'s custom_vjp."""
from __future__ import annotations

import functools

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp

from . import _ffi


def fwd(q, k, v, operands, cfg):
    """`_ffi.fwd`, partitioned: (o, lse)."""
    return _vmappable("fwd", cfg)(q, k, v, *operands)


def bwd(do, q, k, v, o, lse, dlse, operands, cfg):
    """`_ffi.bwd`, partitioned: (dq, dk, dv); the workspaces are dropped."""
    return _vmappable("bwd", cfg)(do, q, k, v, o, lse, dlse, *operands)


# --- the rules ------------------------------------------------------------------------------------------------
# Factors: s, t query and key sequence; p the dQ workspace's rows (s rounded up); h = (k g) query heads as (kv head,
# group member); d head_dim; w the words of the dropout state; z the empty last dim of an unused mask operand;
# `...` every leading (batch) dim.

def _mask_operands(cfg):
    """The rule's text for q/kv segment ids, q/kv lengths and the dropout state; unused ones are empty arrays
    (attention.plan) with a last dim of size 0."""
    seg = "... s, ... t" if cfg.segment_ids else "... z, ... z"
    lengths = "..., ..." if cfg.lengths else "... z, ... z"
    return f"{seg}, {lengths}, {'... w' if cfg.dropout_rate > 0 else '... z'}"


def _rule(kind, cfg, group, split_heads):
    h = "(k g)" if group > 1 else "k"
    q, kv, stat, masks = f"... s {h} d", "... t k d", f"... {h} s", _mask_operands(cfg)
    if kind == "fwd":
        rule = f"{q}, {kv}, {kv}, {masks} -> {q}, {stat}"
    else:  # do, q, k, v, o, lse, dlse, masks -> dq, dk, dv, and two fp32 workspaces: q's shape with its
        # rows rounded up (p), and lse's shape
        rule = f"{q}, {q}, {kv}, {kv}, {q}, {stat}, {stat}, {masks} -> {q}, {kv}, {kv}, ... p {h} d, {stat}"
    sizes = {"g": group} if group > 1 else {}
    replicated = {"s", "p", "d", "t", "w", "z"} | (set() if split_heads else {"k", *sizes})
    # Shardy wants them in the order the factors first appear in the rule.
    order = dict.fromkeys(c for c in rule if c.isalpha())
    return rule, dict(need_replication_factors=tuple(f for f in order if f in replicated), **sizes)


def _shardings(kind, mesh, cfg, q_info, hk, split_heads):
    """(operand shardings, result shardings) of one call from q's sharding: q's leading-dim axes for every batch
    dim, q's head axes for the heads when allowed and they split the key/value heads evenly, everything else
    replicated."""
    nd = len(q_info.shape)
    spec = tuple(getattr(q_info.sharding, "spec", ())) + (None,) * nd
    lead, heads = spec[:nd - 3], spec[nd - 2]
    if heads is not None and (not split_heads or hk % _axes_size(mesh, heads)):
        heads = None  # dropout, or a shard would hold part of a kv head's group: heads whole
    named = lambda *s: NamedSharding(mesh, P(*lead, *s))
    q, kv, stat = named(None, heads, None), named(None, heads, None), named(heads, None)
    lengths = named() if cfg.lengths else named(None)
    masks = (named(None), named(None), lengths, lengths, named(None))
    if kind == "fwd":
        return (q, kv, kv, *masks), (q, stat)
    return (q, q, kv, kv, q, stat, stat, *masks), (q, kv, kv, q, stat)


def _axes_size(mesh, axes) -> int:
    axes = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _call(kind, cfg, *arrays):
    """The unpartitioned FFI call; the bwd's workspaces are returned too, so the rule can name every result."""
    if kind == "fwd":
        q, k, v, *operands = arrays
        return tuple(_ffi.fwd(q, k, v, operands, cfg))
    do, q, k, v, o, lse, dlse, *operands = arrays
    return _ffi.bwd(do, q, k, v, o, lse, dlse, operands, cfg)


@functools.lru_cache(maxsize=None)
def _partitioned(kind, cfg, group):
    # The dropout counter holds the head's index within the call; a head shard would draw other heads' masks.
    split_heads = cfg.dropout_rate == 0

    def f(*arrays):
        return _call(kind, cfg, *arrays)

    def partition(mesh, arg_infos, result_infos):
        del result_infos
        q_info = arg_infos[0] if kind == "fwd" else arg_infos[1]
        hk = arg_infos[1].shape[-2] if kind == "fwd" else arg_infos[2].shape[-2]
        in_shardings, out_shardings = _shardings(kind, mesh, cfg, q_info, hk, split_heads)
        return mesh, functools.partial(_call, kind, cfg), out_shardings, in_shardings

    def infer_sharding_from_operands(mesh, arg_infos, result_infos):  # the partitioner without Shardy (GSPMD)
        return partition(mesh, arg_infos, result_infos)[2]

    rule, factors = _rule(kind, cfg, group, split_heads)
    cp = custom_partitioning(f)
    cp.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                     sharding_rule=rule, **factors)
    return cp


@functools.lru_cache(maxsize=None)
def _vmappable(kind, cfg):
    @custom_vmap
    def call(*arrays):
        q, k = arrays[:2] if kind == "fwd" else arrays[1:3]
        outs = _partitioned(kind, cfg, q.shape[-2] // k.shape[-2])(*arrays)
        return tuple(outs) if kind == "fwd" else tuple(outs[:3])

    @call.def_vmap
    def rule(axis_size, in_batched, *arrays):
        # Every operand gets the vmapped axis in front (unbatched ones by broadcasting, as the FFI calls'
        # vmap_method="broadcast_all" does), and the kernels see one more batch dim.
        arrays = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(arrays, in_batched)]
        outs = call(*arrays)
        return outs, tuple(True for _ in outs)

    # Under jit this inlines; called eagerly, the jit lets the partitioner see the operands' shardings too.
    return jax.jit(call)
