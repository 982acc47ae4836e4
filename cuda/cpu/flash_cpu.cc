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
// deterministic. Layouts and mask rule: params.h, mask.h.
#include "cpu/flash_cpu.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "mask.h"

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

inline void Axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Copies `rows` rows of `d` elements, `stride` apart, into a dense float tile (times `mul`).
template <typename Tag>
void LoadTile(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, float mul,
              float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * d + c] = ToFloat(tag, src[r * stride + c]) * mul;
}

// Copies `rows` rows of `d` elements, `stride` apart, transposed: dst[c * ld + r] = src[r][c].
template <typename Tag>
void LoadTileT(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, float* dst,
               int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[c * ld + r] = ToFloat(tag, src[r * stride + c]);
}

// One row of products a[r] . B for a tile B given transposed (bt[c * ld + j]), as axpys over the tile's
// columns: unlike a dot product this vectorises without reassociating the sum.
inline void RowTimesTileT(const float* a, const float* bt, int64_t d, int64_t cols, int64_t ld, float* out) {
  std::fill(out, out + cols, 0.f);
  for (int64_t c = 0; c < d; ++c) Axpy(a[c], bt + c * ld, out, cols);
}

// Scores of one tile: s[r][c] = q[r] . k[c] (k given transposed), -inf where the mask hides (i, j).
void Scores(const float* q, const float* kt, int64_t rows, int64_t cols, int64_t d, int64_t row0, int64_t col0,
            const MaskParams& mask, bool full, float* s, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = s + r * ld;
    RowTimesTileT(q + r * d, kt, d, cols, ld, srow);
    if (!full)
      for (int64_t c = 0; c < cols; ++c)
        if (!is_visible(mask, row0 + r, col0 + c)) srow[c] = kNegInf;
  }
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
    std::vector<float> q, k, v, s, o, m, l;
  };
  auto make_scratch = [&] {
    return Scratch{std::vector<float>(br * D), std::vector<float>(bc * D), std::vector<float>(bc * D),
                   std::vector<float>(br * bc), std::vector<float>(br * D), std::vector<float>(br),
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
    const T* qp = q + b * dm.q_batch_stride() + row0 * dm.q_row_stride() + h * D;
    const T* kp = k + b * dm.k_batch_stride() + hk * D;
    const T* vp = v + b * dm.k_batch_stride() + hk * D;

    LoadTile(tag, qp, rows, D, dm.q_row_stride(), p.scale, w.q.data());  // scale folded into Q once
    std::fill(w.o.begin(), w.o.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);
    std::fill(w.l.begin(), w.l.end(), 0.f);

    int64_t key_begin, key_end;
    visible_key_range(p.mask, row0, row0 + rows, dm.seqlen_k, &key_begin, &key_end);
    for (int64_t col0 = key_begin; col0 < key_end; col0 += bc) {  // fully masked blocks never visited
      const int64_t cols = std::min(bc, key_end - col0);
      LoadTileT(tag, kp + col0 * dm.k_row_stride(), cols, D, dm.k_row_stride(), w.k.data(), bc);
      LoadTile(tag, vp + col0 * dm.k_row_stride(), cols, D, dm.k_row_stride(), 1.f, w.v.data());
      const bool full = block_fully_visible(p.mask, row0, row0 + rows, col0, col0 + cols);
      Scores(w.q.data(), w.k.data(), rows, cols, D, row0, col0, p.mask, full, w.s.data(), bc);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = w.s.data() + r * bc;
        float m_new = w.m[r];
        for (int64_t c = 0; c < cols; ++c) m_new = std::max(m_new, s[c]);
        if (m_new == kNegInf) continue;  // this row has seen no key yet
        const float alpha = std::exp(w.m[r] - m_new);  // exp(-inf) = 0 on the first visible block
        float* orow = w.o.data() + r * D;
        for (int64_t c = 0; c < D; ++c) orow[c] *= alpha;
        float sum = 0.f;
        for (int64_t c = 0; c < cols; ++c) {
          const float pc = std::exp(s[c] - m_new);
          sum += pc;
          if (pc != 0.f) Axpy(pc, w.v.data() + c * D, orow, D);
        }
        w.l[r] = w.l[r] * alpha + sum;
        w.m[r] = m_new;
      }
    }

    T* op = o + b * dm.q_batch_stride() + row0 * dm.q_row_stride() + h * D;
    float* lse = p.lse + (b * dm.heads_q + h) * dm.seqlen_q + row0;
    for (int64_t r = 0; r < rows; ++r) {
      const float l = w.l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key: O = 0, LSE = -inf
      for (int64_t c = 0; c < D; ++c) op[r * dm.q_row_stride() + c] = FromFloat(tag, w.o[r * D + c] * inv);
      lse[r] = l > 0.f ? w.m[r] + std::log(l) : kNegInf;
    }
  });
}

// --- backward -------------------------------------------------------------------------------------
// P and dS of one tile from recomputed scores (K and V given transposed). q is pre-scaled, so dS here
// is d(loss)/d(scaled S).
void ProbsAndGrads(const float* q, const float* kt, const float* vt, const float* dout, const float* lse,
                   const float* delta, int64_t rows, int64_t cols, int64_t D, int64_t row0, int64_t col0,
                   const MaskParams& mask, bool full, float* pt, float* ds, int64_t ld) {
  Scores(q, kt, rows, cols, D, row0, col0, mask, full, pt, ld);
  for (int64_t r = 0; r < rows; ++r) {
    float* prow = pt + r * ld;
    float* dsrow = ds + r * ld;
    RowTimesTileT(dout + r * D, vt, D, cols, ld, dsrow);  // dP
    for (int64_t c = 0; c < cols; ++c) {
      prow[c] = (lse[r] == kNegInf || prow[c] == kNegInf) ? 0.f : std::exp(prow[c] - lse[r]);
      dsrow[c] = prow[c] * (dsrow[c] - delta[r]);
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
    std::vector<float> q, k, v, dout, p, ds, acc_a, acc_b;
  };
  auto make_scratch = [&] {
    return Scratch{std::vector<float>(br * D), std::vector<float>(bc * D), std::vector<float>(bc * D),
                   std::vector<float>(br * D), std::vector<float>(br * bc), std::vector<float>(br * bc),
                   std::vector<float>(std::max(br, bc) * D), std::vector<float>(bc * D)};
  };

  // Pass 1: dK, dV per (batch, key head, key block), summed over the query heads of the group.
  const int64_t kv_items = dm.batch * dm.heads_k * tiles.num_k_blocks;
  const int64_t kv_flops = 8 * bc * dm.seqlen_q * D * group;
  ParallelFor(kv_items, kv_flops, make_scratch, [&](int64_t item, Scratch& w) {
    const int64_t kb = item % tiles.num_k_blocks;
    const int64_t hk = (item / tiles.num_k_blocks) % dm.heads_k;
    const int64_t b = item / (tiles.num_k_blocks * dm.heads_k);
    const int64_t col0 = kb * bc, cols = std::min(bc, dm.seqlen_k - col0);
    LoadTileT(tag, k + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.k.data(), bc);
    LoadTileT(tag, v + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.v.data(), bc);
    float* dk = w.acc_a.data();
    float* dv = w.acc_b.data();
    std::fill(dk, dk + cols * D, 0.f);
    std::fill(dv, dv + cols * D, 0.f);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t row0 = 0; row0 < dm.seqlen_q; row0 += br) {
        const int64_t rows = std::min(br, dm.seqlen_q - row0);
        int64_t key_begin, key_end;
        visible_key_range(p.mask, row0, row0 + rows, dm.seqlen_k, &key_begin, &key_end);
        if (key_begin >= col0 + cols || key_end <= col0) continue;  // block fully masked for these rows
        LoadTile(tag, q + q_off(b, row0, h), rows, D, dm.q_row_stride(), p.scale, w.q.data());
        LoadTile(tag, dout + q_off(b, row0, h), rows, D, dm.q_row_stride(), 1.f, w.dout.data());
        const bool full = block_fully_visible(p.mask, row0, row0 + rows, col0, col0 + cols);
        ProbsAndGrads(w.q.data(), w.k.data(), w.v.data(), w.dout.data(), p.lse + stat_off(b, h, row0),
                      p.delta + stat_off(b, h, row0), rows, cols, D, row0, col0, p.mask, full, w.p.data(),
                      w.ds.data(), bc);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            const float pv = w.p[r * bc + c], dsv = w.ds[r * bc + c];
            if (pv != 0.f) Axpy(pv, w.dout.data() + r * D, dv + c * D, D);
            if (dsv != 0.f) Axpy(dsv, w.q.data() + r * D, dk + c * D, D);  // q carries the scale
          }
        }
      }
    }
    T* dkp = static_cast<T*>(p.dk) + k_off(b, col0, hk);
    T* dvp = static_cast<T*>(p.dv) + k_off(b, col0, hk);
    for (int64_t r = 0; r < cols; ++r)
      for (int64_t c = 0; c < D; ++c) {
        dkp[r * dm.k_row_stride() + c] = FromFloat(tag, dk[r * D + c]);
        dvp[r * dm.k_row_stride() + c] = FromFloat(tag, dv[r * D + c]);
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
    LoadTile(tag, q + q_off(b, row0, h), rows, D, dm.q_row_stride(), p.scale, w.q.data());
    LoadTile(tag, dout + q_off(b, row0, h), rows, D, dm.q_row_stride(), 1.f, w.dout.data());
    float* dq = w.acc_a.data();
    std::fill(dq, dq + rows * D, 0.f);
    int64_t key_begin, key_end;
    visible_key_range(p.mask, row0, row0 + rows, dm.seqlen_k, &key_begin, &key_end);
    for (int64_t col0 = key_begin; col0 < key_end; col0 += bc) {
      const int64_t cols = std::min(bc, key_end - col0);
      LoadTileT(tag, k + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.k.data(), bc);
      LoadTileT(tag, v + k_off(b, col0, hk), cols, D, dm.k_row_stride(), w.v.data(), bc);
      LoadTile(tag, k + k_off(b, col0, hk), cols, D, dm.k_row_stride(), 1.f, w.acc_b.data());
      const bool full = block_fully_visible(p.mask, row0, row0 + rows, col0, col0 + cols);
      ProbsAndGrads(w.q.data(), w.k.data(), w.v.data(), w.dout.data(), p.lse + stat_off(b, h, row0),
                    p.delta + stat_off(b, h, row0), rows, cols, D, row0, col0, p.mask, full, w.p.data(),
                    w.ds.data(), bc);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float dsv = w.ds[r * bc + c];
          if (dsv != 0.f) Axpy(dsv, w.acc_b.data() + c * D, dq + r * D, D);
        }
    }
    T* dqp = static_cast<T*>(p.dq) + q_off(b, row0, h);
    float* acc = p.dq_accum + q_off(b, row0, h);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < D; ++c) {
        const float g = dq[r * D + c] * p.scale;
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
