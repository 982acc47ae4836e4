// Host-side helpers of every GPU family's launchers: the CUTLASS element type of a DType, the per-device
// shared-memory opt-in, grid limits, and which kernel variant a call needs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cutlass/numeric_types.h>

#include "config.h"

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

// launch(std::bool_constant<kExtras>{}) with the variant the call needs.
template <class Params, class Launch>
cudaError_t with_extras(const Params& p, Launch&& launch) {
  return needs_extras(p) ? launch(std::true_type{}) : launch(std::false_type{});
}

}  // namespace jaxflash
