// Host-side entry of the CUDA forward kernel: what the FFI handler (compiled by the host compiler) sees.
// Defined in launch.cuh; explicitly instantiated once per (dtype, head dim) in instantiate/*.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "params.h"

namespace jaxflash {

enum class DType { kBF16, kFP16 };

// Launches the forward kernel on `stream`; returns the launch's error (never synchronises).
template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream, int device);

}  // namespace jaxflash
