"""`jaxflash.dot_product_attention` against `jax.nn.dot_product_attention(implementation="xla")`: forward,
residual and gradients over causal, windows, lengths, GQA, 3-D input, scale and dtypes (FlashAttention's 2x rule
against jax.nn in float32), plus the documented difference on rows that see no key, and the argument checks."""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import DTYPES, check_close, f64

# (name, (B, T, S, N, K, H), keywords, query lengths, key/value lengths); B = None means 3-D input.
CASES = [
    ("full", (2, 17, 33, 4, 4, 32), {}, None, None),
    ("causal-T<S-scale", (2, 17, 33, 4, 4, 32), dict(is_causal=True, scale=0.3), None, None),
    ("causal-T>S", (2, 33, 17, 4, 4, 40), dict(is_causal=True), None, None),
    ("causal-T1", (2, 1, 70, 4, 2, 16), dict(is_causal=True), None, None),
    ("window-int-4", (2, 33, 70, 4, 4, 64), dict(local_window_size=4), None, None),
    ("window-0-0-T>S", (2, 40, 17, 4, 4, 16), dict(local_window_size=(0, 0)), None, None),
    ("causal-window-5-9", (2, 33, 33, 4, 4, 32), dict(is_causal=True, local_window_size=(5, 9)), None, None),
    ("causal-lengths", (2, 33, 33, 4, 4, 32), dict(is_causal=True), [10, 33], [20, 5]),
    ("kv-lengths-zero", (2, 17, 17, 4, 4, 32), {}, None, [0, 17]),
    ("q-lengths", (2, 17, 33, 4, 4, 32), {}, [3, 0], None),
    ("gqa-causal", (2, 33, 33, 8, 2, 32), dict(is_causal=True), None, None),
    ("mqa-window-lengths", (2, 33, 50, 6, 1, 48), dict(local_window_size=(7, 0)), [30, 20], [50, 9]),
    ("3d-causal", (None, 33, 17, 4, 2, 32), dict(is_causal=True), None, None),
    ("3d-lengths", (None, 33, 33, 4, 4, 32), dict(local_window_size=(2, 6)), [20], [25]),
]

xla = functools.partial(jax.nn.dot_product_attention, implementation="xla")


def make_case(seed, shape, dtype, q_len, kv_len):
    b, t, s, n, k, h = shape
    lead = () if b is None else (b,)
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(lead + sh, dtype=np.float32) for sh in ((t, n, h), (s, k, h), (s, k, h), (t, n, h))]
    kw = {}
    if q_len is not None:
        kw["query_seq_lengths"] = jnp.asarray(q_len, jnp.int32)
    if kv_len is not None:
        kw["key_value_seq_lengths"] = jnp.asarray(kv_len, jnp.int32)
    return [jnp.asarray(x, dtype) for x in arrays], kw


def row_kinds(shape, keywords, q_len, kv_len):
    """Per (batch, query row): does it see any key, and is it past query_seq_lengths? Bool [B, T] each,
    computed here from jax.nn's documented mask rules."""
    b, t, s = (shape[0] or 1), shape[1], shape[2]
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    vis = np.ones((t, s), bool)
    if keywords.get("is_causal"):
        vis &= j <= i
    w = keywords.get("local_window_size")
    if w is not None:
        left, right = (w, w) if isinstance(w, int) else w
        vis &= (j >= i - left) & (j <= i + right)
    vis = np.broadcast_to(vis, (b, t, s)).copy()
    if kv_len is not None:
        vis &= j[None] < np.asarray(kv_len)[:, None, None]
    padded = np.zeros((b, t), bool) if q_len is None else np.arange(t)[None] >= np.asarray(q_len)[:, None]
    return vis.any(-1), padded


def batched(x, shape):
    return x if shape[0] is not None else x[None]


# bfloat16 on a subset: its rounding is the same whatever the mask.
GRID = [(*c, "float32") for c in CASES] + [(*c, "bfloat16") for c in CASES if c[0] in
                                           ("causal-T>S", "mqa-window-lengths")]


@pytest.mark.parametrize("name,shape,keywords,q_len,kv_len,dtype", GRID, ids=[f"{c[0]}-{c[-1]}" for c in GRID])
def test_matches_jax_nn(name, shape, keywords, q_len, kv_len, dtype):
    (q, k, v, do), lengths = make_case(zlib.crc32(name.encode()), shape, DTYPES[dtype], q_len, kv_len)
    kw = dict(keywords, **lengths)
    sees, padded = row_kinds(shape, keywords, q_len, kv_len)
    rows = sees | padded  # jax.nn and jaxflash agree on these (both 0 when padded)
    # No cotangent on the other rows (jax.nn's mean(value) there would send gradients to value).
    do = jnp.where(jnp.asarray(rows if shape[0] else rows[0])[..., None, None], do, 0)

    @functools.partial(jax.jit, static_argnums=0)  # one compilation, not one per eager op
    def run(fn, *args):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), *args)
        return out, vjp(do.astype(out.dtype))

    out, grads = run(jaxflash.dot_product_attention, q, k, v)
    ref, ref_grads = run(xla, *(x.astype(jnp.float32) for x in (q, k, v)))
    naive, naive_grads = (ref, ref_grads) if dtype == "float32" else run(xla, q, k, v)

    assert out.shape == q.shape and out.dtype == q.dtype
    pick = lambda x: f64(batched(x, shape))[rows]  # noqa: E731
    check_close("out", pick(out), pick(ref), pick(naive), dtype, name)
    for g_name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        check_close(g_name, g, f64(r), n, dtype, name)


def some(*names):
    return pytest.mark.parametrize("name,shape,keywords,q_len,kv_len", [c for c in CASES if c[0] in names],
                                   ids=[c[0] for c in CASES if c[0] in names])


@some("causal-T>S", "window-int-4", "causal-lengths", "gqa-causal", "3d-lengths")
def test_residual_matches_jax_nn(name, shape, keywords, q_len, kv_len):
    (q, k, v, _), lengths = make_case(1, shape, jnp.float32, q_len, kv_len)
    kw = dict(keywords, **lengths)
    out, res = jax.jit(lambda *a: jaxflash.dot_product_attention(*a, return_residual=True, **kw))(q, k, v)
    ref, ref_res = jax.jit(lambda *a: xla(*a, return_residual=True, **kw))(q, k, v)
    assert res.shape == ref_res.shape == q.shape[:-1] and res.dtype == q.dtype
    sees, padded = row_kinds(shape, keywords, q_len, kv_len)
    rows = sees & ~padded
    np.testing.assert_allclose(f64(batched(res, shape))[rows], f64(batched(ref_res, shape))[rows], rtol=1e-5,
                               atol=1e-5)
    assert np.all(np.isneginf(f64(batched(res, shape))[~rows]))
    np.testing.assert_allclose(out, jax.jit(lambda *a: jaxflash.dot_product_attention(*a, **kw))(q, k, v),
                               rtol=0, atol=0)


@some("window-0-0-T>S", "kv-lengths-zero", "mqa-window-lengths")
def test_rows_without_keys(name, shape, keywords, q_len, kv_len):
    """The documented difference: a row that sees no key is 0 here (zero gradients), mean(value) in jax.nn."""
    (q, k, v, do), lengths = make_case(2, shape, jnp.float32, q_len, kv_len)
    kw = dict(keywords, **lengths)
    sees, padded = row_kinds(shape, keywords, q_len, kv_len)
    empty = ~sees & ~padded
    assert empty.any()
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, **kw)), q, k, v)
    ref = jax.jit(lambda *a: xla(*a, **kw))(q, k, v)
    b, t, s, n, kh, h = shape
    mean_v = np.repeat(f64(v).mean(axis=-3), n // kh, axis=-2)  # [B, N, H]: each query head's kv head
    np.testing.assert_array_equal(f64(out)[empty], 0.0)
    np.testing.assert_allclose(f64(ref)[empty], np.broadcast_to(mean_v[:, None], (b, t, n, h))[empty], atol=1e-5)
    # A cotangent on those rows alone reaches no input.
    for g in vjp(jnp.where(jnp.asarray(empty)[..., None, None], do, 0)):
        np.testing.assert_array_equal(f64(g), 0.0)


@pytest.mark.parametrize("implementation", [None, "cpu", "reference"])
def test_implementations_and_vmap(implementation):
    (q, k, v, _), kw = make_case(3, (2, 33, 17, 8, 2, 32), jnp.float32, [30, 7], [17, 4])
    f = jax.jit(lambda *a: jaxflash.dot_product_attention(*a, is_causal=True, implementation=implementation, **kw))
    ref = jax.jit(lambda *a: xla(*a, is_causal=True, **kw))(q, k, v)
    np.testing.assert_allclose(f(q, k, v), ref, atol=2e-5)
    # vmap over a leading axis of 3-D inputs (jax.nn's 3-D form, one example at a time); every row sees a key.
    g = jax.jit(jax.vmap(lambda *a: jaxflash.dot_product_attention(*a, local_window_size=(20, 1),
                                                                   implementation=implementation)))
    h = jax.jit(jax.vmap(lambda *a: xla(*a, local_window_size=(20, 1))))
    np.testing.assert_allclose(g(q, k, v), h(q, k, v), atol=2e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bias=np.zeros((1, 1, 5, 5), np.float32)), NotImplementedError, "bias.*segment ids"),
    (dict(mask=np.ones((1, 1, 5, 5), bool)), NotImplementedError, "mask.*is_causal.*segment ids"),
    (dict(implementation="xla"), ValueError, "implementation.*'xla'.*jax.nn.dot_product_attention"),
    (dict(implementation="cudnn"), ValueError, "implementation.*'cudnn'"),
    (dict(implementation="triton"), ValueError, "implementation.*'triton'"),
    (dict(local_window_size=-1), ValueError, "local_window_size.*>= 0.*-1"),
    (dict(local_window_size=(1, 2, 3)), ValueError, r"local_window_size.*pair.*\(1, 2, 3\)"),
    (dict(local_window_size=(1.5, 2)), TypeError, "local_window_size.*ints"),
    (dict(is_causal=1), TypeError, "is_causal.*bool.*1"),
    (dict(query_seq_lengths=jnp.array([5, 5], jnp.int32)), ValueError, r"query_seq_lengths.*\(1,\).*\(2,\)"),
    (dict(key_value_seq_lengths=jnp.array([5.0])), TypeError, "key_value_seq_lengths.*integer.*float32"),
], ids=["bias", "mask", "xla", "cudnn", "unknown", "window-negative", "window-triple", "window-float",
        "is_causal-int", "lengths-shape", "lengths-dtype"])
def test_errors(kwargs, error, match):
    q = jnp.zeros((1, 5, 2, 8), jnp.float32)
    with pytest.raises(error, match=match):
        jaxflash.dot_product_attention(q, q, q, **kwargs)


def test_rank_error():
    q = jnp.zeros((5, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"all be 4-D.*all 3-D.*key \(1, 5, 2, 8\)"):
        jaxflash.dot_product_attention(q, q[None], q)
