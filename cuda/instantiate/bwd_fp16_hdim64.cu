#include "launch_bwd.cuh"

namespace jaxflash {
template cudaError_t run_bwd<DType::kFP16, 64>(const BwdParams&, bool, cudaStream_t, int);
}  // namespace jaxflash
