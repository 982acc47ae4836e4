// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, sm_80 and later), CuTe.
//
// Computes, for every (batch b, query head h, query row i):
//   o[b, i, h, :] = softmax_j(scale · q[b,i,h,:]·k[b,j,hk,:], j visible to i) · v[b, :, hk, :]
//   lse[b, h, i]  = log Σ_{j visible} exp(scale · q·k)          (natural log; −inf when no j is visible)
// with hk = h / (Hq / Hk) (GQA/MQA by index). Layouts (params.h): q, o [B, Sq, Hq, D]; k, v [B, Sk, Hk, D];
// lse [B, Hq, Sq] float32. Visibility comes from mask.h only (through mask_tile.cuh). With a softcap c the
// scores are c·tanh(scale·q·k / c); with dropout the kept probabilities are scaled by keep_scale (philox.h)
// before P·V, and the LSE stays that of the undropped softmax. The LSE is the residual the backward pass uses to
// recompute P = exp(score − LSE) without a second softmax.
//
// One thread block owns kBlockM query rows of one (b, h) and loops over the visible K/V blocks, last to
// first, so the blocks that need the per-element mask (the sequence tail, the causal diagonal) come first
// and the rest run predicate-free. Q stays in shared memory; K and V blocks stream through kStages
// shared-memory buffers each with cp.async; S and P never leave registers; O is written once.
#pragma once

#include "kernel_common.cuh"
#include "traits.cuh"

namespace jaxflash::sm80 {

using namespace cute;

template <class Element_, int kHeadDim_>
struct FwdTraits : OperandTraits<Element_, kHeadDim_, TileConfig<kHeadDim_>::kBlockM, TileConfig<kHeadDim_>::kBlockN,
                                 TileConfig<kHeadDim_>::kNWarps * 32> {
  using Base = OperandTraits<Element_, kHeadDim_, TileConfig<kHeadDim_>::kBlockM, TileConfig<kHeadDim_>::kBlockN,
                             TileConfig<kHeadDim_>::kNWarps * 32>;
  static constexpr int kStages = TileConfig<kHeadDim_>::kStages;
  // Two resident blocks per SM when four warps (<= 255 registers each); eight-warp tiles keep 255 too.
  static constexpr int kMinBlocksPerSm = Base::kNWarps == 4 ? 2 : 1;
  static_assert(Base::kBlockM % (16 * Base::kNWarps) == 0, "each warp owns whole 16-row MMA tiles of Q");
  static_assert(Base::kBlockN % 16 == 0 && kHeadDim_ % 32 == 0);
  static_assert(kStages >= 1);

  using TiledMma = typename Base::TiledMmaRows;
  // V seen as Vᵀ (D x N) for the B operand of P·V, read with ldmatrix.trans.
  using SmemLayoutVt = typename Base::template Transposed<typename Base::SmemLayoutKV, Base::kBlockN, kHeadDim_>;
  using SmemLayoutVtShape = Layout<Shape<Int<kHeadDim_>, Int<Base::kBlockN>>>;  // only to size register fragments
  static constexpr int kSmemBytes = (Base::kQElems + 2 * kStages * Base::kKVElems) * int(sizeof(Element_));
};

// ---- the kernel ------------------------------------------------------------------------------------
// Masks come from mask_tile.cuh. kExtras compiles in segment ids, softcap and dropout: the variant without
// them (windows, lengths and causal need no extras) keeps the registers of the plain kernel.
template <class Tr, bool kExtras>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocksPerSm)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim, kStages = Tr::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x;

  const int64_t seqlen_q = p.dims.seqlen_q, seqlen_k = p.dims.seqlen_k;
  const QueryBlock qb = this_query_block<kM, kD>(p.dims);
  float* lse_row = p.lse + qb.stat_off + qb.m0;

  Tensor mO = gmem_rows<kD>(static_cast<T*>(p.o) + qb.q_off, seqlen_q, qb.q_row_stride);
  Tensor gO = local_tile(mO, typename Tr::TileQ{}, make_coord(qb.m_block, 0));
  Tensor cQ = make_identity_tensor(typename Tr::TileQ{});  // (row, col) inside the Q/O tile
  typename Tr::GmemTiledCopyOut gmem_copy_o;
  auto gmem_thr_copy_o = gmem_copy_o.get_thread_slice(tid);
  Tensor tOgO = gmem_thr_copy_o.partition_D(gO);
  Tensor tOcO = gmem_thr_copy_o.partition_D(cQ);

  const BatchMask bm = batch_mask(p.mask, qb.batch, seqlen_q, seqlen_k);
  const int64_t m_valid_end = cute::min(qb.m_end, bm.q_len);  // rows past q_len see nothing
  const bool segments = kExtras && bm.q_seg != nullptr;
  int64_t key_begin, key_end;
  visible_keys<Tr::kNThreads>(bm, qb, segments, reinterpret_cast<int*>(smem_raw), &key_begin, &key_end);
  const int n_block_min = int(key_begin / kN);
  const int n_block_max = key_end > key_begin ? int((key_end + kN - 1) / kN) : n_block_min;
  const int n_iters = n_block_max - n_block_min;

  if (n_iters <= 0) {  // no row of this block sees any key: O = 0, LSE = −inf
    Tensor zeros = make_tensor<T>(shape(tOgO));
    clear(zeros);
    copy_rows</*kZeroFill=*/false>(gmem_copy_o, zeros, tOgO, tOcO, qb.m_end - qb.m0);
    for (int r = tid; r < qb.m_end - qb.m0; r += Tr::kNThreads) lse_row[r] = -INFINITY;
    return;
  }

  // ---- global and shared tiles ----
  Tensor mQ = gmem_rows<kD>(static_cast<const T*>(p.q) + qb.q_off, seqlen_q, qb.q_row_stride);
  Tensor mK = gmem_rows<kD>(static_cast<const T*>(p.k) + qb.k_off, seqlen_k, qb.k_row_stride);
  Tensor mV = gmem_rows<kD>(static_cast<const T*>(p.v) + qb.k_off, seqlen_k, qb.k_row_stride);
  Tensor gQ = local_tile(mQ, typename Tr::TileQ{}, make_coord(qb.m_block, 0));  // (M, D)
  Tensor gK = local_tile(mK, typename Tr::TileKV{}, make_coord(_, 0));           // (N, D, n_blocks)
  Tensor gV = local_tile(mV, typename Tr::TileKV{}, make_coord(_, 0));

  T* smem = reinterpret_cast<T*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem + Tr::kQElems), typename Tr::SmemLayoutKV{});  // stage 0
  T* smem_v = smem + Tr::kQElems + kStages * Tr::kKVElems;
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Tr::SmemLayoutVt{});
  Tensor sVtShape = make_tensor(make_smem_ptr(smem_v), typename Tr::SmemLayoutVtShape{});

  typename Tr::GmemTiledCopy gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tQcQ = gmem_thr_copy.partition_S(cQ);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_D, n_blocks)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(typename Tr::TileKV{}));

  typename Tr::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);         // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);         // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtShape);  // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, typename Tr::TileQ{});
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Tr::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Tr::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Tr::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);

  // (row, col) inside the block of each score this thread holds, for the mask.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(typename Tr::TileS{}));

  // ---- the K/V pipeline ----
  // Block i of the loop is n_block_max − 1 − i; its K and V live in stage i % kStages. Commit groups go
  // out in the order [Q+K_0], V_0, K_1, V_1, ...; iteration i issues V_{i+S−1} once every thread is past
  // P·V_{i−1} and K_{i+S} once every thread is past Q·K_iᵀ. So 2(S−1) groups may still be in flight when
  // K_i or V_i is needed. Empty groups are committed past the end to keep that count exact.
  // Only the first block of the loop (the highest, which may hold the end of the visible keys) can be
  // partial: every later one is full and is copied without row predicates or zero-fill. Keys past the
  // visible range are zero-filled, never read (past kv_len they may hold anything, even NaN).
  auto load_kv = [&](auto const& tXgX, auto const& tXsX, int i) {
    if (i < n_iters) {
      const int n_block = n_block_max - 1 - i;
      Tensor dst = at_offset(tXsX, (i % kStages) * Tr::kKVElems);
      if (i == 0) {
        copy_rows</*kZeroFill=*/true>(gmem_copy, tXgX(_, _, _, n_block), dst, tKVcKV,
                                      key_end - int64_t(n_block) * kN);
      } else {
        copy(gmem_copy, tXgX(_, _, _, n_block), dst);
      }
    }
    cp_async_fence();
  };
  auto load_k = [&](int i) { load_kv(tKgK, tKsK, i); };
  auto load_v = [&](int i) { load_kv(tVgV, tVsV, i); };

  copy_rows</*kZeroFill=*/true>(gmem_copy, tQgQ, tQsQ, tQcQ, m_valid_end - qb.m0);
  load_k(0);  // the first group also carries Q
  CUTE_UNROLL
  for (int s = 0; s + 1 < kStages; ++s) {
    load_v(s);
    load_k(s + 1);
  }

  constexpr int kInFlight = 2 * (kStages - 1);
  const float softcap = kExtras ? p.softcap : 0.f;
  // The softmax sees scale·S, or the soft-capped scores, which are already scaled; exp(x) = exp2(x·log2 e).
  const float score_scale = softcap > 0.f ? 1.f : p.scale;
  const float scale_log2 = score_scale * 1.4426950408889634f;
  const bool dropout = kExtras && p.dropout.rate > 0.f;
  const DropoutDraw draw = dropout ? dropout_draw(p.dropout, qb.batch) : DropoutDraw{};
  constexpr int kRows = 2 * decltype(size<1>(acc_o))::value;  // query rows this thread holds
  OnlineSoftmax<kRows> softmax;

  // Only blocks that straddle the sequence end or the mask boundary pay the per-element predicate.
  // With segment ids every block is masked (its ids are only known element by element).
  auto block_needs_mask = [&](int i) {
    const int64_t n0 = int64_t(n_block_max - 1 - i) * kN;
    return segments || n0 + kN > bm.kv_len || qb.m_end > bm.q_len ||
           !block_fully_visible(bm.m, qb.m0, qb.m_end, n0, n0 + kN);
  };
  auto iteration = [&](int i, auto masked) __attribute__((always_inline)) {
    const int n_block = n_block_max - 1 - i;
    const int64_t n0 = int64_t(n_block) * kN;
    const int stage_offset = (i % kStages) * Tr::kKVElems;

    cp_async_wait<kInFlight>();  // K_i (and Q) landed
    __syncthreads();
    load_v(i + kStages - 1);

    Tensor acc_s = partition_fragment_C(tiled_mma, typename Tr::TileS{});
    clear(acc_s);
    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, at_offset(tSsK, stage_offset), tiled_mma, smem_copy_q, smem_copy_k,
            smem_thr_copy_q, smem_thr_copy_k);

    cp_async_wait<kInFlight>();  // V_i landed
    __syncthreads();
    load_k(i + kStages);

    if (softcap > 0.f) softcap_scores(acc_s, p.scale, softcap);
    Tensor s_rc = rowcol(acc_s);
    Tensor c_rc = rowcol(tScS);
    if constexpr (decltype(masked)::value) mask_scores<kN, kExtras>(s_rc, c_rc, bm, qb.m0, n0);

    Tensor o_rc = rowcol(acc_o);
    softmax.update(s_rc, o_rc, scale_log2);  // the row sums see P before dropout: the LSE is undropped
    if (dropout) {
      for_each_keep<2>(c_rc, draw, uint32_t(qb.head), qb.m0, n0, [&](int r, int c, bool keep) {
        if (!keep) s_rc(r, c) = 0.f;
      });
    }

    Tensor rP = convert_fragment<T>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
    gemm_rs(acc_o, tOrP, tOrVt, at_offset(tOsVt, stage_offset), tiled_mma, smem_copy_v, smem_thr_copy_v);
  };

  // Blocks run from the last to the first: the masked ones (sequence tail, causal diagonal) come first,
  // then a predicate-free run (and, for a left window bound, masked ones again). Separate loops keep the
  // mask's registers out of the predicate-free one.
  for (int i = 0; i < n_iters;) {
    for (; i < n_iters && block_needs_mask(i); ++i) iteration(i, std::true_type{});
    for (; i < n_iters && !block_needs_mask(i); ++i) iteration(i, std::false_type{});
  }
  cp_async_wait<0>();

  // ---- epilogue: normalise, stage O through shared memory for 16-byte stores, write O and LSE ----
  float lse[kRows];
  {
    Tensor o_rc = rowcol(acc_o);
    softmax.finalize(o_rc, score_scale, dropout ? p.dropout.keep_scale : 1.f, lse);
  }
  Tensor rO = convert_fragment<T>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Tr::SmemLayoutQ{});
  auto smem_copy_o = make_tiled_copy_C(typename Tr::SmemCopyAtomStore{}, tiled_mma);
  auto smem_thr_copy_o = smem_copy_o.get_thread_slice(tid);
  Tensor taccOrO = smem_thr_copy_o.retile_S(rO);
  Tensor taccOsO = smem_thr_copy_o.partition_D(sO);
  __syncthreads();  // every warp is done reading sQ
  copy(smem_copy_o, taccOrO, taccOsO);
  __syncthreads();
  Tensor tOsO = gmem_thr_copy_o.partition_S(sO);
  Tensor tOrO = make_tensor<T>(shape(tOgO));
  copy(gmem_copy_o, tOsO, tOrO);
  copy_rows</*kZeroFill=*/false>(gmem_copy_o, tOrO, tOgO, tOcO, qb.m_end - qb.m0);

  Tensor tOcO_acc = rowcol(thr_mma.partition_C(cQ));  // (row, col) of this thread's O rows
  if (get<1>(tOcO_acc(0, 0)) == 0) {                   // one thread of each quad writes the row's LSE
    CUTE_UNROLL
    for (int r = 0; r < size<0>(tOcO_acc); ++r) {
      const int row = get<0>(tOcO_acc(r, 0));
      if (row < qb.m_end - qb.m0) lse_row[row] = lse[r];
    }
  }
}

}  // namespace jaxflash::sm80
