// What the backward kernels of every family share: the preprocess (delta, dq_accum cleared) and convert
// (dq = scale · dq_accum) kernels, and the element-wise rules that recompute P from the scores and turn dP into
// dS (softcap, dropout, rows that see no key). The rules work on any rowcol view whose coordinates give
// (query row, key column), whatever the accumulator's orientation.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cute/tensor.hpp>

#include "bwd_order.h"
#include "device_info.h"
#include "launch_utils.cuh"
#include "mask.h"
#include "mask_tile.cuh"
#include "params.h"
#include "philox.h"
#include "softmax.cuh"

namespace jaxflash {

using cute::get;
using cute::size;
using cute::Tensor;

// Two adjacent fp32 values added to global memory; one vector atomic on Hopper.
__forceinline__ __device__ void atomic_add_pair(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(addr), make_float2(a, b));
#else
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
#endif
}

// LSE of a query row in log2 units, as the exponent offset of P = exp2(s·scale·log2 e − lse·log2 e). Rows
// past the end and rows that see no key (LSE = −inf) get +inf, so their P is exactly 0.
__forceinline__ __device__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f; }
__forceinline__ __device__ float lse_log2_of(const float* lse_row, int64_t row, int64_t rows) {
  return row >= rows ? INFINITY : lse_log2(lse_row[row]);
}

// What the backward pass adds to dS = P ∘ (dP − delta) for softcap and dropout (default: the plain rule).
struct BwdExtras {
  float softcap = 0.f;  // > 0: scores were soft-capped
  float t_scale = 0.f;  // ln 2 / softcap: turns log2(P) + LSE·log2 e into t = capped score / cap
  bool dropout = false;
  DropoutDraw draw{};
  float keep_scale = 1.f;  // what a kept probability is multiplied by (philox.h)

  BwdExtras() = default;
  __device__ BwdExtras(const BwdParams& p, int64_t batch) {
    if (p.softcap > 0.f) {
      softcap = p.softcap;
      t_scale = 0.6931471805599453f / p.softcap;
    }
    if (p.dropout.rate > 0.f) {
      dropout = true;
      draw = dropout_draw(p.dropout, batch);
      keep_scale = p.dropout.keep_scale;
    }
  }

  // Softcap's factor 1 − t² of a probability of a row whose lse2 is given (1 without softcap).
  __forceinline__ __device__ float cap_factor(float prob, float row_lse2) const {
    if (softcap == 0.f) return 1.f;
    const float t = (log2f(prob) + row_lse2) * t_scale;
    return prob > 0.f ? 1.f - t * t : 0.f;
  }

  // One element with dropout: dp -> P ∘ (dP ∘ Z − delta) ∘ (1 − t²), prob -> P ∘ Z. kCap = false leaves
  // softcap's factor out (a caller that has already checked that there is none).
  template <bool kCap = true>
  __forceinline__ __device__ void drop(float& dp, float& prob, bool keep, float row_delta, float row_lse2) const {
    const float p = prob, z = keep ? keep_scale : 0.f;
    const float ds = p * fmaf(dp, z, -row_delta);
    dp = kCap ? ds * cap_factor(p, row_lse2) : ds;
    prob = p * z;
  }
};

// Raw Q·Kᵀ -> the scores the forward's softmax saw: soft-capped if asked, −inf where the mask hides (kMasked;
// mask_tile.cuh). kExtras as in the forward kernel: compiles in softcap and segment ids.
template <bool kExtras, bool kMasked, int kTileN, class TAcc, class TC>
__forceinline__ __device__ void recompute_scores(TAcc& acc, TC const& coords, const BwdParams& p, const BatchMask& bm,
                                                 int64_t m0, int64_t n0) {
  if (kExtras && p.softcap > 0.f) softcap_scores(acc, p.scale, p.softcap);
  if constexpr (kMasked) {
    Tensor s = rowcol(acc);
    mask_scores<kTileN, kExtras>(s, coords, bm, m0, n0);
  }
}

// In place: s (rowcol view of scores, −inf where masked) -> P = exp2(s·score_log2 − lse2[row]).
template <class TS, int kRows>
__forceinline__ __device__ void scores_to_probs(TS& s, const float (&lse2)[kRows], float score_log2) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) s(r, c) = exp2f(fmaf(s(r, c), score_log2, -lse2[r]));
  }
}

// In place: dp (rowcol view of dP = dO·Vᵀ) -> dS = P ∘ (dP ∘ Z − delta) ∘ (1 − t²), and pr -> P ∘ Z (what dV
// needs). Z = keep · keep_scale is the forward's dropout, drawn again from the same counters; t is the capped
// score over the cap, recovered from P itself (log2 P + lse2 = s'·log2 e) instead of holding the scores in
// registers. Without softcap and dropout this is the plain P ∘ (dP − delta). kKeepAtoms: for_each_keep's
// kAtomsPerGroup for this accumulator layout, 0 where the caller applies dropout itself (BwdExtras::drop).
// kCapAlways: a kernel that runs only with softcap, which need not compile the branch without it.
template <bool kExtras, int kKeepAtoms, bool kCapAlways = false, class TP, class TD, class TC, int kRows>
__forceinline__ __device__ void dprobs_to_dscores(TD& dp, TP& pr, TC const& coords, const float (&delta)[kRows],
                                                  const float (&lse2)[kRows], const BwdExtras& x, uint32_t head,
                                                  int64_t m0, int64_t n0) {
  if constexpr (kExtras && kKeepAtoms > 0) {
    if (x.dropout) {
      for_each_keep<kKeepAtoms>(coords, x.draw, head, m0, n0, [&](int r, int c, bool keep) {
        x.drop(dp(r, c), pr(r, c), keep, delta[r], lse2[r]);
      });
      return;
    }
  }
  if (kCapAlways || (kExtras && x.softcap > 0.f)) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dp); ++c)
        dp(r, c) = pr(r, c) * (dp(r, c) - delta[r]) * x.cap_factor(pr(r, c), lse2[r]);
    }
  } else {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dp); ++c) dp(r, c) = pr(r, c) * (dp(r, c) - delta[r]);
    }
  }
}

// Stats of the rows a thread holds: lse2 (lse_log2_of) and delta; rows past q_len get P = 0 and delta 0, so
// whatever their dO holds never reaches a gradient.
template <class TC, int kRows>
__forceinline__ __device__ void load_row_stats(TC const& coords, const BwdParams& p, const BatchMask& bm,
                                               int64_t stat_off, int64_t m0, float (&lse2)[kRows],
                                               float (&delta)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = m0 + get<0>(coords(r, 0));
    lse2[r] = lse_log2_of(p.lse + stat_off, row, bm.q_len);
    delta[r] = row < bm.q_len ? p.delta[stat_off + row] : 0.f;
  }
}

// ---- preprocess: before the main kernel -----------------------------------------------------------------

// delta[b, h, i] = Σ_d dO·O − dLSE in fp32 for each row (b, i, h) of dO and O, and clear_rows rows of head_dim
// floats of dq_accum cleared (the grid covers the larger count): the first ones, or with flag_rows > 0 the flag
// rows of each (batch, head) of the tile layout (dq_flag_rows). A row's 16-byte vectors go to
// kLanes consecutive lanes (the head dim's vectors rounded up to a power of two), so a warp takes 32 / kLanes
// rows: one row per warp left 3/4 of the lanes idle at d = 64.
template <int kHeadDim>
struct PreprocessShape {
  static constexpr int kVecs = kHeadDim / 8;
  static constexpr int kLanes = kVecs <= 4 ? 4 : kVecs <= 8 ? 8 : kVecs <= 16 ? 16 : 32;
  static constexpr int kRowsPerWarp = 32 / kLanes, kRowsPerBlock = 8 * kRowsPerWarp;  // 256 threads
  static_assert(kHeadDim % 8 == 0 && kVecs <= 32);
};

template <class T, int kHeadDim>
__global__ void __launch_bounds__(256) flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p,
                                                                   const int64_t clear_rows,
                                                                   const int64_t flag_rows) {
  using Shape = PreprocessShape<kHeadDim>;
  const AttnDims& dims = p.dims;
  const int64_t rows = dims.batch * dims.seqlen_q * dims.heads_q;
  const int lane = threadIdx.x % Shape::kLanes;
  const int64_t row = int64_t(blockIdx.x) * Shape::kRowsPerBlock + threadIdx.x / Shape::kLanes;
  // Past the last row a lane group only sums zeros, so that every lane of the warp takes the shuffles.
  const bool real = row < rows;
  float sum = 0.f;
  const int64_t off = row * kHeadDim + lane * 8;
  if (row < clear_rows && lane < Shape::kVecs) {
    const int64_t clear = flag_rows == 0 ? row
                                         : row / flag_rows * dq_accum_rows(dims.seqlen_q) +
                                               dq_accum_tile_rows(dims.seqlen_q) + row % flag_rows;
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + clear * kHeadDim + lane * 8);
    acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (real && lane < Shape::kVecs) {
    const uint4 a = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + off);
    const uint4 b = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + off);
    const T* ea = reinterpret_cast<const T*>(&a);
    const T* eb = reinterpret_cast<const T*>(&b);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) sum = fmaf(float(ea[e]), float(eb[e]), sum);
  }
  CUTE_UNROLL
  for (int s = Shape::kLanes / 2; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (real && lane == 0) {
    const int64_t h = row % dims.heads_q;
    const int64_t i = (row / dims.heads_q) % dims.seqlen_q;
    const int64_t b = row / (dims.heads_q * dims.seqlen_q);
    const int64_t stat = (b * dims.heads_q + h) * dims.seqlen_q + i;
    p.delta[stat] = sum - p.dlse[stat];
  }
}

// ---- dq = scale · dq_accum: after the main kernel, when it accumulated dQ by atomics in q's layout ----------

template <class T>
__global__ void __launch_bounds__(256) flash_bwd_convert_dq_kernel(const float* __restrict__ dq_accum,
                                                                   T* __restrict__ dq, int64_t n4, float scale) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
    alignas(8) T out[4] = {T(a.x * scale), T(a.y * scale), T(a.z * scale), T(a.w * scale)};
    reinterpret_cast<uint2*>(dq)[i] = *reinterpret_cast<const uint2*>(out);
  }
}

// ---- the work of one block of a K/V-stationary main kernel -------------------------------------------------

// kN keys of one (batch, K/V head), and the query blocks the block visits: every query block of every head of
// the GQA group that can see those keys (with segment ids, only the rows of the block's documents), heads
// outer, query blocks inner. K/V blocks of one head are adjacent in launch order (they read the same Q and
// dO, which stay in L2), and each starts at a different query block (rotation by n_block), so the blocks
// running side by side add their dQ into different rows of dq_accum instead of contending for them.
// Deterministic mode orders the additions into each query block by n_block instead: every block visits its
// query blocks in the same order (no rotation, else a block would wait for a predecessor's later step), and
// the launch order (OrderedLaunch) puts every block after its predecessor, far enough behind it that the
// predecessor is usually a step ahead, and near enough that they share Q, dO and dq_accum lines in L2.
struct KvBlockWork {
  int64_t n_block, batch, head_k, group;
  int64_t n0, n_end, n_valid_end;  // keys [n0, n_end); those at or past n_valid_end (kv_len) are seen by nobody
  BatchMask bm;
  bool segments;  // segment ids given (and compiled in)
  int64_t m_block_min, n_m, n_iters, head0, m_shift;
  // Deterministic mode: the query blocks that the predecessor (bwd_order.h) visits, and this block's place in
  // the order of adds (n_block, or from the last block when descending), which the turn counters hold.
  int64_t pred_m_begin, pred_m_end, turn;

  // Step it visits query block m_block_min + (it % n_m + m_shift) mod n_m of head head0 + it / n_m: a cursor
  // advanced step by step, since a 64-bit division per step is a called subroutine in the loop. The sm90 stats
  // warp (ready_stats) walks the same order in 32 bits: change both together.
  struct Cursor {
    int64_t head, m_block;
    int32_t idx, m;  // the step's index within its head; its query block's offset from m_block_min
  };
  __device__ Cursor first() const { return {head0, m_block_min + m_shift, 0, int32_t(m_shift)}; }
  __device__ void advance(Cursor& c) const {
    if (++c.m == n_m) c.m = 0;
    if (++c.idx == n_m) {
      c.idx = 0;
      ++c.head;
    }
    c.m_block = m_block_min + c.m;
  }
};

// Every thread of the block calls it (segment ids narrow the rows with the whole block's help); `scratch` is
// 4 ints of shared memory, free again on return. `order` is used in deterministic mode (kOrdered) only.
template <int kM, int kN, int kThreads, bool kExtras, bool kOrdered>
__device__ KvBlockWork kv_block_work(const BwdParams& p, OrderedLaunch order, int* scratch) {
  const AttnDims& dims = p.dims;
  KvBlockWork w;
  const int64_t num_n_blocks = (dims.seqlen_k + kN - 1) / kN, num_bh = dims.batch * dims.heads_k;
  int64_t bh;
  if constexpr (kOrdered) {
    ordered_block(order, num_bh, num_n_blocks, blockIdx.x, &bh, &w.n_block);
  } else {
    w.n_block = blockIdx.x % num_n_blocks;
    bh = blockIdx.x / num_n_blocks;
  }
  w.head_k = bh % dims.heads_k;
  w.batch = bh / dims.heads_k;
  w.group = dims.heads_q / dims.heads_k;
  w.n0 = w.n_block * kN;
  w.n_end = cute::min(w.n0 + int64_t(kN), dims.seqlen_k);
  w.bm = batch_mask(p.mask, w.batch, dims.seqlen_q, dims.seqlen_k);
  w.n_valid_end = cute::min(w.n_end, w.bm.kv_len);
  int64_t row_begin, row_end;
  visible_query_range(w.bm, w.n0, w.n_end, &row_begin, &row_end);
  w.segments = kExtras && w.bm.q_seg != nullptr;
  if (w.segments && row_begin < row_end)
    narrow_by_ids<kThreads>(w.bm.kv_seg, w.n0, w.n_valid_end, w.bm.q_seg, &row_begin, &row_end, scratch);
  w.m_block_min = row_begin / kM;
  const int64_t m_block_max = row_end > row_begin ? (row_end + kM - 1) / kM : w.m_block_min;
  w.n_m = m_block_max - w.m_block_min;
  w.n_iters = w.n_m * w.group;
  w.head0 = w.head_k * w.group;
  w.m_shift = w.n_m > 0 && !kOrdered ? w.n_block % w.n_m : 0;
  // The same rule as above for the predecessor (no segment ids: their narrowing needs the whole block). With
  // lengths, causal and windows, the K/V blocks that visit a query block are consecutive.
  w.pred_m_begin = w.pred_m_end = 0;
  w.turn = order.descending ? num_n_blocks - 1 - w.n_block : w.n_block;
  if (kOrdered && w.turn > 0) {
    const int64_t pred0 = order.descending ? w.n0 + kN : w.n0 - kN;
    visible_query_range(w.bm, pred0, cute::min(pred0 + int64_t(kN), dims.seqlen_k), &row_begin, &row_end);
    if (row_end > row_begin) {
      w.pred_m_begin = row_begin / kM;
      w.pred_m_end = (row_end + kM - 1) / kM;
    }
  }
  return w;
}

// ---- their launches, as every family's run_bwd makes them -------------------------------------------------

// Which of dq_accum the preprocess clears: none, the first B·Sq·Hq rows (of head_dim floats: the layout of q,
// which the atomic kernels add into), all of it (every dq_accum_rows(Sq) row: the sm90 kernels' tiles), or the
// rows of the tiles' flags alone (the sm90 kernels that store each tile first).
enum class DqAccumClear { kNone, kQRows, kAll, kFlags };

// delta (and dq_accum cleared as asked): PreprocessShape's rows per block.
template <class T, int kHeadDim>
cudaError_t launch_bwd_preprocess(const BwdParams& p, DqAccumClear clear, cudaStream_t stream) {
  constexpr int kRowsPerBlock = PreprocessShape<kHeadDim>::kRowsPerBlock;
  const AttnDims& d = p.dims;
  const int64_t rows = d.batch * d.seqlen_q * d.heads_q;
  const int64_t flag_rows = clear == DqAccumClear::kFlags ? dq_flag_rows(d.seqlen_q) : 0;
  const int64_t clear_rows = clear == DqAccumClear::kNone    ? 0
                             : clear == DqAccumClear::kQRows ? rows
                             : clear == DqAccumClear::kFlags ? d.batch * d.heads_q * flag_rows
                                                             : d.batch * dq_accum_rows(d.seqlen_q) * d.heads_q;
  const int64_t blocks = (std::max(rows, clear_rows) + kRowsPerBlock - 1) / kRowsPerBlock;
  if (!grid_fits(blocks)) return cudaErrorInvalidConfiguration;
  flash_bwd_preprocess_kernel<T, kHeadDim><<<unsigned(blocks), 256, 0, stream>>>(p, clear_rows, flag_rows);
  return cudaPeekAtLastError();
}

// dq = scale · dq_accum: a grid-stride loop, 16 blocks of 256 threads per multiprocessor keep every SM busy.
template <class T, int kHeadDim>
cudaError_t launch_convert_dq(const BwdParams& p, cudaStream_t stream, int device) {
  DeviceInfo info;
  if (cudaError_t err = device_info(device, &info); err != cudaSuccess) return err;
  const int64_t n4 = p.dims.batch * p.dims.seqlen_q * p.dims.heads_q * kHeadDim / 4;
  const int64_t blocks = std::min<int64_t>((n4 + 255) / 256, int64_t(info.multiprocessors) * 16);
  flash_bwd_convert_dq_kernel<T><<<unsigned(blocks), 256, 0, stream>>>(p.dq_accum, static_cast<T*>(p.dq), n4,
                                                                         p.scale);
  return cudaPeekAtLastError();
}

}  // namespace jaxflash
