// Tile shapes, shared-memory layouts, MMAs and TMA types of the sm90 backward kernel (wgmma + TMA, sm_90a):
// the only home of its tuning numbers. An unlisted head dim has no BwdTileConfig and fails to compile.
//
// One thread block = one producer warpgroup (one warp issues every TMA load) and two consumer warpgroups that
// own 64 keys each of the kBlockN-key block. Scores are computed transposed, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (keys
// along wgmma's M), so Pᵀ and dSᵀ come out of the accumulators already in the register layout of the A
// operand of dV += Pᵀ·dO and dK += dSᵀ·Q: neither goes through shared memory. dQ = dS·K reads dS from shared
// memory (both warpgroups' keys), the warpgroups splitting dQ's columns (or rows when kBlockM = 128).
// Registers per consumer thread (fp32): dK + dV = 2·(64·d)/128, Sᵀ + dPᵀ = 2·(64·kBlockM)/128, dQ =
// kBlockM·d/256 (its rows' LSE and delta are read from shared memory where they are used):
//   d=64 : 64 x 128: dK+dV 64,  S+dP 64,  dQ 16
//          128 x 128 (kernels without extras, kBlockMPlain): dK+dV 64, S+dP 128, dQ 32, and dSᵀ as an A
//          operand would take 32 more: dK += dSᵀ·Q reads dSᵀ from shared memory instead (kDsFromSmem).
//          ptxas spills ~90 bytes; 8-11 % faster than 64 x 128 on an H100 (its producer no longer waits).
//   d=128: 64 x 128 (kernels with extras, and deterministic ones): dK+dV 128, S+dP 64, dQ 32 (of 240; ptxas
//          spills ~50 bytes)
//          80 x 128 (the others, kBlockMPlain; FlashAttention-3's tile): dK+dV 128, S+dP 80, dQᵀ 40, each
//          query's LSE and delta read where used (kStatsAtUse); 80 rows are no multiple of wgmma's M, so dQᵀ =
//          Kᵀ·dSᵀ with dS stored key-contiguous by stmatrix.trans (kDqTransposed). ptxas spills ~50 bytes.
//          An earlier 80-row try with dSᵀ read from shared memory spilled 136 bytes and ran 14 % slower.
//          Deterministic at 80 rows (the dQ writer keeps the turns) is correct but cost +15-20 % against the
//          plain kernel, where 64 rows cost +10-14 % (H100).
// Shared memory: K, V + kStages of Q and dO + 2 buffers of dS (the next block's dS is written while the other
// warpgroup may still read this one) + kDqBuffers fp32 dQ staging tiles per consumer (two: one may still be read
// by the previous reduce-add):
//   d=64 : 16+16 + 2·(8+8) + 2·16 + 2·16 = 128 KB, 128 rows: 16+16 + 2·(16+16) + 2·32 + 2·32 = 224 KB;
//   d=128: 32+32 + 2·(16+16) + 2·16 + 2·32 = 224 KB, 80 rows with one staging tile: 32+32 + 2·(20+20) + 2·20 +
//          40 = 224 KB
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "params.h"
#include "traits.cuh"

namespace jaxflash::sm90 {

using namespace cute;

// The TMA descriptor of a kernel that does not use one.
struct NoTma {};

template <int kHeadDim>
struct BwdTileConfig;

// kBlockMPlain: the query rows of the kernels without extras (Extras::kNone), kBlockMOrdered those of their
// deterministic ones; the kernels with extras keep kBlockM (dropout's keep bits are drawn for 64 queries).
// kStages: of Q, kStagesDo: of dO.
template <>
struct BwdTileConfig<64> {
  static constexpr int kBlockM = 64, kBlockMPlain = 128, kBlockMOrdered = 128, kBlockN = 128, kStages = 2,
                       kStagesDo = 2;
};
template <>
struct BwdTileConfig<128> {
  static constexpr int kBlockM = 64, kBlockMPlain = 80, kBlockMOrdered = 64, kBlockN = 128, kStages = 2,
                       kStagesDo = 2;
};
// d = 256 (BwdSplitDTraits): one stage of dO, whose 32 KB stage dQ's staging takes instead.
template <>
struct BwdTileConfig<256> {
  static constexpr int kBlockM = 64, kBlockMPlain = 64, kBlockMOrdered = 64, kBlockN = 64, kStages = 2,
                       kStagesDo = 1;
};

template <class Element_, int kHeadDim_, int kBlockM_>
struct BwdTraits {
  static constexpr bool kSplitD = false;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_, kBlockN = BwdTileConfig<kHeadDim_>::kBlockN;
  static constexpr int kStages = BwdTileConfig<kHeadDim_>::kStages, kStagesDo = kStages;
  static_assert(BwdTileConfig<kHeadDim_>::kStagesDo == kStages, "the kernel walks Q and dO in one stage order");
  static constexpr int kMmaWarpGroups = kBlockN / 64;  // wgmma's M is 64: one warpgroup per 64 keys
  static constexpr int kMmaThreads = kMmaWarpGroups * 128;
  static constexpr int kNThreads = kMmaThreads + 128;  // + the producer warpgroup
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(kMmaWarpGroups == 2 && kProducerRegs + 2 * kConsumerRegs == 3 * 168,
                "setmaxnreg blocks forever when the warpgroups ask for more than the block's register budget");
  static_assert(dq_accum_tiles_whole(kBlockM), "dq_accum_rows covers whole tiles of 64, 80 and 128 rows");
  // 128 query rows: dSᵀ leaves the registers (the A operand of dK from shared memory) and each row's LSE and
  // delta are read where used.
  static constexpr bool kDsFromSmem = kBlockM == 128;
  // 80 query rows are no multiple of wgmma's M (64): dQᵀ = Kᵀ·dSᵀ instead, the warpgroups splitting d.
  static constexpr bool kDqTransposed = kBlockM == 80;

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim_>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim_>>;
  using TileSt = Shape<Int<kBlockN>, Int<kBlockM>>;  // (key, query)

  // Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ: both operands in shared memory, d contiguous.
  using AtomKeys = Layout<Shape<Int<kMmaWarpGroups>, _1, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim_>>>(),
      AtomKeys{}));
  // dV += Pᵀ·dO, dK += dSᵀ·Q: A from registers; B is dO (or Q) read as (d, query), d contiguous.
  using TiledMmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim_>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomKeys{}));
  // dK += dSᵀ·Q with dSᵀ read as (key, query) from dS's buffer, queries contiguous (kDsFromSmem).
  using TiledMmaKVss = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim_>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomKeys{}));
  // dQ = dS·K: A is dS (query, key) stored query-contiguous, B is K read as (d, key), d contiguous. Two
  // warpgroups split dQ's kBlockM rows when there are 128, else its d columns.
  // kDqTransposed: dQᵀ = Kᵀ·dSᵀ, A is K read as (d, key), B is dS (query, key) stored key-contiguous.
  static constexpr bool kDqSplitRows = kBlockM == 128;
  using DqAtomShape = std::conditional_t<kDqTransposed, Shape<_64, Int<kBlockM>, Int<kBlockN>>,
                                         Shape<_64, Int<kDqSplitRows ? kHeadDim_ : kHeadDim_ / 2>, Int<kBlockN>>>;
  using DqAtomLayout = std::conditional_t<kDqSplitRows || kDqTransposed, Layout<Shape<_2, _1, _1>>,
                                          Layout<Shape<_1, _2, _1>>>;
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, DqAtomShape, GMMA::Major::MN,
                           kDqTransposed ? GMMA::Major::K : GMMA::Major::MN>(),
      DqAtomLayout{}));
  using TileDqAcc = std::conditional_t<kDqTransposed, Shape<Int<kHeadDim_>, Int<kBlockM>>, TileQ>;
  // One warpgroup's part of dQ (fp32, kDqRows x kDqCols) is staged in shared memory and added into dq_accum.
  // kDqFlat (64 and 80 query rows): in the threads' register order, float4 v of thread t at (v·128 + t)·4 (16-byte
  // stores at fixed offsets, no bank conflicts, no swizzle arithmetic) and one bulk reduce-add of contiguous
  // bytes; dq_accum then holds each query tile in that order (flash_bwd_convert_dq undoes it). fwd+bwd measured
  // 3-4 % faster that way at d = 128, but 2-3 % slower in the 128-row kernels (d = 64), which keep 128-byte
  // swizzled rows and a TMA reduce-add into q's layout.
  static constexpr bool kDqFlat = kBlockM != 128;
  static constexpr int kDqRows = kDqSplitRows ? 64 : kBlockM, kDqCols = kDqSplitRows ? kHeadDim_ : kHeadDim_ / 2;
  static constexpr int kDqChunk = kDqRows * kDqCols;
  // Staging tiles per consumer: two, so that one may still be read by the previous reduce-add; at 80 rows one
  // (shared memory), which the next block's dQ takes once that add has read it.
  static constexpr int kDqBuffers = kDqTransposed ? 1 : 2;
  static_assert(kDqChunk % (4 * 128) == 0);
  using TileDq = Shape<Int<kDqRows>, Int<kDqCols>>;
  using SmemLayoutDq = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, TileDq{}));
  static_assert(cosize_v<SmemLayoutDq> == kDqChunk);

  using SmemAtom = decltype(smem_atom_k_major<Element, kHeadDim_>());
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, TileKV{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim_>, Int<kStages>>{}));
  // The same bytes seen as (d, row[, stage]): the MN-major B operands.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim_>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim_>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutDo = SmemLayoutQ;
  using SmemLayoutDot = SmemLayoutQt;
  // dS (query, key, buffer), query contiguous (key-contiguous for kDqTransposed, where dS is the B operand);
  // seen as (key, query, buffer) it takes the dSᵀ accumulator.
  using SmemLayoutdS = decltype(tile_to_shape(
      std::conditional_t<kDqTransposed, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_MN_SW128_Atom<Element>>{},
      Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  // The dSᵀ accumulator's stores by stmatrix: 8x8 tiles as they are, or transposed into key-contiguous rows.
  using DsStoreAtom = Copy_Atom<std::conditional_t<kDqTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>, Element>;
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_2, _1, _3>{})));

  // Global tensors as TMA sees them: (row, d, head, batch) with 64-bit strides (the forward's types).
  using GmemTensor = typename FwdTraits<Element_, kHeadDim_>::GmemTensor;
  using GmemShape = typename FwdTraits<Element_, kHeadDim_>::GmemShape;
  using GmemStride = typename FwdTraits<Element_, kHeadDim_>::GmemStride;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}), TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{}, TileKV{}, _1{}));
  using GmemTensorF32 = decltype(make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaDq = std::conditional_t<kDqFlat, NoTma, decltype(make_tma_copy(SM90_TMA_REDUCE_ADD{}, GmemTensorF32{},
                                                                          SmemLayoutDq{}, TileDq{}, _1{}))>;
  // dK and dV leave through the K and V tiles in shared memory.
  using TmaDkv = decltype(make_tma_copy(SM90_TMA_STORE{}, typename FwdTraits<Element_, kHeadDim_>::GmemTensorOut{},
                                        SmemLayoutKV{}, TileKV{}, _1{}));

  static constexpr int kQBytes = kBlockM * kHeadDim_ * int(sizeof(Element));  // one stage of Q or of dO
  static constexpr int kKVBytes = kBlockN * kHeadDim_ * int(sizeof(Element));
};

// d = 256 (the split-d kernel, bwd_split_d_kernel.cuh). A warpgroup owning 64 keys would hold dK and dV of
// 2·(64·256)/128 = 256 registers per thread, so here both warpgroups see all kBlockN keys and split the head
// dim instead, as FlashAttention-3 does at 256:
//   S = Q·Kᵀ, dP = dO·Vᵀ: queries along M, each warpgroup kBlockN/2 keys (both operands in shared memory);
//   P and dS go to shared memory (key-contiguous rows), both warpgroups' halves, two buffers;
//   dV += Pᵀ·dO, dK += dSᵀ·Q, dQ = dS·K: every operand in shared memory, each warpgroup d/2 columns;
//   dQ is staged in shared memory in the threads' register order and added into dq_accum by bulk reduce-adds
//   (as kDqFlat in BwdTraits), in two rounds of 16 KB per warpgroup through the 32 KB that a single stage of
//   dO leaves free (dO is released once dV's GEMM has read it, so its next load runs under dQ's and dK's).
//   With 64 keys a block, dQ's adds are twice the bytes per FLOP of d = 128. As vector atomics from registers
//   they took about half of the backward's time (H100, fwd+bwd: 345 TFLOP/s, 652 with the adds left out);
//   staged this way 428. Staging all of dQ at once needs one stage of Q as well, which cost more than it saved
//   (347; without the adds 490).
// Registers per consumer thread: dK + dV 2·(64·128)/128 = 128, S + dP 2·(64·32)/128 = 32, dQ 64 (after S
//   and dP are gone). Shared memory: K, V 32 + 32, Q 2 stages 2·32, dO 1 stage 32, P and dS 2·(8 + 8), dQ
//   staging 2·16 = 224 KB.
template <class Element_, int kHeadDim_>
struct BwdSplitDTraits {
  static constexpr bool kSplitD = true;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = BwdTileConfig<kHeadDim_>::kBlockM, kBlockN = BwdTileConfig<kHeadDim_>::kBlockN;
  static constexpr int kStages = BwdTileConfig<kHeadDim_>::kStages;
  static constexpr int kStagesDo = BwdTileConfig<kHeadDim_>::kStagesDo;
  static constexpr int kMmaWarpGroups = 2;
  static constexpr int kMmaThreads = kMmaWarpGroups * 128;
  static constexpr int kNThreads = kMmaThreads + 128;  // + the producer warpgroup
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(kProducerRegs + 2 * kConsumerRegs == 3 * 168,
                "setmaxnreg blocks forever when the warpgroups ask for more than the block's register budget");
  static_assert(kBlockM == 64 && kBlockN == 64, "dV and dK take all kBlockN keys as wgmma's M of 64");
  static constexpr bool kDqTransposed = false;

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim_>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim_>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;  // (query, key)

  // The warpgroups side by side along N: keys for S and dP, head-dim columns for dV, dK and dQ.
  using AtomSplitN = Layout<Shape<_1, _2, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN / 2>, Int<kHeadDim_>>>(),
      AtomSplitN{}));
  // dV += Pᵀ·dO, dK += dSᵀ·Q: A is P (or dS) read as (key, query), key contiguous; B is dO (or Q) read as
  // (d, query), d contiguous.
  using TiledMmaKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim_ / 2>, Int<kBlockM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      AtomSplitN{}));
  // dQ = dS·K: A is dS (query, key), key contiguous; B is K read as (d, key), d contiguous.
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim_ / 2>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomSplitN{}));
  using TileDqAcc = TileQ;

  using SmemAtom = decltype(smem_atom_k_major<Element, kHeadDim_>());
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, TileKV{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim_>, Int<kStages>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim_>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim_>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutDo = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim_>, Int<kStagesDo>>{}));
  using SmemLayoutDot = decltype(composition(
      SmemLayoutDo{}, make_ordered_layout(Shape<Int<kHeadDim_>, Int<kBlockM>, Int<kStagesDo>>{}, Step<_2, _1, _3>{})));
  // P and dS (query, key, buffer), key contiguous in 128-byte swizzled rows; and as (key, query, buffer).
  using SmemLayoutPdS = decltype(tile_to_shape(smem_atom_k_major<Element, kBlockN>(),
                                               Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_2, _1, _3>{})));

  using GmemTensor = typename FwdTraits<Element_, kHeadDim_>::GmemTensor;
  using GmemShape = typename FwdTraits<Element_, kHeadDim_>::GmemShape;
  using GmemStride = typename FwdTraits<Element_, kHeadDim_>::GmemStride;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}), TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{}, TileKV{}, _1{}));
  using TmaDq = NoTma;  // dQ leaves by bulk reduce-adds in register order
  static constexpr bool kDqFlat = true;
  static constexpr int kDqChunk = kBlockM * kHeadDim_ / 2;  // one warpgroup's columns of dQ
  static constexpr int kDqRounds = 2;                       // staged kDqChunk / kDqRounds floats at a time
  static_assert(kDqChunk % (4 * 128 * kDqRounds) == 0 && dq_accum_tiles_whole(kBlockM));
  using TmaDkv = decltype(make_tma_copy(SM90_TMA_STORE{}, typename FwdTraits<Element_, kHeadDim_>::GmemTensorOut{},
                                        SmemLayoutKV{}, TileKV{}, _1{}));

  static constexpr int kQBytes = kBlockM * kHeadDim_ * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim_ * int(sizeof(Element));
};

// The backward's traits of a head dim: the split-d kernel's past 128; kBlockM: one of BwdTileConfig's query
// tiles (a kernel without extras takes kBlockMPlain or, deterministic, kBlockMOrdered).
template <class Element, int kHeadDim, int kBlockM = BwdTileConfig<kHeadDim>::kBlockM>
using BwdTraitsOf = std::conditional_t<(kHeadDim > 128), BwdSplitDTraits<Element, kHeadDim>,
                                       BwdTraits<Element, kHeadDim, kBlockM>>;

}  // namespace jaxflash::sm90
