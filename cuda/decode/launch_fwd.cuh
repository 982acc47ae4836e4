// decode::run_fwd<dtype, head_dim>: grids, shared-memory opt-in and the two launches. Included only by the
// generated instantiation units.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "decode/launch.h"
#include "decode/split_kernel.cuh"
#include "launch_utils.cuh"

namespace jaxflash::decode {

template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const DecodeParams& p, cudaStream_t stream, int device) {
  constexpr auto kSplit = &decode_split_kernel<kDType, kHeadDim>;
  constexpr int kSmem = smem_bytes(kHeadDim);
  if (cudaError_t err = allow_smem<kSplit>(kSmem, device); err != cudaSuccess) return err;
  const AttnDims& d = p.fwd.dims;
  const int64_t row_blocks = (d.seqlen_q * d.group() + kRows - 1) / kRows;
  const int64_t tiles = d.batch * d.heads_k * row_blocks;
  if (!grid_fits(tiles) || p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidConfiguration;
  kSplit<<<dim3(unsigned(tiles), unsigned(p.num_splits)), dim3(kThreads), kSmem, stream>>>(p);
  if (cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess || p.num_splits == 1) return err;
  const int64_t rows = d.batch * d.seqlen_q * d.heads_q;
  if (!grid_fits(rows)) return cudaErrorInvalidConfiguration;
  decode_combine_kernel<kDType, kHeadDim><<<dim3(unsigned(rows)), dim3(kCombineThreads), 0, stream>>>(p);
  return cudaPeekAtLastError();
}

}  // namespace jaxflash::decode
