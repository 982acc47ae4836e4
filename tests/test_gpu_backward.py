"""The CUDA backward kernel against the float64 oracle, on a GPU (scripts/gpu_check.sh runs these).

dq, dk, dv of jaxflash.attention (backend="cuda") against tests/oracle.py with FlashAttention's rule from
conftest (kernel error <= 2x the error of the same computation done plainly in the input dtype, plus a
floor), on random normal inputs, with the gradient buffers poisoned with NaN just before each call (an
element the kernel forgets to write fails the finiteness check). Both dQ paths are covered: the default
(fp32 atomics into dq_accum) and deterministic=True (a dQ kernel without atomics), which must also be
bitwise reproducible run to run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import check_close, f64, make_inputs, naive_grads, poison, stable_seed
from grid import case_id, cases

import jaxflash
from jaxflash import _ffi

pytestmark = pytest.mark.gpu

# Every (dtype, head dim) the module compiles a backward kernel for, read from its configuration list.
BWD_CONFIGS = sorted(_ffi.cuda_supported("bwd"))
GRID = [c for c in cases() if (c[6], c[4]) in BWD_CONFIGS]


@pytest.fixture(autouse=True)
def _need_cuda_module():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")


@functools.partial(jax.jit, static_argnames=("causal", "deterministic"))
def _kernel_grads(q, k, v, do, causal, deterministic):
    _, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, deterministic=deterministic,
                                                        backend="cuda"), q, k, v)
    return vjp(do)


_naive_grads = jax.jit(naive_grads, static_argnums=(4,))


def _run(q, k, v, do, causal, deterministic=False):
    poison(q, k, v, _ffi._dq_accum_type(q))  # the gradients and the fp32 dq workspace
    return jax.block_until_ready(_kernel_grads(q, k, v, do, causal, deterministic))


def _check(q, k, v, do, causal, dtype, case, deterministic=False):
    grads = _run(q, k, v, do, causal, deterministic)
    ref = oracle.attention(f64(q), f64(k), f64(v), causal=causal, do=f64(do))[2:]
    naive = _naive_grads(q, k, v, do, causal)
    for name, g, r, n, x in zip(("dq", "dk", "dv"), grads, ref, naive, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape} {g.dtype} ({case})"
        check_close(name, g, r, n, dtype, f"{case} deterministic={deterministic}")


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_backward_grid(case):
    """The foundation grid (odd lengths both ways, GQA/MQA, causal with rows that see nothing); the dQ
    path alternates between atomics and the deterministic kernel."""
    sq, sk, hq, hk, d, causal, dtype = case
    q, k, v, do = make_inputs(stable_seed(case_id(case)), (2,), sq, sk, hq, hk, d, jnp.dtype(dtype))
    _check(q, k, v, do, causal, dtype, case_id(case), deterministic=GRID.index(case) % 2 == 1)


@pytest.mark.parametrize("causal", (False, True), ids=lambda c: f"causal={c}")
@pytest.mark.parametrize("dtype,head_dim", BWD_CONFIGS, ids=lambda x: f"{x}")
def test_backward_every_head_dim(dtype, head_dim, causal):
    """Every compiled (dtype, head dim), both dQ paths, partial tiles on both sides, GQA 6/2."""
    q, k, v, do = make_inputs(head_dim * 3 + causal, (1,), 131, 259, 6, 2, head_dim, jnp.dtype(dtype))
    for deterministic in (False, True):
        _check(q, k, v, do, causal, dtype, f"{dtype} d={head_dim} causal={causal}", deterministic)


@pytest.mark.parametrize("dtype,head_dim", BWD_CONFIGS, ids=lambda x: f"{x}")
def test_backward_partial_last_preprocess_warp(dtype, head_dim):
    """The preprocess gives a warp 32 / lanes-per-row rows (8 at d=32, 4 at 64, 2 at 96 and 128): 1 x 37 x 3
    = 111 rows leaves its last warp partly filled there, and delta of those rows must still be right."""
    q, k, v, do = make_inputs(head_dim + 7, (1,), 37, 45, 3, 1, head_dim, jnp.dtype(dtype))
    _check(q, k, v, do, False, dtype, f"{dtype} d={head_dim} 111 rows")


@pytest.mark.parametrize("causal", (False, True), ids=lambda c: f"causal={c}")
@pytest.mark.parametrize("hq,hk", ((8, 2), (8, 1), (6, 3)), ids=lambda x: f"{x}")
def test_backward_gqa_long(hq, hk, causal):
    """Many K/V and query blocks, dK/dV summed over each head group, two leading batch dims."""
    q, k, v, do = make_inputs(hq * 31 + hk, (2, 1), 700, 1100, hq, hk, 128, jnp.bfloat16)
    _check(q, k, v, do, causal, "bfloat16", f"gqa {hq}/{hk} causal={causal}")


def test_backward_rows_that_see_nothing():
    """Causal with Sq > Sk: the first Sq - Sk rows see no key (LSE = -inf) and get exactly zero dq."""
    q, k, v, do = make_inputs(5, (2,), 300, 40, 4, 2, 64, jnp.bfloat16)
    for deterministic in (False, True):
        dq, dk, dv = _run(q, k, v, do, True, deterministic)
        assert np.all(f64(dq)[:, :260] == 0.0)
        for g in (dq, dk, dv):
            assert np.all(np.isfinite(f64(g)))


def test_backward_deterministic_bitwise():
    """deterministic=True: bitwise identical gradients over repeated runs (atomics-free dQ)."""
    q, k, v, do = make_inputs(11, (2,), 1500, 2100, 8, 2, 128, jnp.bfloat16)
    for causal in (False, True):
        first = _run(q, k, v, do, causal, True)
        for _ in range(3):
            again = _run(q, k, v, do, causal, True)
            for a, b in zip(first, again):
                np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_backward_deterministic_bitwise_masks():
    """deterministic=True with a window, lengths and GQA (blocks that visit only some query blocks wait only
    for the blocks before them that visit those): bitwise identical over repeated runs."""
    q, k, v, do = make_inputs(15, (3,), 1100, 1300, 6, 2, 64, jnp.bfloat16)
    kw = dict(window=(300, 40), q_lengths=jnp.array([1100, 700, 0]), kv_lengths=jnp.array([1300, 513, 90]))
    f = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: jaxflash.attention(
        q, k, v, deterministic=True, backend="cuda", **kw), q, k, v)[1](do))
    first = jax.block_until_ready(f(q, k, v, do))
    for _ in range(3):
        for a, b in zip(first, jax.block_until_ready(f(q, k, v, do))):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_backward_deterministic_matches_atomic():
    """The two dQ paths compute the same function, to fp32 summation order (the sm90 family's deterministic
    kernel also visits the query blocks in another order, so dk and dv may differ in the last bit too)."""
    q, k, v, do = make_inputs(12, (1,), 777, 900, 4, 1, 64, jnp.float16)
    a = _run(q, k, v, do, True, False)
    b = _run(q, k, v, do, True, True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(f64(x), f64(y), atol=2e-3, rtol=2e-3)


def test_grad_under_jit_and_vmap():
    """jax.grad of a loss through jaxflash under jit, and vmapped (k, v unbatched), on the GPU, against
    the same in float32 through the reference."""
    q, k, v, _ = make_inputs(13, (3, 2), 97, 150, 4, 2, 64, jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(14).standard_normal(q.shape[1:]), jnp.float32)

    def grads(backend):
        def loss(q, k, v):
            o = jaxflash.attention(q, k, v, causal=True, backend=backend)
            return jnp.sum(o.astype(jnp.float32) * w)
        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))

    k, v = k[0], v[0]
    got = grads("cuda")(q, k, v)
    want = grads("reference")(*(x.astype(jnp.float32) for x in (q, k, v)))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(f64(a), f64(b), atol=3e-2, rtol=3e-2)


@pytest.mark.bigmem
def test_backward_64bit_offsets():
    """k and v hold more than 2^31 elements; the second batch entry's dK and dV lie past that offset."""
    sk, d = (1 << 23) + 17, 128
    key = jax.random.key(1)
    q = jax.random.normal(key, (2, 16, 1, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (2, sk, 1, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (2, sk, 1, d), jnp.bfloat16)
    do = jax.random.normal(jax.random.fold_in(key, 3), (2, 16, 1, d), jnp.bfloat16)
    assert k.size > 2**31
    dq, dk, dv = _run(q, k, v, do, True)  # causal: row i sees keys <= i + sk - 16
    # Float32 reference for the far batch entry's last 4096 keys and dq, on the device.
    qb, kb, vb, dob = (x[1, :, 0].astype(jnp.float32) for x in (q, k, v, do))
    s = (qb @ kb.T) / np.sqrt(d)
    s = jnp.where(jnp.arange(sk)[None, :] <= jnp.arange(16)[:, None] + sk - 16, s, -jnp.inf)
    p = jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True))
    dp = dob @ vb.T
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    tail = slice(sk - 4096, sk)
    dv_ref = p[:, tail].T @ dob
    dk_ref = ds[:, tail].T @ qb / np.sqrt(d)
    dq_ref = ds @ kb / np.sqrt(d)
    np.testing.assert_allclose(f64(dv[1, tail, 0]), f64(dv_ref), atol=2e-2, rtol=0)
    np.testing.assert_allclose(f64(dk[1, tail, 0]), f64(dk_ref), atol=2e-2, rtol=0)
    np.testing.assert_allclose(f64(dq[1, :, 0]), f64(dq_ref), atol=2e-2, rtol=0)
