// FlashAttention backward for Hopper at head dim 256: the split-d kernel (traits_bwd.cuh, BwdSplitDTraits).
//
// The contract, the producer warp, the stats and the epilogue are bwd_kernel.cuh's; what differs is how the two
// consumer warpgroups share a K/V block of 64 keys. Holding dK and dV of their own keys whole would take 256
// registers per thread at d = 256, so both warpgroups see all 64 keys and split the head dim:
//   S = Q·Kᵀ and dP = dO·Vᵀ with the queries along wgmma's M, each warpgroup 32 of the keys;
//   P and dS element-wise in registers (the (query, key) orientation of bwd_common.cuh's rules), then to
//   shared memory, where the other warpgroup reads them;
//   dV += Pᵀ·dO, dK += dSᵀ·Q and dQ = dS·K over all 64 keys, each warpgroup 128 of the head dim's columns;
//   dQ staged in shared memory in the threads' register order and added into the fp32 dq_accum by bulk
//   reduce-adds, in two rounds (flash_bwd_convert_dq turns that into dq).
// P and dS have two buffers: a warpgroup writes the next block's while the other may still read this one.
// Deterministic mode is not taken (the handler runs the sm80 backward): bwd_kernel.cuh's turn order is not
// wired into this kernel.
#pragma once

#include "bwd_kernel.cuh"

namespace jaxflash::sm90 {

using namespace cute;

template <class Tr>
struct BwdSplitDSharedStorage {
  using T = typename Tr::Element;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> k;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> v;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutDo>, 1024> dout;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutPdS>, 1024> p;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutPdS>, 1024> ds;
  array_aligned<float, Tr::kMmaWarpGroups * Tr::kDqChunk / Tr::kDqRounds, 1024> dq;  // a round per consumer
  uint64_t kv_full;
  uint64_t q_full[Tr::kStages], q_empty[Tr::kStages];
  uint64_t do_full[Tr::kStagesDo], do_empty[Tr::kStagesDo];
  // As in BwdSharedStorage.
  uint64_t q_ready[Tr::kStages], do_ready[Tr::kStagesDo];
  float lse2[Tr::kStages][Tr::kBlockM];
  float delta[Tr::kStagesDo][Tr::kBlockM];
  int scratch[4];  // narrow_by_ids
};

// A thread's accumulator values as T into the same elements of a shared tile, one 32-bit store per pair of
// adjacent columns (rowcol views of one partition; the swizzle moves whole 16-byte chunks, so a pair stays
// together). Rows at 128-byte steps with the swizzle: a warp's stores fall on distinct banks.
template <class T, class AccRC, class SmemRC>
__forceinline__ __device__ void store_pairs(AccRC const& acc, SmemRC&& s) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(acc); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc); c += 2) {
      cutlass::Array<T, 2> pair;
      pair[0] = T(acc(r, c));
      pair[1] = T(acc(r, c + 1));
      *reinterpret_cast<uint32_t*>(&s(r, c)) = *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
}

template <class Tr, bool kExtras>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    flash_bwd_split_d_kernel(const __grid_constant__ BwdKernelParams<Tr> kp) {
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim;
  constexpr int kMmaThreads = Tr::kMmaThreads;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<BwdSplitDSharedStorage<Tr>*>(smem_raw);
  const BwdParams& p = kp.p;
  const AttnDims& dims = p.dims;
  const int tid = threadIdx.x;
  const int warp_group = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int64_t seqlen_q = dims.seqlen_q;

  const KvBlockWork w = kv_block_work<kM, kN, Tr::kNThreads, kExtras, /*kOrdered=*/false>(p, kp.order, ss.scratch);
  const int64_t n0 = w.n0, n_end = w.n_end, n_valid_end = w.n_valid_end, n_iters = w.n_iters;
  const BatchMask& bm = w.bm;

  if (tid == 0) init_bwd_barriers<Tr, /*kStatsOnFull=*/true>(ss);
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (tid < 32 && n_iters > 0) produce_bwd<Tr>(kp, ss, w, tid);
    if (tid / 32 == 2 && n_iters > 0) ready_stats<Tr, /*kStatsOnFull=*/true>(kp, ss, w, tid % 32);
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int mma_tid = tid - 128;
  const int wg = warp_group - 1;  // warp-uniform
  const bool releaser = mma_tid % 128 == 0;

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutDo{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutDot{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Tr::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.p.data()), typename Tr::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutPdSt{});

  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaKV mma_kv;
  typename Tr::TiledMmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
  auto thr_kv = mma_kv.get_thread_slice(mma_tid);
  // Shared-memory descriptors partitioned for the warpgroup's first thread (uniform registers; bwd_kernel.cuh).
  auto wg_sdp = mma_sdp.get_thread_slice(wg * 128);
  auto wg_kv = mma_kv.get_thread_slice(wg * 128);
  auto wg_dq = mma_dq.get_thread_slice(wg * 128);
  Tensor tSrQ = wg_sdp.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_D, stage)
  Tensor tSrdO = wg_sdp.partition_fragment_A(sdO);
  Tensor tSrK = wg_sdp.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_D)
  Tensor tSrV = wg_sdp.partition_fragment_B(sV);
  Tensor tKVrPt = wg_kv.partition_fragment_A(sPt);  // (MMA, MMA_N, MMA_M, buffer)
  Tensor tKVrdSt = wg_kv.partition_fragment_A(sdSt);
  Tensor tKVrdOt = wg_kv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_M, stage)
  Tensor tKVrQt = wg_kv.partition_fragment_B(sQt);
  Tensor tQrdS = wg_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_N, buffer)
  Tensor tQrKt = wg_dq.partition_fragment_B(sKt);  // (MMA, MMA_D, MMA_N)

  Tensor acc_s = partition_fragment_C(mma_sdp, typename Tr::TileS{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, typename Tr::TileS{});
  Tensor acc_dk = partition_fragment_C(mma_kv, typename Tr::TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_kv, typename Tr::TileKV{});
  Tensor acc_dq = partition_fragment_C(mma_dq, typename Tr::TileQ{});
  clear(acc_dk);
  clear(acc_dv);

  // (query, key) of every score this thread holds.
  Tensor c_s = rowcol(thr_sdp.partition_C(make_identity_tensor(typename Tr::TileS{})));
  Tensor s_rc = rowcol(acc_s);
  Tensor dp_rc = rowcol(acc_dp);
  constexpr int kRows = decltype(size<0>(c_s))::value;

  const float score_log2 = (kExtras && p.softcap > 0.f ? 1.f : p.scale) * 1.4426950408889634f;
  const BwdExtras extras = kExtras ? BwdExtras(p, w.batch) : BwdExtras();

  // Whether a query block needs the per-key mask, decided once for this K/V block (as bwd_kernel.cuh).
  const bool mask_always = w.segments || n0 + kN > bm.kv_len;
  int64_t full_rows_begin, full_rows_end;
  fully_visible_query_range(bm.m, n0, n0 + kN, &full_rows_begin, &full_rows_end);
  full_rows_end = cute::min(full_rows_end, bm.q_len);
  if (n_iters > 0) {
    ClusterTransactionBarrier::wait(&ss.kv_full, 0);
    // Keys past kv_len inside the tensor.
    if (n_valid_end < n_end) zero_tails<Tr>(sK, sV, int(n_valid_end - n0), int(n_end - n0), mma_tid);
  }

  KvBlockWork::Cursor cur = w.first();
  for (int64_t it = 0; it < n_iters; ++it, w.advance(cur)) {
    const int64_t head = cur.head, m_block = cur.m_block;
    const int64_t m0 = m_block * kM;
    const int64_t m_end = cute::min(m0 + int64_t(kM), seqlen_q);
    const int stage = int(it % Tr::kStages), do_stage = int(it % Tr::kStagesDo), buf = int(it & 1);
    const uint32_t parity = uint32_t((it / Tr::kStages) & 1), do_parity = uint32_t((it / Tr::kStagesDo) & 1);

    ClusterTransactionBarrier::wait(&ss.q_full[stage], parity);
    ClusterTransactionBarrier::wait(&ss.do_full[do_stage], do_parity);
    const int64_t q_valid_end = cute::min(m_end, bm.q_len);
    if (q_valid_end < m_end)  // query rows past q_len inside the tensor
      zero_tails<Tr>(sQ(_, _, stage), sdO(_, _, do_stage), int(q_valid_end - m0), int(m_end - m0), mma_tid);
    wgmma</*kZeroInit=*/true>(mma_sdp, tSrQ(_, _, _, stage), tSrK, acc_s);
    wgmma</*kZeroInit=*/true>(mma_sdp, tSrdO(_, _, _, do_stage), tSrV, acc_dp);
    float lse2[kRows], delta[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      lse2[r] = ss.lse2[stage][get<0>(c_s(r, 0))];
      delta[r] = ss.delta[do_stage][get<0>(c_s(r, 0))];
    }

    warpgroup_wait<1>();  // S landed; dP still running
    if (kExtras && p.softcap > 0.f) softcap_scores(acc_s, p.scale, p.softcap);
    if (mask_always || m0 < full_rows_begin || m_end > full_rows_end)
      mask_scores<kN, kExtras>(s_rc, c_s, bm, m0, n0);
    scores_to_probs(s_rc, lse2, score_log2);
    warpgroup_wait<0>();
    // dS, and P ∘ Z for dV (a thread's atoms are the two halves of a 16-key dropout group).
    dprobs_to_dscores<kExtras, 2>(dp_rc, s_rc, c_s, delta, lse2, extras, uint32_t(head), m0, n0);
    store_pairs<typename Tr::Element>(s_rc, rowcol(thr_sdp.partition_C(sP(_, _, buf))));
    store_pairs<typename Tr::Element>(dp_rc, rowcol(thr_sdp.partition_C(sdS(_, _, buf))));
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by wgmma
    if (releaser) tma_store_wait<0>();  // the previous block's last reduce-add has read the staging tile
    NamedBarrier::sync(kMmaThreads, BwdBar::kShared);  // both warpgroups' keys of P and dS written

    wgmma</*kZeroInit=*/false>(mma_kv, tKVrPt(_, _, _, buf), tKVrdOt(_, _, _, do_stage), acc_dv);
    wgmma</*kZeroInit=*/true>(mma_dq, tQrdS(_, _, _, buf), tQrKt, acc_dq);
    wgmma</*kZeroInit=*/false>(mma_kv, tKVrdSt(_, _, _, buf), tKVrQt(_, _, _, stage), acc_dk);
    warpgroup_wait<2>();  // dV landed: dO's stage is free for the next block's
    ClusterBarrier::arrive(&ss.do_empty[do_stage]);
    warpgroup_wait<1>();  // dQ landed; dK still running
    // dQ in rounds through this warpgroup's staging tile: float4 v of thread t at (v·128 + t)·4 of its part of
    // the query tile (flat_dq_tile), kDqChunk / kDqRounds floats at a time, each added by one bulk reduce-add.
    // Rows past q_len add zeros (their dS is 0); rows past the tensor are dropped by the convert step.
    {
      constexpr int kPerRound = Tr::kDqChunk / Tr::kDqRounds, kVecs = kPerRound / (4 * 128);
      float* staging = ss.dq.data() + wg * kPerRound;
      float* dst = flat_dq_tile<kD>(p.dq_accum, seqlen_q, w.batch * dims.heads_q + head, m0) + wg * Tr::kDqChunk;
      CUTE_UNROLL
      for (int round = 0; round < Tr::kDqRounds; ++round) {
        if (round > 0) {  // the previous round's add has read the tile
          if (releaser) tma_store_wait<0>();
          NamedBarrier::sync(128, BwdBar::kDqEmpty + wg);
        }
        float4* mine = reinterpret_cast<float4*>(staging) + mma_tid % 128;
        CUTE_UNROLL
        for (int v = 0; v < kVecs; ++v) {
          const int e = 4 * (round * kVecs + v);
          mine[v * 128] = make_float4(acc_dq(e), acc_dq(e + 1), acc_dq(e + 2), acc_dq(e + 3));
        }
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the bulk copy
        NamedBarrier::sync(128, BwdBar::kDqFull + wg);
        if (releaser) {
          bulk_reduce_add<kPerRound>(dst + round * kPerRound, staging);
          tma_store_arrive();
        }
      }
    }
    warpgroup_wait<0>();
    ClusterBarrier::arrive(&ss.q_empty[stage]);
  }

  if (releaser) tma_store_wait<0>();  // the shared memory outlives the last reduce-add's read
  store_dkdv<Tr>(kp, ss, w, rowcol(acc_dk), rowcol(acc_dv), thr_kv, mma_tid);
}

}  // namespace jaxflash::sm90
