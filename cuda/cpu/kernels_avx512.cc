// The kernel table for AVX-512 (AVX512F/DQ/BW/VL, as in x86-64-v4): 16 floats a vector and 32 vector
// registers, so a register block of 8 rows x 32 columns (16 accumulators, 2 B vectors, a broadcast).
// Products of tile size (m, n, k in 64..256, operands in cache) ran at 93-109 GFLOP/s on one core of the
// idle 2-core CI machine (an AMD EPYC of the Zen 4 kind, one 16-wide FMA a cycle: 32 flops a cycle at a
// boost clock of ~3.1-3.4 GHz, so near its peak).
#include <immintrin.h>

#include "kernels.h"

namespace jaxflash::cpu {
namespace {

typedef __m512 V;
typedef int32_t VI __attribute__((vector_size(64)));
constexpr int kW = 16, kMR = 8, kNV = 2;
inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V Splat(float x) { return _mm512_set1_ps(x); }

#include "kernels_impl.h"

constexpr Kernels kTable{"avx512", kW, Gemm, Softmax, ProbsGrads};

}  // namespace

const Kernels& KernelsAvx512() { return kTable; }

}  // namespace jaxflash::cpu
