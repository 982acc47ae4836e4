// sm90::run_bwd<dtype, head_dim>: TMA descriptors, grids, shared-memory opt-in and the launches (preprocess,
// main kernel, dq conversion). Included only by the generated instantiation units.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "bwd_kernel.cuh"
#include "bwd_split_d_kernel.cuh"
#include "device_info.h"
#include "launch.h"
#include "launch_fwd.cuh"
#include "launch_utils.cuh"

namespace jaxflash::sm90 {

// The main kernel and the dq conversion for its layout of dq_accum. kX: the extras compiled in
// (bwd_kernel.cuh); the split-d kernel has only kNone and kAll (its kExtras).
template <class Tr, Extras kX, bool kOrdered>
cudaError_t launch_bwd_main(const BwdParams& p, cudaStream_t stream, int device) {
  using T = typename Tr::Element;
  static_assert(!(Tr::kSplitD && kOrdered), "the split-d kernel has no deterministic mode");
  static_assert(!Tr::kSplitD || kX == Extras::kNone || kX == Extras::kAll, "the split-d kernel: all or none");
  constexpr auto kKernel = [] {
    if constexpr (Tr::kSplitD) return &flash_bwd_split_d_kernel<Tr, kX == Extras::kAll>;
    else return &flash_bwd_kernel<Tr, kX, kOrdered>;
  }();
  using Storage = std::conditional_t<Tr::kSplitD, BwdSplitDSharedStorage<Tr>, BwdSharedStorage<Tr>>;
  constexpr int kSmemBytes = int(sizeof(Storage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than one block may have");
  if (cudaError_t err = allow_smem<kKernel>(kSmemBytes, device); err != cudaSuccess) return err;
  const AttnDims& d = p.dims;
  const int64_t blocks = (d.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN * d.batch * d.heads_k;
  if (!grid_fits(blocks)) return cudaErrorInvalidConfiguration;
  DeviceInfo info;
  if (cudaError_t err = device_info(device, &info); err != cudaSuccess) return err;
  // All of dq_accum cleared, or only its flags where the kernel stores each tile first.
  constexpr DqAccumClear kClear = kStoresFirst<Tr, kOrdered> ? DqAccumClear::kFlags : DqAccumClear::kAll;
  if (cudaError_t err = launch_bwd_preprocess<T, Tr::kHeadDim>(p, kClear, stream); err != cudaSuccess) return err;
  if (kOrdered) {  // the turn counters (bwd_kernel.cuh): 8 bytes per 64 rows of dq
    const size_t turns = size_t(d.batch * d.heads_q * ((d.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM)) *
                         Tr::kMmaWarpGroups;
    if (cudaError_t err = cudaMemsetAsync(p.dq, 0, turns * sizeof(int), stream); err != cudaSuccess) return err;
  }
  const auto q_layout = take<0, 2>(typename Tr::SmemLayoutQ{});
  const BwdKernelParams<Tr> kp{
      p,
      make_tma<Tr>(p.q, d.seqlen_q, d.heads_q, d.batch, q_layout, typename Tr::TileQ{}),
      make_tma<Tr>(p.dout, d.seqlen_q, d.heads_q, d.batch, q_layout, typename Tr::TileQ{}),
      make_tma<Tr>(p.k, d.seqlen_k, d.heads_k, d.batch, typename Tr::SmemLayoutKV{}, typename Tr::TileKV{}),
      make_tma<Tr>(p.v, d.seqlen_k, d.heads_k, d.batch, typename Tr::SmemLayoutKV{}, typename Tr::TileKV{}),
      [&] {
        if constexpr (std::is_same_v<typename Tr::TmaDq, NoTma>) return NoTma{};
        else
          return make_tma_copy(SM90_TMA_REDUCE_ADD{}, gmem_view<Tr>(p.dq_accum, d.seqlen_q, d.heads_q, d.batch),
                               typename Tr::SmemLayoutDq{}, typename Tr::TileDq{}, _1{});
      }(),
      make_tma_copy(SM90_TMA_STORE{}, gmem_view<Tr>(static_cast<T*>(p.dk), d.seqlen_k, d.heads_k, d.batch),
                    typename Tr::SmemLayoutKV{}, typename Tr::TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, gmem_view<Tr>(static_cast<T*>(p.dv), d.seqlen_k, d.heads_k, d.batch),
                    typename Tr::SmemLayoutKV{}, typename Tr::TileKV{}, _1{}),
      kOrdered ? ordered_launch(d, Tr::kBlockM, info.multiprocessors, adds_descending(p.mask))
               : OrderedLaunch{1, 1, false},
  };
  kKernel<<<dim3(unsigned(blocks)), dim3(Tr::kNThreads), kSmemBytes, stream>>>(kp);
  if (cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess) return err;
  if constexpr (!Tr::kDqFlat) {
    return launch_convert_dq<T, Tr::kHeadDim>(p, stream, device);  // dq_accum in q's layout (128-row kernels)
  } else {
    const int64_t tiles = (d.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM * d.batch * d.heads_q;
    if (!grid_fits(tiles)) return cudaErrorInvalidConfiguration;
    flash_bwd_convert_dq<Tr, kStoresFirst<Tr, kOrdered>><<<unsigned(tiles), Tr::kMmaThreads, 0, stream>>>(p);
    return cudaPeekAtLastError();
  }
}

template <DType kDType, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream, int device) {
  using T = ElementOf<kDType>;
  using Tr = BwdTraitsOf<T, kHeadDim>;
  // Deterministic with segment ids or past d = 128: the sm80 family's (the handler's choice).
  if (p.deterministic && (Tr::kSplitD || p.mask.q_segment_ids != nullptr)) return cudaErrorNotSupported;
  // One extra alone runs a kernel of its own (bwd_kernel.cuh), except in deterministic calls, whose ordered
  // kernels are those with none and with all (an ordered kernel of dropout alone measured 2 % slower).
  const bool cap = p.softcap > 0.f, drop = p.dropout.rate > 0.f, seg = p.mask.q_segment_ids != nullptr;
  const bool alone = !Tr::kSplitD && !p.deterministic && !seg && cap != drop;
  auto launch = [&](auto x) -> cudaError_t {
    constexpr Extras kX = decltype(x)::value;
    constexpr bool kAlone = kX == Extras::kSoftcap || kX == Extras::kDropout;
    // Without extras, the kernels' own tiles (kBlockMPlain, kBlockMOrdered).
    using Cfg = BwdTileConfig<kHeadDim>;
    using TrX = std::conditional_t<kX == Extras::kNone, BwdTraitsOf<T, kHeadDim, Cfg::kBlockMPlain>, Tr>;
    using TrO = std::conditional_t<kX == Extras::kNone, BwdTraitsOf<T, kHeadDim, Cfg::kBlockMOrdered>, Tr>;
    if constexpr (Tr::kSplitD && kAlone) return cudaErrorNotSupported;  // never chosen: alone is false
    else if constexpr (Tr::kSplitD || kAlone) return launch_bwd_main<TrX, kX, false>(p, stream, device);
    else
      return p.deterministic ? launch_bwd_main<TrO, kX, true>(p, stream, device)
                             : launch_bwd_main<TrX, kX, false>(p, stream, device);
  };
  using std::integral_constant;
  return alone ? (cap ? launch(integral_constant<Extras, Extras::kSoftcap>{})
                      : launch(integral_constant<Extras, Extras::kDropout>{}))
               : (needs_extras(p) ? launch(integral_constant<Extras, Extras::kAll>{})
                                  : launch(integral_constant<Extras, Extras::kNone>{}));
}

}  // namespace jaxflash::sm90
