// run_bwd<dtype, head_dim>: grids, shared-memory opt-in and the launches. Included only by instantiate/bwd_*.cu.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "flash_bwd_kernel.cuh"
#include "launch_bwd.h"

namespace jaxflash {

template <DType kDType>
using BwdElementOf = std::conditional_t<kDType == DType::kBF16, cutlass::bfloat16_t, cutlass::half_t>;

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

template <DType kDType, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, bool deterministic, cudaStream_t stream, int device) {
  using T = BwdElementOf<kDType>;
  using Tr = BwdTraits<T, kHeadDim>;
  using TrQ = BwdDqTraits<T, kHeadDim>;
  const AttnDims& d = p.dims;
  cudaError_t err;

  // 1. delta (and dq_accum cleared when dQ is accumulated by atomics): one warp per row.
  const int64_t rows = d.batch * d.seqlen_q * d.heads_q;
  const int64_t pre_blocks = (rows + 7) / 8;
  if (!grid_fits(pre_blocks)) return cudaErrorInvalidConfiguration;
  flash_bwd_preprocess_kernel<T, kHeadDim><<<unsigned(pre_blocks), 256, 0, stream>>>(p, !deterministic);
  if ((err = cudaPeekAtLastError()) != cudaSuccess) return err;

  // 2. dK, dV (+ dQ atomics).
  constexpr auto kDkDv = &flash_bwd_dkdv_kernel<Tr>;
  if ((err = allow_smem<kDkDv>(Tr::kSmemBytes, device)) != cudaSuccess) return err;
  const int64_t kv_blocks = (d.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN * d.batch * d.heads_k;
  if (!grid_fits(kv_blocks)) return cudaErrorInvalidConfiguration;
  kDkDv<<<unsigned(kv_blocks), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p, !deterministic);
  if ((err = cudaPeekAtLastError()) != cudaSuccess) return err;

  // 3. dQ.
  if (deterministic) {
    constexpr auto kDq = &flash_bwd_dq_kernel<TrQ>;
    if ((err = allow_smem<kDq>(TrQ::kSmemBytes, device)) != cudaSuccess) return err;
    const int64_t q_blocks = (d.seqlen_q + TrQ::kBlockM - 1) / TrQ::kBlockM * d.batch * d.heads_q;
    if (!grid_fits(q_blocks)) return cudaErrorInvalidConfiguration;
    kDq<<<unsigned(q_blocks), TrQ::kNThreads, TrQ::kSmemBytes, stream>>>(p);
  } else {
    const int64_t n4 = rows * kHeadDim / 4;
    const int64_t blocks = std::min<int64_t>((n4 + 255) / 256, 132 * 16);
    flash_bwd_convert_dq_kernel<T><<<unsigned(blocks), 256, 0, stream>>>(p.dq_accum, static_cast<T*>(p.dq), n4,
                                                                           p.scale);
  }
  return cudaPeekAtLastError();
}

}  // namespace jaxflash
