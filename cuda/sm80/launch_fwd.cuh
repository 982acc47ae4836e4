// sm80::run_fwd<dtype, head_dim>: grid, shared-memory opt-in and the launch. Included only by the
// generated instantiation units.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fwd_kernel.cuh"
#include "launch.h"
#include "launch_utils.cuh"

namespace jaxflash::sm80 {

template <class Tr, bool kExtras>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream, int device) {
  constexpr auto kKernel = &flash_fwd_kernel<Tr, kExtras>;
  if (cudaError_t err = allow_smem<kKernel>(Tr::kSmemBytes, device); err != cudaSuccess) return err;
  const int64_t m_blocks = (params.dims.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t grid = m_blocks * params.dims.batch * params.dims.heads_q;
  if (!grid_fits(grid)) return cudaErrorInvalidConfiguration;
  kKernel<<<dim3(unsigned(grid)), dim3(Tr::kNThreads), Tr::kSmemBytes, stream>>>(params);
  return cudaPeekAtLastError();
}

template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream, int device) {
  using Tr = FwdTraits<ElementOf<kDType>, kHeadDim>;
  return with_extras(params,
                     [&](auto extras) { return launch_fwd<Tr, decltype(extras)::value>(params, stream, device); });
}

}  // namespace jaxflash::sm80
