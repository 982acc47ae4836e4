#include "launch_bwd.cuh"

namespace jaxflash {
template cudaError_t run_bwd<DType::kBF16, 96>(const BwdParams&, bool, cudaStream_t, int);
}  // namespace jaxflash
