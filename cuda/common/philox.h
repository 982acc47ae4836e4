// Philox4x32 (Salmon, Moraes, Dror & Shaw, SC'11), the counter-based generator cuRAND and FlashAttention use,
// and the dropout decision built on it. One definition for the CPU and CUDA kernels and the same spec as
// jaxflash.dropout_mask (Python), so every backend draws the identical mask bit for bit.
//
// Dropout draws one byte per element, sixteen per Philox call: element (batch b, head h, query row i, key
// column j) reads byte 2 * (c / 8) + c % 2 (little-endian) of word (c % 8) / 2 of
//   Philox4x32-7(counter = (j / 16, i, h, b), key = (k0, k1)),   c = j % 16,
// and is kept iff that byte is >= threshold = round(rate * 256). The rate is thus drawn in steps of 1/256 and kept
// values are scaled by 256 / (256 - threshold), the inverse of the keep probability. The byte order puts
// the four columns one lane of a tensor-core accumulator holds in a 16-column group (2q, 2q+1, 8+2q, 9+2q
// for lane q of a quad) in word q, so a call's words go one to each lane of the quad. A pure function of
// the key and the four indices: independent of tile sizes, thread layout and backend.
//
// Seven rounds, not cuRAND's ten: seven is the fewest with which Philox4x32 passes TestU01's BigCrush (the
// authors' count; ten is their safety margin), FlashAttention-2's dropout runs seven, and the rounds' wide
// multiplies are most of what dropout costs the kernels.
#pragma once

#include <cstdint>

#include "params.h"

namespace jaxflash {

struct Philox4 {
  uint32_t x[4];
};

JAXFLASH_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(p >> 32);
  *lo = uint32_t(p);
}

// The rounds dropout draws with (see above).
constexpr int kDropoutRounds = 7;

template <int kRounds>
JAXFLASH_HD Philox4 philox4x32(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < kRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kM0, ctr.x[0], &hi0, &lo0);
    mulhilo32(kM1, ctr.x[2], &hi1, &lo1);
    ctr = Philox4{{hi1 ^ ctr.x[1] ^ k0, lo1, hi0 ^ ctr.x[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// What a kernel needs to decide dropout: the batch element's key, index and position (see DropoutParams), and
// the rate as an 8-bit threshold.
struct DropoutDraw {
  uint32_t k0, k1, batch;
  uint32_t row0, group0;  // this call's first query row and first group of 16 key columns in the whole sequence
  uint32_t threshold;
};

// The Philox words of row i, head h and the 16 key columns 16g .. 16g+15, i and g counted within the call:
// the counter holds their positions in the whole sequence.
JAXFLASH_HD Philox4 dropout_words(const DropoutDraw& d, uint32_t h, uint32_t i, uint32_t g) {
  return philox4x32<kDropoutRounds>(Philox4{{g + d.group0, i + d.row0, h, d.batch}}, d.k0, d.k1);
}

// Where column c of a 16-column group reads its byte: the word, and the byte's shift within it.
JAXFLASH_HD int dropout_word(int c) { return (c & 7) >> 1; }
JAXFLASH_HD int dropout_shift(int c) { return 8 * (2 * ((c >> 3) & 1) + (c & 1)); }

JAXFLASH_HD bool dropout_byte_keeps(uint32_t word, int shift, uint32_t threshold) {
  return ((word >> shift) & 0xFFu) >= threshold;
}

// The decisions of a word's four bytes at once: bit 7 of byte b of the result is set iff byte b >= threshold,
// i.e. iff byte + (256 - threshold) carries out of the byte: bit 7 of majority(a, c, (a & 0x7f) + (c & 0x7f))
// per byte, with no carry crossing a byte. threshold in [1, 255] (params.h).
JAXFLASH_HD uint32_t keep_msbs(uint32_t word, uint32_t threshold) {
  const uint32_t add = (256u - threshold) * 0x01010101u, low = (word & 0x7f7f7f7fu) + (add & 0x7f7f7f7fu);
  return (word & add) | ((word | add) & low);
}

// The 16 keep bits of the group of columns 16g .. 16g+15 of row i (bit c: column 16g + c).
JAXFLASH_HD uint32_t dropout_keep16(const DropoutDraw& d, uint32_t h, uint32_t i, uint32_t g) {
  const Philox4 r = dropout_words(d, h, i, g);
  uint32_t bits = 0;
  for (int c = 0; c < 16; ++c)
    bits |= uint32_t(dropout_byte_keeps(r.x[dropout_word(c)], dropout_shift(c), d.threshold)) << c;
  return bits;
}

JAXFLASH_HD DropoutDraw dropout_draw(const DropoutParams& p, int64_t b) {
  const uint32_t* s = p.state + kDropoutStateWords * b;
  return DropoutDraw{s[0], s[1], s[2], s[3], s[4] >> 4, p.threshold};
}

}  // namespace jaxflash
