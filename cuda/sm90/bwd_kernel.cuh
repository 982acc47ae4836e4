// FlashAttention backward for Hopper (sm_90a): TMA loads on an mbarrier pipeline, wgmma, warp specialisation.
//
// The math and the contract are the sm80 backward's (bwd_common.cuh: P recomputed from the LSE, dS = P ∘ (dP −
// delta), softcap's exact gradient, rows that see no key give zero gradients; dK, dV summed over a GQA group).
// The preprocess and convert kernels are shared; this file holds the main kernel of head dims up to 128 (and the
// producer, barriers and dK/dV epilogue that the d = 256 kernel, bwd_split_d_kernel.cuh, shares), K/V-stationary:
//   one block per (K/V block of kBlockN keys, batch, K/V head) keeps K and V in shared memory and dK, dV in
//   registers, and visits every query block of every head of the group that can see its keys.
//   producer warp:  TMA of K and V once, then of Q and dO per query block into kStages stages; it waits until
//                   every consumer thread released a stage.
//   stats warp:     the rows' LSE and delta into the same stages (the producer warpgroup's third warp).
//   2 consumers:    64 keys each. Per query block: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (wgmma, operands in shared
//                   memory), Pᵀ and dSᵀ element-wise in registers, dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ, dSᵀ
//                   straight from registers (dSᵀ from shared memory at 128 query rows: kDsFromSmem); dS to
//                   shared memory, then dQ = dS·K over both consumers' keys (at 80 rows dQᵀ = Kᵀ·dSᵀ).
//                   Each consumer stages its part of dQ in shared memory and one of its threads adds it
//                   into the fp32 dq_accum (80 rows: the dQ writer does; deterministic 64 rows: the dQ warps):
//                   at 64 and 80 query rows in register order by a bulk reduce-add (flash_bwd_convert_dq,
//                   below, turns that into dq), at 128 by a TMA reduce-add in q's layout (Tr::kDqFlat says why).
//                   At the end dK and dV go through the K and V tiles in shared memory and out by TMA.
//   dQ writer:      80-row kernels (the producer warpgroup's second warp): takes each consumer's staged dQ at a
//                   named barrier and issues its reduce-add, so the consumers wait neither for each other nor
//                   for the add's read of the tile (kDqWriter); outside deterministic mode the first block to
//                   reach a query tile stores it instead, so dq_accum is not cleared (kStoresFirst); in
//                   deterministic mode it also waits for each add's turn and passes the turns once its adds
//                   completed.
//   dQ warps:       deterministic mode at 64 rows (the producer warpgroup's second and fourth warps), below.
// Dropout redraws the forward's keep bits of a query block while its Sᵀ and dPᵀ GEMMs run
// (keep_bits_transposed: one 32-bit mask per thread). Which extras a kernel holds is its Extras argument.
// Deterministic mode adds into each query block's rows of dq_accum in n_block order (descending for short sequences
// under causal masks and windows' right sides, where block n reaches a query block before block n - 1: bwd_order.h): a
// turn counter per (batch, query head, query block, consumer) says which K/V block adds next. A dQ warp takes each
// staged tile, waits for the block's turn, issues the reduce-add, and passes the turn once the add has completed: waits
// the consumers no longer make (when they waited themselves, the backward took +62 % rather than +30 %). At 64 rows two
// dQ warps, one per staging buffer, so that one adds while the other waits for its adds to complete; at 80 rows (one
// staging tile per consumer) the dQ writer lets the tiles go once read, then waits for the adds. kv_block_work orders
// the blocks so that a block waits only for its predecessor, launched before it. Segment ids are not taken then (the
// handler runs the sm80 backward).
// Keys past kv_len and query rows past q_len inside the tensors may hold anything, even NaN; their P is 0,
// but 0·NaN is not, so those rows of K, V, Q and dO are zeroed in shared memory once landed.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd_common.cuh"
#include "fwd_kernel.cuh"
#include "traits_bwd.cuh"

namespace jaxflash::sm90 {

using namespace cute;

template <class Tr>
struct BwdKernelParams {
  BwdParams p;
  typename Tr::TmaQ tma_q, tma_do;
  typename Tr::TmaKV tma_k, tma_v;
  typename Tr::TmaDq tma_dq;  // NoTma where kDqFlat
  typename Tr::TmaDkv tma_dk, tma_dv;
  OrderedLaunch order;  // deterministic mode's launch order
};

template <class Tr>
struct BwdSharedStorage {
  using T = typename Tr::Element;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> k;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutKV>, 1024> v;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutDo>, 1024> dout;
  array_aligned<T, cosize_v<typename Tr::SmemLayoutdS>, 1024> ds;
  array_aligned<float, Tr::kDqBuffers * Tr::kMmaWarpGroups * Tr::kDqChunk, 1024> dq;  // staging tiles per consumer
  uint64_t kv_full;
  uint64_t q_full[Tr::kStages], q_empty[Tr::kStages];
  uint64_t do_full[Tr::kStagesDo], do_empty[Tr::kStagesDo];
  // A stage's stats written by the stats warp (ready_stats).
  uint64_t q_ready[Tr::kStages], do_ready[Tr::kStagesDo];
  // Deterministic mode: staging tile (b, g) written by consumer g / read by the dQ warp of buffer b.
  uint64_t dq_full[2][Tr::kMmaWarpGroups], dq_empty[2][Tr::kMmaWarpGroups];
  // Per stage, the stats of its query rows: lse2 with Q, delta with dO.
  float lse2[Tr::kStages][Tr::kBlockM];
  float delta[Tr::kStagesDo][Tr::kBlockM];
  int scratch[4];    // narrow_by_ids
  DropoutDraw draw;  // read where each block's keep bits are drawn rather than held in registers
};

// A rowcol view with its two modes swapped: (key, query) accumulators seen as (query, key), the orientation
// of bwd_common.cuh's rules.
template <class TensorT>
__forceinline__ __device__ auto transposed(TensorT&& t) {
  return make_tensor(t.data(), select<1, 0>(t.layout()));
}

// Deterministic mode's turn counters: ints in dq's buffer, unused until the convert step writes dq, zeroed by
// run_bwd before the main kernel. Each holds the place (KvBlockWork::turn) of the block whose reduce-add is next.
__forceinline__ __device__ void wait_turn(const int* turn, int place) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(turn) : "memory");
  } while (v != place);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the reduce-add (async proxy) comes after
}

// Waits until at most kPending of this thread's bulk groups are still running: performed, not only read from
// shared memory (tma_store_wait), so that passing the turn orders the adds themselves.
template <int kPending>
__forceinline__ __device__ void bulk_wait_performed() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

__forceinline__ __device__ void pass_turn(int* turn, int next) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(turn), "r"(next) : "memory");
}

// Zeroes rows [row_begin, row_end) of a (row, d) tile in shared memory, 16-byte chunks (the swizzle keeps each
// chunk whole), `threads` threads from `tid`; the caller fences and synchronises.
template <int kD, class T, class TensorS>
__forceinline__ __device__ void zero_rows(TensorS&& s, int row_begin, int row_end, int tid, int threads) {
  constexpr int kChunksPerRow = kD * int(sizeof(T)) / 16;
  for (int c = tid; c < (row_end - row_begin) * kChunksPerRow; c += threads)
    *reinterpret_cast<uint4*>(&s(row_begin + c / kChunksPerRow, (c % kChunksPerRow) * (16 / int(sizeof(T))))) =
        make_uint4(0, 0, 0, 0);
}

// Named barriers of the consumers (and the dQ writer); kDqFull and kDqEmpty + the consumer's index.
// cutlass::arch::NamedBarrier adds 8 to each (the hardware ids below 8 are its collectives'), so these must stay
// below 8: 8 itself was hardware barrier 16, which does not exist (ptxas encoded it as barrier 0, __syncthreads').
struct BwdBar {
  static constexpr uint32_t kEpilogue = 1, kShared = 2, kZeroed = 3, kDqFull = 4, kDqEmpty = 6;
  static_assert(kDqEmpty + 2 <= 8, "NamedBarrier's ids 0-7 are hardware barriers 8-15");
};

// A kDqFlat kernel's dq_accum: query tile m0 (kBlockM rows, d columns) of query head bh = batch·heads_q + head
// starts at (bh·dq_accum_rows(seqlen_q) + m0)·d floats, each consumer's register-order part kDqChunk floats after
// the previous one's (whole tiles: dq_accum's rows are rounded up).
template <int kD>
__forceinline__ __device__ float* flat_dq_tile(float* dq_accum, int64_t seqlen_q, int64_t bh, int64_t m0) {
  return dq_accum + (bh * dq_accum_rows(seqlen_q) + m0) * kD;
}

// dst[i] += src[i] for kFloats contiguous floats, src in shared memory: one bulk reduce-add, in the caller's next
// bulk group (tma_store_arrive commits it).
template <int kFloats>
__forceinline__ __device__ void bulk_reduce_add(float* dst, const float* src) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(cast_smem_ptr_to_uint(src)), "n"(kFloats * 4)
               : "memory");
}

// dst[i] = src[i]: as bulk_reduce_add, a plain store.
template <int kFloats>
__forceinline__ __device__ void bulk_store(float* dst, const float* src) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
               ::"l"(dst), "r"(cast_smem_ptr_to_uint(src)), "n"(kFloats * 4)
               : "memory");
}

// Store-first kernels (kDqWriter, not deterministic): dq_accum is not cleared. The first block to visit a query
// tile claims its flag (dq_flag_rows) and stores its dQ there; the others add theirs once that store has
// completed. The flag: 0 untouched (the convert step writes zeros: no block saw those rows), 1 claimed, 2 stored.
// The clear was a full pass over dq_accum, and each tile's first add read those zeros back.
template <class Tr, bool kOrdered>
constexpr bool kStoresFirst = Tr::kDqTransposed && !kOrdered;  // the kernels of a dQ writer warp

template <int kD>
__forceinline__ __device__ int* dq_tile_flag(float* dq_accum, int64_t seqlen_q, int64_t bh, int64_t m_block) {
  return reinterpret_cast<int*>(dq_accum + (bh * dq_accum_rows(seqlen_q) + dq_accum_tile_rows(seqlen_q)) * kD) +
         m_block;
}

// Whether this block stores the tile of `flag` first (it then calls announce_stored once the store completed).
__forceinline__ __device__ bool claim_tile(int* flag) { return atomicCAS(flag, 0, 1) == 0; }

__forceinline__ __device__ void wait_stored(const int* flag) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  } while (v != 2);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the reduce-add (async proxy) comes after
}

__forceinline__ __device__ void announce_stored(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(2) : "memory");
}

// Rows [row_begin, row_end) of two (row, d) tiles zeroed by every consumer thread and made visible to wgmma
// (rows past a length may hold anything, even NaN, and 0·NaN is not 0).
template <class Tr, class TensorA, class TensorB>
__forceinline__ __device__ void zero_tails(TensorA&& a, TensorB&& b, int row_begin, int row_end, int mma_tid) {
  using T = typename Tr::Element;
  zero_rows<Tr::kHeadDim, T>(a, row_begin, row_end, mma_tid, Tr::kMmaThreads);
  zero_rows<Tr::kHeadDim, T>(b, row_begin, row_end, mma_tid, Tr::kMmaThreads);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by wgmma
  NamedBarrier::sync(Tr::kMmaThreads, BwdBar::kZeroed);
}

// The pipeline's barriers (one thread): a stage is full once its tile's TMA bytes landed, its stats ready once
// every lane of the stats warp stored them (kStatsOnFull: full only then, so the consumers wait once per tile;
// the deterministic kernels measured 4-5 % slower that way, the others 1-3 % faster), empty once every consumer
// thread released it. Each thread arrives for itself, since an arrive releases only its own thread's accesses
// (with one arrive per consumer after a named barrier, racecheck reported the stats' reads against their
// writer's next stores; every thread arriving costs nothing measurable).
template <class Tr, bool kStatsOnFull, class Storage>
__forceinline__ __device__ void init_bwd_barriers(Storage& ss) {
  ClusterTransactionBarrier::init(&ss.kv_full, 1);
  CUTE_UNROLL
  for (int s = 0; s < Tr::kStages; ++s) {
    // The producer's arrive with the bytes it expects (and with kStatsOnFull one per lane of the stats warp).
    ClusterTransactionBarrier::init(&ss.q_full[s], kStatsOnFull ? 1 + 32 : 1);
    ClusterBarrier::init(&ss.q_ready[s], 32);  // the stats warp's lanes
    ClusterBarrier::init(&ss.q_empty[s], Tr::kMmaThreads);
  }
  CUTE_UNROLL
  for (int s = 0; s < Tr::kStagesDo; ++s) {
    ClusterTransactionBarrier::init(&ss.do_full[s], kStatsOnFull ? 1 + 32 : 1);
    ClusterBarrier::init(&ss.do_ready[s], 32);
    ClusterBarrier::init(&ss.do_empty[s], Tr::kMmaThreads);
  }
}

// The producer warp of either backward kernel (lane 0 issues every load): K and V once, then Q and dO of every
// query block the block visits into kStages stages; a stage is refilled once every consumer thread released it.
// The stats warp (ready_stats) fills in the rows' stats, so that no global read delays a tile's load.
template <class Tr, class Storage>
__forceinline__ __device__ void produce_bwd(const BwdKernelParams<Tr>& kp, Storage& ss, const KvBlockWork& w,
                                            int lane) {
  constexpr int kD = Tr::kHeadDim, kStages = Tr::kStages, kStagesDo = Tr::kStagesDo;
  const AttnDims& dims = kp.p.dims;
  const int64_t seqlen_q = dims.seqlen_q, seqlen_k = dims.seqlen_k;
  const int64_t batch = w.batch;
  if (lane != 0) return;
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutDo{});
  auto gmem_shape = [&](int64_t rows, int64_t heads) {
    return make_shape(int32_t(rows), Int<kD>{}, int32_t(heads), int32_t(dims.batch));
  };
  Tensor mQ = kp.tma_q.get_tma_tensor(gmem_shape(seqlen_q, dims.heads_q));
  Tensor mdO = kp.tma_do.get_tma_tensor(gmem_shape(seqlen_q, dims.heads_q));
  Tensor mK = kp.tma_k.get_tma_tensor(gmem_shape(seqlen_k, dims.heads_k));
  Tensor mV = kp.tma_v.get_tma_tensor(gmem_shape(seqlen_k, dims.heads_k));
  {
    Tensor gK = local_tile(mK(_, _, int32_t(w.head_k), int32_t(batch)), typename Tr::TileKV{},
                           make_coord(int32_t(w.n_block), _0{}));
    Tensor gV = local_tile(mV(_, _, int32_t(w.head_k), int32_t(batch)), typename Tr::TileKV{},
                           make_coord(int32_t(w.n_block), _0{}));
    auto [tKg, tKs] = tma_partition(kp.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(kp.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full, 2 * Tr::kKVBytes);
    copy(kp.tma_k.with(ss.kv_full), tKg, tKs);
    copy(kp.tma_v.with(ss.kv_full), tVg, tVs);
  }
  KvBlockWork::Cursor cur = w.first();
  for (int64_t it = 0; it < w.n_iters; ++it, w.advance(cur)) {
    const int32_t head = int32_t(cur.head), m_block = int32_t(cur.m_block);
    const int stage = int(it % kStages), do_stage = int(it % kStagesDo);
    // A fresh barrier counts as released.
    const uint32_t free_parity = uint32_t((it / kStages) & 1) ^ 1, do_free_parity = uint32_t((it / kStagesDo) & 1) ^ 1;
    Tensor gQ = local_tile(mQ(_, _, head, int32_t(batch)), typename Tr::TileQ{}, make_coord(m_block, _0{}));
    Tensor gdO = local_tile(mdO(_, _, head, int32_t(batch)), typename Tr::TileQ{}, make_coord(m_block, _0{}));
    auto [tQg, tQs] = tma_partition(kp.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOg, tdOs] =
        tma_partition(kp.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    ClusterBarrier::wait(&ss.q_empty[stage], free_parity);
    ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full[stage], Tr::kQBytes);
    copy(kp.tma_q.with(ss.q_full[stage]), tQg, tQs(_, stage));
    ClusterBarrier::wait(&ss.do_empty[do_stage], do_free_parity);
    ClusterTransactionBarrier::arrive_and_expect_tx(&ss.do_full[do_stage], Tr::kQBytes);
    copy(kp.tma_do.with(ss.do_full[do_stage]), tdOg, tdOs(_, do_stage));
  }
}

// The stats warp of either backward kernel: each step's LSE and delta rows read from global memory before the
// stage is free (their latency hides under the wait), then stored into it as lse2 and delta (load_row_stats'
// rule: rows past q_len get P = 0 and delta 0); every lane arrives after its own stores. It walks the steps in
// KvBlockWork::Cursor's order but in 32 bits (a head's rows fit): with the cursor's 64-bit state the producer
// warpgroup's 24 registers a thread spilled 40-60 bytes more in every kernel.
template <class Tr, bool kStatsOnFull, class Storage>
__forceinline__ __device__ void ready_stats(const BwdKernelParams<Tr>& kp, Storage& ss, const KvBlockWork& w,
                                            int lane) {
  constexpr int kM = Tr::kBlockM, kStages = Tr::kStages, kStagesDo = Tr::kStagesDo, kRows = (kM + 31) / 32;
  const AttnDims& dims = kp.p.dims;
  const int32_t n_m = int32_t(w.n_m), q_len = int32_t(w.bm.q_len), n_iters = int32_t(w.n_iters);
  // The step's query block as KvBlockWork's cursor walks them: m cycles through n_m blocks, the head moves on
  // every n_m steps.
  int32_t m = int32_t(w.m_shift), idx = 0;
  const int32_t row_min = int32_t(w.m_block_min * kM);
  const int64_t head_off = (w.batch * dims.heads_q + w.head0) * dims.seqlen_q;
  const float* lse = kp.p.lse + head_off;
  const float* delta = kp.p.delta + head_off;
  for (int32_t it = 0; it < n_iters; ++it) {
    const int stage = it % kStages, do_stage = it % kStagesDo;
    // A fresh barrier counts as released.
    const uint32_t free_parity = uint32_t(((it / kStages) & 1) ^ 1);
    const uint32_t do_free_parity = uint32_t(((it / kStagesDo) & 1) ^ 1);
    const int32_t row0 = row_min + m * kM;
    float l[kRows], d[kRows];
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int32_t row = row0 + lane + 32 * i;
      l[i] = row < q_len ? lse[row] : -INFINITY;
      d[i] = row < q_len ? delta[row] : 0.f;
    }
    ClusterBarrier::wait(&ss.q_empty[stage], free_parity);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i)
      if (kM % 32 == 0 || lane + 32 * i < kM) ss.lse2[stage][lane + 32 * i] = lse_log2(l[i]);
    ClusterBarrier::arrive(kStatsOnFull ? &ss.q_full[stage] : &ss.q_ready[stage]);
    ClusterBarrier::wait(&ss.do_empty[do_stage], do_free_parity);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i)
      if (kM % 32 == 0 || lane + 32 * i < kM) ss.delta[do_stage][lane + 32 * i] = d[i];
    ClusterBarrier::arrive(kStatsOnFull ? &ss.do_full[do_stage] : &ss.do_ready[do_stage]);
    if (++m == n_m) m = 0;
    if (++idx == n_m) {
      idx = 0;
      lse += dims.seqlen_q;
      delta += dims.seqlen_q;
    }
  }
}

// The consumers' end: dK = scale · dK and dV into the K and V tiles (free once both consumers' last GEMMs
// have read them), then one TMA store each (keys past the tensor are dropped by TMA). Every consumer thread
// calls it.
template <class Tr, class Storage, class AccRC, class ThrMma>
__forceinline__ __device__ void store_dkdv(const BwdKernelParams<Tr>& kp, Storage& ss, const KvBlockWork& w,
                                           AccRC const& dk_rc, AccRC const& dv_rc, ThrMma const& thr_kv,
                                           int mma_tid) {
  using T = typename Tr::Element;
  const AttnDims& dims = kp.p.dims;
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  NamedBarrier::sync(Tr::kMmaThreads, BwdBar::kEpilogue);
  Tensor kv_c = rowcol(thr_kv.partition_C(make_identity_tensor(typename Tr::TileKV{})));
  store_sw128_rows<T>(dk_rc, kv_c, sK, 0, kp.p.scale);
  store_sw128_rows<T>(dv_rc, kv_c, sV, 0, 1.f);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the TMA stores
  NamedBarrier::sync(Tr::kMmaThreads, BwdBar::kEpilogue);
  if (mma_tid == 0) {
    Tensor mdK = kp.tma_dk.get_tma_tensor(make_shape(int32_t(dims.seqlen_k), Int<Tr::kHeadDim>{},
                                                     int32_t(dims.heads_k), int32_t(dims.batch)));
    Tensor mdV = kp.tma_dv.get_tma_tensor(shape(mdK));
    auto block = [&](auto& m) {
      return group_modes<0, 2>(local_tile(m(_, _, int32_t(w.head_k), int32_t(w.batch)), typename Tr::TileKV{},
                                          make_coord(int32_t(w.n_block), _0{})));
    };
    auto [tdKg, tdKs] = tma_partition(kp.tma_dk, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), block(mdK));
    auto [tdVg, tdVs] = tma_partition(kp.tma_dv, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), block(mdV));
    copy(kp.tma_dk, tdKs, tdKg);
    copy(kp.tma_dv, tdVs, tdVg);
    tma_store_arrive();
    tma_store_wait<0>();  // the shared memory must outlive the stores' reads
  }
}

// The extras a backward kernel compiles in. kAll: softcap, segment ids and dropout, each decided at run time.
// kSoftcap, kDropout: that extra alone, always on (the launcher's choice when it is the only one): beside the
// branch without it, ptxas spilled about three times as much at d = 128, in the loop too, and the backward
// with dropout ran 8-15 % slower.
enum class Extras { kNone, kSoftcap, kDropout, kAll };

template <class Tr, Extras kX, bool kOrdered>
__global__ void __launch_bounds__(Tr::kNThreads, 1) flash_bwd_kernel(const __grid_constant__ BwdKernelParams<Tr> kp) {
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim, kStages = Tr::kStages;
  constexpr int kMmaThreads = Tr::kMmaThreads;
  constexpr uint32_t kBarDs = BwdBar::kShared, kBarDqFull = BwdBar::kDqFull;
  constexpr int kWG = Tr::kMmaWarpGroups;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<BwdSharedStorage<Tr>*>(smem_raw);
  const BwdParams& p = kp.p;
  const AttnDims& dims = p.dims;
  const int tid = threadIdx.x;
  const int warp_group = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int64_t seqlen_q = dims.seqlen_q;

  constexpr bool kAll = kX == Extras::kAll;  // segment ids, and the extras decided at run time
  constexpr bool kDsFromSmem = Tr::kDsFromSmem;
  static_assert(!kDsFromSmem || kX == Extras::kNone, "the extras' kernels keep dSᵀ and the stats in registers");
  // Each query's LSE and delta read from shared memory where used, not held for all of the thread's queries:
  // registers for the larger tiles' accumulators.
  constexpr bool kStatsAtUse = kDsFromSmem || Tr::kDqTransposed;
  static_assert(!kStatsAtUse || kX == Extras::kNone, "the extras' rules take the stats from registers");
  // The producer warpgroup's second warp adds the consumers' staged dQ into dq_accum (the consumers arrive and
  // go on instead of waiting for each other and issuing the add).
  constexpr bool kDqWriter = Tr::kDqTransposed;
  constexpr bool kDqWarps = kOrdered && !kDqWriter;  // deterministic mode's two dQ warps
  static_assert(!kDqWarps || Tr::kDqBuffers == 2, "deterministic mode's two dQ warps take a staging tile each");
  const bool softcap = kX == Extras::kSoftcap || (kAll && p.softcap > 0.f);
  const bool dropout = kX == Extras::kDropout || (kAll && p.dropout.rate > 0.f);
  const KvBlockWork w = kv_block_work<kM, kN, Tr::kNThreads, kAll, kOrdered>(p, kp.order, ss.scratch);
  constexpr bool kStatsOnFull = !kOrdered;  // init_bwd_barriers says why
  const int64_t batch = w.batch;
  const int64_t n0 = w.n0, n_end = w.n_end, n_valid_end = w.n_valid_end, n_iters = w.n_iters;
  const BatchMask& bm = w.bm;
  const bool segments = w.segments;
  auto stage_of = [](int64_t it) { return int(it % kStages); };
  auto parity_of = [](int64_t it) { return uint32_t((it / kStages) & 1); };

  if (tid == 0) {
    if (dropout) ss.draw = dropout_draw(p.dropout, batch);
    init_bwd_barriers<Tr, kStatsOnFull>(ss);
    if constexpr (kDqWarps) {
      CUTE_UNROLL
      for (int b = 0; b < 2; ++b) {
        CUTE_UNROLL
        for (int g = 0; g < kWG; ++g) {
          ClusterBarrier::init(&ss.dq_full[b][g], 128);  // every thread of consumer g, after its stores
          ClusterBarrier::init(&ss.dq_empty[b][g], 1);   // the dQ warp, once its add has read the tile
        }
      }
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutDo{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutDot{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Tr::SmemLayoutdSt{});

  // Consumer g's dQ staging tiles (kDqBuffers; b counts blocks), and the reduce-add of one into dq_accum: kDqFlat,
  // at flat_dq_tile; else in q's layout, where TMA drops rows past the tensor (rows past q_len hold zeros).
  auto dq_staged = [&](int g, int b) {
    return ss.dq.data() + (Tr::kDqBuffers * g + b % Tr::kDqBuffers) * Tr::kDqChunk;
  };
  auto dq_staging = [&](int g, int b) {
    return make_tensor(make_smem_ptr(dq_staged(g, b)), typename Tr::SmemLayoutDq{});
  };
  auto reduce_add_dq = [&](int g, int b, int64_t head, int64_t m0, bool store = false) {
    if constexpr (Tr::kDqFlat) {
      float* dst = flat_dq_tile<kD>(p.dq_accum, seqlen_q, batch * dims.heads_q + head, m0) + g * Tr::kDqChunk;
      if (store) bulk_store<Tr::kDqChunk>(dst, dq_staged(g, b));
      else bulk_reduce_add<Tr::kDqChunk>(dst, dq_staged(g, b));
    } else {
      Tensor mDq = kp.tma_dq.get_tma_tensor(
          make_shape(int32_t(seqlen_q), Int<kD>{}, int32_t(dims.heads_q), int32_t(dims.batch)));
      const int row0 = Tr::kDqSplitRows ? g * Tr::kDqRows : 0, col0 = Tr::kDqSplitRows ? 0 : g * Tr::kDqCols;
      Tensor gDq = local_tile(mDq(_, _, int32_t(head), int32_t(batch)), typename Tr::TileDq{},
                              make_coord(int32_t((m0 + row0) / Tr::kDqRows), col0 / Tr::kDqCols));
      auto [tDqg, tDqs] = tma_partition(kp.tma_dq, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(dq_staging(g, b)),
                                        group_modes<0, 2>(gDq));
      copy(kp.tma_dq, tDqs, tDqg);
    }
    tma_store_arrive();
  };
  // Deterministic mode: consumer g's turn counter of a query block, and whether the block waits for its turn
  // there (the previous K/V block adds first where it visits that query block too).
  const int64_t m_blocks = kOrdered ? (seqlen_q + kM - 1) / kM : 0;
  auto turn = [&](int64_t head, int64_t m_block, int g) {
    return static_cast<int*>(p.dq) + ((batch * dims.heads_q + head) * m_blocks + m_block) * kWG + g;
  };
  auto waits_turn = [&](int64_t m_block) { return w.pred_m_begin <= m_block && m_block < w.pred_m_end; };

  if (warp_group == 0) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (kDqWarps && tid % 64 == 32 && n_iters > 0) {
      // ---- dQ warps (deterministic mode; lane 0 of warps 1 and 3): per query block, each consumer's staged
      // tile in turn order. Warp 1 takes the even blocks (staging buffer 0), warp 3 the odd ones (buffer 1): a
      // warp waits for its adds to complete before passing their turns, and meanwhile the other one adds.
      const int b = tid / 64;
      KvBlockWork::Cursor cur = w.first();
      if (b == 1) w.advance(cur);
      for (int64_t it = b; it < n_iters; it += 2, w.advance(cur), w.advance(cur)) {
        const int64_t head = cur.head, m_block = cur.m_block;
        const uint32_t parity = uint32_t((it >> 1) & 1);
        const bool waits = waits_turn(m_block);
        for (int g = 0; g < kWG; ++g) {
          ClusterBarrier::wait(&ss.dq_full[b][g], parity);
          if (waits) wait_turn(turn(head, m_block, g), int(w.turn));
          reduce_add_dq(g, b, head, m_block * kM);
        }
        tma_store_wait<0>();  // both tiles read: the consumers may stage into them again
        for (int g = 0; g < kWG; ++g) ClusterBarrier::arrive(&ss.dq_empty[b][g]);
        bulk_wait_performed<0>();  // the adds performed: the turns pass on
        for (int g = 0; g < kWG; ++g) pass_turn(turn(head, m_block, g), int(w.turn) + 1);
      }
      return;
    }
    if constexpr (kDqWriter) {
      if (tid / 32 == 1 && n_iters > 0) {
        const int lane = tid % 32;
        for (int g = 0; g < kWG; ++g) NamedBarrier::arrive(128 + 32, BwdBar::kDqEmpty + g);  // staging free
        KvBlockWork::Cursor cur = w.first();
        for (int64_t it = 0; it < n_iters; ++it, w.advance(cur)) {
          const bool waits = kOrdered && waits_turn(cur.m_block);
          int* flag = nullptr;
          bool store = false;
          if (kStoresFirst<Tr, kOrdered> && lane == 0) {  // claimed while the consumers compute the tile
            flag = dq_tile_flag<kD>(p.dq_accum, seqlen_q, batch * dims.heads_q + cur.head, cur.m_block);
            store = claim_tile(flag);
          }
          for (int g = 0; g < kWG; ++g) {
            NamedBarrier::sync(128 + 32, BwdBar::kDqFull + g);
            if (lane == 0) {
              if (waits) wait_turn(turn(cur.head, cur.m_block, g), int(w.turn));
              if (kStoresFirst<Tr, kOrdered> && !store && g == 0) wait_stored(flag);
              reduce_add_dq(g, 0, cur.head, cur.m_block * kM, store);
            }
          }
          if (lane == 0) tma_store_wait<0>();  // both tiles read
          __syncwarp();
          if (it + 1 < n_iters)
            for (int g = 0; g < kWG; ++g) NamedBarrier::arrive(128 + 32, BwdBar::kDqEmpty + g);
          if (kOrdered && lane == 0) {  // the adds performed (while the consumers go on): the turns pass on
            bulk_wait_performed<0>();
            for (int g = 0; g < kWG; ++g) pass_turn(turn(cur.head, cur.m_block, g), int(w.turn) + 1);
          }
          if (store) {  // the others may add once the store completed (the consumers go on meanwhile)
            bulk_wait_performed<0>();
            announce_stored(flag);
          }
        }
        return;
      }
    }
    if (tid < 32 && n_iters > 0) produce_bwd<Tr>(kp, ss, w, tid);
    if (tid / 32 == 2 && n_iters > 0) ready_stats<Tr, kStatsOnFull>(kp, ss, w, tid % 32);
    return;
  }

  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int mma_tid = tid - 128;
  const int wg = warp_group - 1;  // warp-uniform (a shuffle's result), unlike mma_tid / 128
  const bool releaser = mma_tid % 128 == 0;

  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaKV mma_kv;
  typename Tr::TiledMmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
  auto thr_kv = mma_kv.get_thread_slice(mma_tid);
  auto thr_dq = mma_dq.get_thread_slice(mma_tid);
  // The shared-memory operands' descriptors are one per warpgroup: partitioned for the warpgroup's first
  // thread, a warp-uniform index, they are built in uniform registers (from mma_tid, every wgmma rebuilt its
  // K or V descriptor in vector registers and moved it over).
  auto wg_sdp = mma_sdp.get_thread_slice(wg * 128);
  auto wg_kv = mma_kv.get_thread_slice(wg * 128);
  auto wg_dq = mma_dq.get_thread_slice(wg * 128);
  Tensor tSrK = wg_sdp.partition_fragment_A(sK);    // (MMA, MMA_N, MMA_D)
  Tensor tSrV = wg_sdp.partition_fragment_A(sV);
  Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);    // (MMA, MMA_M, MMA_D, stage)
  Tensor tSrdO = wg_sdp.partition_fragment_B(sdO);
  Tensor tKVrQt = wg_kv.partition_fragment_B(sQt);  // (MMA, MMA_D, MMA_M, stage)
  Tensor tKVrdOt = wg_kv.partition_fragment_B(sdOt);
  // dQ's operands: dS and Kᵀ, or (kDqTransposed) Kᵀ and dS.
  Tensor tQrdS = [&] {  // (MMA, MMA_M, MMA_N, buffer)
    if constexpr (Tr::kDqTransposed) return wg_dq.partition_fragment_B(sdS);
    else return wg_dq.partition_fragment_A(sdS);
  }();
  Tensor tQrKt = [&] {  // (MMA, MMA_D, MMA_N)
    if constexpr (Tr::kDqTransposed) return wg_dq.partition_fragment_A(sKt);
    else return wg_dq.partition_fragment_B(sKt);
  }();

  Tensor acc_s = partition_fragment_C(mma_sdp, typename Tr::TileSt{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, typename Tr::TileSt{});
  Tensor acc_dk = partition_fragment_C(mma_kv, typename Tr::TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_kv, typename Tr::TileKV{});
  Tensor acc_dq = partition_fragment_C(mma_dq, typename Tr::TileDqAcc{});
  Tensor rP = make_tensor<T>(acc_s.layout());
  Tensor rdS = make_tensor<T>(acc_dp.layout());
  Tensor tKVrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  Tensor tKVrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
  typename Tr::TiledMmaKVss mma_kv_ss;
  auto tKVsdSt = [&] {  // (MMA, MMA_N, MMA_M, buffer)
    if constexpr (kDsFromSmem) return mma_kv_ss.get_thread_slice(wg * 128).partition_fragment_A(sdSt);
    else return 0;  // dSᵀ stays in registers
  }();
  clear(acc_dk);
  clear(acc_dv);
  // dSᵀ's accumulator stored as dS by stmatrix where it pays (fwd+bwd on an H100): at 128 query rows (d = 64)
  // the 32-bit stores' addresses spilled ~100 bytes and ran 7-13 % slower (deterministic mode too, 8-12 %,
  // once its dQ warps stopped holding the consumers back); at 64 rows (d = 128) stmatrix was 1.5-3 % slower.
  // At 80 rows (dS key-contiguous) stmatrix transposes its 8x8 tiles.
  constexpr bool kDsByStmatrix = kM == 128 || Tr::kDqTransposed;
  auto sts_ds = make_tiled_copy_C(typename Tr::DsStoreAtom{}, mma_sdp);
  auto thr_sts_ds = sts_ds.get_thread_slice(mma_tid);
  Tensor tdSs = thr_sts_ds.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (CPY, KEYS, QUERIES, buffer)

  // (key, query) of every score this thread holds, and the same as (query, key) in the (query, key)
  // orientation of bwd_common.cuh's rules.
  Tensor c_kq = rowcol(thr_sdp.partition_C(make_identity_tensor(typename Tr::TileSt{})));
  const auto swapped = make_layout(typename Tr::TileSt{}, make_stride(E<1>{}, E<0>{}));
  Tensor c_t = transposed(rowcol(thr_sdp.partition_C(make_tensor(
      make_identity_tensor(Shape<Int<kM>, Int<kN>>{}).data(), swapped))));
  Tensor s_kq = rowcol(acc_s);
  Tensor s_t = transposed(s_kq);
  Tensor dp_t = transposed(rowcol(acc_dp));
  constexpr int kQCols = decltype(size<0>(c_t))::value;
  Tensor dq_rc = rowcol(acc_dq);
  Tensor dq_c_rc = rowcol(thr_dq.partition_C(make_identity_tensor(typename Tr::TileDqAcc{})));
  // Where this warpgroup's dQ staging tile lies in the (kBlockM, d) tile (without kDqFlat).
  const int dq_row0 = Tr::kDqSplitRows ? wg * Tr::kDqRows : 0, dq_col0 = Tr::kDqSplitRows ? 0 : wg * Tr::kDqCols;

  const float score_log2 = (softcap ? 1.f : p.scale) * 1.4426950408889634f;
  const BwdExtras extras = kX != Extras::kNone ? BwdExtras(p, batch) : BwdExtras();

  auto sync_consumers = [&](uint32_t id) { NamedBarrier::sync(kMmaThreads, id); };
  // Whether a query block needs the per-key mask, decided once for this K/V block: the whole mask's state
  // spilled, and its reload from L2 stalled every block before the softmax.
  const bool mask_always = segments || n0 + kN > bm.kv_len;
  int64_t full_rows_begin, full_rows_end;
  fully_visible_query_range(bm.m, n0, n0 + kN, &full_rows_begin, &full_rows_end);
  full_rows_end = cute::min(full_rows_end, bm.q_len);  // rows past q_len are zeroed where masked
  auto needs_mask = [&](int64_t m0, int64_t m_end) {
    return mask_always || m0 < full_rows_begin || m_end > full_rows_end;
  };
  if (n_iters > 0) {
    ClusterTransactionBarrier::wait(&ss.kv_full, 0);
    // Keys past kv_len inside the tensor.
    if (n_valid_end < n_end) zero_tails<Tr>(sK, sV, int(n_valid_end - n0), int(n_end - n0), mma_tid);
  }

  // One query block. by_key: whether this copy holds the per-key mask (and the zeroing of query rows past
  // q_len, which only such blocks have). The kernels without extras or with dropout alone run a copy without it
  // for the blocks that need no mask: with the mask's code in the loop, ptxas spilled there (d = 128: 616
  // instructions in the loop with spills, 402 without). Softcap alone kept spills in both copies and measured
  // slower than with one copy; it keeps one, as the kernel of all extras does, which decides inside.
  constexpr bool kOneCopy = kAll || kX == Extras::kSoftcap;
  auto step = [&](int64_t it, int64_t head, int64_t m_block, auto by_key) {
    constexpr bool kByKey = decltype(by_key)::value;
    const int64_t m0 = m_block * kM;
    const int64_t m_end = cute::min(m0 + int64_t(kM), seqlen_q);
    const int stage = stage_of(it), buf = int(it & 1);
    const uint32_t parity = parity_of(it);

    ClusterTransactionBarrier::wait(&ss.q_full[stage], parity);
    ClusterTransactionBarrier::wait(&ss.do_full[stage], parity);
    if constexpr (!kStatsOnFull) {
      ClusterBarrier::wait(&ss.q_ready[stage], parity);
      ClusterBarrier::wait(&ss.do_ready[stage], parity);
    }
    const int64_t q_valid_end = cute::min(m_end, bm.q_len);
    if (kByKey && q_valid_end < m_end)  // query rows past q_len inside the tensor
      zero_tails<Tr>(sQ(_, _, stage), sdO(_, _, stage), int(q_valid_end - m0), int(m_end - m0), mma_tid);
    wgmma</*kZeroInit=*/true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    wgmma</*kZeroInit=*/true>(mma_sdp, tSrV, tSrdO(_, _, _, stage), acc_dp);
    // Dropout's keep bits of this block while the two GEMMs run: one 32-bit mask per thread.
    uint32_t keep = 0u;
    if constexpr (kX == Extras::kDropout || kAll) keep = dropout ? keep_bits_transposed(c_kq, ss.draw, uint32_t(head), m0, n0) : 0u;
    // Each stat is read from shared memory where it is used, to keep registers for the accumulators.
    float lse2[kQCols], delta[kQCols];
    auto load_stats = [&](const float* from, float (&to)[kQCols]) {
      CUTE_UNROLL
      for (int r = 0; r < kQCols; ++r) to[r] = from[get<1>(c_kq(0, r))];
    };
    if constexpr (!kStatsAtUse) load_stats(ss.lse2[stage], lse2);

    warpgroup_wait<1>();  // Sᵀ landed; dPᵀ still running
    if (softcap) softcap_scores(acc_s, p.scale, p.softcap);
    // The loop below decided it (kOneCopy kernels take this copy for every block and decide here).
    if (kByKey && (!kOneCopy || needs_mask(m0, m_end))) mask_scores_by_key<kM, kAll>(s_kq, c_kq, bm, n0, m0);
    if constexpr (kStatsAtUse) {
      CUTE_UNROLL
      for (int c = 0; c < kQCols; ++c) {
        const float l = ss.lse2[stage][get<1>(c_kq(0, c))];
        CUTE_UNROLL
        for (int r = 0; r < size<1>(s_t); ++r) s_t(c, r) = exp2f(fmaf(s_t(c, r), score_log2, -l));
      }
    } else {
      scores_to_probs(s_t, lse2, score_log2);
      load_stats(ss.delta[stage], delta);
    }
    warpgroup_wait<0>();
    // Softcap's gradient needs lse2 again: read anew after the wait (a memory clobber), so the registers of
    // the first read are free while dPᵀ lands instead of live across it.
    if constexpr (kAll || kX == Extras::kSoftcap) load_stats(ss.lse2[stage], lse2);
    if (dropout) {
      // Softcap's factor only where asked: the loop without it is the common case.
      auto drop_all = [&](auto with_cap) {
        CUTE_UNROLL
        for (int c = 0; c < kQCols; ++c) {
          CUTE_UNROLL
          for (int r = 0; r < size<1>(s_t); ++r)
            extras.drop<decltype(with_cap)::value>(dp_t(c, r), s_t(c, r), kept_transposed(keep, r, c), delta[c],
                                                    lse2[c]);
        }
      };
      if (softcap) drop_all(std::true_type{});
      else drop_all(std::false_type{});
    } else if constexpr (kStatsAtUse) {
      CUTE_UNROLL
      for (int c = 0; c < kQCols; ++c) {
        const float dl = ss.delta[stage][get<1>(c_kq(0, c))];
        CUTE_UNROLL
        for (int r = 0; r < size<1>(s_t); ++r) dp_t(c, r) = s_t(c, r) * (dp_t(c, r) - dl);
      }
    } else {
      dprobs_to_dscores<kX != Extras::kNone, 0, kX == Extras::kSoftcap>(dp_t, s_t, c_t, delta, lse2, extras,
                                                                       uint32_t(head), m0, n0);
    }
    convert_into<T>(acc_s, rP);
    convert_into<T>(acc_dp, rdS);

    // dS to shared memory: a thread's two adjacent queries of one key are adjacent there (query-contiguous),
    // the rows of stmatrix's 8x8 tiles (kDsByStmatrix: 4 stores instead of 16). At 64 rows its pairs of one key
    // sit 8 queries (16 bytes) apart in one 128-byte swizzled row, so pair j lies at the first pair's address
    // with bits 4-6 XOR j: one address per key instead of one per pair.
    Tensor rdS_rc = rowcol(rdS);
    if constexpr (kDsByStmatrix) {
      copy(sts_ds, thr_sts_ds.retile_S(rdS), tdSs(_, _, _, buf));
    } else {
      static_assert(kM == 64, "other tiles store dS by stmatrix");
      CUTE_UNROLL
      for (int r = 0; r < size<0>(rdS_rc); ++r) {
        int key = get<0>(c_kq(r, 0));
        asm volatile("" : "+r"(key));  // addresses recomputed here, not hoisted into registers
        const uint32_t addr0 = cast_smem_ptr_to_uint(&sdSt(key, get<1>(c_kq(r, 0)), buf));
        CUTE_UNROLL
        for (int c = 0; c < size<1>(rdS_rc); c += 2) {
          const uint32_t pair = *reinterpret_cast<const uint32_t*>(&rdS_rc(r, c));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr0 ^ uint32_t((c / 2) << 4)), "r"(pair));
        }
      }
    }
    cutlass::arch::fence_view_async_shared();

    warpgroup_fence_operand(rP);
    wgmma</*kZeroInit=*/false>(mma_kv, tKVrP, tKVrdOt(_, _, _, stage), acc_dv);
    // The reduce-add that last read this block's dQ staging tile (kDqBuffers blocks ago) has read it before
    // anyone passes; with a writer warp, the writer waits for it instead.
    if (!kOrdered && !kDqWriter && releaser) tma_store_wait<Tr::kDqBuffers - 1>();
    sync_consumers(kBarDs);  // both halves of dS written
    if constexpr (Tr::kDqTransposed) wgmma</*kZeroInit=*/true>(mma_dq, tQrKt, tQrdS(_, _, _, buf), acc_dq);
    else wgmma</*kZeroInit=*/true>(mma_dq, tQrdS(_, _, _, buf), tQrKt, acc_dq);
    if constexpr (kDsFromSmem) {
      wgmma</*kZeroInit=*/false>(mma_kv_ss, tKVsdSt(_, _, _, buf), tKVrQt(_, _, _, stage), acc_dk);
    } else {
      warpgroup_fence_operand(rdS);
      wgmma</*kZeroInit=*/false>(mma_kv, tKVrdS, tKVrQt(_, _, _, stage), acc_dk);
    }

    warpgroup_wait<1>();  // dV and dQ landed; dK still running
    warpgroup_fence_operand(rP);
    ClusterBarrier::arrive(&ss.do_empty[stage]);
    // dQ into this block's staging tile (deterministic mode: once its buffer's dQ warp has let it go).
    if (kDqWarps && it >= 2) ClusterBarrier::wait(&ss.dq_empty[buf][wg], uint32_t(((it >> 1) - 1) & 1));
    if constexpr (kDqWriter) NamedBarrier::sync(128 + 32, BwdBar::kDqEmpty + wg);  // the last tile read
    if constexpr (Tr::kDqFlat) {
      float4* staged = reinterpret_cast<float4*>(dq_staged(wg, buf)) + mma_tid % 128;
      CUTE_UNROLL
      for (int v = 0; v < size(acc_dq) / 4; ++v)
        staged[v * 128] = make_float4(acc_dq(4 * v), acc_dq(4 * v + 1), acc_dq(4 * v + 2), acc_dq(4 * v + 3));
    } else {
      Tensor sDq = dq_staging(wg, buf);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dq_rc); ++r) {
        int row = get<0>(dq_c_rc(r, 0)) - dq_row0;
        // Opaque to the compiler: the swizzled addresses are recomputed here rather than hoisted out of the
        // loop into registers that would be spilled.
        asm volatile("" : "+r"(row));
        // (c, c + 1) are adjacent columns, adjacent in sDq. Pairs 8 columns (32 bytes) apart: four share a
        // 128-byte swizzled row, where pair j lies at the first one's address with bits 5-6 XOR j. The swizzle
        // puts rows 2i and 2i + 1 on the same banks, and a half-warp's 64-bit stores cover four rows: odd rows
        // store their pairs in the order j ^ 2, so each half-warp fills all 32 banks once.
        const bool odd = row & 1;
        uint32_t addr0 = 0;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dq_rc); c += 2) {
          const int j = c / 2 % 4;
          if (j == 0)
            addr0 = cast_smem_ptr_to_uint(&sDq(row, get<1>(dq_c_rc(r, c)) - dq_col0)) ^ (odd ? 2u << 5 : 0u);
          const float lo = odd ? dq_rc(r, c ^ 4) : dq_rc(r, c), hi = odd ? dq_rc(r, (c ^ 4) + 1) : dq_rc(r, c + 1);
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr0 ^ uint32_t(j << 5)), "f"(lo), "f"(hi));
        }
      }
    }
    cutlass::arch::fence_view_async_shared();
    if constexpr (kDqWarps) {
      ClusterBarrier::arrive(&ss.dq_full[buf][wg]);
    } else if constexpr (kDqWriter) {
      NamedBarrier::arrive(128 + 32, BwdBar::kDqFull + wg);
    } else {
      NamedBarrier::sync(128, kBarDqFull + wg);
      if (releaser) reduce_add_dq(wg, buf, head, m0);
    }
    warpgroup_wait<0>();
    if constexpr (!kDsFromSmem) warpgroup_fence_operand(rdS);
    ClusterBarrier::arrive(&ss.q_empty[stage]);
  };
  KvBlockWork::Cursor cur = w.first();
  for (int64_t it = 0; it < n_iters; ++it, w.advance(cur)) {
    const int64_t m0 = cur.m_block * kM, m_end = cute::min(m0 + int64_t(kM), seqlen_q);
    if (kOneCopy || needs_mask(m0, m_end)) step(it, cur.head, cur.m_block, std::true_type{});
    else step(it, cur.head, cur.m_block, std::false_type{});
  }

  if (!kOrdered && !kDqWriter && releaser) tma_store_wait<0>();  // the last reduce-add has read its staging tile

  store_dkdv<Tr>(kp, ss, w, rowcol(acc_dk), rowcol(acc_dv), thr_kv, mma_tid);
}

// dq = scale · dq_accum after a kDqFlat flash_bwd_kernel, one block per (query tile, batch · query head): the
// tile's floats lie in the consumers' register order (reduce_add_dq), which the TiledMmaDq's partition of the
// tile undoes. Each thread reads its own registers' float4s (a warp 512 contiguous bytes), puts them at their
// (row, column) in shared memory, and the tile leaves in 16-byte row pieces; rows past seqlen_q are dropped.
// kFlagged: after a store-first kernel, a tile that no block stored gives zeros.
template <class Tr, bool kFlagged>
__global__ void __launch_bounds__(Tr::kMmaThreads) flash_bwd_convert_dq(const __grid_constant__ BwdParams p) {
  using T = typename Tr::Element;
  constexpr int kM = Tr::kBlockM, kD = Tr::kHeadDim, kPitch = kD + 8;  // 16 bytes of padding: no bank conflicts
  __shared__ alignas(16) T tile[kM * kPitch];
  const AttnDims& dims = p.dims;
  const int64_t m_blocks = (dims.seqlen_q + kM - 1) / kM;
  const int64_t m0 = int64_t(blockIdx.x) % m_blocks * kM, bh = int64_t(blockIdx.x) / m_blocks;
  const int tid = threadIdx.x;
  const float* acc = flat_dq_tile<kD>(p.dq_accum, dims.seqlen_q, bh, m0);
  const bool stored = !kFlagged || *dq_tile_flag<kD>(p.dq_accum, dims.seqlen_q, bh, m0 / kM) != 0;
  Tensor coord = typename Tr::TiledMmaDq{}.get_thread_slice(tid).partition_C(
      make_identity_tensor(typename Tr::TileDqAcc{}));
  // Register order: 4v, 4v + 1 are adjacent columns of one row, 4v + 2, 4v + 3 the same columns 8 rows down;
  // rows are d and columns queries where dQ was computed transposed.
  const float4* mine = reinterpret_cast<const float4*>(acc + tid / 128 * Tr::kDqChunk) + tid % 128;
  CUTE_UNROLL
  for (int v = 0; v < size(coord) / 4; ++v) {
    const float4 a = stored ? mine[v * 128] : make_float4(0.f, 0.f, 0.f, 0.f);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int row = get<0>(coord(4 * v + 2 * h)), col = get<1>(coord(4 * v + 2 * h));
      const T lo = T((h ? a.z : a.x) * p.scale), hi = T((h ? a.w : a.y) * p.scale);
      if constexpr (Tr::kDqTransposed) {  // (d, query): the pair lies in two rows of the tile
        tile[col * kPitch + row] = lo;
        tile[(col + 1) * kPitch + row] = hi;
      } else {
        alignas(4) T pair[2] = {lo, hi};
        *reinterpret_cast<uint32_t*>(&tile[row * kPitch + col]) = *reinterpret_cast<const uint32_t*>(pair);
      }
    }
  }
  __syncthreads();
  const int64_t batch = bh / dims.heads_q, head = bh % dims.heads_q;
  constexpr int kPieces = kD * int(sizeof(T)) / 16;  // per row
  for (int i = tid; i < kM * kPieces; i += Tr::kMmaThreads) {
    const int row = i / kPieces, piece = i % kPieces;
    if (m0 + row >= dims.seqlen_q) break;  // rows grow with i
    T* out = static_cast<T*>(p.dq) + ((batch * dims.seqlen_q + m0 + row) * dims.heads_q + head) * kD;
    reinterpret_cast<uint4*>(out)[piece] = *reinterpret_cast<const uint4*>(&tile[row * kPitch + piece * 8]);
  }
}

}  // namespace jaxflash::sm90
