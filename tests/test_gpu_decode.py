"""The decode kernel on a GPU (scripts/gpu_check.sh runs these): `jaxflash.attention` with few query rows per
K/V head (split-KV, the query heads of a K/V head packed into one tile) and `jaxflash.paged_attention`, against
the float64 oracle with FlashAttention's tolerance rule, outputs and split workspaces poisoned beforehand.
Under the "sm80" family the attention cases run the mma.sync prefill kernel instead: the same checks, so the
two kernels are tested against each other's oracle on the same shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import DTYPES, check_close, f64, make_inputs, poison, stable_seed
from test_masks import KINDS, mask_arrays
from test_paged import GARBAGE, MASKS as PAGED_MASKS, check, make_cache

import jaxflash
from jaxflash import _ffi
from jaxflash.attention import attend

pytestmark = pytest.mark.gpu

DECODE = sorted((t, d) for f, _, t, d in _ffi.cuda_configs() if f == "decode")
HEAD_DIMS = sorted({d for _, d in DECODE})


@pytest.fixture(autouse=True)
def _need_cuda_module():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")


def _poison_like(q, n_splits=64):
    """o, lse and the largest split workspaces a call on q could get."""
    lse = jax.ShapeDtypeStruct(q.shape[:-3] + (q.shape[-2], q.shape[-3]), jnp.float32)
    poison(q, lse, jax.ShapeDtypeStruct((n_splits, *q.shape), jnp.float32),
           jax.ShapeDtypeStruct((n_splits, *lse.shape), jnp.float32))


def _forward(q, k, v, kind, kw, backend):
    mask = jaxflash.Mask(kind.get("causal", False), kind.get("window"), bottom_right=not kind.get("top_left", False),
                         offset=kind.get("offset", 0), **kw)
    return attend(q, k, v, mask, softcap=kind.get("softcap"), return_lse=True, backend=backend)


# (Sq, Sk, Hq, Hk): one token against short to long caches (the long ones split into many chunks), a
# speculative draft of 4, MQA with 32 packed rows, 64 rows of plain multi-head attention (the most the kernel
# takes), and a key range shorter than one stage.
SHAPES = [(1, 1, 8, 2), (1, 77, 8, 2), (1, 20000, 8, 2), (4, 5003, 8, 2), (1, 9000, 32, 1), (64, 300, 2, 2),
          (3, 40, 4, 4)]
MASK_KINDS = ["window-16-0", "window-5-5", "segments-packed", "segments-random", "lengths", "lengths-zero",
              "softcap-5", "causal-segments-lengths-softcap", "top-left-causal", "causal-offset-back",
              "window-offset-ahead", "top-left-window-lengths"]
CASES = ([("causal", shape, d, dt) for shape in SHAPES for d in HEAD_DIMS for dt in ("bfloat16", "float16")
          if (dt, d) in DECODE and (d == 128 or dt == "bfloat16")]
         + [("full", shape, 128, "bfloat16") for shape in SHAPES]
         + [(kind, SHAPES[(n % 5) + 1], 64 + 64 * (n % 2), "bfloat16") for n, kind in enumerate(MASK_KINDS)])


@pytest.mark.parametrize("kind_name,shape,d,dtype", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_decode_shapes_match_oracle(kind_name, shape, d, dtype):
    if (dtype, d) not in DECODE:
        pytest.skip(f"decode kernel not compiled for {dtype} d={d}")
    kind = {"causal": dict(causal=True), "full": {}}[kind_name] if kind_name in ("causal", "full") else KINDS[kind_name]
    sq, sk, hq, hk = shape
    rng = np.random.default_rng(stable_seed("decode", kind_name, shape, d, dtype))
    q, k, v, _ = make_inputs(int(rng.integers(2**31)), (2,), sq, sk, hq, hk, d, DTYPES[dtype])
    kw = mask_arrays(kind, rng, sq, sk)
    _poison_like(q)
    o, lse = jax.block_until_ready(jax.jit(lambda q, k, v: _forward(q, k, v, kind, kw, "cuda"))(q, k, v))
    naive = _forward(q, k, v, kind, kw, "reference")
    ref = oracle.attention(f64(q), f64(k), f64(v), causal=kind.get("causal", False), softcap=kind.get("softcap"),
                           window=kind.get("window"), bottom_right=not kind.get("top_left", False),
                           offset=kind.get("offset", 0), **kw)
    case = f"{kind_name} {shape} d={d} {dtype}"
    check_close("o", o, ref[0], naive[0], dtype, case)
    check_close("lse", lse, ref[1], naive[1], dtype, case)


def test_decode_is_bitwise_reproducible_and_runs_the_decode_kernel():
    q, k, v, _ = make_inputs(5, (1,), 1, 70000, 8, 2, 128, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, return_lse=True, backend="cuda"))
    runs = [jax.block_until_ready(f(q, k, v)) for _ in range(3)]
    for o, lse in runs[1:]:
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(runs[0][0], np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(runs[0][1]))
    # This shape fills a few tiles only: the keys are split, and the workspaces appear in the compiled call.
    assert _ffi._splits(q, 70000, 2) > 1
    hlo = f.lower(q, k, v).as_text()
    assert "jaxflash_fwd" in hlo


def test_decode_padding_past_lengths_never_leaks():
    """A partly filled contiguous cache whose tail holds NaN: the result equals the clean cache's."""
    q, k, v, _ = make_inputs(9, (3,), 2, 6000, 8, 2, 128, jnp.bfloat16)
    lengths = jnp.asarray([5999, 1, 2500], jnp.int32)
    tail = jnp.arange(6000)[None, :, None, None] >= lengths[:, None, None, None]
    kn, vn = (jnp.where(tail, jnp.nan, x).astype(x.dtype) for x in (k, v))
    f = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=True, kv_lengths=lengths, return_lse=True))
    clean, dirty = f(q, k, v), f(q, kn, vn)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- paged_attention on the GPU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [8, 16, 64, 256])
@pytest.mark.parametrize("sq", [1, 5])
def test_paged_matches_oracle(dtype, page_size, sq):
    case = f"cuda {dtype} page {page_size} sq {sq}"
    lengths = [37, 0, 1, 130, page_size, 3000]  # partial and full last pages, an empty cache, a split one
    args = make_cache(stable_seed("paged", case), lengths, page_size, 8, 2, 128, getattr(jnp, dtype), sq=sq)
    _poison_like(args[0])
    check(case, dtype, *args, causal=True)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_paged_head_dims(d):
    case = f"cuda d={d}"
    args = make_cache(stable_seed("paged d", d), [300, 17], 16, 4, 2, d, jnp.bfloat16, sq=2)
    check(case, "bfloat16", *args, causal=True)


@pytest.mark.parametrize("mask", list(PAGED_MASKS), ids=str)
@pytest.mark.parametrize("hq,hkv,tail", [(3, 1, GARBAGE[0]), (4, 4, GARBAGE[1]), (32, 8, GARBAGE[0])], ids=str)
def test_paged_masks_heads_and_table_tails(mask, hq, hkv, tail):
    case = f"cuda {mask} {hq}/{hkv} tail {tail}"
    # Sq = 7 > two of the lengths: those rows see no key under the causal diagonal (0 and -inf).
    args = make_cache(stable_seed("paged masks", case), [3, 2000, 45, 6], 16, hq, hkv, 64, jnp.bfloat16, sq=7,
                      tail=tail)
    check(case, "bfloat16", *args, **PAGED_MASKS[mask])


def test_paged_num_splits_agree():
    args = make_cache(7, [5000, 9, 700], 16, 8, 2, 128, jnp.bfloat16, sq=3)
    ref_o, ref_lse = None, None
    for n in (None, 1, 3, 8, 64):
        case = f"num_splits={n}"
        check(case, "bfloat16", *args, causal=True, num_splits=n)
        o, lse = jaxflash.paged_attention(*args, causal=True, num_splits=n, return_lse=True)
        if ref_o is None:
            ref_o, ref_lse = f64(o), f64(lse)
        np.testing.assert_allclose(f64(lse), ref_lse, rtol=0, atol=1e-4, err_msg=case)
        np.testing.assert_allclose(f64(o), ref_o, rtol=0, atol=2e-2, err_msg=case)


def test_paged_bad_table_or_length_under_jit_gives_nan_for_that_sequence_only():
    q, kc, vc, table, lengths = make_cache(3, [40, 40, 40], 16, 4, 2, 64, jnp.bfloat16)
    table = table.at[1, 1].set(kc.shape[0] + 5)            # a page outside the cache
    lengths = lengths.at[2].set(table.shape[1] * 16 + 1)   # past the table's capacity
    f = jax.jit(lambda *a: jaxflash.paged_attention(*a, return_lse=True))
    o, lse = f(q, kc, vc, table, lengths)
    o, lse = f64(o), f64(lse)
    assert np.all(np.isfinite(o[0])) and np.all(np.isfinite(lse[0]))
    assert np.all(np.isnan(o[1])) and np.all(np.isnan(lse[1]))
    assert np.all(np.isnan(o[2])) and np.all(np.isnan(lse[2]))


def test_public_combine_agrees_with_the_split_kernel():
    """jaxflash.combine over two halves of the keys equals the decode kernel's merge of its own splits."""
    q, k, v, _ = make_inputs(13, (2,), 1, 9000, 8, 2, 128, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, return_lse=True, backend="cuda"))
    whole = f(q, k, v)
    halves = [f(q, k[:, s], v[:, s]) for s in (slice(0, 4321), slice(4321, None))]
    o, lse = jaxflash.combine(jnp.stack([h[0] for h in halves]), jnp.stack([h[1] for h in halves]))
    np.testing.assert_allclose(f64(lse), f64(whole[1]), rtol=0, atol=1e-4)
    np.testing.assert_allclose(f64(o), f64(whole[0]), rtol=0, atol=2e-2)
