"""Shared test helpers: stable seeds, random inputs, the naive baselines and FlashAttention's tolerance rule."""
from __future__ import annotations

import functools
import os
import sys
import zlib

# Eight host devices so the shard_map and ring tests shard for real (must precede the first jax import).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # the test modules import oracle, grid and conftest by name

import jaxflash  # noqa: E402
from jaxflash import reference  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # the naive float32 baseline must be float32

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Absolute floor added to 2x the naive error: covers the case where the naive computation happens to
# be exact (e.g. Sk = 1) while the kernel rounds once more.
FLOOR = {"float32": 2e-5, "bfloat16": 2e-3, "float16": 5e-4}


def pytest_collection_modifyitems(config, items):
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)


# The GPU tests run once per CUDA kernel family: "auto" lets the handler pick (the sm90 kernels on a Hopper
# GPU for the configurations they have), "sm80" forces the mma.sync kernels, so one H200 tests both.
# JAXFLASH_TEST_FAMILIES narrows the list (e.g. "auto" for a quick run).
CUDA_FAMILIES = os.environ.get("JAXFLASH_TEST_FAMILIES", "auto sm80").split()


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("gpu") is not None:
        metafunc.fixturenames.append("cuda_family")
        metafunc.parametrize("cuda_family", CUDA_FAMILIES, indirect=True)


@pytest.fixture
def cuda_family(request, monkeypatch):
    """The kernel family a GPU test runs on (the handler reads JAXFLASH_CUDA_KERNELS at every call)."""
    monkeypatch.setenv("JAXFLASH_CUDA_KERNELS", request.param)
    return request.param


def stable_seed(*parts) -> int:
    """The seed of one test case, the same in every process, so a failure replays: crc32 of the parts' text
    (hash() of a string is salted per process)."""
    return zlib.crc32(" ".join(map(str, parts)).encode())


def make_inputs(seed, lead, sq, sk, hq, hk, d, dtype):
    """Random normal q, k, v, do (rounded to dtype) as JAX arrays in `dtype`."""
    rng = np.random.default_rng(seed)
    shapes = [(*lead, sq, hq, d), (*lead, sk, hk, d), (*lead, sk, hk, d), (*lead, sq, hq, d)]
    return [jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in shapes]


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def check_close(name, got, ref64, naive, dtype_name, case=""):
    """FlashAttention's rule: max|kernel - ref| <= 2 * max|naive - ref| + floor, where `naive` is the
    same computation done plainly in the input dtype and `ref` is float64. -inf entries must match."""
    got, naive = f64(got), f64(naive)
    ref64 = np.asarray(ref64, np.float64)
    inf = np.isinf(ref64)
    np.testing.assert_array_equal(np.isinf(got), inf, err_msg=f"{name}: infinities differ ({case})")
    assert np.all(np.isfinite(got[~inf])), f"{name}: non-finite values ({case})"
    err = float(np.max(np.abs(got[~inf] - ref64[~inf]), initial=0.0))
    base = float(np.max(np.abs(naive[~inf] - ref64[~inf]), initial=0.0))
    bound = 2 * base + FLOOR[dtype_name]
    # The rule trusts `naive`: were it and the kernel wrong alike (or the oracle fed other inputs, say another
    # dropout mask), the bound would grow to cover both. Outputs of the naive computation stay within ~2 % of
    # the oracle's largest entry in every test of the suite (a wrong dropout mask: 60 % and more).
    if name in ("o", "out"):
        scale = float(np.max(np.abs(ref64[~inf]), initial=0.0))
        assert base <= 0.1 * scale + FLOOR[dtype_name], (
            f"{name}: the naive computation is {base:.3e} from the float64 oracle (max |ref| {scale:.3e}): "
            f"the test's inputs disagree ({case})")
    assert err <= bound, f"{name}: kernel error {err:.3e} > 2 x naive error {base:.3e} + floor ({case})"


def poison(*like):
    """Fill then free device buffers shaped like each of `like` (arrays or jax.ShapeDtypeStructs), so that
    memory a kernel forgets to write reads as NaN: XLA's allocator hands the freed buffers out next."""
    for x in like:
        jnp.full(x.shape, jnp.nan, x.dtype).block_until_ready().delete()


def plain_jit(f, **kw):
    """jax.jit for the naive baselines: without excess precision XLA rounds every intermediate to the input
    dtype as op-by-op execution does (plain attention in bfloat16/float16: the same bits; a fused tanh or a
    masked backward: the last bits may differ), and one compilation replaces one per eager op (the eager
    baselines were most of the CPU suite's time)."""
    return jax.jit(f, compiler_options={"xla_allow_excess_precision": False}, **kw)


@functools.partial(plain_jit, static_argnames=("causal", "scale"))
def naive_forward(q, k, v, causal, scale=None):
    return reference.attention_with_lse(q, k, v, causal=causal, scale=scale)


@functools.partial(plain_jit, static_argnames=("causal", "scale"))
def naive_grads(q, k, v, do, causal, scale=None):
    _, vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, causal=causal, scale=scale), q, k, v)
    return vjp(do)


def kernel_grads(q, k, v, do, causal, scale=None, backend=None):
    _, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, scale=scale, backend=backend),
                     q, k, v)
    return vjp(do)

