"""jaxflash.paged_attention and append_kv against a float64 NumPy oracle that gathers the pages itself: odd
lengths, partial last pages, shuffled pages, garbage table tails, GQA, the masks, every dtype, page sizes."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import oracle
from conftest import check_close, f64, stable_seed
from jaxflash import paged, reference

GARBAGE = (-1, 2**30)  # table entries past a sequence's pages: never read


def make_cache(seed, lengths, page_size, hq, hkv, d, dtype, sq=1, pages_per_seq=None, tail=-1):
    """Random q and caches whose pages are dealt to the sequences in a shuffled order, a table tail of `tail`,
    and NaN in every slot no sequence holds (a kernel that reads one returns NaN)."""
    rng = np.random.default_rng(seed)
    need = [-(-n // page_size) for n in lengths]
    pages_per_seq = pages_per_seq or max(max(need), 1) + 1
    num_pages = sum(need) + 3  # spare pages, never named
    order = rng.permutation(num_pages)
    table = np.full((len(lengths), pages_per_seq), tail, np.int64)
    kc = np.full((num_pages, page_size, hkv, d), np.nan, np.float32)
    vc = np.full_like(kc, np.nan)
    at = 0
    for b, n in enumerate(lengths):
        table[b, :need[b]] = order[at:at + need[b]]
        at += need[b]
        for t in range(n):
            kc[table[b, t // page_size], t % page_size] = rng.standard_normal((hkv, d))
            vc[table[b, t // page_size], t % page_size] = rng.standard_normal((hkv, d))
    q = rng.standard_normal((len(lengths), sq, hq, d), dtype=np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(kc, dtype), jnp.asarray(vc, dtype),
            jnp.asarray(table.astype(np.int32)), jnp.asarray(lengths, jnp.int32))


def gather(cache, table, lengths, b):
    """Sequence b's keys (or values) [n, Hkv, D], read page by page in NumPy."""
    cache, table = np.asarray(cache), np.asarray(table)
    n = int(lengths[b])
    rows = [cache[table[b, t // cache.shape[1]], t % cache.shape[1]] for t in range(n)]
    return np.stack(rows) if rows else np.zeros((0,) + cache.shape[2:], cache.dtype)


def paged_oracle(q, kc, vc, table, lengths, **kw):
    """float64 (o, lse): the existing oracle on each sequence's gathered keys, bottom-right on its own length."""
    q = f64(q)
    o = np.zeros(q.shape)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)
    for b in range(q.shape[0]):
        if int(lengths[b]) == 0:
            continue
        k, v = (np.asarray(gather(f64(c), table, lengths, b)) for c in (kc, vc))
        o[b], lse[b] = oracle.attention(q[b], k, v, **kw)
    return o, lse


def naive(q, kc, vc, table, lengths, **kw):
    """The same computed plainly in the input dtype (the baseline of the tolerance rule), in one call: each
    sequence's keys right-aligned in a row of the table's capacity, so the static bottom-right diagonal is the
    sequence's own, and the padding before them hidden by segment ids."""
    cap = table.shape[1] * kc.shape[1]
    rows = []
    for c in (kc, vc):
        x = np.zeros((q.shape[0], cap) + c.shape[2:], np.float32)
        for b in range(q.shape[0]):
            n = int(lengths[b])
            x[b, cap - n:] = gather(np.asarray(c.astype(jnp.float32)), table, lengths, b)
        rows.append(jnp.asarray(x, q.dtype))
    kv_ids = (np.arange(cap)[None, :] >= cap - np.asarray(lengths)[:, None]).astype(np.int32)
    q_ids = np.ones(q.shape[:2], np.int32)
    return reference.attention_with_lse(q, *rows, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kw)


def check(case, dtype_name, q, kc, vc, table, lengths, num_splits=None, **kw):
    out, lse = jaxflash.paged_attention(q, kc, vc, table, lengths, return_lse=True, num_splits=num_splits, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    ref_o, ref_lse = paged_oracle(q, kc, vc, table, lengths, **kw)
    base_o, base_lse = naive(q, kc, vc, table, lengths, **kw)
    check_close("o", out, ref_o, base_o, dtype_name, case)
    check_close("lse", lse, ref_lse, base_lse, dtype_name, case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [8, 16, 64])
@pytest.mark.parametrize("sq", [1, 5])
def test_matches_oracle(dtype, page_size, sq):
    case = f"{dtype} page {page_size} sq {sq}"
    lengths = [37, 0, 1, 130, page_size]  # partial and full last pages, an empty cache, more than a key block
    args = make_cache(stable_seed("paged", case), lengths, page_size, 4, 2, 32, getattr(jnp, dtype), sq=sq)
    check(case, dtype, *args, causal=True)


MASKS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(6, None)),
    "window both sides": dict(window=(3, 2)),
    "softcap and scale": dict(causal=True, softcap=5.0, scale=0.3),
}


@pytest.mark.parametrize("mask", list(MASKS), ids=str)
@pytest.mark.parametrize("hq,hkv,tail", [(3, 1, GARBAGE[0]), (4, 4, GARBAGE[1])], ids=str)
def test_masks_heads_and_table_tails(mask, hq, hkv, tail):
    case = f"{mask} {hq}/{hkv} tail {tail}"
    # Sq = 7 > two of the lengths: those rows see no key under the causal diagonal (0 and -inf).
    args = make_cache(stable_seed("paged masks", case), [3, 200, 45, 6], 16, hq, hkv, 24, jnp.float32, sq=7,
                      tail=tail)
    check(case, "float32", *args, **MASKS[mask])


def test_num_splits_does_not_change_the_cpu_result():
    args = make_cache(7, [50, 9], 16, 4, 2, 16, jnp.bfloat16, sq=3)
    outs = [jaxflash.paged_attention(*args, causal=True, num_splits=n) for n in (None, 1, 3, 8)]
    for o in outs[1:]:
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(outs[0], np.float32))


def test_jit_compiles_to_the_custom_call_without_a_gather():
    args = make_cache(8, [20, 33], 8, 4, 2, 16, jnp.float32, sq=2)
    f = jax.jit(lambda *a: jaxflash.paged_attention(*a, causal=True))
    hlo = f.lower(*args).compile().as_text()
    assert "jaxflash_paged_fwd" in hlo
    assert not re.search(r"\bgather\(", hlo), "the cache is gathered before the kernel"
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(jaxflash.paged_attention(*args, causal=True)))


def test_vmap_over_queries():
    q, kc, vc, table, lengths = make_cache(9, [11, 40], 16, 2, 1, 8, jnp.float32, sq=2)
    qs = jnp.stack([q, 2 * q, -q])
    got = jax.vmap(lambda q: jaxflash.paged_attention(q, kc, vc, table, lengths, causal=True))(qs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got[i]),
                                      np.asarray(jaxflash.paged_attention(qs[i], kc, vc, table, lengths, causal=True)))


def test_differentiating_raises():
    q, kc, vc, table, lengths = make_cache(10, [5], 8, 2, 2, 8, jnp.float32)
    with pytest.raises(NotImplementedError, match="jaxflash.paged_attention is forward only"):
        jax.grad(lambda q: jaxflash.paged_attention(q, kc, vc, table, lengths).sum())(q)


def test_backend_cuda_needs_the_inputs_on_a_gpu():
    q, kc, vc, table, lengths = make_cache(11, [5], 8, 2, 2, 8, jnp.float32)
    if jaxflash._ffi.cuda_built():
        err, match = ValueError, "jaxflash.paged_attention: backend='cuda' needs the inputs on a GPU; they are on cpu"
    else:
        err, match = RuntimeError, "jaxflash.paged_attention: backend 'cuda' is not available"
    if jax.default_backend() == "cpu":
        with pytest.raises(err, match=match):
            jaxflash.paged_attention(q, kc, vc, table, lengths, backend="cuda")
    with pytest.raises(ValueError, match="jaxflash.paged_attention: backend must be None, 'cpu' or 'cuda'; got "
                                         "'reference'"):
        jaxflash.paged_attention(q, kc, vc, table, lengths, backend="reference")


# --- append_kv -------------------------------------------------------------------------------------------------

def test_append_writes_exactly_the_new_positions():
    q, kc, vc, table, lengths = make_cache(12, [13, 0, 16], 8, 2, 2, 8, jnp.float32, pages_per_seq=4)
    # Each sequence needs one more page for its 5 new tokens: the cache's three spare ones.
    spare = sorted(set(range(kc.shape[0])) - set(np.asarray(table).ravel().tolist()))
    table = table.at[0, 2].set(spare[0]).at[1, 0].set(spare[1]).at[2, 2].set(spare[2])
    rng = np.random.default_rng(12)
    nk, nv = (jnp.asarray(rng.standard_normal((3, 5, 2, 8)), jnp.float32) for _ in range(2))
    kc2, vc2, lengths2 = jaxflash.append_kv(kc, vc, table, lengths, nk, nv)
    np.testing.assert_array_equal(np.asarray(lengths2), [18, 5, 21])
    before, after = np.asarray(kc), np.asarray(kc2)
    written = np.zeros(before.shape[:2], bool)
    for b, n in enumerate([13, 0, 16]):
        for s in range(5):
            page, slot = int(table[b, (n + s) // 8]), (n + s) % 8
            np.testing.assert_array_equal(after[page, slot], np.asarray(nk[b, s]))
            np.testing.assert_array_equal(np.asarray(vc2)[page, slot], np.asarray(nv[b, s]))
            written[page, slot] = True
    np.testing.assert_array_equal(after[~written], before[~written])  # NaN-filled slots compare equal here


def test_append_drops_tokens_the_table_does_not_cover_under_jit():
    kc = jnp.zeros((4, 8, 1, 4))
    table = jnp.array([[0, -1], [1, 2]], jnp.int32)  # sequence 0 owns one page, its second entry is garbage
    new = jnp.ones((2, 3, 1, 4))
    kc2, _, lengths = jax.jit(jaxflash.append_kv)(kc, kc, table, jnp.array([6, 6], jnp.int32), new, new)
    got = np.asarray(kc2)[..., 0, 0]
    np.testing.assert_array_equal(got[0], [0] * 6 + [1, 1])  # sequence 0: positions 6, 7; position 8 has no page
    np.testing.assert_array_equal(got[1], [0] * 6 + [1, 1])  # sequence 1: positions 6, 7
    np.testing.assert_array_equal(got[2], [1] + [0] * 7)     # and 8, in its second page
    np.testing.assert_array_equal(got[3], [0] * 8)           # the last page (what -1 would wrap to) untouched
    np.testing.assert_array_equal(np.asarray(lengths), [9, 9])
    # Past the table's capacity (2 pages x 8) nothing is written either.
    kc3, _, _ = jax.jit(jaxflash.append_kv)(kc, kc, table, jnp.array([0, 15], jnp.int32), new, new)
    np.testing.assert_array_equal(np.asarray(kc3)[1:, :, 0, 0].ravel(), [0] * 15 + [1] + [0] * 8)


def test_append_with_donated_caches_is_in_place():
    table, num_pages = paged.simple_block_tables(2, 40, 16)
    kc, vc = jnp.zeros((num_pages, 16, 2, 8)), jnp.ones((num_pages, 16, 2, 8))
    new = jnp.full((2, 3, 2, 8), 5.0)
    lengths = jnp.array([5, 37], jnp.int32)
    f = jax.jit(jaxflash.append_kv, donate_argnums=(0, 1))
    hlo = f.lower(kc, vc, table, lengths, new, new).compile().as_text()
    # Both caches alias outputs, and no instruction copies a cache-sized buffer.
    assert re.search(r"input_output_alias=\{ \{0\}: \(0, \{\}, may-alias\), \{1\}: \(1, \{\}", hlo), hlo[:400]
    cache_shapes = ("f32[6,16,2,8]", "f32[96,2,8]")
    copies = [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in cache_shapes)]
    assert not copies, copies
    # And at run time the results are the donated buffers themselves.
    pointers = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
    kc2, vc2, _ = f(kc, vc, table, lengths, new, new)
    assert (kc2.unsafe_buffer_pointer(), vc2.unsafe_buffer_pointer()) == pointers
    assert kc.is_deleted() and vc.is_deleted()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_then_decode_matches_attention_on_the_contiguous_sequence(dtype):
    dt = getattr(jnp, dtype)
    batch, prompt, steps, hq, hkv, d, page_size = 2, 19, 6, 4, 2, 16, 8
    rng = np.random.default_rng(stable_seed("decode loop", dtype))
    total = prompt + steps
    q, k, v = (jnp.asarray(rng.standard_normal((batch, total, h, d)), dt) for h in (hq, hkv, hkv))
    table, num_pages = paged.simple_block_tables(batch, total, page_size)
    table = table[:, ::-1]  # any disjoint pages do; reversed, so pages are not in order
    kc, vc = (jnp.zeros((num_pages, page_size, hkv, d), dt) for _ in range(2))  # two buffers: both are donated
    lengths = jnp.zeros((batch,), jnp.int32)
    append = jax.jit(jaxflash.append_kv, donate_argnums=(0, 1))
    attend = jax.jit(lambda *a: jaxflash.paged_attention(*a, causal=True))

    kc, vc, lengths = append(kc, vc, table, lengths, k[:, :prompt], v[:, :prompt])
    outs = [attend(q[:, :prompt], kc, vc, table, lengths)]
    for t in range(prompt, total):
        kc, vc, lengths = append(kc, vc, table, lengths, k[:, t:t + 1], v[:, t:t + 1])
        outs.append(attend(q[:, t:t + 1], kc, vc, table, lengths))
    got = jnp.concatenate(outs, axis=1)
    want = jaxflash.attention(q, k, v, causal=True)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(f64(got), f64(want), atol=tol)
    np.testing.assert_array_equal(np.asarray(lengths), [total] * batch)


# --- errors ----------------------------------------------------------------------------------------------------

def _ok():
    return make_cache(13, [10, 3], 8, 4, 2, 8, jnp.float32)


def _with(i, x):
    args = list(_ok())
    args[i] = x
    return args


PA = "jaxflash.paged_attention"
ERRORS = [
    (lambda: _with(3, jnp.zeros((2, 3), jnp.float32)), TypeError, rf"{PA}: block_tables must have an integer dtype; "
                                                                  r"got float32"),
    (lambda: _with(2, jnp.zeros((8, 8, 2, 4))), ValueError, rf"{PA}: key_cache and value_cache must have the same "
                                                            r"shape; got key_cache \(\d+, 8, 2, 8\), value_cache"),
    (lambda: _with(0, jnp.zeros((3, 1, 4, 8))), ValueError, rf"{PA}: block_tables must have shape \[B, "
                                                            r"pages_per_seq\] with B = 3"),
    (lambda: _with(4, jnp.array([1, 2, 3], jnp.int32)), ValueError, rf"{PA}: kv_lengths must have shape \[B\] with "
                                                                    r"B = 2 .*got \(3,\)"),
    (lambda: _with(0, jnp.zeros((2, 1, 3, 8))), ValueError, rf"{PA}: query heads must be a multiple of key/value "
                                                            r"heads; got 3 query heads and 2"),
    (lambda: _with(0, jnp.zeros((2, 1, 4, 16))), ValueError, rf"{PA}: query and key_cache must have the same head "
                                                             r"dim; got query 16, key_cache 8"),
    (lambda: _with(0, jnp.zeros((2, 1, 4, 8), jnp.bfloat16)), TypeError, rf"{PA}: query and the caches must share a "
                                                                         r"dtype; got query=bfloat16, "
                                                                         r"key_cache=float32"),
    (lambda: _with(2, _ok()[2].astype(jnp.float16)), TypeError, rf"{PA}: key_cache and value_cache must share a "
                                                               r"dtype; got key_cache=float32, value_cache=float16"),
    (lambda: [_ok()[0], jnp.zeros((4, 12, 2, 8)), jnp.zeros((4, 12, 2, 8))] + list(_ok()[3:]), ValueError,
     rf"{PA}: page size \(key_cache.shape\[1\]\) must be a multiple of 8 in \[8, 256\]; got 12"),
    (lambda: _with(4, jnp.array([10, 99], jnp.int32)), ValueError, rf"{PA}: kv_lengths\[1\] = 99 exceeds the block "
                                                                   r"table's capacity"),
    (lambda: _with(3, jnp.array([[0, 77, -1], [3, -1, -1]], jnp.int32)), ValueError,
     rf"{PA}: block_tables\[0, 1\] = 77 is not a page of the cache \(0 <= page < \d+\)"),
    (lambda: _with(4, jnp.array([-1, 2], jnp.int32)), ValueError, rf"{PA}: kv_lengths must be >= 0; got -1"),
]


@pytest.mark.parametrize("make,err,match", ERRORS, ids=[m for _, _, m in ERRORS])
def test_errors(make, err, match):
    with pytest.raises(err, match=match):
        jaxflash.paged_attention(*make())


@pytest.mark.parametrize("kw,err,match", [
    (dict(num_splits=0), ValueError, r"num_splits must be in \[1, 64\] or None; got 0"),
    (dict(num_splits=65), ValueError, r"num_splits must be in \[1, 64\] or None; got 65"),
    (dict(num_splits=2.0), TypeError, r"num_splits must be a positive int or None; got 2.0"),
    (dict(causal=1), TypeError, r"causal must be a Python bool; got 1"),
    (dict(window=(3,)), ValueError, r"window must be a pair"),
    (dict(scale=-1.0), ValueError, r"scale must be finite and positive; got -1.0"),
    (dict(backend="tpu"), ValueError, r"backend must be None, 'cpu' or 'cuda'; got 'tpu'"),
], ids=str)
def test_option_errors(kw, err, match):
    with pytest.raises(err, match=f"{PA}: {match}"):
        jaxflash.paged_attention(*_ok(), **kw)


def test_the_kernel_checks_the_table_under_jit():
    q, kc, vc, table, lengths = _ok()
    bad = table.at[0, 1].set(kc.shape[0] + 5)
    with pytest.raises(Exception, match=r"jaxflash_paged_fwd: block_tables\[0, 1\] must be a page in \[0, \d+\)"):
        jax.jit(jaxflash.paged_attention)(q, kc, vc, bad, lengths).block_until_ready()
    with pytest.raises(Exception, match=r"jaxflash_paged_fwd: kv_lengths\[1\] must be in \[0, 24\]"):
        jax.jit(jaxflash.paged_attention)(q, kc, vc, table, jnp.array([3, 25], jnp.int32)).block_until_ready()


AK = "jaxflash.append_kv"


@pytest.mark.parametrize("new_k,new_v,lengths,err,match", [
    ((2, 1, 2, 8), (2, 1, 2, 8), [3, 3], TypeError, rf"{AK}: new_key must have the caches' dtype float32; got "
                                                    r"bfloat16"),
    ((2, 1, 3, 8), (2, 1, 3, 8), [3, 3], ValueError, rf"{AK}: new_key must have shape \[B, S_new, 2, 8\]"),
    ((2, 1, 2, 8), (2, 2, 2, 8), [3, 3], ValueError, rf"{AK}: new_key and new_value must have the same shape"),
    ((3, 1, 2, 8), (3, 1, 2, 8), [3, 3], ValueError, rf"{AK}: block_tables must have shape \[B, pages_per_seq\] "
                                                     r"with B = 3"),
    ((2, 4, 2, 8), (2, 4, 2, 8), [3, 21], ValueError, rf"{AK}: kv_lengths\[1\] = 21 \+ 4 new tokens exceeds the "
                                                      r"block table's capacity"),
], ids=lambda p: str(p) if isinstance(p, str) else None)
def test_append_errors(new_k, new_v, lengths, err, match):
    _, kc, vc, table, _ = _ok()
    dt = jnp.bfloat16 if "bfloat16" in match else jnp.float32
    with pytest.raises(err, match=match):
        jaxflash.append_kv(kc, vc, table, jnp.array(lengths, jnp.int32), jnp.zeros(new_k, dt), jnp.zeros(new_v))


def test_simple_block_tables():
    table, num_pages = paged.simple_block_tables(3, 17, 8)
    assert num_pages == 9 and table.shape == (3, 3) and table.dtype == jnp.int32
    assert sorted(np.asarray(table).ravel().tolist()) == list(range(9))
    with pytest.raises(ValueError, match=r"jaxflash.paged.simple_block_tables: page_size must be a positive int"):
        paged.simple_block_tables(3, 17, 0)


def test_the_readme_example_runs():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Decoding with a paged KV cache", 1)[1]
    code = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    exec(compile(code, "README.md (paged KV cache)", "exec"), {})
