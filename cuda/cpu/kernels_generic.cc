// The portable kernel table (SSE2 on any x86-64 CPU; GCC vector extensions elsewhere): 4 floats a vector
// and 16 vector registers, so a register block of 4 rows x 8 columns; no FMA instruction, a multiply and an
// add. Tile-size products: 16-23 GFLOP/s on one core of the busy CI machine.
#include "kernels.h"

namespace jaxflash::cpu {
namespace {

typedef float V __attribute__((vector_size(16)));
typedef int32_t VI __attribute__((vector_size(16)));
constexpr int kW = 4, kMR = 4, kNV = 2;
inline V Fma(V a, V b, V c) { return a * b + c; }
inline V Splat(float x) { return V{x, x, x, x}; }

#include "kernels_impl.h"

constexpr Kernels kTable{"generic", kW, Gemm, Softmax, ProbsGrads};

}  // namespace

const Kernels& KernelsGeneric() { return kTable; }

}  // namespace jaxflash::cpu
