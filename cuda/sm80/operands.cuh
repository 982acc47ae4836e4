// What the traits of every sm80 kernel share, given the element type, head dim, tile rows and threads: the
// mma.sync atom, the swizzled shared-memory layouts of row-major tiles and their transposed views, the
// shared -> register copy atoms and the 16-byte global-memory copies.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace jaxflash::sm80 {

using namespace cute;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNThreads_>
struct OperandTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNThreads = kNThreads_;
  static constexpr int kNWarps = kNThreads / 32;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;   // Q, O, dO, dQ blocks
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;  // K, V, dK, dV blocks
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;    // scores, P, dS

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>>;
  // Warps split the query rows (FlashAttention-2's "split-Q"): no reduction across warps is ever needed.
  using TiledMmaRows = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  // Shared memory: 8-row atoms of 64 (or 32) columns, XOR-swizzled so that both the 16-byte cp.async stores
  // and the ldmatrix loads are free of bank conflicts.
  template <int kCols>
  using SwizzledAtom = decltype(composition(Swizzle<kCols == 32 ? 2 : 3, 3, 3>{},
                                            Layout<Shape<_8, Int<kCols>>, Stride<Int<kCols>, _1>>{}));
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  using SmemLayoutAtom = SwizzledAtom<kBlockKSmem>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, TileQ{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, TileKV{}));
  // A (rows x cols) layout seen as (cols x rows): the B operand read with ldmatrix.trans.
  template <class Layout_, int kRows, int kCols>
  using Transposed = decltype(composition(Layout_{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));

  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockN * kHeadDim;

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global memory: each thread moves 16 bytes per access, a row of kBlockKSmem columns per thread group.
  static constexpr int kGmemElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerAccess;
  using GmemLayoutThreads = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                   Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemLayoutValues = Layout<Shape<_1, Int<kGmemElemsPerAccess>>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                                                 GmemLayoutThreads{}, GmemLayoutValues{}));
  using GmemTiledCopyOut = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{},
                                                    GmemLayoutThreads{}, GmemLayoutValues{}));
};

}  // namespace jaxflash::sm80
