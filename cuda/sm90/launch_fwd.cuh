// sm90::run_fwd<dtype, head_dim>: TMA descriptors, grid, shared-memory opt-in and the launch. Included only
// by the generated instantiation units.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fwd_kernel.cuh"
#include "launch.h"
#include "device_info.h"
#include "launch_utils.cuh"

namespace jaxflash::sm90 {

// (row, d, head, batch) view of a [batch, rows, heads, d] tensor, for every TMA descriptor of the family.
template <class Tr, class T>
auto gmem_view(T* ptr, int64_t rows, int64_t heads, int64_t batch) {
  constexpr int kD = Tr::kHeadDim;
  auto shape = typename Tr::GmemShape{int32_t(rows), Int<kD>{}, int32_t(heads), int32_t(batch)};
  auto stride = typename Tr::GmemStride{heads * kD, _1{}, int64_t(kD), rows * heads * kD};
  return make_tensor(make_gmem_ptr(ptr), shape, stride);
}

// A load descriptor embeds the data pointer, so it is rebuilt at every call (host-only work: no device memory,
// no stream operation).
template <class Tr, class SmemLayout, class Tile>
auto make_tma(const void* ptr, int64_t rows, int64_t heads, int64_t batch, SmemLayout smem_layout, Tile tile) {
  using T = typename Tr::Element;
  return make_tma_copy(SM90_TMA_LOAD{}, gmem_view<Tr>(static_cast<const T*>(ptr), rows, heads, batch), smem_layout,
                       tile, _1{});
}

template <class Tr, bool kExtras>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream, int device, bool persistent, bool uniform) {
  constexpr int kSmemBytes = int(sizeof(FwdSharedStorage<Tr>));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than one block may have");
  const AttnDims& d = p.dims;
  const int64_t tiles = (d.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM * d.batch * d.heads_q;
  if (!grid_fits(tiles)) return cudaErrorInvalidConfiguration;
  DeviceInfo info;
  if (cudaError_t err = device_info(device, &info); err != cudaSuccess) return err;
  // Tiles that cost alike: the last ones split between all SMs (schedule.h), counters zeroed first.
  const int64_t n_blocks = (d.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const TailSchedule tail =
      Tr::kSplitTail && persistent && uniform
          ? make_tail_schedule(tiles, n_blocks, info.multiprocessors, Tr::kHeadDim, p.workspace, p.workspace_floats)
          : TailSchedule{uint32_t(tiles), uint32_t(n_blocks)};
  if (tail.sk_ctas > 0)
    if (cudaError_t err = cudaMemsetAsync(tail.counters, 0, 2 * (tiles - tail.dp_tiles) * sizeof(int), stream);
        err != cudaSuccess)
      return err;
  const int64_t grid = tail.sk_ctas > 0 ? info.multiprocessors
                       : persistent     ? std::min<int64_t>(tiles, info.multiprocessors)
                                        : tiles;
  const auto kv_layout = take<0, 2>(typename Tr::SmemLayoutKV{});
  const FwdKernelParams<Tr> kp{
      p,
      make_tma<Tr>(p.q, d.seqlen_q, d.heads_q, d.batch, typename Tr::SmemLayoutQ{}, typename Tr::TileQ{}),
      make_tma<Tr>(p.k, d.seqlen_k, d.heads_k, d.batch, kv_layout, typename Tr::TileKV{}),
      make_tma<Tr>(p.v, d.seqlen_k, d.heads_k, d.batch, kv_layout, typename Tr::TileKV{}),
      make_tma_copy(SM90_TMA_STORE{},
                    gmem_view<Tr>(static_cast<typename Tr::Element*>(p.o), d.seqlen_q, d.heads_q, d.batch),
                    typename Tr::SmemLayoutO{}, typename Tr::TileO{}, _1{}),
      tail,
  };
  auto launch = [&](auto split) {
    auto go = [&](auto dropout) {
      constexpr auto kKernel = &flash_fwd_kernel<Tr, kExtras, decltype(split)::value, decltype(dropout)::value>;
      if (cudaError_t err = allow_smem<kKernel>(kSmemBytes, device); err != cudaSuccess) return err;
      kKernel<<<dim3(unsigned(grid)), dim3(Tr::kNThreads), kSmemBytes, stream>>>(kp);
      return cudaPeekAtLastError();
    };
    if constexpr (kExtras) {
      if (p.dropout.rate > 0.f) return go(std::true_type{});
    }
    return go(std::false_type{});
  };
  if constexpr (Tr::kSplitTail) {
    if (tail.sk_ctas > 0) return launch(std::true_type{});
  }
  return launch(std::false_type{});
}

template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream, int device) {
  using Tr = FwdTraits<ElementOf<kDType>, kHeadDim>;
  // Persistent (one block per SM looping over tiles) when tiles cost alike: no window (causal is one), which
  // would leave the blocks of light tiles idle, and no segment ids (the kernel narrows those per block).
  const MaskParams& m = params.mask;
  const bool persistent = m.window_left < 0 && m.window_right < 0 && m.q_segment_ids == nullptr;
  const bool uniform = persistent && m.q_lengths == nullptr && m.kv_lengths == nullptr;  // every tile alike
  return with_extras(params, [&](auto extras) {
    return launch_fwd<Tr, decltype(extras)::value>(params, stream, device, persistent, uniform);
  });
}

}  // namespace jaxflash::sm90
