"""Forward pass of the CPU kernel: o and lse against the float64 oracle, FlashAttention's tolerance rule."""
import jax
import numpy as np
import pytest

import jaxflash
import oracle
from conftest import DTYPES, check_close, make_inputs, naive_forward, stable_seed
from grid import case_id, cases


@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_forward_matches_oracle(case):
    sq, sk, hq, hk, d, causal, dtype = case
    q, k, v, _ = make_inputs(stable_seed(case_id(case)), (2,), sq, sk, hq, hk, d, DTYPES[dtype])
    o, lse = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, return_lse=True,
                                                          backend="cpu"))(q, k, v)
    ref_o, ref_lse = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=causal)
    naive_o, naive_lse = naive_forward(q, k, v, causal)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (2, hq, sq) and lse.dtype == np.float32
    check_close("o", o, ref_o, naive_o, dtype, case_id(case))
    check_close("lse", lse, ref_lse, naive_lse, dtype, case_id(case))


def test_rows_that_see_nothing_are_zero_with_lse_minus_inf():
    # Sq > Sk with the bottom-right causal mask: the first Sq - Sk query rows see no key.
    q, k, v, _ = make_inputs(1, (), 9, 4, 2, 2, 16, DTYPES["float32"])
    o, lse = jaxflash.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(np.asarray(o)[:5] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :5]))
    assert np.all(np.isfinite(np.asarray(lse)[:, 5:])) and np.all(np.isfinite(np.asarray(o)))


def test_custom_scale():
    q, k, v, _ = make_inputs(2, (3,), 33, 47, 4, 2, 24, DTYPES["float32"])
    o = jaxflash.attention(q, k, v, scale=0.37)
    ref, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), scale=0.37)
    np.testing.assert_allclose(np.asarray(o), ref, atol=2e-5)


@pytest.mark.parametrize("d", [1, 3, 255])
def test_odd_head_dims(d):
    q, k, v, _ = make_inputs(3, (2,), 21, 30, 2, 1, d, DTYPES["float32"])
    o = jaxflash.attention(q, k, v, causal=True)
    ref, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(np.asarray(o), ref, atol=2e-5)


def test_many_leading_dims():
    q, k, v, _ = make_inputs(4, (2, 3), 19, 23, 4, 2, 16, DTYPES["float32"])
    o = jaxflash.attention(q, k, v)
    ref, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(o), ref, atol=2e-5)


@pytest.mark.parametrize("shape", [(0, 4, 2, 8), (2, 0, 2, 8)])
def test_empty_query(shape):
    q = np.zeros(shape, np.float32)
    k = np.ones((shape[0], 5, 2, 8), np.float32)
    o, lse = jaxflash.attention(q, k, k, return_lse=True)
    assert o.shape == shape and lse.shape == (shape[0], 2, shape[1])


def test_empty_keys_give_zero_and_minus_inf():
    q, _, _, _ = make_inputs(5, (2,), 7, 1, 2, 2, 8, DTYPES["float32"])
    k = np.zeros((2, 0, 2, 8), np.float32)
    o, lse = jaxflash.attention(q, k, k, return_lse=True)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_deterministic_run_to_run():
    q, k, v, _ = make_inputs(6, (2,), 300, 300, 4, 2, 64, DTYPES["bfloat16"])
    a = np.asarray(jaxflash.attention(q, k, v, causal=True))
    b = np.asarray(jaxflash.attention(q, k, v, causal=True))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
