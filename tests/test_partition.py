"""Automatic partitioning: plain `jax.jit` over sharded inputs runs the kernels on each shard.

On the 4 host devices that conftest sets up (a 2 x 2 mesh, "data" x "model"): for inputs sharded on the batch
dims and/or the heads, the compiled forward and `jax.vjp` backward hold no collective, the kernels see shard-sized
operands, the results equal the unsharded call bitwise, and the outputs and dq/dk/dv come back sharded like their
inputs. Sharded sequence axes (and heads with dropout, whose counter numbers heads within a call) are gathered by
the rule: correct results, collectives allowed.
"""
from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxflash
from conftest import stable_seed

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
B, S, H, D = 4, 24, 4, 16
AxisType = getattr(jax.sharding, "AxisType", None)


def _mesh(explicit=False):
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    if not explicit:
        return jax.sharding.Mesh(devices, ("data", "model"))
    return jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _mesh_context(mesh, explicit):
    if not explicit:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


def _explicit_supported():
    return AxisType is not None and (hasattr(jax, "set_mesh") or hasattr(jax.sharding, "use_mesh"))


def _inputs(case, hk, lead=(B,)):
    rng = np.random.default_rng(stable_seed("partition", case))
    q = jnp.asarray(rng.standard_normal(lead + (S, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal(lead + (S, hk, D)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, lead + (S,)), axis=-1), jnp.int32)
    lengths = jnp.asarray(rng.integers(0, S + 1, lead), jnp.int32)
    return q, k, v, seg, lengths


def _options(masks, dropout, seg, lengths):
    opts = dict(causal=True)
    if masks:
        opts.update(window=(7, None), q_segment_ids=seg, kv_segment_ids=seg, q_lengths=lengths,
                    kv_lengths=jnp.maximum(lengths, 5))
    if dropout:
        opts.update(dropout_rate=0.25, dropout_key=jax.random.key(7))
    return opts


def _forward_and_vjp(attn):
    def f(q, k, v):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(jnp.cos(o)))
    return f


def _kernel_shapes(hlo, target):
    """The result shapes text of every custom call to `target` in compiled HLO."""
    return [m.group(1) for m in re.finditer(r"= (\(?[^=]*?\)?) custom-call\([^\n]*custom_call_target=\"" + target,
                                              hlo)]


def _check(f, args, shardings, *, collectives_allowed=False, mesh=None, explicit=False, local_q=None):
    """jit(f) over `args` placed with `shardings` equals jit(f) on one device, bitwise; with no collective in the
    compiled HLO unless allowed; its results sharded like (q, q, k, v)."""
    expected = jax.jit(f)(*args)
    placed = [jax.device_put(x, s) for x, s in zip(args, shardings)]
    with _mesh_context(mesh, explicit):
        compiled = jax.jit(f).lower(*placed).compile()
        got = compiled(*placed)
    hlo = compiled.as_text()
    if not collectives_allowed:
        assert [c for c in COLLECTIVES if c in hlo] == []
        fwd = _kernel_shapes(hlo, "jaxflash_fwd")
        assert fwd and all(local_q in s for s in fwd), fwd  # the kernel ran on one shard's operands
    for name, g, e, like in zip(("o", "dq", "dk", "dv"), got, expected, (placed[0], placed[0], placed[1], placed[2])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=name)
        if not collectives_allowed:
            assert g.sharding.is_equivalent_to(like.sharding, g.ndim), (name, g.sharding, like.sharding)


CASES = {  # name: (q/k/v spec, kv heads, masks, dropout)
    "batch": (P("data"), H, False, False),
    "heads": (P(None, None, "model"), H, False, False),
    "heads-gqa": (P(None, None, "model"), 2, False, False),
    "batch+heads-gqa-masks": (P("data", None, "model"), 2, True, False),
    "batch-masks-dropout": (P("data"), 2, True, True),
    "batch+heads-dropout": (P("data", None, "model"), H, False, True),  # heads gathered
    "sequence": (P(None, "data"), H, True, False),  # sequence gathered
}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_jit(case, explicit):
    if explicit and not _explicit_supported():
        pytest.skip(f"jax {jax.__version__} has no Explicit mesh axes")
    if explicit and case not in ("batch+heads-gqa-masks", "batch-masks-dropout"):
        pytest.skip("Explicit axes: two cases suffice")
    spec, hk, masks, dropout = CASES[case]
    mesh = _mesh(explicit)
    q, k, v, seg, lengths = _inputs(case, hk)
    opts = _options(masks, dropout, seg, lengths)  # mask operands: batch-sharded by the rule, whatever they are
    f = _forward_and_vjp(lambda q, k, v: jaxflash.attention(q, k, v, **opts))
    gathered = case in ("batch+heads-dropout", "sequence")
    local = [n // (2 if a else 1) for n, a in zip((B, S, H, D), tuple(spec) + (None,) * 4)]
    _check(f, (q, k, v), [NamedSharding(mesh, spec)] * 3, collectives_allowed=gathered, mesh=mesh,
           explicit=explicit, local_q="f32[{},{},{},{}]".format(*local))


def test_two_batch_dims_each_sharded():
    mesh = _mesh()
    q, k, v, seg, lengths = _inputs("two batch dims", 2, lead=(2, 2))
    opts = _options(True, True, seg, lengths)
    f = _forward_and_vjp(lambda q, k, v: jaxflash.attention(q, k, v, **opts))
    _check(f, (q, k, v), [NamedSharding(mesh, P("data", "model"))] * 3, local_q=f"f32[1,1,{S},{H},{D}]")


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_vmap_of_sharded(explicit):
    """vmap puts its axis in front of the batch dims; that axis and the heads sharded, k/v vmapped too."""
    if explicit and not _explicit_supported():
        pytest.skip(f"jax {jax.__version__} has no Explicit mesh axes")
    mesh = _mesh(explicit)
    q, k, v, seg, lengths = _inputs("vmap", 2, lead=(2, 3))
    f = _forward_and_vjp(jax.vmap(lambda q, k, v: jaxflash.attention(q, k, v, causal=True)))
    _check(f, (q, k, v), [NamedSharding(mesh, P("data", None, None, "model"))] * 3, mesh=mesh,
           explicit=explicit, local_q=f"f32[1,3,{S},{H // 2},{D}]")


def test_vmap_of_query_only():
    """vmap over q alone: the rule broadcasts k and v over the vmapped axis, which stays sharded."""
    mesh = _mesh()
    q, k, v, _, _ = _inputs("vmap q", 2, lead=(2, B))
    k, v = k[0], v[0]

    def f(q, k, v):
        return (jax.vmap(lambda q: jaxflash.attention(q, k, v, causal=True))(q),)
    expected = jax.jit(f)(q, k, v)
    placed = [jax.device_put(q, NamedSharding(mesh, P(None, "data")))] + \
             [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (k, v)]
    compiled = jax.jit(f).lower(*placed).compile()
    assert [c for c in COLLECTIVES if c in compiled.as_text()] == []
    got = compiled(*placed)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]))
    assert got[0].sharding.is_equivalent_to(placed[0].sharding, q.ndim)


def test_eager_call_stays_sharded():
    """Without an enclosing jit, each kernel call is still compiled for its operands' shardings."""
    mesh = _mesh()
    q, k, v, _, _ = _inputs("eager", 2)
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))) for x in (q, k, v)]
    got = _forward_and_vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=True))(*placed)
    expected = jax.jit(_forward_and_vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=True)))(q, k, v)
    for g, e, like in zip(got, expected, (placed[0], placed[0], placed[1], placed[2])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
        assert g.sharding.is_equivalent_to(like.sharding, g.ndim)


@pytest.mark.skipif(not hasattr(jax.config, "jax_use_shardy_partitioner"), reason="no GSPMD switch in this jax")
def test_gspmd_partitioner():
    """The same partitioning with Shardy switched off (XLA's older GSPMD propagation)."""
    mesh = _mesh()
    q, k, v, _, _ = _inputs("gspmd", 2)
    f = _forward_and_vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=True))
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        _check(f, (q, k, v), [NamedSharding(mesh, P("data", None, "model"))] * 3, local_q=f"f32[2,{S},{H // 2},{D}]")
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
