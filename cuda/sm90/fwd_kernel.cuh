// FlashAttention forward for Hopper (sm_90a): TMA loads on an mbarrier pipeline, wgmma, warp specialisation.
//
// Same contract as the sm80 forward (params.h layouts; visibility from mask.h through mask_tile.cuh; softcap,
// Philox dropout with the same keep bits, LSE in natural log, −inf and O = 0 for rows that see no key).
//
// A thread block owns kBlockM query rows of one (batch, head) and visits the visible K/V blocks from the last
// to the first (the masked ones come first). Roles:
//   producer warp:   TMA of Q once and of K, V per block into kStages shared-memory stages; it waits until
//                    both consumers released a stage before refilling it.
//   2 consumers:     64 query rows each. Per block i: S_i = Q·K_iᵀ (wgmma, both operands in shared memory)
//                    is issued together with O += P_{i−1}·V_{i−1} (P from registers), the softmax of S_i runs
//                    while that P·V is still in flight, and O is rescaled once it has landed. A named-barrier
//                    handshake alternates the two consumers' GEMM batches on the tensor cores, so one
//                    warpgroup's softmax hides under the other's GEMMs.
// Keys past the visible range inside the tensor (past kv_len, or a window's far side) may hold anything, even
// NaN; P is 0 there, but 0·NaN is not, so the producer zeroes those rows of the one partial V block.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>

#include "mask.h"
#include "mask_tile.cuh"
#include "params.h"
#include "softmax.cuh"
#include "traits.cuh"

namespace jaxflash::sm90 {

using namespace cute;
using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;
using cutlass::arch::NamedBarrier;

template <class Tr>
struct FwdKernelParams {
  FwdParams p;
  typename Tr::TmaQ tma_q;
  typename Tr::TmaKV tma_k, tma_v;
};

template <class Tr>
struct FwdSharedStorage {
  using T = typename Tr::Element;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> k;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> v;
  uint64_t q_full;
  uint64_t k_full[Tr::kStages], k_empty[Tr::kStages];
  uint64_t v_full[Tr::kStages], v_empty[Tr::kStages];
  uint64_t v_partial;  // the partial V block lands here first, to be cleaned before v_full
  int scratch[4];      // narrow_by_ids
};

// One batch of wgmmas: acc (+)= A·B over the K mode, issued and committed but not waited for.
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__forceinline__ __device__ void wgmma(TiledMma& mma, TA const& a, TB const& b, TC& acc) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// The wgmma accumulator of a 64xN tile, ((2, 2, N/8), MMA_M, MMA_N), as the register A operand of the next
// wgmma, ((2, 2, 2), MMA_M, N/16): two adjacent 8-column groups form one 16-wide K slice (16-bit types).
template <class Layout>
__forceinline__ __device__ auto acc_as_a_operand(Layout const& acc) {
  auto v = get<0>(acc);
  auto groups = logical_divide(get<2>(v), _2{});  // (2, N/16)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(groups)), get<1>(acc),
                     coalesce(make_layout(get<1>(groups), get<2>(acc))));
}

template <class T, class TensorF, class TensorT>
__forceinline__ __device__ void convert_into(TensorF const& from, TensorT& to) {
  constexpr int kN = decltype(size(from))::value;
  cutlass::NumericArrayConverter<T, float, kN> convert;
  *reinterpret_cast<cutlass::Array<T, kN>*>(raw_pointer_cast(to.data())) =
      convert(*reinterpret_cast<const cutlass::Array<float, kN>*>(raw_pointer_cast(from.data())));
}

template <class Tr, bool kExtras>
__global__ void __launch_bounds__(Tr::kNThreads, 1) flash_fwd_kernel(const __grid_constant__ FwdKernelParams<Tr> kp) {
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim, kStages = Tr::kStages;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<FwdSharedStorage<Tr>*>(smem_raw);
  const FwdParams& p = kp.p;
  const AttnDims& dims = p.dims;
  const int tid = threadIdx.x;
  const int warp_group = __shfl_sync(0xffffffffu, tid / 128, 0);

  const int64_t seqlen_q = dims.seqlen_q, seqlen_k = dims.seqlen_k;
  const int64_t num_m_blocks = (seqlen_q + kM - 1) / kM;
  // The heaviest causal block of each head first (as in the sm80 kernel).
  const int64_t m_block = num_m_blocks - 1 - int64_t(blockIdx.x) % num_m_blocks;
  const int64_t bh = int64_t(blockIdx.x) / num_m_blocks;
  const int64_t head = bh % dims.heads_q, batch = bh / dims.heads_q;
  const int64_t head_k = head / (dims.heads_q / dims.heads_k);
  const int64_t m0 = m_block * kM, m_end = cute::min(m0 + int64_t(kM), seqlen_q);
  const int64_t q_row_stride = dims.heads_q * kD;
  float* lse_row = p.lse + (batch * dims.heads_q + head) * seqlen_q + m0;
  T* o_base = static_cast<T*>(p.o) + batch * seqlen_q * q_row_stride + head * kD;

  if (tid == 0) {
    ClusterTransactionBarrier::init(&ss.q_full, 1);
    ClusterTransactionBarrier::init(&ss.v_partial, 1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      ClusterTransactionBarrier::init(&ss.k_full[s], 1);
      ClusterTransactionBarrier::init(&ss.v_full[s], 1);
      ClusterBarrier::init(&ss.k_empty[s], Tr::kMmaWarpGroups);
      ClusterBarrier::init(&ss.v_empty[s], Tr::kMmaWarpGroups);
    }
  }

  // The visible key range: producer and consumers must agree on it exactly, or a barrier phase drifts.
  const BatchMask bm = batch_mask(p.mask, batch, seqlen_q, seqlen_k);
  const int64_t m_valid_end = cute::min(m_end, bm.q_len);
  int64_t key_begin, key_end;
  visible_key_range(bm, m0, m_end, &key_begin, &key_end);
  const bool segments = kExtras && bm.q_seg != nullptr;
  if (segments && key_begin < key_end)
    narrow_by_ids<Tr::kNThreads>(bm.q_seg, m0, m_valid_end, bm.kv_seg, &key_begin, &key_end, ss.scratch);
  const int n_block_min = int(key_begin / kN);
  const int n_block_max = key_end > key_begin ? int((key_end + kN - 1) / kN) : n_block_min;
  const int n_iters = n_block_max - n_block_min;

  if (n_iters <= 0) {  // no row of this block sees any key: O = 0, LSE = −inf
    for (int64_t e = tid; e < (m_end - m0) * kD; e += Tr::kNThreads) o_base[(m0 + e / kD) * q_row_stride + e % kD] = T(0.f);
    for (int r = tid; r < m_end - m0; r += Tr::kNThreads) lse_row[r] = -INFINITY;
    return;
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{});

  if (warp_group == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (tid >= 32) return;
    const int lane = tid;
    auto gmem_shape = [&](int64_t rows, int64_t heads) {
      return make_shape(int32_t(rows), Int<kD>{}, int32_t(heads), int32_t(dims.batch));
    };
    Tensor mQ = kp.tma_q.get_tma_tensor(gmem_shape(seqlen_q, dims.heads_q));
    Tensor mK = kp.tma_k.get_tma_tensor(gmem_shape(seqlen_k, dims.heads_k));
    Tensor mV = kp.tma_v.get_tma_tensor(gmem_shape(seqlen_k, dims.heads_k));
    Tensor gQ = local_tile(mQ(_, _, int32_t(head), int32_t(batch)), typename Tr::TileQ{}, make_coord(int32_t(m_block), _0{}));
    Tensor gK = local_tile(mK(_, _, int32_t(head_k), int32_t(batch)), typename Tr::TileKV{}, make_coord(_, _0{}));
    Tensor gV = local_tile(mV(_, _, int32_t(head_k), int32_t(batch)), typename Tr::TileKV{}, make_coord(_, _0{}));
    auto [tQg, tQs] = tma_partition(kp.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKg, tKs] = tma_partition(kp.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(kp.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    if (lane == 0) {
      ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full, Tr::kQBytes);
      copy(kp.tma_q.with(ss.q_full), tQg, tQs);
    }
    // Rows at or past key_end of the first (highest) block are invisible; inside the tensor they are zeroed.
    const int partial_rows = int(key_end - int64_t(n_block_max - 1) * kN);
    const bool clean_partial = partial_rows < kN && key_end < seqlen_k;
    for (int i = 0; i < n_iters; ++i) {
      const int n_block = n_block_max - 1 - i, stage = i % kStages;
      const uint32_t free_parity = ((i / kStages) & 1) ^ 1;  // a fresh barrier counts as released
      if (lane == 0) {
        ClusterBarrier::wait(&ss.k_empty[stage], free_parity);
        ClusterTransactionBarrier::arrive_and_expect_tx(&ss.k_full[stage], Tr::kKVBytes);
        copy(kp.tma_k.with(ss.k_full[stage]), tKg(_, n_block), tKs(_, stage));
        ClusterBarrier::wait(&ss.v_empty[stage], free_parity);
      }
      if (i == 0 && clean_partial) {
        if (lane == 0) {
          ClusterTransactionBarrier::arrive_and_expect_tx(&ss.v_partial, Tr::kKVBytes);
          copy(kp.tma_v.with(ss.v_partial), tVg(_, n_block), tVs(_, stage));
        }
        __syncwarp();
        ClusterBarrier::wait(&ss.v_partial, 0);
        Tensor v = sV(_, _, stage);
        for (int e = lane; e < (kN - partial_rows) * kD; e += 32) v(partial_rows + e / kD, e % kD) = T(0.f);
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by wgmma
        __syncwarp();
        if (lane == 0) ClusterBarrier::arrive(&ss.v_full[stage]);
      } else if (lane == 0) {
        ClusterTransactionBarrier::arrive_and_expect_tx(&ss.v_full[stage], Tr::kKVBytes);
        copy(kp.tma_v.with(ss.v_full[stage]), tVg(_, n_block), tVs(_, stage));
      }
    }
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int mma_tid = tid - 128;
  const int wg = warp_group - 1;  // 0 or 1
  const bool releaser = mma_tid % 128 == 0;
  // Pingpong: each consumer waits on its own named barrier before issuing a GEMM batch and signals the
  // other's right after; consumer 0 goes first.
  auto sched_wait = [&] { NamedBarrier::sync(Tr::kMmaThreads, wg); };
  auto sched_signal = [&] { NamedBarrier::arrive(Tr::kMmaThreads, 1 - wg); };
  if (wg == 1) sched_signal();

  typename Tr::TiledMmaQK mma_qk;
  typename Tr::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(mma_tid);
  auto thr_pv = mma_pv.get_thread_slice(mma_tid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_D) descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_D, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_D, MMA_N, stage)
  Tensor acc_s = partition_fragment_C(mma_qk, typename Tr::TileS{});
  Tensor acc_o = partition_fragment_C(mma_pv, typename Tr::TileQ{});
  Tensor rP = make_tensor<T>(acc_s.layout());
  Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  clear(acc_o);
  Tensor c_rc = rowcol(thr_qk.partition_C(make_identity_tensor(typename Tr::TileS{})));  // (row, col) in the tile
  Tensor s_rc = rowcol(acc_s);
  Tensor o_rc = rowcol(acc_o);

  const float softcap = kExtras ? p.softcap : 0.f;
  const float score_scale = softcap > 0.f ? 1.f : p.scale;
  const float scale_log2 = score_scale * 1.4426950408889634f;
  const bool dropout = kExtras && p.dropout.rate > 0.f;
  const DropoutDraw draw = dropout ? dropout_draw(p.dropout, batch) : DropoutDraw{};
  constexpr int kRows = decltype(size<0>(s_rc))::value;
  OnlineSoftmax<kRows> softmax;
  float correction[kRows];

  auto block_needs_mask = [&](int i) {
    const int64_t n0 = int64_t(n_block_max - 1 - i) * kN;
    return segments || n0 + kN > bm.kv_len || m_end > bm.q_len ||
           !block_fully_visible(p.mask, m0, m_end, n0, n0 + kN);
  };
  // S_i (raw Q·Kᵀ, landed) -> unnormalised probabilities in s_rc; returns whether a row max moved.
  auto scores_to_probs = [&](int i, auto masked) __attribute__((always_inline)) {
    const int64_t n0 = int64_t(n_block_max - 1 - i) * kN;
    if (softcap > 0.f) softcap_scores(acc_s, p.scale, softcap);
    if constexpr (decltype(masked)::value) mask_scores<kN, kExtras>(s_rc, c_rc, bm, m0, n0);
    const bool moved = softmax.update_max(s_rc, scale_log2, correction);
    softmax.exponentiate(s_rc, scale_log2);  // the row sums see P before dropout: the LSE is undropped
    if (dropout) {
      for_each_keep(c_rc, draw, uint32_t(head), m0, n0, [&](int r, int c, bool keep) {
        if (!keep) s_rc(r, c) = 0.f;
      });
    }
    return moved;
  };
  auto stage_parity = [](int i) { return uint32_t((i / kStages) & 1); };
  auto release = [&](uint64_t* bars, int i) {
    if (releaser) ClusterBarrier::arrive(&bars[i % kStages]);
  };

  ClusterTransactionBarrier::wait(&ss.q_full, 0);
  // Block 0: S_0 alone.
  ClusterTransactionBarrier::wait(&ss.k_full[0], 0);
  sched_wait();
  wgmma</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, 0), acc_s);
  if (!(wg == 1 && n_iters == 1)) sched_signal();
  warpgroup_wait<0>();
  release(ss.k_empty, 0);
  if (block_needs_mask(0)) {
    scores_to_probs(0, std::true_type{});
  } else {
    scores_to_probs(0, std::false_type{});
  }
  convert_into<T>(acc_s, rP);

  // Block i: S_i and P_{i−1}·V_{i−1} in one batch; the softmax of S_i overlaps the P·V.
  auto iteration = [&](int i, auto masked) __attribute__((always_inline)) {
    ClusterTransactionBarrier::wait(&ss.k_full[i % kStages], stage_parity(i));
    sched_wait();
    wgmma</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, i % kStages), acc_s);
    ClusterTransactionBarrier::wait(&ss.v_full[(i - 1) % kStages], stage_parity(i - 1));
    warpgroup_fence_operand(rP);
    wgmma</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, (i - 1) % kStages), acc_o);
    if (!(wg == 1 && i == n_iters - 1)) sched_signal();  // consumer 1's last signal would have no taker
    warpgroup_wait<1>();  // S_i landed; P·V still running
    release(ss.k_empty, i);
    const bool moved = scores_to_probs(i, masked);
    warpgroup_wait<0>();
    warpgroup_fence_operand(rP);
    release(ss.v_empty, i - 1);
    softmax.rescale(o_rc, correction, moved);
    convert_into<T>(acc_s, rP);
  };
  for (int i = 1; i < n_iters;) {
    for (; i < n_iters && block_needs_mask(i); ++i) iteration(i, std::true_type{});
    for (; i < n_iters && !block_needs_mask(i); ++i) iteration(i, std::false_type{});
  }
  // The last P·V alone.
  {
    const int i = n_iters;
    ClusterTransactionBarrier::wait(&ss.v_full[(i - 1) % kStages], stage_parity(i - 1));
    warpgroup_fence_operand(rP);
    wgmma</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, (i - 1) % kStages), acc_o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(rP);
    release(ss.v_empty, i - 1);
  }

  // ---- epilogue: normalise and write this thread's rows of O (pairs of columns) and LSE ----
  float lse[kRows];
  softmax.finalize(o_rc, score_scale, dropout ? 1.f / (1.f - p.dropout.rate) : 1.f, lse);
  Tensor oc_rc = rowcol(thr_pv.partition_C(make_identity_tensor(typename Tr::TileQ{})));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(oc_rc(r, 0));
    if (row < m_end - m0) {
      T* o_row = o_base + (m0 + row) * q_row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        cutlass::Array<T, 2> pair;
        pair[0] = T(o_rc(r, c));
        pair[1] = T(o_rc(r, c + 1));
        *reinterpret_cast<cutlass::Array<T, 2>*>(o_row + get<1>(oc_rc(r, c))) = pair;
      }
      if (get<1>(oc_rc(r, 0)) == 0) lse_row[row] = lse[r];
    }
  }
}

}  // namespace jaxflash::sm90
