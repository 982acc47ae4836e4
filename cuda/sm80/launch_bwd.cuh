// sm80::run_bwd<dtype, head_dim>: grids, shared-memory opt-in and the launches. Included only by the
// generated instantiation units.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "bwd_kernel.cuh"
#include "device_info.h"
#include "launch.h"
#include "launch_utils.cuh"

namespace jaxflash::sm80 {

template <class Tr, class TrQ, bool kExtras>
cudaError_t launch_bwd_main(const BwdParams& p, cudaStream_t stream, int device) {
  const bool deterministic = p.deterministic;
  const AttnDims& d = p.dims;
  cudaError_t err;
  // 2. dK, dV (+ dQ atomics).
  constexpr auto kDkDv = &flash_bwd_dkdv_kernel<Tr, kExtras>;
  if ((err = allow_smem<kDkDv>(Tr::kSmemBytes, device)) != cudaSuccess) return err;
  const int64_t kv_blocks = (d.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN * d.batch * d.heads_k;
  if (!grid_fits(kv_blocks)) return cudaErrorInvalidConfiguration;
  kDkDv<<<unsigned(kv_blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, !deterministic);
  if ((err = cudaPeekAtLastError()) != cudaSuccess) return err;
  // 3b. dQ without atomics.
  if (deterministic) {
    constexpr auto kDq = &flash_bwd_dq_kernel<TrQ, kExtras>;
    if ((err = allow_smem<kDq>(TrQ::kSmemBytes, device)) != cudaSuccess) return err;
    const int64_t q_blocks = (d.seqlen_q + TrQ::kBlockM - 1) / TrQ::kBlockM * d.batch * d.heads_q;
    if (!grid_fits(q_blocks)) return cudaErrorInvalidConfiguration;
    kDq<<<unsigned(q_blocks), TrQ::kNThreads, TrQ::kSmemBytes, stream>>>(p);
  }
  return cudaPeekAtLastError();
}

template <DType kDType, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream, int device) {
  const bool deterministic = p.deterministic;
  using T = ElementOf<kDType>;
  using Tr = BwdTraits<T, kHeadDim>;
  using TrQ = BwdDqTraits<T, kHeadDim>;
  cudaError_t err;

  // 1. delta (and dq_accum cleared when dQ is accumulated by atomics).
  const DqAccumClear clear = deterministic ? DqAccumClear::kNone : DqAccumClear::kQRows;
  if ((err = launch_bwd_preprocess<T, kHeadDim>(p, clear, stream)) != cudaSuccess) return err;

  // 2. dK, dV (+ dQ atomics), 3b. dQ without atomics.
  err = with_extras(p, [&](auto extras) {
    return launch_bwd_main<Tr, TrQ, decltype(extras)::value>(p, stream, device);
  });
  if (err != cudaSuccess) return err;

  // 3a. dq = scale · dq_accum.
  return deterministic ? cudaSuccess : launch_convert_dq<T, kHeadDim>(p, stream, device);
}

}  // namespace jaxflash::sm80
