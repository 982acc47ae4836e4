// Host-side entry of the CUDA backward kernels: what the FFI handler (compiled by the host compiler) sees.
// Defined in launch_bwd.cuh; explicitly instantiated once per (dtype, head dim) in instantiate/bwd_*.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "launch.h"  // DType
#include "params.h"

namespace jaxflash {

// Launches preprocess, dK/dV and the dQ pass on `stream`; returns the first launch error (never
// synchronises). `deterministic` replaces the dQ atomics by a separate dQ kernel (bitwise reproducible).
// Expects seqlen_q, seqlen_k > 0; every output (dq, dk, dv, dq_accum, delta) is written.
template <DType kDType, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, bool deterministic, cudaStream_t stream, int device);

}  // namespace jaxflash
