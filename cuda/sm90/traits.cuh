// Tile shapes, shared-memory layouts, MMAs and TMA types of the sm90 forward kernel (wgmma + TMA, sm_90a):
// the only home of its tuning numbers. An unlisted head dim has no TileConfig and fails to compile.
//
// One thread block = one producer warpgroup (one warp issues every TMA load; it keeps 24 registers, 56 in the
// d=64 dropout kernel, whose other three warps draw the mask) and two consumer warpgroups of 64 query rows
// each (240 registers: 24 + 2·240 = 3·168, the budget of 384 threads).
// A consumer holds S (kBlockN/2 fp32 per thread), P (kBlockN/4) and O (d/2) at once, since P·V of one block
// runs while the softmax of the next is computed. The K and V stages fill shared memory:
//   d=64 : 128 x 192, 2 stages:  16 KB Q + 2·2·24 KB K/V = 112 KB;  S 96 + P 48 + O 32 regs (a 128-key
//          block is too short a GEMM to hide the softmax and the barriers: 421 vs 496 TFLOP/s for cuDNN)
//   d=128: 128 x 128, 2 stages:  32 KB Q + 2·2·32 KB     = 160 KB;  S 64 + P 32 + O 64
//   d=256: 128 x 80,  2 stages:  64 KB Q + 2·2·40 KB     = 224 KB;  S 40 + P 20 + O 128 (N = 80 is an
//          "extended" wgmma shape: the build defines CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "schedule.h"

namespace jaxflash::sm90 {

using namespace cute;

template <int kHeadDim>
struct TileConfig;

template <>
struct TileConfig<64> {
  static constexpr int kBlockM = 128, kBlockN = 192, kStages = 2;
};
template <>
struct TileConfig<128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
};
template <>
struct TileConfig<256> {
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2;
};

// The widest swizzle whose atom row (8 rows x 128, 64 or 32 bytes) divides the head dim: wgmma reads it
// without bank conflicts and TMA writes it in one pass.
template <class T, int kCols>
auto smem_atom_k_major() {
  constexpr int kBytes = kCols * int(sizeof(T));
  if constexpr (kBytes % 128 == 0) return GMMA::Layout_K_SW128_Atom<T>{};
  else if constexpr (kBytes % 64 == 0) return GMMA::Layout_K_SW64_Atom<T>{};
  else return GMMA::Layout_K_SW32_Atom<T>{};
}

template <class Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = TileConfig<kHeadDim_>::kBlockM, kBlockN = TileConfig<kHeadDim_>::kBlockN;
  static constexpr int kStages = TileConfig<kHeadDim_>::kStages;
  static constexpr int kMmaWarpGroups = kBlockM / 64;  // wgmma's M is 64: one warpgroup per 64 query rows
  static constexpr int kMmaThreads = kMmaWarpGroups * 128;
  static constexpr int kNThreads = kMmaThreads + 128;  // + the producer warpgroup
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // A row's softmax max moves only when it grows by more than 2^8 in probability (softmax.cuh): O is rescaled
  // on few blocks instead of whenever some row of a warp meets a larger score. Not at d = 64, where the
  // rescale is cheap and the extra test per row cost 4 % (measured).
  static constexpr int kRescaleSlackLog2 = kHeadDim_ >= 128 ? 8 : 0;
  // Dropout's Philox draws (most of its cost) run on the producer warpgroup's three idle warps, a block ahead,
  // into shared memory, and a consumer only masks P: at d=64 (dropout 8.9 -> 8.05 ms at S=16k, 32 heads).
  // At d=128 the drawing warps fall behind (their Philox issues at about 0.1 IPC beside the consumers') and
  // the consumers wait: 4.5 -> 4.8-5.0 ms; they draw themselves there. The drawing warps need more registers
  // than the TMA warp's 24 (spills in the Philox rounds).
  static constexpr bool kKeepsAhead = kHeadDim_ <= 64;
  static constexpr int kDrawProducerRegs = 56, kDrawConsumerRegs = 224;
  static constexpr int kKeepGroups = kBlockN / 16, kKeepWordsPerRow = 4 * ((kKeepGroups + 7) / 8);
  static_assert(kDrawProducerRegs + 2 * kDrawConsumerRegs == 3 * 168);
  static_assert(kMmaWarpGroups == 2 && kProducerRegs + 2 * kConsumerRegs == 3 * 168,
                "setmaxnreg blocks forever when the warpgroups ask for more than the block's register budget");
  static_assert(kBlockN % 16 == 0 && kHeadDim_ % 16 == 0);
  static_assert(kBlockM == kFwdTileRows && kMmaThreads == kFwdConsumerThreads, "schedule.h's tile");
  static constexpr bool kSplitTail = tail_split_pays(kHeadDim_);  // a kernel that splits the last round

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim_>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim_>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

  // S = Q·Kᵀ with both operands in shared memory; O += P·V with P from registers and V read as the
  // (d x kBlockN) operand Vᵀ, i.e. "MN-major" (its d axis is contiguous).
  using AtomLayout = Layout<Shape<Int<kMmaWarpGroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim_>>>(),
      AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim_>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  using SmemAtom = decltype(smem_atom_k_major<Element, kHeadDim_>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, TileQ{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim_>, Int<kStages>>{}));
  // The same bytes as V's stages, seen as (d, kBlockN, stage).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim_>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // Global tensors as TMA sees them: (row, d, head, batch) with 64-bit strides.
  using GmemShape = Shape<int32_t, Int<kHeadDim_>, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{},
                                          GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}, TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutKV{}), TileKV{}, _1{}));

  static constexpr int kQBytes = kBlockM * kHeadDim_ * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim_ * int(sizeof(Element));  // one stage of K or of V

  // O leaves through shared memory and a TMA store per consumer (its 64 rows) where that fits beside the
  // K/V stages (d=64 and 128: +16 and +32 KB); at d=256 the threads store it from registers.
  static constexpr bool kStoreOViaSmem = kQBytes + 2 * kStages * kKVBytes + kQBytes <= 200 * 1024;
  using TileO = Shape<_64, Int<kHeadDim_>>;
  using SmemLayoutO = decltype(tile_to_shape(SmemAtom{}, TileO{}));
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutO{}, TileO{}, _1{}));
};

}  // namespace jaxflash::sm90
