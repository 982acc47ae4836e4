"""Dropout inside the kernels: the Philox stream against its published known answers, the mask's
statistics, and forward/backward against the float64 oracle that applies `jaxflash.dropout_mask`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import oracle
from conftest import DTYPES, check_close, make_inputs, plain_jit
from jaxflash import _jaxflash_cpu, dropout
from jaxflash.dropout import philox4x32

# Random123's known-answer vectors for Philox4x32 (rounds, counter, key, output): dropout's 7 rounds, and 10
# (cuRAND's) so that the round structure is checked where most published answers are.
_PI = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
KAT = [(7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
       (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
       (7, *_PI, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
       (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       (10, *_PI, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("rounds,ctr,key,out", KAT)
def test_philox_known_answers(rounds, ctr, key, out):
    assert tuple(_jaxflash_cpu.philox4x32(*ctr, *key, rounds)) == out  # the kernels' C++ (cuda/common/philox.h)
    assert tuple(int(w) for w in philox4x32(*ctr, *key, rounds)) == out  # the JAX twin (dropout_mask)


def test_dropout_draws_with_seven_rounds():
    assert dropout.ROUNDS == 7
    ctr, key = (1, 2, 3, 4), (5, 6)
    assert tuple(_jaxflash_cpu.philox4x32(*ctr, *key)) == tuple(_jaxflash_cpu.philox4x32(*ctr, *key, 7))
    with pytest.raises(ValueError, match="rounds must be 7 or 10, got 8"):
        _jaxflash_cpu.philox4x32(*ctr, *key, 8)


def test_cpp_and_jax_philox_agree_on_random_counters():
    rng = np.random.default_rng(0)
    for words in rng.integers(0, 2**32, (50, 6), dtype=np.uint64):
        assert tuple(_jaxflash_cpu.philox4x32(*map(int, words))) == tuple(
            int(w) for w in philox4x32(*map(int, words)))


def _bytes_of(k0, k1, b, h, i, g):
    """The 16 bytes of one Philox call (counter (g, i, h, b)), word by word, little-endian: from the C++ generator
    and the byte order philox.h documents, independently of dropout_mask's vectorised spelling."""
    words = _jaxflash_cpu.philox4x32(g, i, h, b, k0, k1)
    return [(w >> (8 * y)) & 0xFF for w in words for y in range(4)]


def test_mask_reads_the_documented_byte_of_the_documented_call():
    key, rate = jax.random.key(12), 0.3
    k0, k1 = (int(w) for w in dropout.key_words(key))
    m = np.asarray(jaxflash.dropout_mask(key, 2, 3, 5, 40, rate))
    t = dropout.threshold(rate)
    for b, h, i, j in np.ndindex(*m.shape):
        c = j % 16
        byte = _bytes_of(k0, k1, b, h, i, j // 16)[4 * ((c % 8) // 2) + 2 * (c // 8) + c % 2]
        assert m[b, h, i, j] == (byte >= t), (b, h, i, j)


def test_cpp_keep_bits_equal_dropout_mask():
    rng = np.random.default_rng(1)
    # One shape and traced offsets: a compilation per rate only (eager, every op compiled for every case).
    mask = jax.jit(jaxflash.dropout_mask, static_argnums=(1, 2, 3, 4, 5))
    for k0, k1, b, h, i, g, r in zip(*rng.integers(0, 2**32, (6, 40), dtype=np.uint64), rng.uniform(0.01, 0.99, 40)):
        k0, k1, b, h, i, g = (int(x) for x in (k0, k1, b % 7, h % 9, i, g % 2**27))
        bits = _jaxflash_cpu.dropout_keep16(k0, k1, b, h, i, g, float(r))
        want = np.asarray(mask(jnp.asarray([k0, k1], jnp.uint32), 7, 9, 1, 16, float(r), row_offset=np.uint32(i),
                               col_offset=np.uint32(16 * g)))[b, h, 0]
        assert [(bits >> c) & 1 for c in range(16)] == [int(x) for x in want]


@pytest.mark.parametrize("rate, steps", [(0.1, 26), (0.5, 128), (0.9, 230), (1 / 512, 1), (0.998, 255), (0.3, 77)])
def test_rate_is_drawn_in_steps_of_1_256(rate, steps):
    assert dropout.threshold(rate) == steps
    assert dropout.effective_rate(rate) == steps / 256
    assert dropout.keep_scale(rate) == np.float32(256 / (256 - steps))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(rate):
    m = np.asarray(jaxflash.dropout_mask(jax.random.key(3), 2, 4, 256, 257, rate))
    n, dropped = m.size, dropout.effective_rate(rate)
    sd = np.sqrt(n * dropped * (1 - dropped))
    assert abs(m.sum() - n * (1 - dropped)) < 5 * sd


@pytest.mark.parametrize("rate", [1e-3, 0.9985])
def test_rate_off_the_256_steps_is_an_error(rate):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"jaxflash.attention: dropout_rate=.* rounds to (0|256)/256: the kernels "
                                         r"draw the rate in steps of 1/256"):
        jaxflash.attention(q, q, q, dropout_rate=rate, dropout_key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"rounds to (0|256)/256; the kernels draw the rate in steps of 1/256"):
        _jaxflash_cpu.dropout_keep16(0, 0, 0, 0, 0, 0, rate)


def test_no_correlation_between_neighbours():
    m = np.asarray(jaxflash.dropout_mask(jax.random.key(4), 1, 2, 512, 512, 0.5), np.float64) - 0.5
    n = m[..., :, 1:].size
    bound = 5 * 0.25 / np.sqrt(n)  # 5 sigma of the mean of n products of independent +-1/2 variables
    for a, b in [(m[..., :, 1:], m[..., :, :-1]), (m[..., 1:, :], m[..., :-1, :]), (m[:, 1:], m[:, :-1])]:
        assert abs(np.mean(a * b)) < max(bound, 5 * 0.25 / np.sqrt(a.size))
    # Columns 16g .. 16g+15 come from one Philox call: no two of its bytes may be correlated either.
    groups = m.reshape(m.shape[:-1] + (32, 16))
    for a in range(16):
        for b in range(a + 1, 16):
            x = groups[..., a] * groups[..., b]
            assert abs(np.mean(x)) < 5 * 0.25 / np.sqrt(x.size), (a, b)


CASES = [  # (Sq, Sk, Hq, Hk, D, causal, dtype, rate)
    (113, 255, 4, 2, 40, False, "float32", 0.1),
    (255, 113, 4, 4, 64, True, "bfloat16", 0.3),
    (64, 64, 8, 1, 16, True, "float16", 0.5),
    (1, 17, 4, 2, 32, False, "float32", 0.9),
    (301, 301, 2, 1, 128, True, "float32", 0.2),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dropout_matches_oracle(case):
    sq, sk, hq, hk, d, causal, dtype, rate = case
    q, k, v, do = make_inputs(len(str(case)), (2,), sq, sk, hq, hk, d, DTYPES[dtype])
    key = jax.random.key(sq * 1000 + sk)

    def run(backend, q, k, v):
        f = lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, dropout_rate=rate, dropout_key=key,
                                               return_lse=True, backend=backend)
        (o, lse), vjp = jax.vjp(f, q, k, v)
        return (o, lse, *vjp((do, jnp.zeros_like(lse))))

    got = jax.jit(lambda *a: run("cpu", *a))(q, k, v)
    naive = plain_jit(lambda *a: run("reference", *a))(q, k, v)
    keep = np.asarray(jaxflash.dropout_mask(key, 2, hq, sq, sk, rate))
    as64 = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, do)]
    ref = oracle.attention(*as64[:3], do=as64[3], causal=causal, keep=keep, rate=rate)
    for name, g, r, n in zip(("o", "lse", "dq", "dk", "dv"), got, ref, naive):
        check_close(name, g, r, n, dtype, str(case))


def test_dropout_with_masks_matches_oracle():
    q, k, v, do = make_inputs(21, (2,), 70, 90, 4, 2, 24, DTYPES["float32"])
    key, rate = jax.random.key(5), 0.25
    kw = dict(window=(30, 5), softcap=3.0, kv_lengths=jnp.array([90, 41], jnp.int32))
    f = lambda q, k, v: jaxflash.attention(q, k, v, dropout_rate=rate, dropout_key=key, **kw)
    o, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do)
    keep = np.asarray(jaxflash.dropout_mask(key, 2, 4, 70, 90, rate))
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), do=np.asarray(do), keep=keep, rate=rate,
                           window=(30, 5), softcap=3.0, kv_lengths=np.array([90, 41]))
    for g, r in zip((o, *grads), (ref[0], *ref[2:])):
        np.testing.assert_allclose(np.asarray(g), r, atol=5e-5)


def test_rate_zero_is_bitwise_no_dropout():
    q, k, v, do = make_inputs(22, (2,), 50, 60, 4, 2, 32, DTYPES["bfloat16"])
    a = jaxflash.attention(q, k, v, causal=True)
    b = jaxflash.attention(q, k, v, causal=True, dropout_rate=0.0, dropout_key=jax.random.key(1))
    assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_same_key_same_result_and_keys_differ():
    q, k, v, do = make_inputs(23, (2,), 40, 40, 2, 2, 16, DTYPES["float32"])
    f = lambda key: jax.grad(lambda q: jnp.sum(jaxflash.attention(q, k, v, dropout_rate=0.4, dropout_key=key) * do))(q)
    a, b, c = f(jax.random.key(1)), f(jax.random.key(1)), f(jax.random.key(2))
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c))


def test_vmap_over_keys_gives_independent_masks():
    q, k, v, _ = make_inputs(24, (2,), 30, 30, 2, 1, 16, DTYPES["float32"])
    keys = jax.random.split(jax.random.key(9), 3)
    outs = jax.vmap(lambda key: jaxflash.attention(q, k, v, dropout_rate=0.5, dropout_key=key))(keys)
    for i in range(3):
        want = jaxflash.attention(q, k, v, dropout_rate=0.5, dropout_key=keys[i])
        np.testing.assert_allclose(np.asarray(outs[i]), np.asarray(want), atol=1e-6)
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))


def test_vmap_over_queries_draws_the_unvmapped_mask():
    q, k, v, _ = make_inputs(25, (3, 2), 20, 20, 2, 2, 8, DTYPES["float32"])
    key = jax.random.key(11)
    outs = jax.vmap(lambda q: jaxflash.attention(q, k[0], v[0], dropout_rate=0.3, dropout_key=key))(q)
    for i in range(3):
        want = jaxflash.attention(q[i], k[0], v[0], dropout_rate=0.3, dropout_key=key)
        np.testing.assert_allclose(np.asarray(outs[i]), np.asarray(want), atol=1e-6)


def test_legacy_uint32_key_is_accepted():
    q, k, v, _ = make_inputs(26, (1,), 8, 8, 1, 1, 8, DTYPES["float32"])
    a = jaxflash.attention(q, k, v, dropout_rate=0.5, dropout_key=jax.random.PRNGKey(3))
    b = jaxflash.attention(q, k, v, dropout_rate=0.5, dropout_key=jax.random.key(3))
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_mask_of_a_slice_is_the_slice_of_the_mask():
    """With row and column offsets, dropout_mask draws that block of a longer sequence's mask (ring attention's
    slices tell the kernels the same offsets)."""
    key = jax.random.key(3)
    whole = np.asarray(jaxflash.dropout_mask(key, 2, 3, 40, 48, 0.4))
    part = jaxflash.dropout_mask(key, 2, 3, 12, 20, 0.4, row_offset=jnp.int32(9), col_offset=24)
    np.testing.assert_array_equal(np.asarray(part), whole[:, :, 9:21, 24:44])
