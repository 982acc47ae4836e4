// The one definition of which (query i, key j) pairs are visible, shared by the CPU and CUDA kernels.
// See MaskParams in params.h for the rule.
#pragma once

#include <cstdint>

#include "params.h"

#if defined(__CUDACC__)
#define JAXFLASH_HD __host__ __device__ __forceinline__
#else
#define JAXFLASH_HD inline
#endif

namespace jaxflash {

JAXFLASH_HD bool is_visible(const MaskParams& m, int64_t i, int64_t j) {
  const int64_t c = i + m.diag_offset;
  if (m.window_right >= 0 && j > c + m.window_right) return false;
  if (m.window_left >= 0 && j < c - m.window_left) return false;
  return true;
}

// Keys that any query row in [row_begin, row_end) can see lie in [*key_begin, *key_end) (clamped to
// [0, seqlen_k]); the range is empty when key_begin >= key_end. Used to skip fully masked K/V blocks.
JAXFLASH_HD void visible_key_range(const MaskParams& m, int64_t row_begin, int64_t row_end,
                                   int64_t seqlen_k, int64_t* key_begin, int64_t* key_end) {
  int64_t lo = 0, hi = seqlen_k;
  if (m.window_left >= 0) lo = row_begin + m.diag_offset - m.window_left;
  if (m.window_right >= 0) hi = (row_end - 1) + m.diag_offset + m.window_right + 1;
  lo = lo < 0 ? 0 : lo;
  hi = hi > seqlen_k ? seqlen_k : hi;
  *key_begin = lo;
  *key_end = hi;
}

// True when every (i, j) in the block [row_begin, row_end) x [key_begin, key_end) is visible, so the
// kernel can skip the per-element predicate.
JAXFLASH_HD bool block_fully_visible(const MaskParams& m, int64_t row_begin, int64_t row_end,
                                     int64_t key_begin, int64_t key_end) {
  if (m.window_right >= 0 && key_end - 1 > row_begin + m.diag_offset + m.window_right) return false;
  if (m.window_left >= 0 && key_begin < (row_end - 1) + m.diag_offset - m.window_left) return false;
  return true;
}

}  // namespace jaxflash
