"""jaxflash.flax against Flax's own attention (float32, CPU): parameters interchangeable with
nn.MultiHeadDotProductAttention / nnx.MultiHeadAttention, outputs and gradients equal to theirs under the same
masks (given to Flax as mask arrays built here), dropout equal to a softmax oracle that uses
jaxflash.dropout_mask, deterministic mode, attention_fn in Flax's modules, and what is refused."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxflash  # noqa: E402
import jaxflash.flax as jf  # noqa: E402

B, S, F, HEADS = 2, 13, 32, 4


def inputs(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def assert_trees_close(a, b, tol=2e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def run(fn, *args):
    """fn(*args) compiled once (eager Flax dispatches, and compiles, op by op)."""
    return jax.jit(fn)(*args)


def shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


# Masks as jaxflash keywords and the same masks as the [B, 1, Sq, Sk] bool arrays Flax takes, built here.
def mask_case(kind, sq, sk):
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    vis = np.ones((B, sq, sk), bool)
    attrs, call = {}, {}
    if "causal" in kind:
        attrs["causal"] = True
        vis &= j <= i
    if "window" in kind:
        attrs["window"] = (2, 1)
        vis &= (j >= i - 2) & (j <= i + 1)
    if "segments" in kind:
        q_ids = np.repeat(np.array([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]]), B, 0)[:, :sq]
        kv_ids = q_ids if sq == sk else np.sort(np.random.default_rng(0).integers(0, 3, (B, sk)), -1)
        call.update(q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
        vis &= q_ids[:, :, None] == kv_ids[:, None, :]
    rows = vis.any(-1)  # rows that see a key; Flax gives the others mean(value), jaxflash 0
    if "lengths" in kind:
        q_len, kv_len = np.array([sq, sq - 4]), np.array([sk - 3, sk])
        call.update(q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
        vis &= j[None] < kv_len[:, None, None]
        rows = vis.any(-1) & (np.arange(sq)[None] < q_len[:, None])
        vis &= (np.arange(sq)[None] < q_len[:, None])[..., None]
    return attrs, call, jnp.asarray(vis[:, None]), jnp.asarray(rows)


def oracle_attention(query, key, value, mask=None, dropout_rng=None, dropout_rate=0.0, deterministic=True,
                     is_causal=False, **_):
    """Plain softmax attention (GQA by repeating heads), with jaxflash's dropout rule drawn by
    jaxflash.dropout_mask: the oracle for dropout and for GQA, used as Flax's attention_fn."""
    h, sq, sk, d = query.shape[-2], query.shape[-3], key.shape[-3], query.shape[-1]
    key, value = (jnp.repeat(x, h // key.shape[-2], axis=-2) for x in (key, value))
    s = jnp.einsum("...qhd,...khd->...hqk", query, key) / math.sqrt(d)
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones((sq, sk), bool)), s, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s, axis=-1)
    if not deterministic and dropout_rate > 0:
        lead = query.shape[:-3]
        keep = jaxflash.dropout_mask(dropout_rng, math.prod(lead), h, sq, sk, dropout_rate)
        p = jnp.where(keep.reshape(lead + (h, sq, sk)), p / (1 - jaxflash.dropout.effective_rate(dropout_rate)), 0)
    return jnp.einsum("...hqk,...khd->...qhd", p, value)


def value_and_grads(apply, params, *xs, rows=None):
    """Output and the gradients of a fixed random projection of it (restricted to `rows`) w.r.t. params and
    inputs, under jit."""
    def loss(params, *xs):
        y = apply(params, *xs)
        w = inputs(99, *y.shape) if rows is None else inputs(99, *y.shape) * rows[..., None]
        return jnp.sum(y * w), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(xs) + 1)), has_aux=True))(params, *xs)
    return y, grads


# --- flax.linen -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(), dict(qkv_features=48, out_features=24, normalize_qk=True, use_bias=False)],
                         ids=["default", "features-normalize_qk-no_bias"])
def test_linen_params_are_flax_params(kwargs):
    x = inputs(0, B, S, F)
    ours = run(jf.FlashMultiHeadAttention(num_heads=HEADS, **kwargs).init, jax.random.key(0), x)
    theirs = run(nn.MultiHeadDotProductAttention(num_heads=HEADS, **kwargs).init, jax.random.key(0), x)
    assert shapes(ours) == shapes(theirs)
    assert_trees_close(ours, theirs, tol=0)  # same names, so the same initial values


@pytest.mark.parametrize("kind,sq,sk", [("none", S, S), ("window", S, S), ("causal-segments-lengths", S, S),
                                        ("cross-causal", 7, S), ("cross-lengths", S, 9)])
def test_linen_matches_flax(kind, sq, sk):
    attrs, call, mask, rows = mask_case(kind, sq, sk)
    xq, xkv = inputs(1, B, sq, F), inputs(2, B, sk, F)
    flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    params = run(flax_mod.init, jax.random.key(0), xq, xkv)  # Flax's parameters, used by both
    ours = jf.FlashMultiHeadAttention(num_heads=HEADS, **attrs)
    y, g = value_and_grads(lambda p, q, kv: ours.apply(p, q, kv, **call), params, xq, xkv, rows=rows)
    y_ref, g_ref = value_and_grads(lambda p, q, kv: flax_mod.apply(p, q, kv, mask=mask), params, xq, xkv,
                                   rows=rows)
    np.testing.assert_allclose(y[rows], y_ref[rows], rtol=2e-5, atol=2e-5)
    if "lengths" in kind:  # rows past q_lengths are 0 before the output projection
        np.testing.assert_allclose(y[~rows], jnp.broadcast_to(params["params"]["out"]["bias"], y[~rows].shape))
    assert_trees_close(g, g_ref)


def test_linen_gqa_matches_oracle():
    x = inputs(3, B, S, F)
    mod = jf.FlashMultiHeadAttention(num_heads=8, num_kv_heads=2, causal=True)
    params = run(mod.init, jax.random.key(0), x)
    p = params["params"]
    assert p["key"]["kernel"].shape == (F, 2, F // 8) and p["query"]["kernel"].shape == (F, 8, F // 8)
    _, _, mask, _ = mask_case("causal", S, S)

    def oracle(params, x):
        p = params["params"]
        q, k, v = (jnp.einsum("bsf,fhd->bshd", x, p[n]["kernel"]) + p[n]["bias"] for n in ("query", "key", "value"))
        return jnp.einsum("bshd,hdf->bsf", oracle_attention(q, k, v, mask=mask), p["out"]["kernel"]) + p["out"]["bias"]

    y, g = value_and_grads(mod.apply, params, x)
    y_ref, g_ref = value_and_grads(oracle, params, x)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)


def test_linen_dropout():
    x = inputs(4, B, S, F)
    ours = jf.FlashMultiHeadAttention(num_heads=HEADS, dropout_rate=0.3, causal=True)
    # The oracle: Flax's module with the oracle attention, per-element dropout and the same 'dropout' stream.
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.3, broadcast_dropout=False,
                                             attention_fn=oracle_attention)
    _, _, mask, _ = mask_case("causal", S, S)
    params = run(lambda k, x: theirs.init(k, x, deterministic=True), jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(7)}
    y, g = value_and_grads(lambda p, x: ours.apply(p, x, deterministic=False, rngs=rngs), params, x)
    y_ref, g_ref = value_and_grads(lambda p, x: theirs.apply(p, x, mask=mask, deterministic=False, rngs=rngs),
                                   params, x)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)
    # An explicit dropout_rng wins over the stream, as in Flax.
    key = jax.random.key(8)
    np.testing.assert_allclose(
        run(lambda p, x: ours.apply(p, x, deterministic=False, dropout_rng=key, rngs=rngs), params, x),
        run(lambda p, x: theirs.apply(p, x, mask=mask, deterministic=False, dropout_rng=key), params, x), atol=2e-5)
    # Another key draws another mask; deterministic=True (call or attribute) is Flax's output without dropout.
    other = run(lambda p, x: ours.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(9)}), params, x)
    assert np.max(np.abs(np.asarray(other - y))) > 1e-2
    plain = run(lambda p, x: nn.MultiHeadDotProductAttention(num_heads=HEADS).apply(p, x, mask=mask), params, x)
    np.testing.assert_allclose(run(lambda p, x: ours.apply(p, x, deterministic=True), params, x), plain, atol=2e-5)
    ours_det = jf.FlashMultiHeadAttention(num_heads=HEADS, dropout_rate=0.3, causal=True, deterministic=True)
    np.testing.assert_allclose(run(ours_det.apply, params, x), plain, atol=2e-5)


def test_linen_rejects_mask_array():
    x = inputs(5, B, S, F)
    mod = jf.FlashMultiHeadAttention(num_heads=HEADS)
    params = run(mod.init, jax.random.key(0), x)
    with pytest.raises(NotImplementedError, match="mask array.*causal=.*q_segment_ids"):
        mod.apply(params, x, mask=nn.make_causal_mask(x[..., 0]))
    with pytest.raises(ValueError, match="num_heads must be a positive multiple of num_kv_heads.*num_kv_heads=3"):
        jf.FlashMultiHeadAttention(num_heads=4, num_kv_heads=3).init(jax.random.key(0), x)


# --- attention_fn in Flax's own modules -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["causal-segments-lengths", "window"])
def test_attention_fn_in_flax_module(kind):
    attrs, call, mask, rows = mask_case(kind, S, S)
    ours_mask = jf.Mask(**attrs, **call)
    x = inputs(6, B, S, F)
    flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.attention_fn)
    params = run(flax_mod.init, jax.random.key(0), x)
    y, g = value_and_grads(lambda p, x: ours.apply(p, x, mask=ours_mask), params, x, rows=rows)
    y_ref, g_ref = value_and_grads(lambda p, x: flax_mod.apply(p, x, mask=mask), params, x, rows=rows)
    np.testing.assert_allclose(y[rows], y_ref[rows], rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)


def test_attention_fn_dropout():
    x = inputs(7, B, S, F)
    kw = dict(num_heads=HEADS, dropout_rate=0.2, broadcast_dropout=False)
    ours = nn.MultiHeadDotProductAttention(attention_fn=jf.attention_fn, **kw)
    theirs = nn.MultiHeadDotProductAttention(attention_fn=oracle_attention, **kw)
    params = run(lambda k, x: ours.init(k, x, deterministic=True), jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(3)}
    y, g = value_and_grads(lambda p, x: ours.apply(p, x, deterministic=False, rngs=rngs), params, x)
    y_ref, g_ref = value_and_grads(lambda p, x: theirs.apply(p, x, deterministic=False, rngs=rngs), params, x)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)
    np.testing.assert_allclose(run(lambda p, x: ours.apply(p, x, deterministic=True), params, x),
                               run(nn.MultiHeadDotProductAttention(num_heads=HEADS).apply, params, x), atol=2e-5)


def test_attention_fn_refuses():
    x = inputs(8, B, S, F)
    plain = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.attention_fn)
    params = run(plain.init, jax.random.key(0), x)
    with pytest.raises(NotImplementedError, match=r"mask array.*\(2, 1, 13, 13\).*jaxflash.flax.Mask"):
        plain.apply(params, x, mask=nn.make_causal_mask(x[..., 0]))
    with pytest.raises(NotImplementedError, match="sow_weights"):
        plain.apply(params, x, sow_weights=True)
    broadcast = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1, attention_fn=jf.attention_fn)
    with pytest.raises(NotImplementedError, match="broadcast_dropout=True.*broadcast_dropout=False"):
        broadcast.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
    # Without dropout the flag is irrelevant: Flax's default module works as is.
    np.testing.assert_allclose(run(lambda p, x: broadcast.apply(p, x, deterministic=True), params, x),
                               run(nn.MultiHeadDotProductAttention(num_heads=HEADS).apply, params, x), atol=2e-5)
    q = inputs(9, B, S, HEADS, 8)
    with pytest.raises(NotImplementedError, match=r"bias.*\(2, 4, 13, 13\)"):
        jf.attention_fn(q, q, q, bias=jnp.zeros((B, HEADS, S, S)))
    with pytest.raises(ValueError, match="dropout_rate=0.1.*dropout_rng"):
        jf.attention_fn(q, q, q, dropout_rate=0.1, broadcast_dropout=False)
    with pytest.raises(NotImplementedError, match="einsum"):
        jf.attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)


def test_mask_is_a_pytree():
    ids = jnp.zeros((B, S), jnp.int32)
    m = jf.Mask(causal=True, window=(3, None), q_segment_ids=ids, kv_segment_ids=ids)
    leaves, tree = jax.tree.flatten(m)
    assert len(leaves) == 2  # the arrays; causal and window are static
    rebuilt = jax.tree.unflatten(tree, leaves)
    assert (rebuilt.causal, rebuilt.window) == (True, (3, None))
    q = inputs(10, B, S, HEADS, 8)
    out = jax.jit(lambda q, m: jf.attention_fn(q, q, q, mask=m))(q, m)
    np.testing.assert_allclose(out, jf.attention_fn(q, q, q, mask=m), atol=1e-6)
    assert isinstance(m, jaxflash.Mask) and rebuilt.bottom_right is False


def test_attention_fn_keeps_a_core_masks_alignment():
    """jaxflash.flax.Mask aligns the diagonal top-left; a jaxflash.Mask given to attention_fn keeps bottom-right."""
    q, k = inputs(11, B, 7, HEADS, 8), inputs(12, B, S, HEADS, 8)
    top_left = jf.attention_fn(q, k, k, mask=jf.Mask(causal=True))
    bottom_right = jf.attention_fn(q, k, k, mask=jaxflash.Mask(causal=True))
    np.testing.assert_allclose(top_left, jaxflash.dot_product_attention(q, k, k, is_causal=True), atol=1e-6)
    np.testing.assert_allclose(bottom_right, jaxflash.attention(q, k, k, causal=True), atol=1e-6)
    assert not np.allclose(top_left, bottom_right)


# --- flax.nnx ---------------------------------------------------------------------------------------------

NNX_CONFIGS = [dict(), dict(num_kv_heads=2), dict(qkv_features=48, out_features=24, in_kv_features=20),
               dict(normalize_qk=True)]
NNX_IDS = ["default", "gqa", "features", "normalize_qk"]


def nnx_pair(seed=0, **kw):
    ours = jf.FlashMultiHeadAttentionNNX(HEADS, F, **kw, rngs=nnx.Rngs(seed))
    theirs = nnx.MultiHeadAttention(HEADS, F, **kw, decode=False, rngs=nnx.Rngs(seed))
    return ours, theirs


@pytest.mark.parametrize("kwargs", NNX_CONFIGS, ids=NNX_IDS)
def test_nnx_params_are_flax_params(kwargs):
    ours, theirs = nnx_pair(**kwargs)
    ours_p, theirs_p = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    assert shapes(ours_p) == shapes(theirs_p)
    assert_trees_close(ours_p, theirs_p, tol=0)  # same construction order, so the same initial values
    other, _ = nnx_pair(seed=1, **kwargs)
    nnx.update(other, theirs_p)  # swapping Flax's weights in
    assert_trees_close(nnx.state(other, nnx.Param), theirs_p, tol=0)


def nnx_value_and_grads(module, *xs, rows=None, dropout_seed=None, **call):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def apply(params, *xs):
        rngs = {} if dropout_seed is None else dict(rngs=nnx.Rngs(dropout=dropout_seed))  # made inside the trace
        return nnx.merge(graphdef, params, rest)(*xs, **call, **rngs)

    return value_and_grads(apply, params, *xs, rows=rows)


NNX_KINDS = ["causal", "lengths", "causal", "lengths"]


@pytest.mark.parametrize("kwargs,kind", list(zip(NNX_CONFIGS, NNX_KINDS)),
                         ids=[f"{i}-{k}" for i, k in zip(NNX_IDS, NNX_KINDS)])
def test_nnx_matches_flax(kwargs, kind):
    ours, theirs = nnx_pair(**kwargs)
    attrs, call, mask, rows = mask_case(kind, S, S)
    ours = jf.FlashMultiHeadAttentionNNX(HEADS, F, **kwargs, **attrs, rngs=nnx.Rngs(5))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    xq, xkv = inputs(11, B, S, F), inputs(12, B, S, kwargs.get("in_kv_features", F))
    y, g = nnx_value_and_grads(ours, xq, xkv, rows=rows, **call)
    y_ref, g_ref = nnx_value_and_grads(theirs, xq, xkv, rows=rows, mask=mask)
    np.testing.assert_allclose(y[rows], y_ref[rows], rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)


def test_nnx_dropout():
    kw = dict(num_kv_heads=2, dropout_rate=0.25)
    ours = jf.FlashMultiHeadAttentionNNX(HEADS, F, **kw, causal=True, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(HEADS, F, **kw, broadcast_dropout=False, attention_fn=oracle_attention,
                                    decode=False, rngs=nnx.Rngs(0))
    x = inputs(13, B, S, F)
    # The same key for both: a fresh Rngs with the same seed given to each call.
    y, g = nnx_value_and_grads(ours, x, deterministic=False, dropout_seed=4)
    y_ref, g_ref = nnx_value_and_grads(theirs, x, deterministic=False, is_causal=True, dropout_seed=4)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)
    # The stream kept from the constructor advances: two calls draw two masks.
    assert np.max(np.abs(np.asarray(ours(x, deterministic=False) - ours(x, deterministic=False)))) > 1e-2
    plain = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ours(x, deterministic=True), plain(x, is_causal=True), atol=2e-5)
    with pytest.raises(ValueError, match="deterministic"):
        ours(x)


def test_attention_fn_in_nnx_module():
    x = inputs(14, B, S, F)
    ours = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, attention_fn=jf.attention_fn, decode=False,
                                  rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    y, g = nnx_value_and_grads(ours, x, is_causal=True)
    y_ref, g_ref = nnx_value_and_grads(theirs, x, is_causal=True)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    assert_trees_close(g, g_ref)
