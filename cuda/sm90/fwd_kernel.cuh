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
//                    warpgroup's softmax hides under the other's GEMMs. O leaves through shared memory and
//                    one TMA store per consumer where shared memory allows (d=64, 128).
// kSplit (tiles that cost alike): the tiles are taken round robin but for the last ones, whose K/V blocks are
// shared out between all blocks (schedule.h); a piece of a tile leaves its partial state in the workspace, and
// the last piece to finish merges them. Its own instantiation, so that the kernel without it stays as it was.
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
#include "schedule.h"
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
  typename Tr::TmaO tma_o;  // used when Tr::kStoreOViaSmem
  TailSchedule tail;        // which tiles are taken whole and how the rest are split (schedule.h)
};

template <class Tr>
struct FwdSharedStorage {
  using T = typename Tr::Element;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> k;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> v;
  // Each consumer's 64 rows of O on their way out (a token size when O is stored from registers).
  array_aligned<T, Tr::kStoreOViaSmem ? 2 * cosize_v<typename Tr::SmemLayoutO> : 8, 1024> o;
  uint64_t q_full, q_empty;  // Q is reloaded per tile once both consumers are past their last Q·Kᵀ
  uint64_t k_full[Tr::kStages], k_empty[Tr::kStages];
  uint64_t v_full[Tr::kStages], v_empty[Tr::kStages];
  uint64_t v_partial;  // the partial V block lands here first, to be cleaned before v_full
  // Dropout drawn ahead (Tr::kKeepsAhead): per consumer and K/V stage, its 64 rows' keep words (mask_tile.cuh)
  array_aligned<uint32_t, Tr::kKeepsAhead ? 2 * Tr::kStages * 64 * Tr::kKeepWordsPerRow : 4, 16> keeps;
  uint64_t keeps_full[2][Tr::kStages], keeps_empty[2][Tr::kStages];
  int scratch[4];      // narrow_by_ids
  int64_t first_keys[2];  // the first tile's key range after narrowing by segment ids
  bool first_pure;        // and whether the ids hide nothing inside it
  int last_piece[2];      // per consumer: whether this piece of a split tile finished the tile
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

// A thread's rows of an accumulator (rowcol view, as wgmma leaves it: pairs of adjacent columns, 8 columns
// apart) times scale, as T, into a (row, col) tile of shared memory swizzled in 128-byte rows (64 columns of a
// 2-byte T). A row's pairs lie 16 bytes apart, eight to a swizzled row: pair j is at the first one's address
// with bits 4-6 XOR j, one address per 64 columns instead of per pair. Each store of a warp covers 8 rows at
// distinct 16-byte chunks: no bank conflicts.
template <class T, class AccRC, class CoordRC, class SmemTensor>
__forceinline__ __device__ void store_sw128_rows(AccRC const& acc_rc, CoordRC const& c_rc, SmemTensor&& s,
                                                 int row_offset, float scale) {
  static_assert(sizeof(T) == 2 && decltype(size<1>(acc_rc))::value % 16 == 0,
                "a thread's pairs must fill whole 128-byte rows");
  CUTE_UNROLL
  for (int r = 0; r < size<0>(acc_rc); ++r) {
    int row = get<0>(c_rc(r, 0)) - row_offset;
    asm volatile("" : "+r"(row));  // addresses recomputed here, not hoisted into registers
    uint32_t addr0 = 0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc_rc); c += 2) {
      const int j = c / 2 % 8;
      if (j == 0) addr0 = cast_smem_ptr_to_uint(&s(row, get<1>(c_rc(r, c))));
      cutlass::Array<T, 2> pair;
      pair[0] = T(acc_rc(r, c) * scale);
      pair[1] = T(acc_rc(r, c + 1) * scale);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr0 ^ uint32_t(j << 4)),
                   "r"(*reinterpret_cast<const uint32_t*>(&pair)));
    }
  }
}

// One work tile: kBlockM query rows of one (batch, head) and the K/V blocks they can see.
struct FwdTile {
  int64_t m_block, head, batch, head_k;
  int64_t m0, m_end;
  int64_t key_begin, key_end;  // visible keys; narrowed by segment ids before the roles split
  bool pure = false;           // segment ids: one id for every row and every key of [key_begin, key_end)
  BatchMask bm;
  int n_block_min, n_block_max;

  __device__ int n_iters() const { return n_block_max - n_block_min; }
};

// Tiles are numbered with the m-blocks of one (batch, head) adjacent (they share K/V in L2) and the
// heaviest causal block of each first, so the light ones fill the end of the grid.
template <int kM, int kN>
__device__ FwdTile fwd_tile(const FwdParams& p, int64_t tile) {
  const AttnDims& d = p.dims;
  const int64_t num_m_blocks = (d.seqlen_q + kM - 1) / kM;
  FwdTile t;
  t.m_block = num_m_blocks - 1 - tile % num_m_blocks;
  const int64_t bh = tile / num_m_blocks;
  t.head = bh % d.heads_q;
  t.batch = bh / d.heads_q;
  t.head_k = t.head / (d.heads_q / d.heads_k);
  t.m0 = t.m_block * kM;
  t.m_end = cute::min(t.m0 + int64_t(kM), d.seqlen_q);
  t.bm = batch_mask(p.mask, t.batch, d.seqlen_q, d.seqlen_k);
  visible_key_range(t.bm, t.m0, t.m_end, &t.key_begin, &t.key_end);
  return t;
}

__device__ inline void set_block_range(FwdTile& t, int kN) {
  t.n_block_min = int(t.key_begin / kN);
  t.n_block_max = t.key_end > t.key_begin ? int((t.key_end + kN - 1) / kN) : t.n_block_min;
}

// Persistent when the grid is smaller than the number of tiles: block b takes tiles b, b + grid, ...; the
// producer then loads the next tile's Q and K while the consumers finish the current one. Segment ids narrow
// a tile's key range with the whole block's help before the roles split, so with them the launcher gives
// every tile its own block.
// kDropout (implies kExtras): an instantiation of its own, so that the softcap and segment-id kernel carries
// none of dropout's code and the drawing kernel has its own register split.
template <class Tr, bool kExtras, bool kSplit, bool kDropout>
__global__ void __launch_bounds__(Tr::kNThreads, 1) flash_fwd_kernel(const __grid_constant__ FwdKernelParams<Tr> kp) {
  static_assert(kExtras || !kDropout);
  constexpr bool kKeepsAhead = Tr::kKeepsAhead && kDropout;  // drawn by the producer's idle warps
  // Else drawn by the consumer quads and applied to the converted P pairs (d=128: 4.60 -> 4.32 ms at S=16k);
  // d=256 (80-key blocks) keeps the per-score select, untested on a GPU in the packed form.
  constexpr bool kQuadDraws = kDropout && !kKeepsAhead && Tr::kBlockN % 64 == 0;
  constexpr int kProducerRegs = kKeepsAhead ? Tr::kDrawProducerRegs : Tr::kProducerRegs;
  constexpr int kConsumerRegs = kKeepsAhead ? Tr::kDrawConsumerRegs : Tr::kConsumerRegs;
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim, kStages = Tr::kStages;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<FwdSharedStorage<Tr>*>(smem_raw);
  const FwdParams& p = kp.p;
  const AttnDims& dims = p.dims;
  const int tid = threadIdx.x;
  const int warp_group = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int64_t seqlen_q = dims.seqlen_q, seqlen_k = dims.seqlen_k;
  const int64_t num_tiles = (seqlen_q + kM - 1) / kM * dims.heads_q * dims.batch;
  const int64_t q_row_stride = dims.heads_q * kD;

  if (tid == 0) {
    ClusterTransactionBarrier::init(&ss.q_full, 1);
    ClusterBarrier::init(&ss.q_empty, Tr::kMmaWarpGroups);
    ClusterTransactionBarrier::init(&ss.v_partial, 1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      ClusterTransactionBarrier::init(&ss.k_full[s], 1);
      ClusterTransactionBarrier::init(&ss.v_full[s], 1);
      ClusterBarrier::init(&ss.k_empty[s], Tr::kMmaWarpGroups);
      ClusterBarrier::init(&ss.v_empty[s], Tr::kMmaWarpGroups);
      CUTE_UNROLL
      for (int w = 0; w < 2; ++w) {
        ClusterBarrier::init(&ss.keeps_full[w][s], 32);    // every lane of the drawing warp
        ClusterBarrier::init(&ss.keeps_empty[w][s], 128);  // every thread of the consumer, after its loads
      }
    }
  }
  // Producer and consumers must agree on every tile's block range exactly, or a barrier phase drifts.
  const bool segments = kExtras && p.mask.q_segment_ids != nullptr;
  if (segments) {
    FwdTile t = fwd_tile<kM, kN>(p, blockIdx.x);
    if (t.key_begin < t.key_end)
      narrow_by_ids<Tr::kNThreads>(t.bm.q_seg, t.m0, cute::min(t.m_end, t.bm.q_len), t.bm.kv_seg, &t.key_begin,
                                   &t.key_end, ss.scratch, &t.pure);
    if (tid == 0) {
      ss.first_keys[0] = t.key_begin;
      ss.first_keys[1] = t.key_end;
      ss.first_pure = t.pure;
    }
  }
  auto tile_at = [&](int64_t tile) {
    FwdTile t = fwd_tile<kM, kN>(p, tile);
    if (segments && tile == blockIdx.x) {
      t.key_begin = ss.first_keys[0];
      t.key_end = ss.first_keys[1];
      t.pure = ss.first_pure;
    }
    set_block_range(t, kN);
    return t;
  };
  // Unit `step` of this block: tile blockIdx.x + step·gridDim.x, or (kSplit) the schedule's; a piece of a
  // split tile sees only its K/V blocks.
  auto next_unit = [&](uint32_t step, FwdUnit* u) {
    if constexpr (kSplit) {
      return fwd_unit(kp.tail, blockIdx.x, gridDim.x, step, u);
    } else {
      u->tile = uint32_t(blockIdx.x + int64_t(step) * gridDim.x);
      return blockIdx.x + int64_t(step) * gridDim.x < num_tiles;
    }
  };
  auto unit_tile = [&](const FwdUnit& u) {
    FwdTile t = tile_at(u.tile);
    if (kSplit && u.block_lo >= 0) {
      t.n_block_min = u.block_lo;
      t.n_block_max = u.block_hi;
      t.key_begin = cute::max(t.key_begin, int64_t(u.block_lo) * kN);
      t.key_end = cute::min(t.key_end, int64_t(u.block_hi) * kN);
    }
    return t;
  };
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{});
  // K/V stages and their barrier phases run on across tiles: `it` counts the blocks loaded so far.
  auto stage_of = [](int it) { return it % kStages; };
  auto parity_of = [](int it) { return uint32_t((it / kStages) & 1); };
  const bool dropout = kDropout && p.dropout.rate > 0.f;
  auto keeps_of = [&](int consumer, int stage) {
    return ss.keeps.data() + (consumer * kStages + stage) * 64 * Tr::kKeepWordsPerRow;
  };

  if (warp_group == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (tid >= 32) {
      // Warps 1-3 draw dropout: block `it`'s draw for consumer w falls to warp 1 + (2·it + w) % 3, each lane
      // drawing two of the 64 rows, into that consumer's slot of the block's stage.
      if (!(kKeepsAhead && dropout)) return;
      const int helper = tid / 32 - 1, lane = tid % 32;
      int it = 0;
      FwdUnit u;
      for (uint32_t step = 0; next_unit(step, &u); ++step) {
        const FwdTile t = unit_tile(u);
        const int n_iters = t.n_iters();
        if (n_iters <= 0) continue;
        const DropoutDraw draw = dropout_draw(p.dropout, t.batch);
        for (int i = 0; i < n_iters; ++i, ++it) {
          const uint32_t g0 = uint32_t(t.n_block_max - 1 - i) * uint32_t(Tr::kKeepGroups);
          for (int w = 0; w < 2; ++w) {
            if ((2 * it + w) % 3 != helper) continue;
            const int stage = stage_of(it);
            ClusterBarrier::wait(&ss.keeps_empty[w][stage], parity_of(it) ^ 1);
            uint4* slot = reinterpret_cast<uint4*>(keeps_of(w, stage));
            const uint32_t row0 = uint32_t(t.m0 + 64 * w + lane), rows[2] = {row0, row0 + 32};
            draw_row_keeps<Tr::kKeepGroups>(draw, uint32_t(t.head), rows, g0, [&](int k, int word, uint4 v) {
              slot[(lane + 32 * k) * (Tr::kKeepWordsPerRow / 4) + word] = v;
            });
            ClusterBarrier::arrive(&ss.keeps_full[w][stage]);
          }
        }
      }
      return;
    }
    const int lane = tid;
    auto gmem_shape = [&](int64_t rows, int64_t heads) {
      return make_shape(int32_t(rows), Int<kD>{}, int32_t(heads), int32_t(dims.batch));
    };
    Tensor mQ = kp.tma_q.get_tma_tensor(gmem_shape(seqlen_q, dims.heads_q));
    Tensor mK = kp.tma_k.get_tma_tensor(gmem_shape(seqlen_k, dims.heads_k));
    Tensor mV = kp.tma_v.get_tma_tensor(gmem_shape(seqlen_k, dims.heads_k));
    int it = 0, tiles_done = 0, partials_done = 0;
    FwdUnit u;
    for (uint32_t step = 0; next_unit(step, &u); ++step) {
      const FwdTile t = unit_tile(u);
      const int n_iters = t.n_iters();
      if (n_iters <= 0) continue;  // the consumers write zeros; no barrier is touched
      Tensor gQ = local_tile(mQ(_, _, int32_t(t.head), int32_t(t.batch)), typename Tr::TileQ{},
                             make_coord(int32_t(t.m_block), _0{}));
      Tensor gK = local_tile(mK(_, _, int32_t(t.head_k), int32_t(t.batch)), typename Tr::TileKV{}, make_coord(_, _0{}));
      Tensor gV = local_tile(mV(_, _, int32_t(t.head_k), int32_t(t.batch)), typename Tr::TileKV{}, make_coord(_, _0{}));
      auto [tQg, tQs] = tma_partition(kp.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKg, tKs] = tma_partition(kp.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVg, tVs] = tma_partition(kp.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      if (lane == 0) {
        ClusterBarrier::wait(&ss.q_empty, (tiles_done & 1) ^ 1);  // a fresh barrier counts as released
        ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full, Tr::kQBytes);
        copy(kp.tma_q.with(ss.q_full), tQg, tQs);
      }
      // Rows at or past key_end of the first (highest) block are invisible; inside the tensor they are zeroed.
      const int partial_rows = int(t.key_end - int64_t(t.n_block_max - 1) * kN);
      const bool clean_partial = partial_rows < kN && t.key_end < seqlen_k;
      for (int i = 0; i < n_iters; ++i, ++it) {
        const int n_block = t.n_block_max - 1 - i, stage = stage_of(it);
        const uint32_t free_parity = parity_of(it) ^ 1;
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
          ClusterBarrier::wait(&ss.v_partial, partials_done++ & 1);
          Tensor v = sV(_, _, stage);
          // 16-byte chunks: the swizzle moves whole chunks, so each stays contiguous.
          constexpr int kChunksPerRow = kD * int(sizeof(T)) / 16;
          for (int c = lane; c < (kN - partial_rows) * kChunksPerRow; c += 32)
            *reinterpret_cast<uint4*>(&v(partial_rows + c / kChunksPerRow, (c % kChunksPerRow) * (16 / sizeof(T)))) =
                make_uint4(0, 0, 0, 0);
          cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by wgmma
          __syncwarp();
          if (lane == 0) ClusterBarrier::arrive(&ss.v_full[stage]);
        } else if (lane == 0) {
          ClusterTransactionBarrier::arrive_and_expect_tx(&ss.v_full[stage], Tr::kKVBytes);
          copy(kp.tma_v.with(ss.v_full[stage]), tVg(_, n_block), tVs(_, stage));
        }
      }
      ++tiles_done;
    }
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int mma_tid = tid - 128;
  const int wg = warp_group - 1;  // 0 or 1
  const bool releaser = mma_tid % 128 == 0;
  // Pingpong: before each GEMM batch of the block loop a consumer waits on its own named barrier, and it
  // signals the other's right after. The handshake runs on across tiles (consumer 0 goes first once; consumer
  // 1's last signal is taken after the tile loop) and a tile's S_0 stays outside it, so a consumer starts its
  // next tile once Q and K_0 are there while the other still finishes the current one (a handshake restarted
  // per tile held consumer 0 until consumer 1's epilogue: 1-2 % at S = 1k and 16k, measured).
  constexpr uint32_t kBarOStore = 2;  // + wg: a consumer's O tile written (ids 0, 1: the pingpong's)
  auto sched_wait = [&] { NamedBarrier::sync(Tr::kMmaThreads, wg); };
  auto sched_signal = [&] { NamedBarrier::arrive(Tr::kMmaThreads, 1 - wg); };

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
  Tensor c_rc = rowcol(thr_qk.partition_C(make_identity_tensor(typename Tr::TileS{})));  // (row, col) in the tile
  Tensor oc_rc = rowcol(thr_pv.partition_C(make_identity_tensor(typename Tr::TileQ{})));
  Tensor s_rc = rowcol(acc_s);
  Tensor p_rc = rowcol(rP);
  Tensor o_rc = rowcol(acc_o);
  constexpr int kRows = decltype(size<0>(s_rc))::value;

  const float softcap = kExtras ? p.softcap : 0.f;
  const float score_scale = softcap > 0.f ? 1.f : p.scale;
  const float scale_log2 = score_scale * 1.4426950408889634f;
  auto release = [&](uint64_t* bars, int it) {
    if (releaser) ClusterBarrier::arrive(&bars[stage_of(it)]);
  };
  // Once this consumer's last Q·Kᵀ of a tile has landed: the next tile's Q then loads under the last softmax.
  auto release_q = [&] {
    if (releaser) ClusterBarrier::arrive(&ss.q_empty);
  };
  // A piece of a split tile: this thread's partial state (O unnormalised, then its rows' max and sum) into
  // the piece's slot, a thread's 16 bytes next to its neighbours' (coalesced). The consumer that completes
  // its tile's count sums every piece in piece order into softmax and o and returns true; else false.
  auto finish_piece = [&](const FwdUnit& u, OnlineSoftmax<kRows>& sm, auto& o) -> bool {
    static_assert(kRows == 2 && decltype(size<1>(o))::value % 4 == 0);
    constexpr int kCols = decltype(size<1>(o))::value, kStats = kRows * kCols / 4;  // float4 of O per thread
    const TailSchedule& ts = kp.tail;
    auto slot = [&](int index) {
      return reinterpret_cast<float4*>(ts.partials + int64_t(index) * tail_slot_floats(kD)) + mma_tid;
    };
    float4* mine = slot(u.slot);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; c += 4)
        mine[(r * kCols + c) / 4 * kFwdConsumerThreads] = make_float4(o(r, c), o(r, c + 1), o(r, c + 2), o(r, c + 3));
    }
    mine[kStats * kFwdConsumerThreads] = make_float4(sm.row_max[0], sm.row_max[1], sm.row_sum[0], sm.row_sum[1]);
    __threadfence();  // the slot before the count
    NamedBarrier::sync(128, kBarOStore + wg);
    if (releaser) ss.last_piece[wg] = atomicAdd(ts.counters + 2 * u.tail + wg, 1) == u.parts - 1;
    NamedBarrier::sync(128, kBarOStore + wg);
    // Through a shuffle the compiler sees the decision as warp-uniform: a branch on the shared-memory flag
    // itself made the tile loop divergent, and its block indices moved from uniform to vector registers.
    if (!__shfl_sync(0xffffffffu, ss.last_piece[wg], 0)) return false;
    __threadfence();  // the count before the other pieces' slots
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      sm.row_max[r] = -INFINITY;
      sm.row_sum[r] = 0.f;
    }
    clear(acc_o);
    for (int part = 0; part < u.parts; ++part) {
      const float4* from = slot(tail_slot_of(ts, u.tail, part));
      const float4 st = __ldcg(from + kStats * kFwdConsumerThreads);
      const float part_max[2] = {st.x, st.y}, part_sum[2] = {st.z, st.w};
      float keep[2], add[2];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float m = fmaxf(sm.row_max[r], part_max[r]), m_safe = m == -INFINITY ? 0.f : m;
        keep[r] = exp2f((sm.row_max[r] - m_safe) * scale_log2);
        add[r] = exp2f((part_max[r] - m_safe) * scale_log2);
        sm.row_max[r] = m;
        sm.row_sum[r] = sm.row_sum[r] * keep[r] + part_sum[r] * add[r];
      }
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < kCols; c += 4) {
          const float4 v = __ldcg(from + (r * kCols + c) / 4 * kFwdConsumerThreads);
          o(r, c) = o(r, c) * keep[r] + v.x * add[r];
          o(r, c + 1) = o(r, c + 1) * keep[r] + v.y * add[r];
          o(r, c + 2) = o(r, c + 2) * keep[r] + v.z * add[r];
          o(r, c + 3) = o(r, c + 3) * keep[r] + v.w * add[r];
        }
      }
    }
    return true;
  };

  int it = 0, tiles_done = 0;
  if (wg == 1) sched_signal();
  FwdUnit u;
  for (uint32_t step = 0; next_unit(step, &u); ++step) {
    const FwdTile t = unit_tile(u);
    const int n_iters = t.n_iters();
    float* lse_row = p.lse + (t.batch * dims.heads_q + t.head) * seqlen_q + t.m0;
    T* o_base = static_cast<T*>(p.o) + t.batch * seqlen_q * q_row_stride + t.head * kD;
    if (n_iters <= 0) {  // no row of this tile sees any key: O = 0, LSE = −inf
      for (int64_t e = mma_tid; e < (t.m_end - t.m0) * kD; e += Tr::kMmaThreads)
        o_base[(t.m0 + e / kD) * q_row_stride + e % kD] = T(0.f);
      for (int r = mma_tid; r < t.m_end - t.m0; r += Tr::kMmaThreads) lse_row[r] = -INFINITY;
      continue;
    }
    const DropoutDraw draw = dropout ? dropout_draw(p.dropout, t.batch) : DropoutDraw{};
    OnlineSoftmax<kRows> softmax;
    float correction[kRows];
    clear(acc_o);

    // Segment ids need the per-element mask except on a pure tile's blocks that lie inside its key range.
    auto block_needs_mask = [&](int i) {
      const int64_t n0 = int64_t(t.n_block_max - 1 - i) * kN;
      return (segments && !(t.pure && n0 >= t.key_begin && n0 + kN <= t.key_end)) || n0 + kN > t.bm.kv_len ||
             t.m_end > t.bm.q_len || !block_fully_visible(t.bm.m, t.m0, t.m_end, n0, n0 + kN);
    };
    // S_i (raw Q·Kᵀ, landed) -> unnormalised probabilities in s_rc; returns whether a row max moved.
    auto scores_to_probs = [&](int i, auto masked) __attribute__((always_inline)) {
      const int64_t n0 = int64_t(t.n_block_max - 1 - i) * kN;
      if (softcap > 0.f) softcap_scores(acc_s, p.scale, softcap);
      if constexpr (decltype(masked)::value) mask_scores<kN, kExtras>(s_rc, c_rc, t.bm, t.m0, n0);
      const bool moved = softmax.template update_max<Tr::kRescaleSlackLog2>(s_rc, scale_log2, correction);
      softmax.exponentiate(s_rc, scale_log2);  // the row sums see P before dropout: the LSE is undropped
      if (dropout && !kQuadDraws && !kKeepsAhead) {
        for_each_keep<2>(c_rc, draw, uint32_t(t.head), t.m0, n0, [&](int r, int c, bool keep) {
          if (!keep) s_rc(r, c) = 0.f;
        });
      }
      return moved;
    };
    // P_i, converted, with dropout applied: drawn by the quads (kQuadDraws), or read from the drawing warps'
    // slot of block it + i, which is then free again.
    auto to_p = [&](int i) __attribute__((always_inline)) {
      convert_into<T>(acc_s, rP);
      if (!dropout || !(kQuadDraws || kKeepsAhead)) return;
      // Pair (r, 2n), (r, 2n + 1) of P's rowcol view, columns 8n + 2q, +1: one 32-bit register.
      auto pair = [&](int r, int n) -> uint32_t& { return *reinterpret_cast<uint32_t*>(&p_rc(r, 2 * n)); };
      if constexpr (kQuadDraws) {  // the quad draws: the word of group g masks atoms 2g and 2g + 1
        uint32_t rows[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) rows[r] = uint32_t(t.m0 + get<0>(c_rc(r, 0)));
        const uint32_t g0 = uint32_t(t.n_block_max - 1 - i) * uint32_t(kN / 16);
        quad_keep_words<kN / 16>(draw, uint32_t(t.head), rows, g0, [&](int r, int g, uint32_t carry) {
          pair(r, 2 * g) &= keep_pair_mask(carry, 0);
          pair(r, 2 * g + 1) &= keep_pair_mask(carry, 1);
        });
        return;
      }
      const int blk = it + i, stage = stage_of(blk);
      ClusterBarrier::wait(&ss.keeps_full[wg][stage], parity_of(blk));
      const uint32_t* slot = keeps_of(wg, stage) + (threadIdx.x & 3);
      uint32_t words[kRows][Tr::kKeepWordsPerRow / 4];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(c_rc(r, 0)) - 64 * wg;
        CUTE_UNROLL
        for (int w = 0; w < Tr::kKeepWordsPerRow / 4; ++w) words[r][w] = slot[row * Tr::kKeepWordsPerRow + 4 * w];
      }
      ClusterBarrier::arrive(&ss.keeps_empty[wg][stage]);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int n = 0; n < decltype(size<1>(p_rc))::value / 2; ++n)
          pair(r, n) &= keep_pair_mask(words[r][n / 16], n);
      }
    };

    ClusterTransactionBarrier::wait(&ss.q_full, tiles_done & 1);
    // Block 0: S_0 alone.
    ClusterTransactionBarrier::wait(&ss.k_full[stage_of(it)], parity_of(it));
    wgmma</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, stage_of(it)), acc_s);  // outside the pingpong
    warpgroup_wait<0>();
    release(ss.k_empty, it);
    if (n_iters == 1) release_q();
    if (block_needs_mask(0)) {
      scores_to_probs(0, std::true_type{});
    } else {
      scores_to_probs(0, std::false_type{});
    }
    to_p(0);

    // Block i: S_i and P_{i−1}·V_{i−1} in one batch; the softmax of S_i overlaps the P·V.
    auto iteration = [&](int i, auto masked) __attribute__((always_inline)) {
      const int cur = it + i, prev = it + i - 1;
      ClusterTransactionBarrier::wait(&ss.k_full[stage_of(cur)], parity_of(cur));
      sched_wait();
      wgmma</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, stage_of(cur)), acc_s);
      ClusterTransactionBarrier::wait(&ss.v_full[stage_of(prev)], parity_of(prev));
      warpgroup_fence_operand(rP);
      wgmma</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, stage_of(prev)), acc_o);
      sched_signal();
      warpgroup_wait<1>();  // S_i landed; P·V still running
      release(ss.k_empty, cur);
      if (i == n_iters - 1) release_q();
      const bool moved = scores_to_probs(i, masked);
      warpgroup_wait<0>();
      warpgroup_fence_operand(rP);
      release(ss.v_empty, prev);
      softmax.rescale(o_rc, correction, moved);
      to_p(i);
    };
    for (int i = 1; i < n_iters;) {
      for (; i < n_iters && block_needs_mask(i); ++i) iteration(i, std::true_type{});
      for (; i < n_iters && !block_needs_mask(i); ++i) iteration(i, std::false_type{});
    }
    // The last P·V alone.
    {
      const int last = it + n_iters - 1;
      ClusterTransactionBarrier::wait(&ss.v_full[stage_of(last)], parity_of(last));
      warpgroup_fence_operand(rP);
      wgmma</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, stage_of(last)), acc_o);
      warpgroup_wait<0>();
      warpgroup_fence_operand(rP);
      release(ss.v_empty, last);
    }
    it += n_iters;
    ++tiles_done;
    if constexpr (kSplit) {
      // The unit once more from its step (through a shuffle, so the compiler neither keeps the first result's
      // fields in registers through the loop nor sees the copy as divergent).
      FwdUnit piece;
      fwd_unit(kp.tail, blockIdx.x, gridDim.x, __shfl_sync(0xffffffffu, step, 0), &piece);
      if (piece.parts > 1 && !finish_piece(piece, softmax, o_rc)) continue;  // another piece finishes the tile
    }

    // ---- epilogue: normalise and write this thread's rows of O (pairs of columns) and LSE ----
    float lse[kRows];
    softmax.finalize(o_rc, score_scale, dropout ? p.dropout.keep_scale : 1.f, lse);
    if constexpr (Tr::kStoreOViaSmem) {
      // Into this consumer's O tile in shared memory once its previous TMA store has read it, then one TMA
      // store (rows past seqlen_q are dropped by TMA); the consumer goes on to its next tile meanwhile.
      Tensor sO = make_tensor(make_smem_ptr(ss.o.data() + wg * cosize_v<typename Tr::SmemLayoutO>),
                              typename Tr::SmemLayoutO{});
      if (releaser) tma_store_wait<0>();
      NamedBarrier::sync(128, kBarOStore + wg);
      store_sw128_rows<T>(o_rc, oc_rc, sO, 64 * wg, 1.f);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the TMA store
      NamedBarrier::sync(128, kBarOStore + wg);
      if (releaser) {
        Tensor mO = kp.tma_o.get_tma_tensor(
            make_shape(int32_t(seqlen_q), Int<kD>{}, int32_t(dims.heads_q), int32_t(dims.batch)));
        Tensor gO = local_tile(mO(_, _, int32_t(t.head), int32_t(t.batch)), typename Tr::TileO{},
                               make_coord(int32_t(t.m_block * 2 + wg), _0{}));
        auto [tOg, tOs] = tma_partition(kp.tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                        group_modes<0, 2>(gO));
        copy(kp.tma_o, tOs, tOg);
        tma_store_arrive();
      }
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(oc_rc(r, 0));
        if (row < t.m_end - t.m0 && get<1>(oc_rc(r, 0)) == 0) lse_row[row] = lse[r];
      }
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(oc_rc(r, 0));
        if (row < t.m_end - t.m0) {
          T* o_row = o_base + (t.m0 + row) * q_row_stride;
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
  }
  if (wg == 0) sched_wait();  // consumer 1's last signal
  // The shared memory of the last O tiles must outlive their TMA stores' reads.
  if (Tr::kStoreOViaSmem && releaser) tma_store_wait<0>();
}

}  // namespace jaxflash::sm90
