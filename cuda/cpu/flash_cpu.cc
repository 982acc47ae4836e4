// FlashAttention-2 on the CPU, the same algorithm as the CUDA kernels.
//
// Forward, per (batch, head, query block): stream K/V blocks, S = Q K^T, online softmax with a running
// row max m and sum l (rescaling O and l when m rises), O += P V; O and LSE = m + log(l) written once.
// Backward recomputes P = exp(S - LSE) block by block and never forms an N x N matrix:
//   pass 1, per (batch, key head, key block): dV += P^T dO, dK += dS^T Q, with dS = P (dP - delta),
//           dP = dO V^T, delta = rowsum(dO * O) - dLSE, summed over the query heads of the GQA group
//           (dLSE, the cotangent of the returned LSE, enters because dLSE/dS = P);
//   pass 2, per (batch, head, query block): dQ += dS K, accumulated in the fp32 workspace dq_accum.
// Splitting dQ from dK/dV costs one more recompute of P but needs no atomics, so results are
// deterministic. Masks (mask.h) skip whole K/V blocks where they can and mask single scores on the rest;
// softcap transforms the scores; dropout (philox.h) scales P after its row sum, in both passes alike.
// Layouts: params.h.
#include "flash_cpu.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "mask.h"
#include "philox.h"

namespace jaxflash::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// --- element conversions (bf16 / fp16 are stored as uint16_t) ---------------------------------------
struct F32 { using Storage = float; };
struct BF16 { using Storage = uint16_t; };
struct F16 { using Storage = uint16_t; };

inline float ToFloat(F32, float x) { return x; }
inline float ToFloat(BF16, uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ToFloat(F16, uint16_t x) {
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return float(h);
}
inline float FromFloat(F32, float x) { return x; }
inline uint16_t FromFloat(BF16, float x) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline uint16_t FromFloat(F16, float x) {
  _Float16 h = static_cast<_Float16>(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

// Eight floats (ints) as one GCC/Clang vector: two SSE registers on baseline x86-64, one AVX register
// where the compiler may use it. Spelling vectors out keeps the compiler from vectorising the wrong loop.
typedef float Vec8 __attribute__((vector_size(32)));
typedef int32_t Int8 __attribute__((vector_size(32)));

inline Vec8 Load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec8 Splat8(float x) { return Vec8{x, x, x, x, x, x, x, x}; }

// exp(x), eight at a time (libm's expf is a scalar call): x log2(e) = n + f with n an integer and
// |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error < 2e-7, about 1 ulp), 2^n put into the
// exponent bits. Inputs below -87 (incl. -inf) give exactly 0; the softmax never passes more than 0, as it
// subtracts the running max first.
inline Vec8 Exp8(Vec8 x) {
  const Vec8 lo = Splat8(-87.f);
  const Vec8 t = (x < lo ? lo : x) * Splat8(1.44269504088896341f);
  const Int8 n = __builtin_convertvector(t + (t >= Splat8(0.f) ? Splat8(0.5f) : Splat8(-0.5f)), Int8);
  const Vec8 f = t - __builtin_convertvector(n, Vec8);
  Vec8 p = Splat8(1.5403530393381606e-4f);  // ln(2)^k / k!, k = 6 .. 0
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.f;
  const Vec8 two_n = reinterpret_cast<Vec8>((n + 127) << 23);
  return x < lo ? Splat8(0.f) : p * two_n;
}

inline float Exp(float x) { return Exp8(Splat8(x))[0]; }

// Row max and exp-and-sum, eight lanes at a time (a single running max or sum is a serial dependency).
inline float RowMax(const float* x, int64_t n) {
  Vec8 lanes = Splat8(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Vec8 v = Load8(x + i);
    lanes = v > lanes ? v : lanes;
  }
  float m = kNegInf;
  for (; i < n; ++i) m = std::max(m, x[i]);
  for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
  return m;
}

// x[i] = exp(x[i] - shift); returns the sum.
inline float ExpShiftSum(float* x, int64_t n, float shift) {
  Vec8 lanes = Splat8(0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Vec8 e = Exp8(Load8(x + i) - shift);
    Store8(x + i, e);
    lanes += e;
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += (x[i] = Exp(x[i] - shift));
  for (int j = 0; j < 8; ++j) sum += lanes[j];
  return sum;
}

// --- a minimal parallel-for: n independent items over the machine's cores -------------------------
// Each worker builds its own scratch once (`make_scratch`) and reuses it for every item it takes,
// so nothing is allocated per block.
template <typename MakeScratch, typename Body>
void ParallelFor(int64_t n, int64_t flops_per_item, MakeScratch make_scratch, Body body) {
  if (n <= 0) return;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  // Starting a thread costs ~tens of microseconds; below ~1 MFLOP of work in all it does not pay.
  const int64_t workers = (n * flops_per_item < (int64_t(1) << 20)) ? 1 : std::min(hw, n);
  std::atomic<int64_t> next{0};
  auto run = [&] {
    auto scratch = make_scratch();
    for (int64_t i = next++; i < n; i = next++) body(i, scratch);
  };
  std::vector<std::thread> threads;
  for (int64_t t = 1; t < workers; ++t) threads.emplace_back(run);
  run();
  for (auto& t : threads) t.join();
}

// --- tiles and the one matrix product everything is made of --------------------------------------
// C (+)= A B, A [m x k] (lda), B [k x n] (ldb), C [m x n] (ldc), all row-major float. A kMR x kNR block
// of C stays in registers over the whole k loop (the compiler vectorises the fixed-size inner loops), so
// each loaded element of B feeds kMR multiply-adds. m and n are rounded up to kMR / kNR: tiles are
// allocated padded and whatever lands in the padding is never read back. The reduction length k is exact,
// so padding never enters a sum.
constexpr int64_t kMR = 8, kNR = 8;

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Also compiled for Haswell (AVX2 + FMA), picked at load time where the CPU has it.
__attribute__((target_clones("arch=haswell", "default")))
void Gemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m, int64_t n,
          int64_t k, bool accumulate) {
  static_assert(kNR == 8, "one Vec8 per register-block row");
  for (int64_t i0 = 0; i0 < m; i0 += kMR) {
    const float* a0 = a + i0 * lda;
    for (int64_t j0 = 0; j0 < n; j0 += kNR) {
      Vec8 acc[kMR] = {};
      for (int64_t l = 0; l < k; ++l) {
        const Vec8 bv = Load8(b + l * ldb + j0);
        for (int64_t i = 0; i < kMR; ++i) acc[i] += a0[i * lda + l] * bv;
      }
      for (int64_t i = 0; i < kMR; ++i) {
        float* out = c + (i0 + i) * ldc + j0;
        Store8(out, accumulate ? acc[i] + Load8(out) : acc[i]);
      }
    }
  }
}

// A dense float tile with padded dims, allocated once per worker.
struct Tile {
  std::vector<float> data;
  int64_t ld = 0;
  Tile(int64_t rows, int64_t cols) : data(RoundUp(rows, kMR) * RoundUp(cols, kNR), 0.f), ld(RoundUp(cols, kNR)) {}
  float* row(int64_t r) { return data.data() + r * ld; }
  float* ptr() { return data.data(); }
};

// Copies `rows` x `d` elements (rows `stride` apart) into `dst` as float, times `mul`.
template <typename Tag>
void LoadTile(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, float mul,
              Tile& dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst.row(r)[c] = ToFloat(tag, src[r * stride + c]) * mul;
}

// The same, transposed: dst[c][r] = src[r][c]. Strided reads, contiguous writes (cheaper than the reverse).
template <typename Tag>
void LoadTileT(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, Tile& dst) {
  for (int64_t c = 0; c < d; ++c) {
    float* out = dst.row(c);
    for (int64_t r = 0; r < rows; ++r) out[r] = ToFloat(tag, src[r * stride + c]);
  }
}

void Transpose(Tile& src, int64_t rows, int64_t cols, Tile& dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst.row(c)[r] = src.row(r)[c];
}

// Scores of one tile: S = Q K^T (K given transposed), soft-capped when softcap > 0, -inf where the mask
// hides (i, j). `full`: the whole tile is visible, the predicate is skipped.
void Scores(Tile& q, Tile& kt, int64_t rows, int64_t cols, int64_t d, int64_t row0, int64_t col0,
            const BatchMask& mask, bool full, float softcap, Tile& s) {
  Gemm(q.ptr(), q.ld, kt.ptr(), kt.ld, s.ptr(), s.ld, rows, cols, d, false);
  if (softcap > 0.f)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) s.row(r)[c] = softcap_score(s.row(r)[c], softcap);
  if (full) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (!is_visible(mask, row0 + r, col0 + c)) s.row(r)[c] = kNegInf;
}

// x[c] *= keep(row, col0 + c) / (1 - rate) for c < cols: dropout of one row of probabilities. One Philox
// call serves four adjacent columns (philox.h).
void ApplyDropout(const DropoutDraw& d, float inv_keep, uint32_t head, uint32_t row, int64_t col0, int64_t cols,
                  float* x) {
  for (int64_t c = 0; c < cols;) {
    const int64_t group = (col0 + c) >> 2;
    const uint32_t bits = dropout_keep4(d, head, row, uint32_t(group));
    for (; c < cols && ((col0 + c) >> 2) == group; ++c) x[c] *= ((bits >> ((col0 + c) & 3)) & 1u) ? inv_keep : 0.f;
  }
}

// Rows [row0, row0 + rows) clipped to the element's valid rows (those below q_len); may be empty.
int64_t ValidRows(const BatchMask& mask, int64_t row0, int64_t rows) {
  return std::clamp<int64_t>(mask.q_len - row0, 0, rows);
}

// False when segment ids prove that no row of the block [row0, row0 + rows) meets a key of
// [col0, col0 + cols): the block is skipped.
bool SegmentsMeet(const BatchMask& mask, int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
  if (mask.q_seg == nullptr) return true;
  return ranges_meet(id_range(mask.q_seg, row0, row0 + rows), id_range(mask.kv_seg, col0, col0 + cols));
}

struct Tiles {
  BlockSizes bs;
  int64_t num_q_blocks, num_k_blocks;
};

Tiles MakeTiles(const AttnDims& d) {
  Tiles t;
  t.bs = ComputeBlockSizes(d.head_dim, CacheBudgetBytes());
  t.num_q_blocks = (d.seqlen_q + t.bs.rows_q - 1) / t.bs.rows_q;
  t.num_k_blocks = (d.seqlen_k + t.bs.rows_k - 1) / t.bs.rows_k;
  return t;
}

// --- forward --------------------------------------------------------------------------------------
template <typename Tag>
void ForwardImpl(const FwdParams& p) {
  using T = typename Tag::Storage;
  const Tag tag;
  const AttnDims& dm = p.dims;
  const int64_t D = dm.head_dim, group = dm.group();
  const Tiles tiles = MakeTiles(dm);
  const int64_t br = tiles.bs.rows_q, bc = tiles.bs.rows_k;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* o = static_cast<T*>(p.o);

  struct Scratch {
    Tile q, kt, v, s, o;
    std::vector<float> m, l;
  };
  auto make_scratch = [&] {
    return Scratch{Tile(br, D), Tile(D, bc), Tile(bc, D), Tile(br, bc), Tile(br, D), std::vector<float>(br),
                   std::vector<float>(br)};
  };
  const int64_t items = dm.batch * dm.heads_q * tiles.num_q_blocks;
  const int64_t flops = 4 * br * dm.seqlen_k * D;
  ParallelFor(items, flops, make_scratch, [&](int64_t item, Scratch& w) {
    const int64_t qb = item % tiles.num_q_blocks;
    const int64_t h = (item / tiles.num_q_blocks) % dm.heads_q;
    const int64_t b = item / (tiles.num_q_blocks * dm.heads_q);
    const int64_t hk = h / group;
    const int64_t row0 = qb * br, rows = std::min(br, dm.seqlen_q - row0);
    const BatchMask mask = batch_mask(p.mask, b, dm.seqlen_q, dm.seqlen_k);
    const int64_t valid = ValidRows(mask, row0, rows);  // rows past q_len keep l = 0: O = 0, LSE = -inf
    const bool dropout = p.dropout.rate > 0.f;
    const DropoutDraw draw = dropout ? dropout_draw(p.dropout, b) : DropoutDraw{};
    const float inv_keep = 1.f / (1.f - p.dropout.rate);
    const T* qp = q + b * dm.q_batch_stride() + row0 * dm.q_row_stride() + h * D;
    const T* kp = k + b * dm.k_batch_stride() + hk * D;
    const T* vp = v + b * dm.k_batch_stride() + hk * D;

    LoadTile(tag, qp, valid, D, dm.q_row_stride(), p.scale, w.q);  // scale folded into Q once
    std::fill(w.o.data.begin(), w.o.data.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);
    std::fill(w.l.begin(), w.l.end(), 0.f);

    int64_t key_begin, key_end;
    visible_key_range(mask, row0, row0 + valid, &key_begin, &key_end);
    for (int64_t col0 = key_begin; col0 < key_end; col0 += bc) {  // fully masked blocks never visited
      const int64_t cols = std::min(bc, key_end - col0);
      if (!SegmentsMeet(mask, row0, valid, col0, cols)) continue;
      LoadTileT(tag, kp + col0 * dm.k_row_stride(), cols, D, dm.k_row_stride(), w.kt);
      LoadTile(tag, vp + col0 * dm.k_row_stride(), cols, D, dm.k_row_stride(), 1.f, w.v);
      const bool full = block_fully_visible(mask, row0, row0 + valid, col0, col0 + cols);
      Scores(w.q, w.kt, valid, cols, D, row0, col0, mask, full, p.softcap, w.s);
      // Online softmax: S becomes P = exp(S - m_new) in place; O and l are rescaled when the max rises.
      for (int64_t r = 0; r < valid; ++r) {
        float* srow = w.s.row(r);
        const float m_new = std::max(w.m[r], RowMax(srow, cols));
        if (m_new == kNegInf) {  // this row has seen no key yet: P = 0, nothing to rescale
          std::fill(srow, srow + cols, 0.f);
          continue;
        }
        const float alpha = Exp(w.m[r] - m_new);  // 0 on the first visible block (m = -inf)
        const float sum = ExpShiftSum(srow, cols, m_new);  // l sums the probabilities before dropout
        if (dropout) ApplyDropout(draw, inv_keep, uint32_t(h), uint32_t(row0 + r), col0, cols, srow);
        float* orow = w.o.row(r);
        for (int64_t c = 0; c < D; ++c) orow[c] *= alpha;
        w.l[r] = w.l[r] * alpha + sum;
        w.m[r] = m_new;
      }
      Gemm(w.s.ptr(), w.s.ld, w.v.ptr(), w.v.ld, w.o.ptr(), w.o.ld, valid, D, cols, true);  // O += P V
    }

    T* op = o + b * dm.q_batch_stride() + row0 * dm.q_row_stride() + h * D;
    float* lse = p.lse + (b * dm.heads_q + h) * dm.seqlen_q + row0;
    for (int64_t r = 0; r < rows; ++r) {
      const float l = w.l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key: O = 0, LSE = -inf
      for (int64_t c = 0; c < D; ++c)  // a select, not a product: a padded row's O is never used
        op[r * dm.q_row_stride() + c] = FromFloat(tag, l > 0.f ? w.o.row(r)[c] * inv : 0.f);
      lse[r] = l > 0.f ? w.m[r] + std::log(l) : kNegInf;
    }
  });
}

// --- backward -------------------------------------------------------------------------------------
// P and dS of one tile from recomputed scores (K and V given transposed); P lands in `p`, dS in `ds`.
// q is pre-scaled, so dS here is d(loss)/d(scaled S); with a softcap it goes through
// d(cap tanh(s / cap))/ds = 1 - tanh^2.
//
// With dropout (keep mask Z, kept values scaled by 1 / (1 - rate)): O = (P * Z') V, so dV uses P * Z', dP is
// dO V^T * Z', and dS = P (dP - delta) as without; `p` then holds P * Z' for dV.
struct Dropout {
  bool on;
  DropoutDraw draw;
  float inv_keep;
  uint32_t head;
};

void ProbsAndGrads(Tile& q, Tile& kt, Tile& vt, Tile& dout, const float* lse, const float* delta, int64_t rows,
                   int64_t cols, int64_t D, int64_t row0, int64_t col0, const BatchMask& mask, bool full,
                   float softcap, const Dropout& dropout, Tile& p, Tile& ds, float* z) {
  Scores(q, kt, rows, cols, D, row0, col0, mask, full, softcap, p);
  Gemm(dout.ptr(), dout.ld, vt.ptr(), vt.ld, ds.ptr(), ds.ld, rows, cols, D, false);  // dP = dO V^T
  for (int64_t r = 0; r < rows; ++r) {
    float* prow = p.row(r);
    float* dsrow = ds.row(r);
    if (dropout.on) {
      std::fill(z, z + cols, 1.f);
      ApplyDropout(dropout.draw, dropout.inv_keep, dropout.head, uint32_t(row0 + r), col0, cols, z);
    }
    for (int64_t c = 0; c < cols; ++c) {
      const float s = prow[c];
      prow[c] = (lse[r] == kNegInf || s == kNegInf) ? 0.f : Exp(s - lse[r]);
      const float dp = dropout.on ? dsrow[c] * z[c] : dsrow[c];
      dsrow[c] = prow[c] == 0.f ? 0.f : prow[c] * (dp - delta[r]);
      if (dropout.on) prow[c] *= z[c];
      if (softcap > 0.f && dsrow[c] != 0.f) {
        const float t = s / softcap;
        dsrow[c] *= 1.f - t * t;
      }
    }
  }
}

template <typename Tag>
void BackwardImpl(const BwdParams& p) {
  using T = typename Tag::Storage;
  const Tag tag;
  const AttnDims& dm = p.dims;
  const int64_t D = dm.head_dim, group = dm.group();
  const Tiles tiles = MakeTiles(dm);
  const int64_t br = tiles.bs.rows_q, bc = tiles.bs.rows_k;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* o = static_cast<const T*>(p.o);
  const T* dout = static_cast<const T*>(p.dout);
  auto q_off = [&](int64_t b, int64_t row, int64_t h) { return b * dm.q_batch_stride() + row * dm.q_row_stride() + h * D; };
  auto k_off = [&](int64_t b, int64_t row, int64_t h) { return b * dm.k_batch_stride() + row * dm.k_row_stride() + h * D; };
  auto stat_off = [&](int64_t b, int64_t h, int64_t row) { return (b * dm.heads_q + h) * dm.seqlen_q + row; };

  // Pass 0: delta = rowsum(dO * O) - dLSE, in fp32 from the stored (rounded) O, as the CUDA kernel does.
  const int64_t rows_total = dm.batch * dm.seqlen_q * dm.heads_q;
  ParallelFor(rows_total, 2 * D, [] { return 0; }, [&](int64_t i, int) {
    const int64_t h = i % dm.heads_q, row = (i / dm.heads_q) % dm.seqlen_q, b = i / (dm.heads_q * dm.seqlen_q);
    const int64_t off = q_off(b, row, h);
    float s = 0.f;
    for (int64_t c = 0; c < D; ++c) s += ToFloat(tag, dout[off + c]) * ToFloat(tag, o[off + c]);
    p.delta[stat_off(b, h, row)] = s - p.dlse[stat_off(b, h, row)];
  });

  struct Scratch {
    Tile q, dout, kt, vt, k, p, ds, t, acc_a, acc_b;
    std::vector<float> z;  // one row of dropout factors
  };
  auto make_scratch = [&] {
    const int64_t n = std::max(br, bc);
    return Scratch{Tile(br, D), Tile(br, D), Tile(D, bc), Tile(D, bc), Tile(bc, D), Tile(br, bc), Tile(br, bc),
                   Tile(n, n), Tile(n, D), Tile(n, D), std::vector<float>(bc)};
  };
  auto dropout_of = [&](int64_t b, int64_t h) {
    const bool on = p.dropout.rate > 0.f;
    return Dropout{on, on ? dropout_draw(p.dropout, b) : DropoutDraw{}, 1.f / (1.f - p.dropout.rate), uint32_t(h)};
  };

  // Pass 1: dK, dV per (batch, key head, key block), summed over the query heads of the group.
  const int64_t kv_items = dm.batch * dm.heads_k * tiles.num_k_blocks;
  const int64_t kv_flops = 8 * bc * dm.seqlen_q * D * group;
  ParallelFor(kv_items, kv_flops, make_scratch, [&](int64_t item, Scratch& w) {
    const int64_t kb = item % tiles.num_k_blocks;
    const int64_t hk = (item / tiles.num_k_blocks) % dm.heads_k;
    const int64_t b = item / (tiles.num_k_blocks * dm.heads_k);
    const int64_t col0 = kb * bc, cols = std::min(bc, dm.seqlen_k - col0);
    LoadTileT(tag, k + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.kt);
    LoadTileT(tag, v + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.vt);
    Tile& dk = w.acc_a;
    Tile& dv = w.acc_b;
    std::fill(dk.data.begin(), dk.data.end(), 0.f);
    std::fill(dv.data.begin(), dv.data.end(), 0.f);
    const BatchMask mask = batch_mask(p.mask, b, dm.seqlen_q, dm.seqlen_k);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t row0 = 0; row0 < mask.q_len; row0 += br) {  // rows past q_len contribute nothing
        const int64_t rows = std::min(br, mask.q_len - row0);
        int64_t key_begin, key_end;
        visible_key_range(mask, row0, row0 + rows, &key_begin, &key_end);
        if (key_begin >= col0 + cols || key_end <= col0) continue;  // block fully masked for these rows
        if (!SegmentsMeet(mask, row0, rows, col0, cols)) continue;
        LoadTile(tag, q + q_off(b, row0, h), rows, D, dm.q_row_stride(), p.scale, w.q);
        LoadTile(tag, dout + q_off(b, row0, h), rows, D, dm.q_row_stride(), 1.f, w.dout);
        const bool full = block_fully_visible(mask, row0, row0 + rows, col0, col0 + cols);
        ProbsAndGrads(w.q, w.kt, w.vt, w.dout, p.lse + stat_off(b, h, row0), p.delta + stat_off(b, h, row0), rows,
                      cols, D, row0, col0, mask, full, p.softcap, dropout_of(b, h), w.p, w.ds, w.z.data());
        Transpose(w.p, rows, cols, w.t);
        Gemm(w.t.ptr(), w.t.ld, w.dout.ptr(), w.dout.ld, dv.ptr(), dv.ld, cols, D, rows, true);  // dV += P^T dO
        Transpose(w.ds, rows, cols, w.t);
        Gemm(w.t.ptr(), w.t.ld, w.q.ptr(), w.q.ld, dk.ptr(), dk.ld, cols, D, rows, true);  // dK += dS^T (scale Q)
      }
    }
    T* dkp = static_cast<T*>(p.dk) + k_off(b, col0, hk);
    T* dvp = static_cast<T*>(p.dv) + k_off(b, col0, hk);
    for (int64_t r = 0; r < cols; ++r)
      for (int64_t c = 0; c < D; ++c) {
        dkp[r * dm.k_row_stride() + c] = FromFloat(tag, dk.row(r)[c]);
        dvp[r * dm.k_row_stride() + c] = FromFloat(tag, dv.row(r)[c]);
      }
  });

  // Pass 2: dQ per (batch, head, query block), accumulated in fp32 in dq_accum then converted.
  const int64_t q_items = dm.batch * dm.heads_q * tiles.num_q_blocks;
  const int64_t q_flops = 6 * br * dm.seqlen_k * D;
  ParallelFor(q_items, q_flops, make_scratch, [&](int64_t item, Scratch& w) {
    const int64_t qb = item % tiles.num_q_blocks;
    const int64_t h = (item / tiles.num_q_blocks) % dm.heads_q;
    const int64_t b = item / (tiles.num_q_blocks * dm.heads_q);
    const int64_t hk = h / group;
    const int64_t row0 = qb * br, rows = std::min(br, dm.seqlen_q - row0);
    const BatchMask mask = batch_mask(p.mask, b, dm.seqlen_q, dm.seqlen_k);
    const int64_t valid = ValidRows(mask, row0, rows);  // rows past q_len get dQ = 0
    LoadTile(tag, q + q_off(b, row0, h), valid, D, dm.q_row_stride(), p.scale, w.q);
    LoadTile(tag, dout + q_off(b, row0, h), valid, D, dm.q_row_stride(), 1.f, w.dout);
    Tile& dq = w.acc_a;
    std::fill(dq.data.begin(), dq.data.end(), 0.f);
    int64_t key_begin, key_end;
    visible_key_range(mask, row0, row0 + valid, &key_begin, &key_end);
    for (int64_t col0 = key_begin; col0 < key_end; col0 += bc) {
      const int64_t cols = std::min(bc, key_end - col0);
      if (!SegmentsMeet(mask, row0, valid, col0, cols)) continue;
      LoadTileT(tag, k + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.kt);
      LoadTileT(tag, v + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.vt);
      LoadTile(tag, k + k_off(b, col0, hk), cols, D, dm.k_row_stride(), 1.f, w.k);
      const bool full = block_fully_visible(mask, row0, row0 + valid, col0, col0 + cols);
      ProbsAndGrads(w.q, w.kt, w.vt, w.dout, p.lse + stat_off(b, h, row0), p.delta + stat_off(b, h, row0), valid,
                    cols, D, row0, col0, mask, full, p.softcap, dropout_of(b, h), w.p, w.ds, w.z.data());
      Gemm(w.ds.ptr(), w.ds.ld, w.k.ptr(), w.k.ld, dq.ptr(), dq.ld, valid, D, cols, true);  // dQ += dS K
    }
    T* dqp = static_cast<T*>(p.dq) + q_off(b, row0, h);
    float* acc = p.dq_accum + q_off(b, row0, h);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < D; ++c) {
        const float g = r < valid ? dq.row(r)[c] * p.scale : 0.f;
        acc[r * dm.q_row_stride() + c] = g;
        dqp[r * dm.q_row_stride() + c] = FromFloat(tag, g);
      }
  });
}

}  // namespace

// The seed's rule: with an on-chip budget of M bytes and head dim d, the four tiles Q (Br x d), K, V
// (Bc x d) and O (Br x d) fit in M when Bc = M / (4 d b) and Br = min(Bc, d), b the bytes per element
// (4 here: tiles are kept as float). On the CPU, M is the L2 cache. Clamped to [16, 256] rows: below
// 16 the per-block loop overhead dominates; above 256 the Br x Bc score tile outgrows L1 and a query
// block's work item gets too coarse to spread over threads for short sequences.
BlockSizes ComputeBlockSizes(int64_t head_dim, int64_t budget_bytes) {
  const int64_t d = std::max<int64_t>(head_dim, 1);
  const int64_t bc = std::clamp<int64_t>(budget_bytes / (4 * d * 4), 16, 256);
  const int64_t br = std::clamp<int64_t>(std::min(bc, d), 16, 256);
  return {br, bc};
}

int64_t CacheBudgetBytes() {
  static const int64_t budget = [] {
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? int64_t(l2) : int64_t(1) << 20;
  }();
  return budget;
}

void Forward(const FwdParams& p, DType dtype) {
  switch (dtype) {
    case DType::kF32: return ForwardImpl<F32>(p);
    case DType::kBF16: return ForwardImpl<BF16>(p);
    case DType::kF16: return ForwardImpl<F16>(p);
  }
}

void Backward(const BwdParams& p, DType dtype) {
  switch (dtype) {
    case DType::kF32: return BackwardImpl<F32>(p);
    case DType::kBF16: return BackwardImpl<BF16>(p);
    case DType::kF16: return BackwardImpl<F16>(p);
  }
}

}  // namespace jaxflash::cpu
