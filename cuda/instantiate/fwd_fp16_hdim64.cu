#include "launch.cuh"

namespace jaxflash {
template cudaError_t run_fwd<DType::kFP16, 64>(const FwdParams&, cudaStream_t, int);
}  // namespace jaxflash
