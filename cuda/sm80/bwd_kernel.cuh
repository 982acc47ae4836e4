// FlashAttention-2 backward on tensor cores (mma.sync m16n8k16, sm_80 and later), CuTe.
//
// Given dO, Q, K, V, O, LSE and dLSE (the cotangent of the returned LSE), with P = exp(scale·Q·Kᵀ − LSE):
//   delta = rowsum(dO ∘ O) − dLSE                  (fp32, [B, Hq, Sq]; the workspace output `delta`)
//   dP = dO·Vᵀ,  dS = P ∘ (dP − delta)
//   dV = Pᵀ·dO,  dK = scale · dSᵀ·Q,  dQ = scale · dS·K
// dK and dV of a K/V head are summed over the query heads of its GQA group; repeated K/V are never formed.
// Layouts (params.h): q, o, do, dq, dq_accum [B, Sq, Hq, D]; k, v, dk, dv [B, Sk, Hk, D]; lse, dlse,
// delta [B, Hq, Sq] float32. Visibility comes from mask.h; rows with LSE = −inf (they see no key) get P = 0,
// so they contribute nothing and never produce inf or NaN. Softcap multiplies dS by 1 − tanh²; dropout uses
// P ∘ Z for dV and dP ∘ Z in dS, Z = keep · keep_scale redrawn from the forward's counters (dprobs_to_dscores).
//
// Kernels, launched in this order by run_bwd (launch_bwd.cuh):
//   1. preprocess: delta, and dq_accum cleared (atomic mode);
//   2. dK/dV: one block per (K/V block, batch, K/V head), K and V resident in shared memory, dK and dV in
//      registers; loops over every visible query block of every head of the group (Q and dO double-
//      buffered with cp.async), recomputing P from Q, K and LSE. P and dS go through shared memory to feed
//      the transposed GEMMs. In atomic mode it also adds dS·K into dq_accum (fp32 atomics);
//   3. atomic mode: convert dq = scale · dq_accum to the input dtype;
//      deterministic mode: a dQ kernel, one block per query block (the forward's shape), recomputes S, P,
//      dP and dS over the visible K/V blocks and keeps dQ in registers: no atomics, so the result is
//      bitwise reproducible, at the price of recomputing Q·Kᵀ and dO·Vᵀ once more.
#pragma once

#include "bwd_common.cuh"
#include "kernel_common.cuh"
#include "traits_bwd.cuh"

namespace jaxflash::sm80 {

using namespace cute;

template <class Element_, int kHeadDim_>
struct BwdTraits : OperandTraits<Element_, kHeadDim_, BwdTileConfig<kHeadDim_>::kBlockM,
                                 BwdTileConfig<kHeadDim_>::kBlockN, BwdTileConfig<kHeadDim_>::kNWarps * 32> {
  using Base = OperandTraits<Element_, kHeadDim_, BwdTileConfig<kHeadDim_>::kBlockM, BwdTileConfig<kHeadDim_>::kBlockN,
                             BwdTileConfig<kHeadDim_>::kNWarps * 32>;
  using Config = BwdTileConfig<kHeadDim_>;
  static constexpr int kBlockM = Base::kBlockM, kBlockN = Base::kBlockN, kNWarps = Base::kNWarps;
  static constexpr int kAtomMSdP = Config::kAtomMSdP, kAtomNdKV = Config::kAtomNdKV, kAtomMdQ = Config::kAtomMdQ;
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (16 * (kNWarps / kAtomMSdP)) == 0);
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim_ % (16 * (kNWarps / kAtomNdKV)) == 0);
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim_ % (16 * (kNWarps / kAtomMdQ)) == 0);

  template <int kAtomRows>
  using WarpGridMma = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kAtomRows>, Int<kNWarps / kAtomRows>, _1>>,
                               Tile<Int<16 * kAtomRows>, Int<16 * (kNWarps / kAtomRows)>, _16>>;
  using TiledMmaSdP = WarpGridMma<kAtomMSdP>;  // (M, N)
  using TiledMmadKV = WarpGridMma<kAtomNdKV>;  // (N, D)
  using TiledMmadQ = WarpGridMma<kAtomMdQ>;    // (M, D)

  using SmemLayoutQt = typename Base::template Transposed<typename Base::SmemLayoutQ, kBlockM, kHeadDim_>;
  using SmemLayoutKt = typename Base::template Transposed<typename Base::SmemLayoutKV, kBlockN, kHeadDim_>;
  using SmemLayoutPdS = decltype(tile_to_shape(typename Base::template SwizzledAtom<kBlockN % 64 == 0 ? 64 : 32>{},
                                               typename Base::TileS{}));
  using SmemLayoutPdSt = typename Base::template Transposed<SmemLayoutPdS, kBlockM, kBlockN>;

  static constexpr int kPElems = kBlockM * kBlockN;
  // K, V | Q stage 0, 1 | dO stage 0, 1 | P | dS
  static constexpr int kSmemBytes = (2 * Base::kKVElems + 4 * Base::kQElems + 2 * kPElems) * int(sizeof(Element_));
};

// The deterministic dQ kernel: the forward's shape (warps split the query rows, dS feeds dS·K from registers).
template <class Element_, int kHeadDim_>
struct BwdDqTraits : OperandTraits<Element_, kHeadDim_, 64, BwdTileConfig<kHeadDim_>::kDqBlockN, 128> {
  using Base = OperandTraits<Element_, kHeadDim_, 64, BwdTileConfig<kHeadDim_>::kDqBlockN, 128>;
  using TiledMma = typename Base::TiledMmaRows;
  using SmemLayoutKt = typename Base::template Transposed<typename Base::SmemLayoutKV, Base::kBlockN, kHeadDim_>;
  // Q | dO | K stage 0, 1 | V stage 0, 1
  static constexpr int kSmemBytes = (2 * Base::kQElems + 4 * Base::kKVElems) * int(sizeof(Element_));
};

// The step both backward kernels take for one (query block, key block) tile: S = Q·Kᵀ recomputed into P
// (masked, capped, exp against the LSE) in acc_s, and dP = dO·Vᵀ turned into dS in acc_dp. `gemm` is the
// S/dP GEMM with its fragments and copies bound (bind_gemm_ss); sQ, sK, sdO, sV its partitioned operands.
// kKeepAtoms: how the GEMM's warps meet the dropout draw's 16-column groups (for_each_keep).
template <bool kExtras, int kN, int kKeepAtoms, class Gemm, class Acc, class SQ, class SK, class SdO, class SV,
          class TC, int kRows>
__forceinline__ __device__ void probs_and_dscores(Gemm const& gemm, Acc& acc_s, Acc& acc_dp, SQ const& sQ,
                                                  SK const& sK, SdO const& sdO, SV const& sV, TC const& coords,
                                                  const BwdParams& p, const BatchMask& bm, bool segments,
                                                  int64_t m0, int64_t m_end, int64_t n0, const float (&lse2)[kRows],
                                                  const float (&delta)[kRows], float score_log2,
                                                  const BwdExtras& extras, uint32_t head) {
  clear(acc_s);
  gemm(acc_s, sQ, sK);
  if (segments || n0 + kN > bm.kv_len || !block_fully_visible(bm.m, m0, m_end, n0, n0 + kN)) {
    recompute_scores<kExtras, true, kN>(acc_s, coords, p, bm, m0, n0);
  } else {
    recompute_scores<kExtras, false, kN>(acc_s, coords, p, bm, m0, n0);
  }
  Tensor s_rc = rowcol(acc_s);
  scores_to_probs(s_rc, lse2, score_log2);
  clear(acc_dp);
  gemm(acc_dp, sdO, sV);
  Tensor dp_rc = rowcol(acc_dp);
  dprobs_to_dscores<kExtras, kKeepAtoms>(dp_rc, s_rc, coords, delta, lse2, extras, head, m0, n0);
}

// ---- 2. dK, dV (and dQ by atomics) -------------------------------------------------------------------

template <class Tr, bool kExtras>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    flash_bwd_dkdv_kernel(const __grid_constant__ BwdParams p, const bool accumulate_dq) {
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x;

  const AttnDims& dims = p.dims;
  const int64_t seqlen_q = dims.seqlen_q, seqlen_k = dims.seqlen_k;
  const int64_t num_n_blocks = (seqlen_k + kN - 1) / kN;
  // K/V blocks of one head are adjacent in launch order: they read the same Q and dO, which stay in L2.
  const int64_t n_block = blockIdx.x % num_n_blocks;
  const int64_t bh = blockIdx.x / num_n_blocks;
  const int64_t head_k = bh % dims.heads_k, batch = bh / dims.heads_k;
  const int64_t group = dims.heads_q / dims.heads_k;
  const int64_t q_row_stride = dims.heads_q * kD, k_row_stride = dims.heads_k * kD;
  const int64_t n0 = n_block * kN;
  const int64_t n_end = cute::min(n0 + int64_t(kN), seqlen_k);

  const BatchMask bm = batch_mask(p.mask, batch, seqlen_q, seqlen_k);
  const int64_t n_valid_end = cute::min(n_end, bm.kv_len);  // keys past kv_len are seen by nobody
  int64_t row_begin, row_end;
  visible_query_range(bm, n0, n_end, &row_begin, &row_end);
  const bool segments = kExtras && bm.q_seg != nullptr;
  if (segments && row_begin < row_end)  // packed documents: only the rows of this block's documents
    narrow_by_ids<Tr::kNThreads>(bm.kv_seg, n0, n_valid_end, bm.q_seg, &row_begin, &row_end,
                                 reinterpret_cast<int*>(smem_raw));
  const int64_t m_block_min = row_begin / kM;
  const int64_t m_block_max = row_end > row_begin ? (row_end + kM - 1) / kM : m_block_min;
  const int64_t n_m = m_block_max - m_block_min;
  const int64_t n_iters = n_m * group;  // every query block of every head of the group

  // 64-bit element offsets: tensors may exceed 2^31 elements.
  const int64_t k_off = batch * seqlen_k * k_row_stride + head_k * kD;
  const int64_t q_batch_off = batch * seqlen_q * q_row_stride;
  const int64_t head0 = head_k * group;

  Tensor mK = gmem_rows<kD>(static_cast<const T*>(p.k) + k_off, seqlen_k, k_row_stride);
  Tensor mV = gmem_rows<kD>(static_cast<const T*>(p.v) + k_off, seqlen_k, k_row_stride);
  Tensor gK = local_tile(mK, typename Tr::TileKV{}, make_coord(n_block, 0));
  Tensor gV = local_tile(mV, typename Tr::TileKV{}, make_coord(n_block, 0));

  T* smem = reinterpret_cast<T*>(smem_raw);
  T* smem_k = smem;
  T* smem_v = smem_k + Tr::kKVElems;
  T* smem_q = smem_v + Tr::kKVElems;
  T* smem_do = smem_q + 2 * Tr::kQElems;
  T* smem_p = smem_do + 2 * Tr::kQElems;
  T* smem_ds = smem_p + Tr::kPElems;
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Tr::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Tr::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Tr::SmemLayoutQ{});  // stage 0
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Tr::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Tr::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Tr::SmemLayoutQt{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Tr::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Tr::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Tr::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Tr::SmemLayoutPdSt{});

  // ---- global -> shared copies ----
  typename Tr::GmemTiledCopy gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(typename Tr::TileKV{}));
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(typename Tr::TileQ{}));
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tQsdO = gmem_thr_copy.partition_D(sdO);

  // (head, m block) of iteration `it`: heads of the group outer, query blocks inner. Each K/V block starts
  // at a different query block (rotation by n_block), so the blocks running side by side add their dQ
  // into different rows of dq_accum instead of all contending for the same addresses.
  const int64_t m_shift = n_m > 0 ? n_block % n_m : 0;
  auto iter_head = [&](int64_t it) { return head0 + it / n_m; };
  auto iter_m_block = [&](int64_t it) {
    const int64_t m = it % n_m + m_shift;
    return m_block_min + (m < n_m ? m : m - n_m);
  };
  auto load_q_do = [&](int64_t it) {
    if (it < n_iters) {
      const int64_t m_block = iter_m_block(it);
      const int64_t q_off = q_batch_off + iter_head(it) * kD;
      Tensor mQ = gmem_rows<kD>(static_cast<const T*>(p.q) + q_off, seqlen_q, q_row_stride);
      Tensor mdO = gmem_rows<kD>(static_cast<const T*>(p.dout) + q_off, seqlen_q, q_row_stride);
      Tensor tQgQ = gmem_thr_copy.partition_S(local_tile(mQ, typename Tr::TileQ{}, make_coord(m_block, 0)));
      Tensor tQgdO = gmem_thr_copy.partition_S(local_tile(mdO, typename Tr::TileQ{}, make_coord(m_block, 0)));
      const int stage_offset = int(it % 2) * Tr::kQElems;
      const int64_t rows_left = bm.q_len - m_block * kM;  // rows past q_len are zero-filled
      copy_rows<true>(gmem_copy, tQgQ, at_offset(tQsQ, stage_offset), tQcQ, rows_left);
      copy_rows<true>(gmem_copy, tQgdO, at_offset(tQsdO, stage_offset), tQcQ, rows_left);
    }
    cp_async_fence();
  };

  copy_rows<true>(gmem_copy, gmem_thr_copy.partition_S(gK), gmem_thr_copy.partition_D(sK), tKVcKV,
                       n_valid_end - n0);
  copy_rows<true>(gmem_copy, gmem_thr_copy.partition_S(gV), gmem_thr_copy.partition_D(sV), tKVcKV,
                       n_valid_end - n0);
  load_q_do(0);  // the first group also carries K and V

  // ---- MMAs and shared -> register copies ----
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmadKV mma_dkv;
  typename Tr::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  // S = Q·Kᵀ and dP = dO·Vᵀ: A (M, D) and B (N, D) both D-contiguous.
  Tensor tSrQ = thr_sdp.partition_fragment_A(shape_only(smem, typename Tr::TileQ{}));
  Tensor tSrK = thr_sdp.partition_fragment_B(shape_only(smem, typename Tr::TileKV{}));
  auto copy_sdp_a = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, mma_sdp);
  auto thr_copy_sdp_a = copy_sdp_a.get_thread_slice(tid);
  auto thr_copy_sdp_b = copy_sdp_b.get_thread_slice(tid);
  Tensor tSsQ = thr_copy_sdp_a.partition_S(sQ);
  Tensor tSsdO = thr_copy_sdp_a.partition_S(sdO);
  Tensor tSsK = thr_copy_sdp_b.partition_S(sK);
  Tensor tSsV = thr_copy_sdp_b.partition_S(sV);
  const auto gemm_sdp = bind_gemm_ss(mma_sdp, tSrQ, tSrK, copy_sdp_a, copy_sdp_b, thr_copy_sdp_a, thr_copy_sdp_b);

  // dV = Pᵀ·dO and dK = dSᵀ·Q: A (N, M) from P/dS and B (D, M) from dO/Q, both read transposed.
  Tensor tKVrPt = thr_dkv.partition_fragment_A(shape_only(smem, Shape<Int<kN>, Int<kM>>{}));
  Tensor tKVrQt = thr_dkv.partition_fragment_B(shape_only(smem, Shape<Int<kD>, Int<kM>>{}));
  auto copy_dkv_a = make_tiled_copy_A(typename Tr::SmemCopyAtomTransposed{}, mma_dkv);
  auto copy_dkv_b = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_copy_dkv_a = copy_dkv_a.get_thread_slice(tid);
  auto thr_copy_dkv_b = copy_dkv_b.get_thread_slice(tid);
  Tensor tKVsPt = thr_copy_dkv_a.partition_S(sPt);
  Tensor tKVsdSt = thr_copy_dkv_a.partition_S(sdSt);
  Tensor tKVsdOt = thr_copy_dkv_b.partition_S(sdOt);
  Tensor tKVsQt = thr_copy_dkv_b.partition_S(sQt);

  // dQ = dS·K: A (M, N) from dS, B (D, N) from K read transposed.
  Tensor tQrdS = thr_dq.partition_fragment_A(shape_only(smem, typename Tr::TileS{}));
  Tensor tQrKt = thr_dq.partition_fragment_B(shape_only(smem, Shape<Int<kD>, Int<kN>>{}));
  auto copy_dq_a = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, mma_dq);
  auto copy_dq_b = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, mma_dq);
  auto thr_copy_dq_a = copy_dq_a.get_thread_slice(tid);
  auto thr_copy_dq_b = copy_dq_b.get_thread_slice(tid);
  Tensor tQsdS = thr_copy_dq_a.partition_S(sdS);
  Tensor tQsKt = thr_copy_dq_b.partition_S(sKt);

  // P and dS: registers -> shared memory in the S accumulator's layout.
  auto copy_pds = make_tiled_copy_C(typename Tr::SmemCopyAtomStore{}, mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tid);
  Tensor tPsP = thr_copy_pds.partition_D(sP);
  Tensor tPsdS = thr_copy_pds.partition_D(sdS);

  Tensor acc_dk = partition_fragment_C(mma_dkv, typename Tr::TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, typename Tr::TileKV{});
  clear(acc_dk);
  clear(acc_dv);

  Tensor tScS = rowcol(thr_sdp.partition_C(make_identity_tensor(typename Tr::TileS{})));  // (row, col) of each score
  constexpr int kRows = decltype(size<0>(tScS))::value;
  Tensor tQcdQ = thr_dq.partition_C(make_identity_tensor(typename Tr::TileQ{}));
  const float score_log2 = (kExtras && p.softcap > 0.f ? 1.f : p.scale) * 1.4426950408889634f;
  const BwdExtras extras = kExtras ? BwdExtras(p, batch) : BwdExtras();

  for (int64_t it = 0; it < n_iters; ++it) {
    const int64_t head = iter_head(it), m_block = iter_m_block(it);
    const int64_t m0 = m_block * kM;
    const int64_t m_end = cute::min(m0 + int64_t(kM), seqlen_q);
    const int stage_offset = int(it % 2) * Tr::kQElems;
    const int64_t stat_off = (batch * dims.heads_q + head) * seqlen_q;

    float lse2[kRows], delta[kRows];
    load_row_stats(tScS, p, bm, stat_off, m0, lse2, delta);

    cp_async_wait<0>();  // Q_it and dO_it (and K, V) landed
    __syncthreads();     // ... for every thread; and every thread is done with stage (it + 1) % 2, P and dS
    load_q_do(it + 1);

    Tensor acc_s = partition_fragment_C(mma_sdp, typename Tr::TileS{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, typename Tr::TileS{});
    // Warps split the key columns too: each atom meets its 16-column group alone.
    probs_and_dscores<kExtras, kN, 1>(gemm_sdp, acc_s, acc_dp, at_offset(tSsQ, stage_offset), tSsK,
                                      at_offset(tSsdO, stage_offset), tSsV, tScS, p, bm, segments, m0, m_end, n0,
                                      lse2, delta, score_log2, extras, uint32_t(head));

    Tensor rP = convert_fragment<T>(acc_s);
    Tensor rdS = convert_fragment<T>(acc_dp);
    copy(copy_pds, thr_copy_pds.retile_S(rP), tPsP);
    copy(copy_pds, thr_copy_pds.retile_S(rdS), tPsdS);
    __syncthreads();

    gemm_ss(acc_dv, tKVrPt, tKVrQt, tKVsPt, at_offset(tKVsdOt, stage_offset), mma_dkv, copy_dkv_a, copy_dkv_b,
            thr_copy_dkv_a, thr_copy_dkv_b);

    if (accumulate_dq) {
      Tensor acc_dq = partition_fragment_C(mma_dq, typename Tr::TileQ{});
      clear(acc_dq);
      gemm_ss(acc_dq, tQrdS, tQrKt, tQsdS, tQsKt, mma_dq, copy_dq_a, copy_dq_b, thr_copy_dq_a, thr_copy_dq_b);
      float* dq_rows = p.dq_accum + q_batch_off + head * kD + m0 * q_row_stride;
      CUTE_UNROLL
      for (int e = 0; e < size(acc_dq); e += 2) {  // (e, e + 1) are adjacent columns of one row
        const int row = get<0>(tQcdQ(e)), col = get<1>(tQcdQ(e));
        if (row < m_end - m0) atomic_add_pair(dq_rows + int64_t(row) * q_row_stride + col, acc_dq(e), acc_dq(e + 1));
      }
    }

    gemm_ss(acc_dk, tKVrPt, tKVrQt, tKVsdSt, at_offset(tKVsQt, stage_offset), mma_dkv, copy_dkv_a, copy_dkv_b,
            thr_copy_dkv_a, thr_copy_dkv_b);
  }
  cp_async_wait<0>();

  // ---- epilogue: dK = scale · dK; stage both through shared memory (K, V's place) for 16-byte stores ----
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); ++e) acc_dk(e) *= p.scale;
  Tensor rdK = convert_fragment<T>(acc_dk);
  Tensor rdV = convert_fragment<T>(acc_dv);
  auto copy_out = make_tiled_copy_C(typename Tr::SmemCopyAtomStore{}, mma_dkv);
  auto thr_copy_out = copy_out.get_thread_slice(tid);
  __syncthreads();  // every warp is done reading K and V
  copy(copy_out, thr_copy_out.retile_S(rdK), thr_copy_out.partition_D(sK));
  copy(copy_out, thr_copy_out.retile_S(rdV), thr_copy_out.partition_D(sV));
  __syncthreads();

  typename Tr::GmemTiledCopyOut gmem_copy_out;
  auto gmem_thr_copy_out = gmem_copy_out.get_thread_slice(tid);
  Tensor mdK = gmem_rows<kD>(static_cast<T*>(p.dk) + k_off, seqlen_k, k_row_stride);
  Tensor mdV = gmem_rows<kD>(static_cast<T*>(p.dv) + k_off, seqlen_k, k_row_stride);
  Tensor tOgdK = gmem_thr_copy_out.partition_D(local_tile(mdK, typename Tr::TileKV{}, make_coord(n_block, 0)));
  Tensor tOgdV = gmem_thr_copy_out.partition_D(local_tile(mdV, typename Tr::TileKV{}, make_coord(n_block, 0)));
  Tensor tOcKV = gmem_thr_copy_out.partition_D(make_identity_tensor(typename Tr::TileKV{}));
  Tensor tOrdK = make_tensor<T>(shape(tOgdK));
  Tensor tOrdV = make_tensor<T>(shape(tOgdV));
  copy(gmem_copy_out, gmem_thr_copy_out.partition_S(sK), tOrdK);
  copy(gmem_copy_out, gmem_thr_copy_out.partition_S(sV), tOrdV);
  copy_rows<false>(gmem_copy_out, tOrdK, tOgdK, tOcKV, seqlen_k - n0);
  copy_rows<false>(gmem_copy_out, tOrdV, tOgdV, tOcKV, seqlen_k - n0);
}

// ---- 3b. dQ without atomics (deterministic mode) -------------------------------------------------------

template <class Tr, bool kExtras>
__global__ void __launch_bounds__(Tr::kNThreads, 1) flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x;

  const int64_t seqlen_q = p.dims.seqlen_q, seqlen_k = p.dims.seqlen_k;
  const QueryBlock qb = this_query_block<kM, kD>(p.dims);

  const BatchMask bm = batch_mask(p.mask, qb.batch, seqlen_q, seqlen_k);
  const int64_t m_valid_end = cute::min(qb.m_end, bm.q_len);
  const bool segments = kExtras && bm.q_seg != nullptr;
  int64_t key_begin, key_end;
  visible_keys<Tr::kNThreads>(bm, qb, segments, reinterpret_cast<int*>(smem_raw), &key_begin, &key_end);
  const int64_t n_block_min = key_begin / kN;
  const int64_t n_block_max = key_end > key_begin ? (key_end + kN - 1) / kN : n_block_min;
  const int64_t n_iters = n_block_max - n_block_min;

  Tensor mQ = gmem_rows<kD>(static_cast<const T*>(p.q) + qb.q_off, seqlen_q, qb.q_row_stride);
  Tensor mdO = gmem_rows<kD>(static_cast<const T*>(p.dout) + qb.q_off, seqlen_q, qb.q_row_stride);
  Tensor mK = gmem_rows<kD>(static_cast<const T*>(p.k) + qb.k_off, seqlen_k, qb.k_row_stride);
  Tensor mV = gmem_rows<kD>(static_cast<const T*>(p.v) + qb.k_off, seqlen_k, qb.k_row_stride);
  Tensor gK = local_tile(mK, typename Tr::TileKV{}, make_coord(_, 0));  // (N, D, n_blocks)
  Tensor gV = local_tile(mV, typename Tr::TileKV{}, make_coord(_, 0));

  T* smem = reinterpret_cast<T*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem + Tr::kQElems), typename Tr::SmemLayoutQ{});
  T* smem_k = smem + 2 * Tr::kQElems;
  T* smem_v = smem_k + 2 * Tr::kKVElems;
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Tr::SmemLayoutKV{});  // stage 0
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Tr::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Tr::SmemLayoutKt{});

  typename Tr::GmemTiledCopy gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(typename Tr::TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(typename Tr::TileKV{}));
  Tensor tKgK = gmem_thr_copy.partition_S(gK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);

  auto load_kv = [&](int64_t i) {
    if (i < n_iters) {
      const int64_t n_block = n_block_min + i;
      const int stage_offset = int(i % 2) * Tr::kKVElems;
      copy_rows<true>(gmem_copy, tKgK(_, _, _, n_block), at_offset(tKsK, stage_offset), tKVcKV,
                           key_end - n_block * kN);
      copy_rows<true>(gmem_copy, tVgV(_, _, _, n_block), at_offset(tVsV, stage_offset), tKVcKV,
                           key_end - n_block * kN);
    }
    cp_async_fence();
  };
  Tensor gQ = local_tile(mQ, typename Tr::TileQ{}, make_coord(qb.m_block, 0));
  Tensor gdO = local_tile(mdO, typename Tr::TileQ{}, make_coord(qb.m_block, 0));
  copy_rows<true>(gmem_copy, gmem_thr_copy.partition_S(gQ), gmem_thr_copy.partition_D(sQ), tQcQ, m_valid_end - qb.m0);
  copy_rows<true>(gmem_copy, gmem_thr_copy.partition_S(gdO), gmem_thr_copy.partition_D(sdO), tQcQ, m_valid_end - qb.m0);
  load_kv(0);

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(shape_only(smem, typename Tr::TileQ{}));
  Tensor tSrK = thr_mma.partition_fragment_B(shape_only(smem, typename Tr::TileKV{}));
  Tensor tQrKt = thr_mma.partition_fragment_B(shape_only(smem, Shape<Int<kD>, Int<kN>>{}));
  auto copy_a = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, mma);
  auto copy_b = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, mma);
  auto copy_bt = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, mma);
  auto thr_copy_a = copy_a.get_thread_slice(tid);
  auto thr_copy_b = copy_b.get_thread_slice(tid);
  auto thr_copy_bt = copy_bt.get_thread_slice(tid);
  Tensor tSsQ = thr_copy_a.partition_S(sQ);
  Tensor tSsdO = thr_copy_a.partition_S(sdO);
  Tensor tSsK = thr_copy_b.partition_S(sK);
  Tensor tSsV = thr_copy_b.partition_S(sV);
  Tensor tQsKt = thr_copy_bt.partition_S(sKt);
  const auto gemm_sdp = bind_gemm_ss(mma, tSrQ, tSrK, copy_a, copy_b, thr_copy_a, thr_copy_b);

  Tensor acc_dq = partition_fragment_C(mma, typename Tr::TileQ{});
  clear(acc_dq);
  Tensor tScS = rowcol(thr_mma.partition_C(make_identity_tensor(typename Tr::TileS{})));
  constexpr int kRows = decltype(size<0>(tScS))::value;
  float lse2[kRows], delta[kRows];
  load_row_stats(tScS, p, bm, qb.stat_off, qb.m0, lse2, delta);
  const float score_log2 = (kExtras && p.softcap > 0.f ? 1.f : p.scale) * 1.4426950408889634f;
  const BwdExtras extras = kExtras ? BwdExtras(p, qb.batch) : BwdExtras();

  for (int64_t i = 0; i < n_iters; ++i) {
    const int64_t n0 = (n_block_min + i) * kN;
    const int stage_offset = int(i % 2) * Tr::kKVElems;
    cp_async_wait<0>();
    __syncthreads();
    load_kv(i + 1);

    Tensor acc_s = partition_fragment_C(mma, typename Tr::TileS{});
    Tensor acc_dp = partition_fragment_C(mma, typename Tr::TileS{});
    // Warps split the query rows only: a thread's atoms pair up into 16-column groups.
    probs_and_dscores<kExtras, kN, 2>(gemm_sdp, acc_s, acc_dp, tSsQ, at_offset(tSsK, stage_offset), tSsdO,
                                      at_offset(tSsV, stage_offset), tScS, p, bm, segments, qb.m0, qb.m_end, n0,
                                      lse2, delta, score_log2, extras, uint32_t(qb.head));

    Tensor rdS = convert_fragment<T>(acc_dp);
    Tensor tQrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
    gemm_rs(acc_dq, tQrdS, tQrKt, at_offset(tQsKt, stage_offset), mma, copy_bt, thr_copy_bt);
  }
  cp_async_wait<0>();

  // dq_accum = dS·K (fp32, the atomic mode's workspace meaning); dq = scale · dS·K.
  Tensor tQcdQ = thr_mma.partition_C(make_identity_tensor(typename Tr::TileQ{}));
  float* acc_rows = p.dq_accum + qb.q_off + qb.m0 * qb.q_row_stride;
  T* dq_rows = static_cast<T*>(p.dq) + qb.q_off + qb.m0 * qb.q_row_stride;
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dq); e += 2) {
    const int row = get<0>(tQcdQ(e)), col = get<1>(tQcdQ(e));
    if (row < qb.m_end - qb.m0) {
      const int64_t off = int64_t(row) * qb.q_row_stride + col;
      *reinterpret_cast<float2*>(acc_rows + off) = make_float2(acc_dq(e), acc_dq(e + 1));
      alignas(4) T pair[2] = {T(acc_dq(e) * p.scale), T(acc_dq(e + 1) * p.scale)};
      *reinterpret_cast<uint32_t*>(dq_rows + off) = *reinterpret_cast<const uint32_t*>(pair);
    }
  }
}

}  // namespace jaxflash::sm80
