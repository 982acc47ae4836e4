"""Dropout of the attention probabilities: the keep mask as the kernels draw it, in plain JAX.

One Philox4x32-7 call draws the bytes of 16 elements. Element (batch b, head h, query row i, key column j),
with c = j % 16, reads byte 2 * (c // 8) + c % 2 (little-endian) of word (c % 8) // 2 of
Philox4x32-7(counter = (j // 16, i, h, b), key = the two words of the JAX key), and is kept iff that byte is
at least threshold(rate) = round(rate * 256) (rate rounded to float32 first, as the kernels receive it). So the
rate is drawn in steps of 1/256: an element is dropped with probability threshold / 256, and kept probabilities
are scaled by keep_scale(rate) = 256 / (256 - threshold), which keeps the output's expectation that of no
dropout. Seven rounds (not cuRAND's ten) is the fewest with which Philox4x32 passes TestU01's BigCrush, as its
authors count, and what FlashAttention-2's dropout runs; the rounds are most of what dropout costs the kernels.
The same rule is written once in C++ (cuda/common/philox.h) for the kernels; this is the independent Python twin
used by `backend="reference"` and the tests.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_M0, _M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
ROUNDS = 7  # the rounds dropout draws with


def _mulhilo(a, b):
    """(hi, lo) words of the 64-bit product of uint32 a and b, with 32-bit arithmetic only."""
    a, b = jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)
    mask = jnp.uint32(0xFFFF)
    a0, a1, b0, b1 = a & mask, a >> 16, b & mask, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & mask) + (p10 & mask)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), a * b


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=ROUNDS):
    """Philox4x32 with `rounds` rounds of counter words (c0..c3) and key words (k0, k1), broadcasting over
    arrays."""
    c = [jnp.asarray(x, jnp.uint32) for x in (c0, c1, c2, c3)]
    k0, k1 = jnp.asarray(k0, jnp.uint32), jnp.asarray(k1, jnp.uint32)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_M0, c[0])
        hi1, lo1 = _mulhilo(_M1, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = k0 + _W0, k1 + _W1
    return c


def key_words(key):
    """The two uint32 words of a JAX PRNG key (a typed threefry key or a legacy uint32[2] key)."""
    if jnp.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = jnp.asarray(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise ValueError("jaxflash: dropout_key must be a JAX PRNG key with two 32-bit words (threefry, the "
                         f"default); got an array of shape {key.shape} and dtype {key.dtype}")
    return key


def threshold(rate: float) -> int:
    """round(rate * 256) of the float32 rate (halves up), exactly as the kernels compute it: bytes below it drop
    their element. 1 .. 255 for the rates the kernels take."""
    return int(np.floor(float(np.float32(rate)) * 256.0 + 0.5))


def keep_scale(rate: float) -> float:
    """What a kept probability is multiplied by: 256 / (256 - threshold(rate)), rounded to float32 as the
    kernels hold it."""
    return float(np.float32(256.0 / (256.0 - threshold(rate))))


def effective_rate(rate: float) -> float:
    """The probability that an element is dropped: threshold(rate) / 256."""
    return threshold(rate) / 256.0


def dropout_mask(key, batch: int, heads: int, q_len: int, k_len: int, rate: float, *, row_offset=0,
                 col_offset=0):
    """The keep mask the kernels draw: bool [batch, heads, q_len, k_len] (True = kept). With offsets (ints or
    traced scalars), the block of rows row_offset.. and columns col_offset.. of a longer sequence's mask."""
    words = key_words(key)
    b = jnp.arange(batch, dtype=jnp.uint32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.uint32)[None, :, None, None]
    i = jnp.arange(q_len, dtype=jnp.uint32)[None, None, :, None] + jnp.asarray(row_offset, jnp.uint32)
    j = jnp.arange(k_len, dtype=jnp.uint32)[None, None, None, :] + jnp.asarray(col_offset, jnp.uint32)
    r = philox4x32(j >> 4, i, h, b, words[0], words[1])
    w = (j & 7) >> 1
    word = jnp.where(w == 0, r[0], jnp.where(w == 1, r[1], jnp.where(w == 2, r[2], r[3])))
    shift = 8 * (2 * ((j >> 3) & 1) + (j & 1))
    return ((word >> shift) & jnp.uint32(0xFF)) >= jnp.uint32(threshold(rate))
