// run_fwd<dtype, head_dim>: grid, shared-memory opt-in and the launch; the helpers the backward's launcher
// shares. Included only by instantiate/*.cu.
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

// Raises kKernel's dynamic shared-memory limit once per device (a function attribute is per device).
template <auto kKernel>
cudaError_t allow_smem(int bytes, int device) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  static std::atomic<uint64_t> raised{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (raised.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) raised.fetch_or(bit, std::memory_order_release);
  return err;
}

inline bool grid_fits(int64_t blocks) { return blocks > 0 && blocks <= int64_t(INT32_MAX); }

// Segment ids, softcap or dropout: the kernels' kExtras variant. Everything else (causal, windows, lengths)
// runs in the variant without them, which keeps the plain kernel's registers.
template <class Params>
bool needs_extras(const Params& p) {
  return p.mask.q_segment_ids != nullptr || p.softcap > 0.f || p.dropout.rate > 0.f;
}

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
  return needs_extras(params) ? launch_fwd<Tr, true>(params, stream, device)
                              : launch_fwd<Tr, false>(params, stream, device);
}

}  // namespace jaxflash
