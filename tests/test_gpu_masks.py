"""Masks, softcap and dropout in the CUDA kernels, on a GPU (scripts/gpu_check.sh runs these).

Forward and gradients against the float64 oracle over test_masks.py's mask kinds (every head dim, both dtypes,
both dQ paths), with FlashAttention's tolerance rule and outputs poisoned beforehand; padding past the lengths
filled with NaN must not leak; the dropout pattern of the CUDA kernel must equal the CPU kernel's and
`jaxflash.dropout_mask` bit for bit.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import DTYPES, check_close, f64, make_inputs, poison, stable_seed
from test_masks import KINDS, LEAD, mask_arrays, run

import jaxflash
from jaxflash import _ffi

pytestmark = pytest.mark.gpu

# (Sq, Sk, Hq, Hk, D): partial tiles on both sides, GQA/MQA, a single row, every compiled head dim.
SHAPES = [(113, 255, 4, 2, 64), (255, 113, 4, 4, 128), (64, 64, 8, 1, 32), (1, 17, 4, 2, 96),
          (301, 301, 2, 1, 256), (200, 333, 2, 2, 192)]
# Every kind x shape in bfloat16, a third of them in float16; both dQ paths (atomics, deterministic) alternate.
# Only (dtype, head dim) pairs compiled for both passes, read from the module's configuration list.
COMPILED = _ffi.cuda_supported("fwd") & _ffi.cuda_supported("bwd")
CASES = [(kind, shape, dtype, (n // 2) % 2 == 1) for n, (kind, shape, dtype) in
         enumerate(itertools.product(KINDS, SHAPES, ("bfloat16", "float16")))
         if (dtype == "bfloat16" or n % 3 == 0) and (dtype, shape[4]) in COMPILED]


@pytest.fixture(autouse=True)
def _need_cuda_module():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")


def _check_cuda_against_oracle(inputs, kind, kw, dtype, deterministic, case, rate=0.0, key=None):
    """The CUDA kernels' (o, lse, dq, dk, dv) of `kind` against the float64 oracle, outputs poisoned beforehand."""
    q, k, v, do = inputs
    poison(q, k, v, q, k, _ffi._dq_accum_type(q))  # o and the gradients; the fp32 dq workspace
    got = jax.block_until_ready(jax.jit(lambda *a: run(*a, kind, kw, "cuda", deterministic, rate, key))(*inputs))
    naive = run(*inputs, kind, kw, "reference", rate=rate, key=key)
    drop = {} if rate == 0.0 else dict(keep=np.asarray(jaxflash.dropout_mask(key, LEAD[0], q.shape[-2], q.shape[-3],
                                                                             k.shape[-3], rate)), rate=rate)
    ref = oracle.attention(f64(q), f64(k), f64(v), do=f64(do), causal=kind.get("causal", False),
                           softcap=kind.get("softcap"), window=kind.get("window"),
                           bottom_right=not kind.get("top_left", False), offset=kind.get("offset", 0), **drop, **kw)
    for name, g, r, n in zip(("o", "lse", "dq", "dk", "dv"), got, ref, naive):
        check_close(name, g, r, n, dtype, f"{case} deterministic={deterministic}")


@pytest.mark.parametrize("kind_name,shape,dtype,deterministic", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_cuda_masks_match_oracle(kind_name, shape, dtype, deterministic):
    kind = KINDS[kind_name]
    sq, sk, hq, hk, d = shape
    rng = np.random.default_rng(stable_seed(kind_name, shape, dtype))
    inputs = make_inputs(int(rng.integers(2**31)), LEAD, sq, sk, hq, hk, d, DTYPES[dtype])
    _check_cuda_against_oracle(inputs, kind, mask_arrays(kind, rng, sq, sk), dtype, deterministic,
                               f"{kind_name} {shape} {dtype}")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_padding_past_lengths_never_leaks(d):
    """Keys and queries past the lengths may hold anything, even NaN: results equal those of clean inputs."""
    q, k, v, do = make_inputs(31, (2,), 150, 170, 4, 2, d, DTYPES["bfloat16"])
    ql, kl = jnp.array([150, 61], jnp.int32), jnp.array([97, 170], jnp.int32)
    row_q = jnp.arange(150)[None, :, None, None] >= ql[:, None, None, None]
    row_k = jnp.arange(170)[None, :, None, None] >= kl[:, None, None, None]
    dirty = [jnp.where(row, jnp.nan, x).astype(x.dtype) for row, x in ((row_q, q), (row_k, k), (row_k, v), (row_q, do))]
    kind = dict(causal=True)
    kw = dict(q_lengths=ql, kv_lengths=kl)
    for det in (False, True):
        clean = run(q, k, v, do, kind, kw, "cuda", det)
        got = run(*dirty, kind, kw, "cuda", det)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, clean):
            if name == "dq" and not det:  # fp32 atomics add in any order: a last bit may round the other way
                np.testing.assert_allclose(np.asarray(f64(a)), np.asarray(f64(b)), rtol=1e-2, atol=1e-3,
                                           err_msg=name)
            else:
                np.testing.assert_array_equal(np.asarray(f64(a)), np.asarray(f64(b)), err_msg=name)


def _dropout_pattern(backend, key, rate, sq, hq, hk, sk):
    """The keep pattern the kernel applies: with q = 0 every probability is 1/Sk, and V = I (Sk = D) turns O
    into the dropped probability matrix itself, so O != 0 exactly where an element is kept."""
    device = jax.devices("cpu" if backend == "cpu" else "gpu")[0]
    dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
    q = jnp.zeros((2, sq, hq, sk), dtype)
    k = jnp.zeros((2, sk, hk, sk), dtype)
    v = jnp.broadcast_to(jnp.eye(sk, dtype=dtype)[None, :, None, :], (2, sk, hk, sk))
    q, k, v = (jax.device_put(x, device) for x in (q, k, v))
    o = jaxflash.attention(q, k, v, dropout_rate=rate, dropout_key=key, backend=backend)
    return np.swapaxes(np.asarray(o.astype(jnp.float32)) != 0, 1, 2)  # [B, Hq, Sq, Sk]


@pytest.mark.parametrize("sq,hq,hk,sk,rate", [(300, 3, 1, 128, 0.1), (77, 2, 2, 256, 0.5), (130, 4, 2, 64, 0.9)])
def test_cuda_dropout_mask_is_bitwise_the_cpu_one(sq, hq, hk, sk, rate):
    key = jax.random.key(sq + sk)
    cuda = _dropout_pattern("cuda", key, rate, sq, hq, hk, sk)
    cpu = _dropout_pattern("cpu", key, rate, sq, hq, hk, sk)
    want = np.asarray(jaxflash.dropout_mask(key, 2, hq, sq, sk, rate))
    np.testing.assert_array_equal(cuda, want)
    np.testing.assert_array_equal(cpu, want)


DROPOUT_CASES = [  # (Sq, Sk, Hq, Hk, D, mask kind, dtype, rate)
    (113, 255, 4, 2, 64, "window-16-0", "bfloat16", 0.1),
    (255, 113, 4, 4, 128, "top-left-causal", "float16", 0.3),
    (64, 64, 8, 1, 32, "segments-packed", "bfloat16", 0.5),
    (301, 301, 2, 1, 256, "causal-segments-lengths-softcap", "bfloat16", 0.2),
    (200, 333, 2, 2, 192, "lengths", "float16", 0.9),
    (130, 130, 2, 2, 96, "softcap-5", "bfloat16", 0.15),
    # The sm90 backward's transposed draw: GQA, segments, softcap, a partial last key block.
    (200, 190, 6, 2, 128, "causal-segments-lengths-softcap", "bfloat16", 0.2),
    (97, 300, 2, 1, 64, "softcap-5", "float16", 0.5),
    # Its kernel of dropout alone: GQA, lengths, a partial last key block; a window at D=64.
    (200, 190, 6, 2, 128, "lengths", "bfloat16", 0.2),
    (97, 300, 2, 1, 64, "top-left-window-lengths", "float16", 0.5),
]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_dropout_matches_oracle(case, deterministic):
    sq, sk, hq, hk, d, kind_name, dtype, rate = case
    kind = KINDS[kind_name]
    rng = np.random.default_rng(sq * 7 + sk)
    inputs = make_inputs(sq + sk, LEAD, sq, sk, hq, hk, d, DTYPES[dtype])
    _check_cuda_against_oracle(inputs, kind, mask_arrays(kind, rng, sq, sk), dtype, deterministic, case, rate,
                               jax.random.key(sq * 1000 + sk))


# Softcap without segment ids and dropout: the sm90 backward's kernel of softcap alone (deterministic calls run
# the kernel of all extras). GQA, causal with lengths, partial blocks on both sides.
SOFTCAP_KIND = dict(causal=True, softcap=3.0, lengths=KINDS["lengths"]["lengths"])
SOFTCAP_CASES = [c for c in [(200, 190, 6, 2, 128, "bfloat16"), (97, 300, 2, 1, 64, "float16"),
                             (255, 113, 4, 4, 128, "float16"), (113, 255, 4, 2, 64, "bfloat16")]
                 if (c[5], c[4]) in COMPILED]


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_softcap_with_lengths_matches_oracle(case, deterministic):
    sq, sk, hq, hk, d, dtype = case
    rng = np.random.default_rng(sq * 5 + sk)
    inputs = make_inputs(sq * 3 + sk, LEAD, sq, sk, hq, hk, d, DTYPES[dtype])
    _check_cuda_against_oracle(inputs, SOFTCAP_KIND, mask_arrays(SOFTCAP_KIND, rng, sq, sk), dtype, deterministic,
                               case)


def test_cuda_extras_deterministic_mode_is_bitwise_reproducible():
    q, k, v, do = make_inputs(41, (2,), 257, 300, 4, 2, 128, DTYPES["bfloat16"])
    rng = np.random.default_rng(5)
    kw = mask_arrays(KINDS["causal-segments-lengths-softcap"], rng, 257, 300)
    kind = KINDS["causal-segments-lengths-softcap"]
    f = jax.jit(lambda *a: run(*a, kind, kw, "cuda", True, 0.2, jax.random.key(3)))
    a, b = f(q, k, v, do), f(q, k, v, do)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(f64(x)), np.asarray(f64(y)))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_diagonal_takes_lengths_as_given(d):
    """As test_masks' CPU test: lengths past S (eager) or negative (traced) still place the bottom-right diagonal,
    c = i + kv_lengths - q_lengths unclipped, while validity clips them; how a ring step describes its block."""
    sq, sk = 70, 150
    q, k, v, do = make_inputs(stable_seed("raw-lengths-cuda", d), (3,), sq, sk, 4, 2, d, jnp.bfloat16)
    for ql, kl in (([90, 90, 70], [20, 200, 0]), ([-4, 30, 70], [10, -2, 150])):
        ql, kl = np.array(ql), np.array(kl)

        def loss(q, k, v, ql, kl):
            o = jaxflash.attention(q, k, v, causal=True, q_lengths=ql, kv_lengths=kl, backend="cuda")
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, ql, kl)
        ref = oracle.attention(f64(q), f64(k), f64(v), do=f64(do), causal=True, q_lengths=ql, kv_lengths=kl)
        for name, g, r in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref[0], *ref[2:])):
            err = np.max(np.abs(f64(g) - r)) / max(np.max(np.abs(r)), 1e-6)
            assert err < 2e-2, f"{name}: relative error {err:.2e} (lengths q={ql}, kv={kl})"
