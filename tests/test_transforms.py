"""Every JAX transform over jaxflash.attention against the float64 oracle (or the reference where the
transform itself is the point), and the custom-call targets in the lowered HLO."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflash
import oracle
from conftest import DTYPES, make_inputs

ATOL = 5e-5
F32 = DTYPES["float32"]


def ref_out(q, k, v, causal=False):
    return oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=causal)[0]


def ref_grads(q, k, v, do, causal=False):
    return oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=causal, do=np.asarray(do))[2:]


def loss(q, k, v, do, causal=False):
    return jnp.sum(jaxflash.attention(q, k, v, causal=causal) * do)


@pytest.fixture
def qkv():
    return make_inputs(11, (2,), 37, 45, 4, 2, 16, F32)


def test_jit_lowers_to_custom_call(qkv):
    q, k, v, do = qkv
    hlo = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v)).lower(q, k, v).as_text()
    assert "jaxflash_fwd" in hlo and "jaxflash_bwd" not in hlo
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, do).as_text()
    assert "jaxflash_fwd" in hlo and "jaxflash_bwd" in hlo


@pytest.mark.parametrize("causal", [False, True])
def test_grad_and_value_and_grad(qkv, causal):
    q, k, v, do = qkv
    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=4)(q, k, v, do, causal)
    np.testing.assert_allclose(float(val), float(np.sum(ref_out(q, k, v, causal) * np.asarray(do))), rtol=1e-5)
    for g, r in zip(grads, ref_grads(q, k, v, do, causal)):
        np.testing.assert_allclose(np.asarray(g), r, atol=ATOL)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 0, 0), (1, 1, 1), (0, 0, None)],
                         ids=str)
def test_vmap_in_axes(in_axes):
    q, k, v, _ = make_inputs(12, (2,), 19, 23, 4, 2, 8, F32)
    n = 3  # vmapped size > 1 and batch > 1: catches mismatched fold/unfold orders
    rng = np.random.default_rng(13)
    args = []
    for x, ax in zip((q, k, v), in_axes):
        if ax is None:
            args.append(x)
        else:
            args.append(jnp.asarray(rng.standard_normal(x.shape[:ax] + (n,) + x.shape[ax:]), F32))
    out = jax.vmap(lambda q, k, v: jaxflash.attention(q, k, v, causal=True), in_axes=in_axes)(*args)
    for i in range(n):
        sl = [x if ax is None else jnp.take(x, i, axis=ax) for x, ax in zip(args, in_axes)]
        np.testing.assert_allclose(np.asarray(out[i]), ref_out(*sl, causal=True), atol=ATOL)


def test_nested_vmap():
    q, k, v, _ = make_inputs(14, (2, 3), 11, 13, 2, 1, 8, F32)
    out = jax.vmap(jax.vmap(lambda q, k, v: jaxflash.attention(q, k, v)))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), ref_out(q, k, v), atol=ATOL)


def test_vmap_of_grad():
    q, k, v, do = make_inputs(15, (3, 2), 17, 21, 4, 2, 8, F32)
    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, do)
    for g, r in zip(grads, ref_grads(q, k, v, do)):
        np.testing.assert_allclose(np.asarray(g), r, atol=ATOL)


def test_grad_of_vmap_with_shared_kv():
    q, k, v, do = make_inputs(16, (3, 2), 17, 21, 4, 2, 8, F32)
    k, v = k[0], v[0]  # only q batched: dk, dv sum over the vmapped axis

    def f(q, k, v):
        return jnp.sum(jax.vmap(lambda q: jaxflash.attention(q, k, v))(q) * do)

    dq, dk, dv = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    want = [ref_grads(q[i], k, v, do[i]) for i in range(3)]
    np.testing.assert_allclose(np.asarray(dq), np.stack([w[0] for w in want]), atol=ATOL)
    np.testing.assert_allclose(np.asarray(dk), sum(w[1] for w in want), atol=ATOL)
    np.testing.assert_allclose(np.asarray(dv), sum(w[2] for w in want), atol=ATOL)


def test_checkpoint(qkv):
    q, k, v, do = qkv
    grads = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v, do)
    for g, r in zip(grads, ref_grads(q, k, v, do)):
        np.testing.assert_allclose(np.asarray(g), r, atol=ATOL)


def test_eval_shape(qkv):
    q, k, v, _ = qkv
    out, lse = jax.eval_shape(lambda q, k, v: jaxflash.attention(q, k, v, return_lse=True), q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 37) and lse.dtype == jnp.float32


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_shard_map(axis):
    devices = jax.devices("cpu")
    n = len(devices)
    assert n > 1, "conftest asks XLA for several host devices"
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    q, k, v, do = make_inputs(17, (2 * n,), 16, 24, 4 * n, 2 * n, 8, F32)
    spec = P("x") if axis == "batch" else P(None, None, "x")
    f = _shard_map(lambda q, k, v, do: jax.grad(loss, argnums=(0, 1, 2))(q, k, v, do), mesh, (spec,) * 4, (spec,) * 3)
    g = _shard_map(lambda q, k, v: jaxflash.attention(q, k, v), mesh, (spec,) * 3, spec)
    np.testing.assert_allclose(np.asarray(jax.jit(g)(q, k, v)), ref_out(q, k, v), atol=ATOL)
    hlo = jax.jit(f).lower(q, k, v, do).compile().as_text()
    assert "jaxflash_bwd" in hlo and "all-gather" not in hlo and "all-reduce" not in hlo
    for got, r in zip(jax.jit(f)(q, k, v, do), ref_grads(q, k, v, do)):
        np.testing.assert_allclose(np.asarray(got), r, atol=ATOL)


def test_return_lse_under_vmap_and_jit(qkv):
    q, k, v, _ = qkv
    out, lse = jax.jit(jax.vmap(lambda q, k, v: jaxflash.attention(q, k, v, return_lse=True)))(q, k, v)
    ro, rl = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(out), ro, atol=ATOL)
    np.testing.assert_allclose(np.asarray(lse), rl, atol=ATOL)


def test_reference_backend_matches_kernel(qkv):
    q, k, v, _ = qkv
    a = jaxflash.attention(q, k, v, causal=True, backend="reference")
    b = jaxflash.attention(q, k, v, causal=True, backend="cpu")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL)
