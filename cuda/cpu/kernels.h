// The vector kernels of the CPU twin, one table per instruction set. flash_cpu.cc (compiled for baseline
// x86-64) keeps the tiling, masks and threads, and calls these for the work that scales with a tile's area:
// the matrix products, the online softmax and the backward's P and dS.
//
// Each table lives in its own translation unit, compiled with that instruction set's flags
// (kernels_avx512.cc, kernels_avx2.cc, kernels_generic.cc) and picked at run time by the CPU's features,
// so one build serves every x86-64 CPU. Those units include nothing with vague linkage (no std templates,
// no shared inline headers): the linker can then never hand an AVX-512 copy of a shared inline function to
// baseline code.
#pragma once

#include <cstdint>

namespace jaxflash::cpu {

// C[m x n] = A[m x k] B[k x n] (+ row_scale[i] * C[i, :] when accumulate; row_scale null: 1).
// A's element (i, l) is a[i * a_row + l * a_col], one of the two strides being 1 (a row-major A, or the
// transpose of a row-major tile). B and C are row-major with ldb / ldc. n must be a multiple of the table's
// `vec`, and B and C readable (C writable) up to column n: the tiles are padded. k is exact, so padding never
// enters a sum.
struct GemmArgs {
  const float* a;
  int64_t a_row, a_col;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
  int64_t m, n, k;
  bool accumulate;
  const float* row_scale;
};

// One step of the forward's online softmax on a transposed score tile st[key j][query i] (row stride ld,
// `keys` rows, n query columns, n a multiple of vec): per query i, m[i] becomes max(m[i], max_j st[j][i]),
// st becomes P = exp(st - m), l[i] = l[i] * alpha[i] + sum_j P, with alpha[i] = exp(m_old - m_new) written
// out for rescaling O. A query whose max is still -inf gets P = 0 and alpha = 0.
struct SoftmaxArgs {
  float* st;
  int64_t ld, keys, n;
  float *m, *l, *alpha;
};

// The backward's elementwise step on transposed tiles [key j][query i] (row stride ld, n a multiple of vec):
//   P = exp(s - lse[i])               (0 where lse[i] = -inf: a row that sees nothing)
//   dS = P (dP * z - delta[i])        (0 where P = 0), times 1 - (s / softcap)^2 when softcap > 0
//   P *= z                            (z: the dropout factor, 0 or keep_scale; null = no dropout)
// `s` enters in pt and leaves as P (times z); dP enters in dpt and leaves as dS.
struct ProbsGradsArgs {
  float* pt;
  float* dpt;
  const float* zt;
  int64_t ld, keys, n;
  const float *lse, *delta;
  float softcap;
};

struct Kernels {
  const char* name;
  int64_t vec;  // floats per vector register
  void (*gemm)(const GemmArgs&);
  void (*softmax)(const SoftmaxArgs&);
  void (*probs_grads)(const ProbsGradsArgs&);
};

const Kernels& KernelsAvx512();
const Kernels& KernelsAvx2();
const Kernels& KernelsGeneric();

}  // namespace jaxflash::cpu
