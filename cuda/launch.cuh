// run_fwd<dtype, head_dim>: grid, shared-memory opt-in and the launch. Included only by instantiate/*.cu.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "flash_fwd_kernel.cuh"
#include "launch.h"

namespace jaxflash {

template <DType kDType>
using ElementOf = std::conditional_t<kDType == DType::kBF16, cutlass::bfloat16_t, cutlass::half_t>;

template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream, int device) {
  using Tr = FwdTraits<ElementOf<kDType>, kHeadDim>;
  auto* kernel = &flash_fwd_kernel<Tr>;
  constexpr int kSmem = Tr::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    // A function attribute is per device: raise the limit once for each device that launches this kernel.
    static std::atomic<uint64_t> raised{0};
    const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
    if (bit == 0 || !(raised.load(std::memory_order_acquire) & bit)) {
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      if (err != cudaSuccess) return err;
      raised.fetch_or(bit, std::memory_order_release);
    }
  }
  const int64_t m_blocks = (params.dims.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t grid = m_blocks * params.dims.batch * params.dims.heads_q;
  if (grid <= 0 || grid > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(grid)), dim3(Tr::kNThreads), kSmem, stream>>>(params);
  return cudaPeekAtLastError();
}

}  // namespace jaxflash
