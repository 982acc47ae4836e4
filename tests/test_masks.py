"""Masks and variable lengths (window, segment ids, lengths, softcap, top-left alignment) on the CPU
kernel, forward and backward, against the float64 oracle that materialises the same masks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import oracle
from conftest import DTYPES, check_close, make_inputs, plain_jit, stable_seed
from jaxflash import reference
from jaxflash.attention import attend

LEAD = (2,)


def packed_ids(rng, n, docs):
    """Sorted ids of `docs` packed documents of random lengths (a packed batch)."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(docs, n) - 1, replace=False)) if n > 1 else []
    ids = np.zeros(n, np.int32)
    for c in cuts:
        ids[c:] += 1
    return ids


def mask_arrays(kind, rng, sq, sk):
    kw = {}
    if "seg" in kind:
        if kind["seg"] == "packed":
            q = np.stack([packed_ids(rng, sq, 4) for _ in range(LEAD[0])])
            k = np.stack([packed_ids(rng, sk, 4) for _ in range(LEAD[0])]) if sk != sq else q.copy()
        else:  # unsorted ids: the block skip must not drop anything
            q, k = rng.integers(0, 3, (LEAD[0], sq)), rng.integers(0, 3, (LEAD[0], sk))
        kw.update(q_segment_ids=jnp.asarray(q, jnp.int32), kv_segment_ids=jnp.asarray(k, jnp.int32))
    if "lengths" in kind:
        ql, kl = kind["lengths"]
        kw.update(q_lengths=jnp.asarray(ql(sq), jnp.int32), kv_lengths=jnp.asarray(kl(sk), jnp.int32))
    return kw


KINDS = {
    "window-16-0": dict(window=(16, 0)),
    "window-0-16": dict(window=(0, 16)),
    "window-5-5": dict(window=(5, 5)),
    "window-none-3": dict(window=(None, 3)),
    "window-20-none": dict(window=(20, -1)),
    "causal-window-7": dict(causal=True, window=(7, None)),
    "segments-packed": dict(seg="packed"),
    "segments-random": dict(seg="random"),
    "lengths": dict(lengths=(lambda s: [s // 2 + 1, s], lambda s: [s, max(s // 3, 1)])),
    "lengths-zero": dict(lengths=(lambda s: [0, s], lambda s: [s, 0])),
    "softcap-5": dict(softcap=5.0),
    "causal-segments-lengths-softcap": dict(causal=True, seg="packed", softcap=2.0,
                                            lengths=(lambda s: [s - 1, s // 2], lambda s: [s, s - 3])),
    "window-segments": dict(window=(9, 2), seg="packed"),
    "top-left-causal": dict(causal=True, top_left=True),
    # The diagonal moved (Mask.offset: a query chunk further along, or before, its keys).
    "causal-offset-back": dict(causal=True, offset=-40),
    "window-offset-ahead": dict(window=(6, 2), offset=30),
    "top-left-causal-offset": dict(causal=True, top_left=True, offset=9, seg="packed"),
    "top-left-window-lengths": dict(window=(4, 1), top_left=True, lengths=(lambda s: [s, 3], lambda s: [s, 5])),
}
SHAPES = [(113, 255, 4, 2, 40), (255, 113, 4, 4, 64), (64, 64, 8, 1, 16), (1, 17, 4, 2, 32), (301, 301, 2, 1, 128)]


def run(q, k, v, do, kind, kw, backend, deterministic=False, rate=0.0, key=None):
    """(o, lse, dq, dk, dv) of `kind` with its mask arrays `kw` on `backend` (dropout at `rate` from `key`)."""
    mask = jaxflash.Mask(kind.get("causal", False), kind.get("window"), bottom_right=not kind.get("top_left", False),
                         offset=kind.get("offset", 0), **kw)

    def f(q, k, v):
        return attend(q, k, v, mask, softcap=kind.get("softcap"), dropout_rate=rate, dropout_key=key, return_lse=True,
                      deterministic=deterministic, backend=backend)

    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse, *vjp((do, jnp.zeros_like(lse))))


# Every kind at every shape, the dtype rotating over kinds and shapes, plus every dtype at the largest shape.
@pytest.mark.parametrize("kind_name,shape,dtype", [
    (name, shape, dtype) for i, name in enumerate(KINDS) for j, shape in enumerate(SHAPES)
    for n, dtype in enumerate(("float32", "bfloat16", "float16")) if (i + j) % 3 == n or shape[0] == 301
], ids=lambda x: str(x).replace(" ", ""))
def test_masked_attention_matches_oracle(kind_name, shape, dtype):
    kind = KINDS[kind_name]
    sq, sk, hq, hk, d = shape
    rng = np.random.default_rng(stable_seed(kind_name, shape, dtype))
    q, k, v, do = make_inputs(int(rng.integers(2**31)), LEAD, sq, sk, hq, hk, d, DTYPES[dtype])
    kw = mask_arrays(kind, rng, sq, sk)
    got = jax.jit(lambda *a: run(*a, kind, kw, "cpu"))(q, k, v, do)
    naive = plain_jit(lambda *a: run(*a, kind, kw, "reference"))(q, k, v, do)
    as64 = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, do)]
    ref = oracle.attention(*as64[:3], do=as64[3], causal=kind.get("causal", False), softcap=kind.get("softcap"),
                           window=kind.get("window"), bottom_right=not kind.get("top_left", False),
                           offset=kind.get("offset", 0), **kw)
    case = f"{kind_name} {shape} {dtype}"
    for name, g, r, n in zip(("o", "lse", "dq", "dk", "dv"), got, ref, naive):
        check_close(name, g, r, n, dtype, case)


@pytest.mark.parametrize("causal,window,sides", [
    (False, None, (-1, -1)), (True, None, (-1, 0)), (False, [None, 3], (-1, 3)), (True, (7, None), (7, 0)),
    (True, (3, 5), (3, 0)), (True, (4, -1), (4, 0)), (False, (np.int64(2), -1), (2, -1))])
def test_mask_sides(causal, window, sides):
    mask = jaxflash.Mask(causal, window)
    assert mask.sides() == sides and isinstance(mask.window, (tuple, type(None)))  # a list becomes hashable


def test_causal_equals_window_none_0():
    q, k, v, _ = make_inputs(1, LEAD, 50, 70, 2, 2, 16, DTYPES["float32"])
    a = jaxflash.attention(q, k, v, causal=True)
    b = jaxflash.attention(q, k, v, window=(None, 0))
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_huge_softcap_acts_as_none():
    """A cap as large as is accepted (min(scale, 1) / softcap still a normal float32; larger ones are refused,
    test_errors) leaves every score as it is, in both passes."""
    q, k, v, do = make_inputs(3, LEAD, 50, 70, 2, 2, 16, DTYPES["float32"])
    run = lambda cap: jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, softcap=cap), q, k, v)
    (a, vjp_a), (b, vjp_b) = run(1e30), run(None)
    for x, y in zip((a, *vjp_a(do)), (b, *vjp_b(do))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_lengths_zero_rows_are_zero_with_zero_grads():
    q, k, v, do = make_inputs(2, LEAD, 40, 30, 2, 1, 16, DTYPES["float32"])
    ql, kl = jnp.array([10, 0], jnp.int32), jnp.array([30, 7], jnp.int32)
    f = lambda q, k, v: jaxflash.attention(q, k, v, q_lengths=ql, kv_lengths=kl, return_lse=True)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
    assert np.all(np.asarray(o)[0, 10:] == 0) and np.all(np.asarray(o)[1] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[0, :, 10:])) and np.all(np.isneginf(np.asarray(lse)[1]))
    assert np.all(np.asarray(dq)[0, 10:] == 0) and np.all(np.asarray(dq)[1] == 0)
    assert np.all(np.asarray(dk)[1] == 0) and np.all(np.asarray(dk)[0] != 0)
    assert np.all(np.asarray(dv)[1] == 0) and np.all(np.asarray(dv)[0] != 0)


def test_vmap_over_segment_ids_only():
    q, k, v, _ = make_inputs(3, (), 48, 48, 2, 2, 16, DTYPES["float32"])
    rng = np.random.default_rng(4)
    ids = jnp.asarray(np.stack([packed_ids(rng, 48, n) for n in (1, 3, 6)]), jnp.int32)
    out = jax.vmap(lambda s: jaxflash.attention(q, k, v, q_segment_ids=s, kv_segment_ids=s))(ids)
    for i in range(3):
        want, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), q_segment_ids=np.asarray(ids[i]),
                                   kv_segment_ids=np.asarray(ids[i]))
        np.testing.assert_allclose(np.asarray(out[i]), want, atol=5e-5)


def test_vmap_over_lengths_only_with_grad():
    q, k, v, do = make_inputs(5, (2,), 33, 41, 4, 2, 8, DTYPES["float32"])
    lens = jnp.array([[0, 41], [41, 12], [5, 1]], jnp.int32)

    def loss(q, k, v, kl):
        return jnp.sum(jaxflash.attention(q, k, v, kv_lengths=kl, causal=True) * do)

    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(None, None, None, 0))(q, k, v, lens)
    for i in range(3):
        want = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True, do=np.asarray(do),
                                kv_lengths=np.asarray(lens[i]))[2:]
        for g, w in zip(grads, want):
            np.testing.assert_allclose(np.asarray(g[i]), w, atol=5e-5)


def test_reference_backend_takes_masks():
    q, k, v, _ = make_inputs(6, LEAD, 20, 25, 2, 1, 8, DTYPES["float32"])
    kw = dict(window=(3, 2), softcap=4.0, q_lengths=jnp.array([20, 9], jnp.int32))
    a = jaxflash.attention(q, k, v, backend="reference", **kw)
    b = jaxflash.attention(q, k, v, backend="cpu", **kw)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)
    c = reference.attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-6)


def test_padding_past_lengths_never_leaks():
    """Keys and queries past the lengths may hold anything, even NaN: results equal those of clean inputs."""
    q, k, v, do = make_inputs(8, LEAD, 150, 170, 4, 2, 32, DTYPES["float32"])
    ql, kl = jnp.array([150, 61], jnp.int32), jnp.array([97, 170], jnp.int32)
    past_q = jnp.arange(150)[None, :, None, None] >= ql[:, None, None, None]
    past_k = jnp.arange(170)[None, :, None, None] >= kl[:, None, None, None]
    dirty = [jnp.where(past, jnp.nan, x) for past, x in ((past_q, q), (past_k, k), (past_k, v), (past_q, do))]
    kind, kw = dict(causal=True), dict(q_lengths=ql, kv_lengths=kl)
    for got, want in zip(run(*dirty, kind, kw, "cpu"), run(q, k, v, do, kind, kw, "cpu")):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_mask_offset_must_be_a_static_int():
    q = jnp.zeros((1, 4, 1, 8))
    with pytest.raises(TypeError, match=r"jaxflash.attention: the mask's offset must be a static int; got float 1.5"):
        attend(q, q, q, jaxflash.Mask(offset=1.5))
    with pytest.raises(TypeError, match=r"the mask's offset must be a static int; got DynamicJaxprTracer"):
        jax.jit(lambda o: attend(q, q, q, jaxflash.Mask(offset=o)))(3)
    # A NumPy integer is as good as an int, and a large shift simply hides every key (or shows them all).
    o, lse = attend(q, q, q, jaxflash.Mask(causal=True, offset=np.int64(-100)), return_lse=True)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_causal_diagonal_follows_each_sequences_lengths(backend):
    """A partly filled cache with several new tokens (a speculative draft, a prefill chunk): with lengths, the
    diagonal sits at each sequence's end, so query i of the Sq new ones sees keys j <= kv_len - q_len + i and
    no later draft token. The expected mask is written out here, element by element."""
    b, sq, sk, h, d = 3, 4, 16, 2, 8
    q, k, v = (jnp.asarray(np.random.default_rng(stable_seed("diag-lengths", i)).standard_normal(s), jnp.float32)
               for i, s in enumerate([(b, sq, h, d), (b, sk, h, d), (b, sk, h, d)]))
    kv_len, q_len = np.array([10, 16, 3]), np.array([4, 2, 4])
    for window in (None, (2, None)):
        out = jaxflash.attention(q, k, v, causal=True, window=window, q_lengths=q_len, kv_lengths=kv_len,
                                 backend=backend)
        want = np.zeros((b, sq, h, d))
        for bi in range(b):
            for i in range(q_len[bi]):
                c = i + kv_len[bi] - q_len[bi]
                seen = [j for j in range(sk) if j < kv_len[bi] and j <= c and (window is None or j >= c - window[0])]
                if not seen:
                    continue
                s = np.einsum("hd,jhd->hj", np.asarray(q[bi, i], np.float64), np.asarray(k[bi, seen], np.float64))
                p = np.exp(s / np.sqrt(d) - np.max(s / np.sqrt(d), axis=-1, keepdims=True))
                want[bi, i] = np.einsum("hj,jhd->hd", p / p.sum(-1, keepdims=True), np.asarray(v[bi, seen]))
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, err_msg=f"window={window}")
    # Without lengths, and for the top-left drop-in, nothing moves.
    top_left = jaxflash.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_len,
                                              key_value_seq_lengths=kv_len)
    mask = np.asarray(reference.visible(sq, sk, causal=True, bottom_right=False, q_lengths=q_len, kv_lengths=kv_len))
    assert mask[1, 0, 1].tolist() == [True, True] + [False] * 14 and np.isfinite(np.asarray(top_left)).all()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_diagonal_takes_lengths_as_given(backend):
    """Lengths past S still place the diagonal (c = i + kv_lengths - q_lengths, unclipped) while only [0, S] of
    them counts for validity; under jit negative ones do too. How a ring step describes a block that sits inside
    a longer sequence."""
    b, sq, sk, h, d = 3, 8, 8, 2, 16
    q, k, v = (jnp.asarray(np.random.default_rng(stable_seed("raw-lengths", i)).standard_normal((b, s, h, d)),
                           jnp.float32) for i, s in enumerate([sq, sk, sk]))
    q_len, kv_len = np.array([12, 12, 8]), np.array([3, 20, 0])
    out, lse = jaxflash.attention(q, k, v, causal=True, q_lengths=q_len, kv_lengths=kv_len, backend=backend,
                                  return_lse=True)
    want, want_lse = oracle.attention(q, k, v, causal=True, q_lengths=q_len, kv_lengths=kv_len)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    # Element 0: c = i + 3 - 12 < 0, no row sees a key (clipped lengths would give c = i - 5: rows 5-7 would).
    # Element 1: c = i + 20 - 12 = i + 8, every row sees all 8 keys: full attention (clipped: causal). Element 2:
    # no key.
    assert np.isneginf(np.asarray(lse)[[0, 2]]).all()
    full, full_lse = oracle.attention(q[1], k[1], v[1])
    np.testing.assert_allclose(np.asarray(out)[1], full, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[1], full_lse, atol=2e-5)
    np.testing.assert_allclose(np.asarray(want_lse)[1], full_lse, atol=1e-12)  # the oracle agrees
    # Negative lengths (traced, so unchecked): q_lengths -4, kv_lengths 6 -> c = i + 10, rows all invalid.
    f = jax.jit(lambda ql, kl: jaxflash.attention(q, k, v, causal=True, q_lengths=ql, kv_lengths=kl, backend=backend,
                                                  return_lse=True))
    out, lse = f(jnp.asarray([-4, 3, 8]), jnp.asarray([6, -2, 8]))
    want, want_lse = oracle.attention(q, k, v, causal=True, q_lengths=np.array([-4, 3, 8]),
                                      kv_lengths=np.array([6, -2, 8]))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    assert np.isneginf(np.asarray(lse)[:2]).all() and np.isfinite(np.asarray(lse)[2]).all()
