// Host-side entries of the sm90 kernel family (wgmma + TMA + warp specialisation; sm_90a only): what the
// generated dispatch (compiled by the host compiler) sees. Defined in launch_fwd.cuh; instantiated once per
// sm90 configuration of cuda/configs.txt by a generated translation unit, compiled for sm_90a alone.
#pragma once

#include <cuda_runtime_api.h>

#include "config.h"
#include "params.h"

namespace jaxflash::sm90 {

// Launch on `stream` and return the launch's error; never synchronise. Expects seqlen_q, seqlen_k > 0 and
// the layouts of params.h (TMA needs 16-byte aligned rows: any head dim of the list qualifies).
template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream, int device);

// The backward. Deterministic mode with segment ids, or at a head dim past 128 (the split-d kernel has no
// ordered adds), gives cudaErrorNotSupported: the handler runs the sm80 family's backward for those. Uses dq's
// buffer as scratch before writing it.
template <DType kDType, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream, int device);

}  // namespace jaxflash::sm90
