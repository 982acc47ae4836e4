"""Backward pass of the CPU kernel: dq, dk, dv against the float64 oracle, the same grid and rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import oracle
from conftest import DTYPES, check_close, kernel_grads, make_inputs, naive_grads, stable_seed
from grid import case_id, cases


@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_backward_matches_oracle(case):
    sq, sk, hq, hk, d, causal, dtype = case
    q, k, v, do = make_inputs(stable_seed(case_id(case), "backward"), (2,), sq, sk, hq, hk, d, DTYPES[dtype])
    grads = jax.jit(lambda *a: kernel_grads(*a, causal, backend="cpu"))(q, k, v, do)
    ref = oracle.attention(*(np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v)),
                           causal=causal, do=np.asarray(jnp.asarray(do, jnp.float32), np.float64))[2:]
    naive = naive_grads(q, k, v, do, causal)
    for name, g, r, n, x in zip(("dq", "dk", "dv"), grads, ref, naive, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        check_close(name, g, r, n, dtype, case_id(case))


def test_gradient_through_lse():
    """Gradients of a loss that uses both out and lse: the kernel's dlse term against autodiff of the
    float32 reference (the float64 oracle has no lse term; float32 autodiff is exact to ~1e-6 here)."""
    q, k, v, do = make_inputs(7, (1,), 13, 29, 2, 1, 8, DTYPES["float32"])
    w = jnp.asarray(np.random.default_rng(8).standard_normal((1, 2, 13)), jnp.float32)

    def loss(q, k, v, backend):
        o, lse = jaxflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * w)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "cpu")
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "reference")
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5)


def test_rows_that_see_nothing_get_zero_gradients():
    q, k, v, do = make_inputs(9, (), 9, 4, 2, 2, 16, DTYPES["float32"])
    dq, dk, dv = kernel_grads(q, k, v, do, True)
    assert np.all(np.asarray(dq)[:5] == 0)
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True, do=np.asarray(do))[2:]
    for g, r in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(np.asarray(g), r, atol=2e-5)


def test_backward_deterministic_run_to_run():
    q, k, v, do = make_inputs(10, (2,), 300, 280, 8, 2, 64, DTYPES["bfloat16"])
    a = kernel_grads(q, k, v, do, True)
    b = kernel_grads(q, k, v, do, True)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))


def test_deterministic_flag_on_cpu_changes_nothing():
    """The CPU backward has no atomics: deterministic=True must give the very same bits."""
    q, k, v, do = make_inputs(11, (2,), 130, 150, 4, 2, 32, DTYPES["float16"])

    def grads(det):
        f = lambda q, k, v: jnp.sum(jaxflash.attention(q, k, v, causal=True, deterministic=det) * do)
        return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    for a, b in zip(grads(False), grads(True)):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
