// Host-side entry of the decode kernel family (mma.sync + cp.async, every GPU from sm_80 on): what the
// generated dispatch sees. Defined in launch_fwd.cuh, instantiated per configuration of cuda/configs.txt.
#pragma once

#include <cuda_runtime_api.h>

#include "config.h"
#include "params.h"

namespace jaxflash::decode {

// Launches the split kernel and, with p.num_splits > 1, the merge; never synchronises. Expects
// seqlen_q > 0 and p.num_splits in [1, kMaxSplits].
template <DType kDType, int kHeadDim>
cudaError_t run_fwd(const DecodeParams& p, cudaStream_t stream, int device);

}  // namespace jaxflash::decode
