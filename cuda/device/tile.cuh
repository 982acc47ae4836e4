// Tile operations on CuTe tensors shared by the GPU kernels (forward and backward): stage views, predicated
// row copies, the two shared-memory GEMM shapes of mma.sync, and fragment conversions.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace jaxflash {

using namespace cute;

// The same tensor view moved by `offset` elements (a multiple of the swizzle period): another stage buffer.
template <class TensorT>
__forceinline__ __device__ auto at_offset(TensorT const& t, int offset) {
  return make_tensor(t.data() + offset, t.layout());
}

// Copies the rows of a partitioned tile whose row coordinate is below `rows_left`. Loads into shared
// memory zero-fill the other rows (kZeroFill), so that padding rows of Q, K, V and dO hold finite values
// (P is 0 there, and 0·NaN would be NaN); stores to global memory skip them (they belong to other tensors).
template <bool kZeroFill, class TiledCopy, class Src, class Dst, class Coord>
__forceinline__ __device__ void copy_rows(TiledCopy const& tiled_copy, Src const& src, Dst&& dst, Coord const& coord,
                                          int64_t rows_left) {
  CUTE_UNROLL
  for (int i = 0; i < size<1>(src); ++i) {
    if (get<0>(coord(0, i, 0)) < rows_left) {
      copy(tiled_copy, src(_, i, _), dst(_, i, _));
    } else if constexpr (kZeroFill) {
      clear(dst(_, i, _));
    }
  }
}

// One head of a [..., S, H, D] tensor in global memory as a (rows x kCols) row-major view.
template <int kCols, class T>
__forceinline__ __device__ auto gmem_rows(T* ptr, int64_t rows, int64_t row_stride) {
  return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kCols>{}), make_stride(row_stride, _1{}));
}

// acc += A·Bᵀ with both operands in shared memory; ldmatrix of k-slice k+1 overlaps the MMAs of slice k.
template <class Acc, class RA, class RB, class SA, class SB, class TiledMma, class CopyA, class CopyB, class ThrCopyA,
          class ThrCopyB>
__forceinline__ __device__ void gemm_ss(Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB, TiledMma& mma,
                                        CopyA const& copy_a, CopyB const& copy_b, ThrCopyA const& thr_copy_a,
                                        ThrCopyB const& thr_copy_b) {
  Tensor rA_view = thr_copy_a.retile_D(rA);
  Tensor rB_view = thr_copy_b.retile_D(rB);
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// gemm_ss with its register fragments, MMA and copies bound once: gemm(acc, sA, sB).
template <class TiledMma, class RA, class RB, class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
struct GemmSS {
  TiledMma& mma;
  RA& rA;
  RB& rB;
  CopyA const& copy_a;
  CopyB const& copy_b;
  ThrCopyA const& thr_copy_a;
  ThrCopyB const& thr_copy_b;

  template <class Acc, class SA, class SB>
  __forceinline__ __device__ void operator()(Acc& acc, SA const& sA, SB const& sB) const {
    gemm_ss(acc, rA, rB, sA, sB, mma, copy_a, copy_b, thr_copy_a, thr_copy_b);
  }
};

template <class TiledMma, class RA, class RB, class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
__forceinline__ __device__ auto bind_gemm_ss(TiledMma& mma, RA& rA, RB& rB, CopyA const& copy_a, CopyB const& copy_b,
                                             ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  return GemmSS<TiledMma, RA, RB, CopyA, CopyB, ThrCopyA, ThrCopyB>{mma, rA, rB, copy_a, copy_b, thr_copy_a,
                                                                    thr_copy_b};
}

// acc += A·Bᵀ with A already in registers (P) and B in shared memory.
template <class Acc, class RA, class RB, class SB, class TiledMma, class CopyB, class ThrCopyB>
__forceinline__ __device__ void gemm_rs(Acc& acc, RA const& rA, RB& rB, SB const& sB, TiledMma& mma,
                                        CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor rB_view = thr_copy_b.retile_D(rB);
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// fp32 fragment -> Element fragment of the same layout (packed conversions).
template <class To, class TensorT>
__forceinline__ __device__ auto convert_fragment(TensorT const& t) {
  using From = typename std::remove_cv_t<std::remove_reference_t<TensorT>>::value_type;
  constexpr int kN = decltype(size(t))::value;
  Tensor out = make_tensor<To>(t.layout());
  cutlass::NumericArrayConverter<To, From, kN> convert;
  *reinterpret_cast<cutlass::Array<To, kN>*>(raw_pointer_cast(out.data())) =
      convert(*reinterpret_cast<const cutlass::Array<From, kN>*>(raw_pointer_cast(t.data())));
  return out;
}

// The C fragment of two adjacent n8 atoms is exactly the A fragment of one k16 atom:
// ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N/2). This is what lets P feed P·V from registers.
template <class Layout>
__forceinline__ __device__ auto acc_as_a_operand(Layout const& acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// A tensor that only carries a shape (for register fragments of transposed operands); never dereferenced.
template <class T, class Shape_>
__forceinline__ __device__ auto shape_only(T* smem, Shape_ const& shape) {
  return make_tensor(make_smem_ptr(smem), make_layout(shape));
}

}  // namespace jaxflash
