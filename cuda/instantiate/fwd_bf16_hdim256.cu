#include "launch.cuh"

namespace jaxflash {
template cudaError_t run_fwd<DType::kBF16, 256>(const FwdParams&, cudaStream_t, int);
}  // namespace jaxflash
