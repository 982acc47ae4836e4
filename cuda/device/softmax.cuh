// Online softmax state of one thread's query rows, kept in registers (FlashAttention-2, Algorithm 1).
//
// The score tile S = Q·Kᵀ arrives as an mma.sync m16n8k16 or a wgmma accumulator: a thread holds, per 16x8
// atom, rows {r, r+8} x columns {c, c+1}. The four threads of a quad (lanes 4k..4k+3) share rows, so a row
// reduction is a reduction over the thread's own columns plus two xor-shuffles.
//
// Numerics: p = exp2(s·scale·log2(e) − m·scale·log2(e)) is one FFMA and one MUFU.EX2 per score. The row
// sum stays a per-thread partial sum until `finalize` (every term of a row shares the same max, so the
// partial sums of a quad rescale identically). A row whose max is still −inf (every key so far masked)
// uses 0 as its max in the exponent, so exp2(−inf − 0) = 0 and no inf − inf = NaN arises; such a row ends
// with sum 0 and gives O = 0, LSE = −inf.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace jaxflash {

// Accumulator -> ((row halves, MMA_M) rows, (cols, MMA_N) cols). mma.sync: ((2 cols, 2 row halves), MMA_M,
// MMA_N). wgmma 64xN: ((2 cols, 2 row halves, N/8 column groups), MMA_M, MMA_N); per warp the same
// rows x columns pattern as mma.sync, repeated across the N/8 groups.
template <class Layout>
__forceinline__ __device__ auto rowcol_layout(Layout const& acc) {
  static_assert(decltype(cute::rank(acc))::value == 3);
  if constexpr (decltype(cute::rank<0>(acc))::value == 3) {
    auto v = cute::get<0>(acc);
    return cute::make_layout(cute::make_layout(cute::get<1>(v), cute::get<1>(acc)),
                             cute::make_layout(cute::make_layout(cute::get<0>(v), cute::get<2>(v)), cute::get<2>(acc)));
  } else {
    auto l = cute::logical_divide(acc, cute::Shape<cute::_2>{});
    return cute::make_layout(cute::make_layout(cute::get<0, 1>(l), cute::get<1>(l)),
                             cute::make_layout(cute::get<0, 0>(l), cute::get<2>(l)));
  }
}

template <class Tensor>
__forceinline__ __device__ auto rowcol(Tensor&& t) {
  return cute::make_tensor(t.data(), rowcol_layout(t.layout()));
}

template <int kNRows>
struct OnlineSoftmax {
  float row_max[kNRows];
  float row_sum[kNRows];

  __forceinline__ __device__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kNRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Folds one block of raw scores `s` (rowcol view, masked entries = −inf) into the state: rescales the
  // output accumulator `o` (rowcol view) by exp(m_old − m_new) and overwrites `s` with exp(s − m_new).
  template <class TS, class TO>
  __forceinline__ __device__ void update(TS& s, TO& o, float scale_log2) {
    float correction[kNRows];
    const bool moved = update_max(s, scale_log2, correction);
    rescale(o, correction, moved);
    exponentiate(s, scale_log2);
  }

  // The three steps of update, for kernels that rescale O later (while P·V of the previous block is still
  // running): the new maxima and the factors O needs (returns whether any row's max moved), ...
  //
  // kSlackLog2 > 0: a row keeps its max until a block's exceeds it by more than kSlackLog2 in the exponent
  // (log2 units). Its probabilities then stay below 2^kSlackLog2, harmless in fp32 sums and bf16/fp16 P, and
  // since the sum and O are taken against the same max the result is unchanged but for rounding; O is rescaled
  // only when a row's max really jumps (mostly the first block), not whenever a new key is a little larger.
  template <int kSlackLog2 = 0, class TS>
  __forceinline__ __device__ bool update_max(TS const& s, float scale_log2, float (&correction)[kNRows]) {
    static_assert(decltype(cute::size<0>(s))::value == kNRows);
    bool max_moved = false;
#pragma unroll
    for (int r = 0; r < kNRows; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) m = fmaxf(m, s(r, c));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if constexpr (kSlackLog2 > 0) {
        // −inf to finite is +inf > slack (moves); −inf to −inf is NaN (stays).
        if (!((m - row_max[r]) * scale_log2 > float(kSlackLog2))) {
          correction[r] = 1.f;
          continue;
        }
      }
      max_moved |= m != row_max[r];
      const float m_safe = m == -INFINITY ? 0.f : m;
      correction[r] = exp2f((row_max[r] - m_safe) * scale_log2);  // 0 while row_max is −inf
      row_max[r] = m;
      row_sum[r] *= correction[r];
    }
    return max_moved;
  }

  // ... O scaled by those factors: once the row maxima settle (after the first blocks, on most data) every
  // factor is exactly 1 and the Br·d multiplies are skipped. The vote keeps the branch uniform in the warp ...
  template <class TO>
  __forceinline__ __device__ void rescale(TO& o, const float (&correction)[kNRows], bool max_moved) {
    if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
      for (int r = 0; r < kNRows; ++r) {
#pragma unroll
        for (int c = 0; c < cute::size<1>(o); ++c) o(r, c) *= correction[r];
      }
    }
  }

  // ... and s -> exp(s − m_new), added to the row sums.
  template <class TS>
  __forceinline__ __device__ void exponentiate(TS& s, float scale_log2) {
#pragma unroll
    for (int r = 0; r < kNRows; ++r) {
      const float m_safe = row_max[r] == -INFINITY ? 0.f : row_max[r];
      const float m_scaled = m_safe * scale_log2;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < cute::size<1>(s); ++c) {
        const float p = exp2f(fmaf(s(r, c), scale_log2, -m_scaled));
        s(r, c) = p;
        sum += p;
      }
      row_sum[r] += sum;
    }
  }

  // Divides `o` (rowcol view) by the row sums, times `o_scale` (dropout's keep_scale), and returns each
  // row's LSE (natural log) in `lse`; `scale` is the factor update() applied to the scores.
  template <class TO>
  __forceinline__ __device__ void finalize(TO& o, float scale, float o_scale, float (&lse)[kNRows]) {
#pragma unroll
    for (int r = 0; r < kNRows; ++r) {
      float sum = row_sum[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool empty = !(sum > 0.f);
      lse[r] = empty ? -INFINITY : row_max[r] * scale + logf(sum);
      const float inv = empty ? 0.f : o_scale / sum;
#pragma unroll
      for (int c = 0; c < cute::size<1>(o); ++c) o(r, c) *= inv;
    }
  }
};

}  // namespace jaxflash
