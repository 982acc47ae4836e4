"""The CUDA forward kernel against the float64 oracle, on a GPU (scripts/gpu_check.sh runs these).

Every case: random normal inputs, the output memory poisoned with NaN just before the call (a freed
NaN buffer of the same size is what XLA's allocator hands out next, so an element the kernel forgets
to write fails the finiteness check), FlashAttention's tolerance rule from conftest (kernel error <= 2x
the error of the same computation done plainly in the input dtype, plus a floor), and rows that see no
key must be exactly O = 0 and LSE = -inf.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import check_close, f64, make_inputs, naive_forward, poison

import jaxflash
from jaxflash import _ffi

pytestmark = pytest.mark.gpu

# Every (dtype, head dim) the module compiles a forward kernel for, read from its configuration list.
FWD_CONFIGS = sorted(_ffi.cuda_supported("fwd"))
# (Sq, Sk): single rows, partial tiles on both sides, Sq > Sk (rows with no visible key when causal),
# Sk < one K block, and just under / over a power of two.
LENGTHS = ((1, 1), (64, 64), (113, 203), (239, 1), (1000, 17), (1023, 1024))


@pytest.fixture(autouse=True)
def _need_cuda_module():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")


@functools.partial(jax.jit, static_argnames=("causal",))
def _kernel(q, k, v, causal):
    return jaxflash.attention(q, k, v, causal=causal, return_lse=True, backend="cuda")


def _run(q, k, v, causal):
    lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    poison(q, jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    o, lse = _kernel(q, k, v, causal)
    return jax.block_until_ready((o, lse))


def _check(q, k, v, causal, dtype, case):
    o, lse = _run(q, k, v, causal)
    o_ref, lse_ref = oracle.attention(f64(q), f64(k), f64(v), causal=causal)
    o_naive, lse_naive = naive_forward(q, k, v, causal)
    check_close("o", o, o_ref, o_naive, dtype, case)
    check_close("lse", lse, lse_ref, lse_naive, dtype, case)
    # Rows that see no key: exactly 0 and -inf (lse [..., H, Sq] vs o [..., Sq, H, D]).
    empty = np.isneginf(lse_ref)
    if empty.any():
        o64 = f64(o)
        o_rows = np.moveaxis(o64, -2, -3)  # [..., H, Sq, D]
        assert np.all(o_rows[empty] == 0.0), f"rows with no visible key must be 0 ({case})"
        assert np.all(np.isneginf(f64(lse)[empty])), f"rows with no visible key must have LSE -inf ({case})"


@pytest.mark.parametrize("causal", (False, True), ids=lambda c: f"causal={c}")
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=lambda x: f"{x}")
@pytest.mark.parametrize("dtype,head_dim", FWD_CONFIGS, ids=lambda x: f"{x}")
def test_forward_grid(dtype, head_dim, sq, sk, causal):
    q, k, v, _ = make_inputs(sq * 7 + sk, (1,), sq, sk, 2, 2, head_dim, jnp.dtype(dtype))
    _check(q, k, v, causal, dtype, f"{dtype} d={head_dim} sq={sq} sk={sk} causal={causal}")


@pytest.mark.parametrize("causal", (False, True), ids=lambda c: f"causal={c}")
@pytest.mark.parametrize("hq,hk", ((8, 2), (8, 1), (6, 3)), ids=lambda x: f"{x}")
@pytest.mark.parametrize("head_dim", (64, 128))
def test_forward_gqa(head_dim, hq, hk, causal):
    q, k, v, _ = make_inputs(hq * 31 + hk, (2,), 113, 203, hq, hk, head_dim, jnp.bfloat16)
    _check(q, k, v, causal, "bfloat16", f"gqa {hq}/{hk} d={head_dim} causal={causal}")


@pytest.mark.parametrize("causal", (False, True), ids=lambda c: f"causal={c}")
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_forward_long(head_dim, causal):
    """Many K/V blocks through the pipeline, several query blocks, two leading batch dims."""
    q, k, v, _ = make_inputs(head_dim, (2, 1), 4096, 4096, 2, 1, head_dim, jnp.bfloat16)
    _check(q, k, v, causal, "bfloat16", f"long d={head_dim} causal={causal}")


def test_forward_deterministic():
    """Bitwise identical output over repeated runs (a difference would be a race)."""
    q, k, v, _ = make_inputs(7, (2,), 2047, 3001, 8, 2, 128, jnp.bfloat16)
    for causal in (False, True):
        first = _run(q, k, v, causal)
        for _ in range(4):
            again = _run(q, k, v, causal)
            for a, b in zip(first, again):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.bigmem
def test_forward_64bit_offsets():
    """k and v hold more than 2^31 elements; the second batch entry lies past that offset. Query row 0
    of that entry is made to attend almost only to a key near the very end, so O there is a V row."""
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit", 1 << 40) < 24 * 2**30:
        pytest.skip("needs about 20 GB of device memory")
    sk = (1 << 23) + 17
    d = 128
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 16, 1, d), np.float32), jnp.bfloat16)
    key = jax.random.key(0)
    k = jax.random.normal(key, (2, sk, 1, d), jnp.bfloat16)
    k = k.at[1, sk - 5, 0].set(q[1, 0, 0] * 8)
    v = jax.random.normal(jax.random.fold_in(key, 1), (2, sk, 1, d), jnp.bfloat16)
    assert k.size > 2**31
    o, lse = _run(q, k, v, False)
    # Reference for the far batch entry only, in float32 on the device (it materialises 16 x Sk scores).
    qb, kb, vb = (x[1, :, 0].astype(jnp.float32) for x in (q, k, v))
    s = (qb @ kb.T) / np.sqrt(d)
    lse_ref = jax.nn.logsumexp(s, axis=-1)
    o_ref = jnp.exp(s - lse_ref[:, None]) @ vb
    np.testing.assert_allclose(np.asarray(lse[1, 0], np.float32), np.asarray(lse_ref), rtol=0, atol=1e-2)
    np.testing.assert_allclose(np.asarray(o[1, :, 0], np.float32), np.asarray(o_ref), rtol=0, atol=2e-2)
    assert float(jnp.max(jnp.abs(o_ref[0]))) > 0.5  # row 0 really is dominated by one far V row
    assert np.all(np.isfinite(np.asarray(o, np.float32)))


# Shapes whose tiles (128 query rows each) leave a partial last round on the 132 SMs of an H100/H200, so the
# sm90 forward shares the last tiles' K/V blocks between all SMs (cuda/sm90/schedule.h): (lead, Sq, Sk, Hq, Hk,
# D, dtype). Two parts per tile; 2-3 parts with partial last query and key blocks and blocks holding the end of
# one tile and the start of the next; GQA in 4 parts; D=256 (80-key blocks) in 2 and in 8 parts. (D=64 is not
# split: schedule.h's tail_split_pays.)
SPLIT_CASES = [
    ((1,), 2048, 4096, 9, 9, 128, "bfloat16"),
    ((2,), 3000, 4500, 5, 5, 128, "float16"),
    ((1,), 1024, 8192, 18, 3, 128, "bfloat16"),
    ((3,), 512, 2560, 12, 4, 256, "bfloat16"),
    ((1,), 128, 10240, 136, 136, 256, "bfloat16"),
]
KEYS_PER_BLOCK = {128: 128, 256: 80}  # the sm90 forward's tiles (cuda/sm90/traits.cuh)


def _split_parts(lead, sq, sk, hq, d):
    """The most parts any tile is split into on this GPU (0: the call is not split), from the module's own
    schedule; the skip covers GPUs other than an sm90 one with 132 SMs."""
    cuda = _ffi._jaxflash_cuda
    if cuda is None or cuda.fwd_split_floats(int(np.prod(lead)), sq, hq, sk, d) == 0:
        pytest.skip("this GPU does not split these tiles (not an sm90 device)")
    sms = jax.devices()[0].core_count
    tiles = int(np.prod(lead)) * hq * -(-sq // 128)
    units = cuda.fwd_split_schedule(tiles, -(-sk // KEYS_PER_BLOCK[d]), sms, d)
    return max(parts for cta in units for _, _, _, _, parts, _, _ in cta)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_forward_split_tiles(case):
    """The pieces of split tiles merged into O and the LSE, against the oracle; bitwise the same on a rerun
    (the pieces are summed in a fixed order, whichever finishes last)."""
    lead, sq, sk, hq, hk, d, dtype = case
    if (dtype, d) not in FWD_CONFIGS:
        pytest.skip(f"{dtype} d={d} not compiled")
    if jax.devices()[0].core_count == 132:  # the cases are made for 132 SMs: there they must split
        assert _split_parts(lead, sq, sk, hq, d) >= 2
    q, k, v, _ = make_inputs(sq + sk + d, lead, sq, sk, hq, hk, d, jnp.dtype(dtype))
    _check(q, k, v, False, dtype, f"split {case}")
    first = _run(q, k, v, False)
    again = _run(q, k, v, False)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("extra", ("softcap", "dropout"))
def test_forward_split_tiles_extras(extra):
    """Softcap and dropout in the split pieces: the same keep bits as jaxflash.dropout_mask (the oracle's)."""
    lead, sq, sk, hq, hk, d, dtype = (1,), 2048, 4096, 9, 3, 128, "bfloat16"
    if jax.devices()[0].core_count == 132:
        assert _split_parts(lead, sq, sk, hq, d) >= 2
    q, k, v, _ = make_inputs(77, lead, sq, sk, hq, hk, d, jnp.bfloat16)
    key, rate = jax.random.key(11), 0.25
    kw = dict(softcap=20.0) if extra == "softcap" else dict(dropout_rate=rate, dropout_key=key)
    poison(q, jax.ShapeDtypeStruct((*lead, hq, sq), jnp.float32))
    o, lse = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, return_lse=True, backend="cuda", **kw))(q, k, v)
    o_naive, lse_naive = jaxflash.reference.attention_with_lse(q, k, v, **kw)
    keep = np.asarray(jaxflash.dropout_mask(key, lead[0], hq, sq, sk, rate)) if extra == "dropout" else None
    o_ref, lse_ref = oracle.attention(f64(q), f64(k), f64(v), softcap=kw.get("softcap"), keep=keep,
                                      rate=rate if keep is not None else 0.0)
    check_close("o", o, o_ref, o_naive, dtype, f"split {extra}")
    check_close("lse", lse, lse_ref, lse_naive, dtype, f"split {extra}")
