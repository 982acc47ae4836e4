// Philox4x32-10 (Salmon, Moraes, Dror & Shaw, SC'11), the counter-based generator cuRAND and FlashAttention
// use, and the dropout decision built on it. One definition for the CPU and CUDA kernels and the same spec as
// jaxflash.dropout_mask (Python), so every backend draws the identical mask bit for bit.
//
// Dropout keeps element (batch b, head h, query row i, key column j) iff word j % 4 of
//   Philox4x32-10(counter = (j / 4, i, h, b), key = (k0, k1))
// is >= threshold = floor(rate * 2^32). A pure function of the key and the four indices: independent of tile
// sizes, thread layout and backend.
#pragma once

#include <cstdint>

#include "params.h"

#if defined(__CUDACC__)
#define JAXFLASH_PHILOX_HD __host__ __device__ __forceinline__
#else
#define JAXFLASH_PHILOX_HD inline
#endif

namespace jaxflash {

struct Philox4 {
  uint32_t x[4];
};

JAXFLASH_PHILOX_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(p >> 32);
  *lo = uint32_t(p);
}

JAXFLASH_PHILOX_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
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
// the rate as a 32-bit threshold.
struct DropoutDraw {
  uint32_t k0, k1, batch;
  uint32_t row0, group0;  // this call's first query row and first group of four key columns in the whole sequence
  uint32_t threshold;
};

// The four keep bits of columns 4c .. 4c+3 of row i, head h (one Philox call serves four columns), i and c
// counted within the call: the counter holds their positions in the whole sequence.
JAXFLASH_PHILOX_HD uint32_t dropout_keep4(const DropoutDraw& d, uint32_t h, uint32_t i, uint32_t c) {
  const Philox4 r = philox4x32_10(Philox4{{c + d.group0, i + d.row0, h, d.batch}}, d.k0, d.k1);
  uint32_t bits = 0;
  for (int w = 0; w < 4; ++w) bits |= uint32_t(r.x[w] >= d.threshold) << w;
  return bits;
}

JAXFLASH_PHILOX_HD DropoutDraw dropout_draw(const DropoutParams& p, int64_t b) {
  const uint32_t* s = p.state + kDropoutStateWords * b;
  return DropoutDraw{s[0], s[1], s[2], s[3], s[4] >> 2, p.threshold};
}

JAXFLASH_PHILOX_HD bool dropout_keep(const DropoutDraw& d, uint32_t h, uint32_t i, uint32_t j) {
  return (dropout_keep4(d, h, i, j >> 2) >> (j & 3)) & 1u;
}

}  // namespace jaxflash
