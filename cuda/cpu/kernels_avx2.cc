// The kernel table for AVX2 + FMA (x86-64-v3): 8 floats a vector and 16 vector registers, so a register
// block of 6 rows x 16 columns (12 accumulators, 2 B vectors, a broadcast). Tile-size products: 54-70
// GFLOP/s on one core of the busy CI machine, where the AVX-512 table ran at 63-77.
#include <immintrin.h>

#include "kernels.h"

namespace jaxflash::cpu {
namespace {

typedef __m256 V;
typedef int32_t VI __attribute__((vector_size(32)));
constexpr int kW = 8, kMR = 6, kNV = 2;
inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V Splat(float x) { return _mm256_set1_ps(x); }

#include "kernels_impl.h"

constexpr Kernels kTable{"avx2", kW, Gemm, Softmax, ProbsGrads};

}  // namespace

const Kernels& KernelsAvx2() { return kTable; }

}  // namespace jaxflash::cpu
