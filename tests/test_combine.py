"""jaxflash.combine against attention over the whole key set (split into disjoint parts), and its edge rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import oracle
from conftest import f64, make_inputs, stable_seed


def parts_of(q, k, v, cuts, **kw):
    """attention of q against each key range [cuts[i], cuts[i+1]) with its LSE, stacked; masks by lengths."""
    outs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        o, lse = jaxflash.attention(q, k[..., lo:hi, :, :], v[..., lo:hi, :, :], return_lse=True, **kw)
        outs.append(o)
        lses.append(lse)
    return jnp.stack(outs), jnp.stack(lses)


@pytest.mark.parametrize("cuts", [(0, 37), (0, 1, 37), (0, 5, 20, 21, 37)], ids=str)
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2)], ids=str)
def test_combine_equals_attention_over_the_union(cuts, hq, hk):
    q, k, v, _ = make_inputs(stable_seed("combine", cuts, hq, hk), (2,), 11, 37, hq, hk, 16, jnp.float32)
    out, lse = jaxflash.combine(*parts_of(q, k, v, cuts))
    ref_o, ref_lse = oracle.attention(f64(q), f64(k), f64(v))
    np.testing.assert_allclose(f64(out), ref_o, atol=2e-5, rtol=0)
    np.testing.assert_allclose(f64(lse), ref_lse, atol=2e-5, rtol=0)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32


def test_empty_parts_contribute_nothing_and_empty_rows_give_zero():
    q, k, v, do = make_inputs(3, (1,), 5, 8, 2, 2, 8, jnp.float32)
    outs, lses = parts_of(q, k, v, (0, 4, 8))
    # Part 1 sees nothing for rows 0-2 (NaN outputs there must not leak: their weight is exactly 0).
    lses = lses.at[1, :, :, :3].set(-jnp.inf)
    outs = outs.at[1, :, :3].set(jnp.nan)
    out, lse = jaxflash.combine(outs, lses)
    np.testing.assert_allclose(np.asarray(out[:, :3]), np.asarray(outs[0, :, :3]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse[..., :3]), np.asarray(lses[0, ..., :3]), atol=1e-6)
    # Every part -inf for row 4: 0 and -inf, and finite zero gradients.
    lses = lses.at[:, :, :, 4].set(-jnp.inf)
    outs = jnp.nan_to_num(outs)
    out, lse = jaxflash.combine(outs, lses)
    assert np.all(np.asarray(out[:, 4]) == 0) and np.all(np.isneginf(np.asarray(lse[..., 4])))
    g_outs, g_lses = jax.grad(lambda o, l: jnp.sum(jaxflash.combine(o, l)[0]), argnums=(0, 1))(outs, lses)
    assert np.all(np.isfinite(np.asarray(g_outs))) and np.all(np.isfinite(np.asarray(g_lses)))
    assert np.all(np.asarray(g_outs[:, :, 4]) == 0)


def test_combine_gradients_match_attention_over_the_union():
    q, k, v, do = make_inputs(4, (2,), 9, 20, 2, 1, 8, jnp.float32)
    whole = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v), q, k, v)[1](do)
    split = jax.vjp(lambda q, k, v: jaxflash.combine(*parts_of(q, k, v, (0, 7, 20)))[0], q, k, v)[1](do)
    for a, b in zip(split, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_combine_keeps_dtype_and_works_under_jit():
    q, k, v, _ = make_inputs(5, (), 6, 10, 2, 2, 8, jnp.bfloat16)
    outs, lses = parts_of(q, k, v, (0, 3, 10))
    out, lse = jax.jit(jaxflash.combine)(outs, lses)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape and lse.shape == (2, 6)
    ref = jaxflash.attention(q, k, v)
    np.testing.assert_allclose(f64(out), f64(ref), atol=2e-2)


@pytest.mark.parametrize("outs,lses,err,match", [
    (np.zeros((2, 3, 2, 4), np.float32), np.zeros((2, 3, 2), np.float32), ValueError, r"lses must have shape"),
    (np.zeros((3, 2, 4), np.float32), np.zeros((3, 2), np.float32), ValueError, r"outs must have rank >= 4"),
    (np.zeros((0, 3, 2, 4), np.float32), np.zeros((0, 2, 3), np.float32), ValueError, r"need at least one part"),
    (np.zeros((2, 3, 2, 4), np.int32), np.zeros((2, 2, 3), np.float32), TypeError, r"outs must have a floating"),
    ([1.0], np.zeros((1,), np.float32), TypeError, r"outs must be an array"),
])
def test_combine_errors(outs, lses, err, match):
    with pytest.raises(err, match=f"jaxflash.combine: {match}"):
        jaxflash.combine(outs, lses)
