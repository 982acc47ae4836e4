// Host-side entries of the sm80 kernel family (mma.sync + cp.async; runs on sm_80 and every later GPU):
// what the generated dispatch (compiled by the host compiler) sees. Defined in launch_fwd.cuh and
// launch_bwd.cuh; instantiated once per configuration of cuda/configs.txt by a generated translation unit.
#pragma once

#include <cuda_runtime_api.h>

#include "config.h"
#include "params.h"

namespace jaxflash::sm80 {

// Launch on `stream` and return the launch's error; never synchronise. The forward expects seqlen_q,
// seqlen_k > 0. The backward launches preprocess, dK/dV and the dQ pass (p.deterministic replaces the dQ
// atomics by a separate dQ kernel) and writes every output (dq, dk, dv, dq_accum, delta).
template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream, int device);

template <DType kDType, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream, int device);

}  // namespace jaxflash::sm80
