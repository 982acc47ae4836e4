// FlashAttention-2 on the CPU, the same algorithm as the CUDA kernels.
//
// Forward, per (batch, head, query block): stream K/V blocks (from one contiguous array, or gathered page by
// page through a block table: the paged KV cache), S = Q K^T, online softmax with a running
// row max m and sum l (rescaling O and l when m rises), O += P V; O and LSE = m + log(l) written once.
// Backward recomputes P = exp(S - LSE) block by block and never forms an N x N matrix. Per (batch, key head,
// share of the query blocks), for each query head of the GQA group and query block of the share, over the
// visible key blocks: dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO * O) - dLSE (dLSE, the
// cotangent of the returned LSE, enters because dLSE/dS = P), dV += P^T dO, dK += dS^T Q, dQ += dS K.
// dQ of a query block is finished within its share; dK and dV are summed over the shares in a fixed order.
// Nothing depends on which thread ran what, so results are deterministic. Masks (mask.h) skip whole K/V
// blocks where they can and mask single scores on the rest; softcap transforms the scores; dropout
// (philox.h) scales P after its row sum, in both passes alike. Layouts: params.h.
//
// Score tiles are kept transposed, st[key][query]: S^T = K (scale Q)^T is a product whose A operand is K
// as it lies in memory, the softmax statistics of a query sit in one vector lane (no horizontal
// reductions), and Q^T / dO^T are built once per query block instead of transposing K and V for every tile.
// The products and elementwise steps run in kernels.h's vector kernels, picked by the CPU's features.
// JAXFLASH_CPU_KERNELS=avx2 or generic picks a lower table (to test those on a newer CPU).
#include "flash_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "mask.h"
#include "philox.h"

namespace jaxflash::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

const Kernels& Isa() {
  static const Kernels& table = []() -> const Kernels& {
    const char* want = std::getenv("JAXFLASH_CPU_KERNELS");
    const bool low = want != nullptr && std::strcmp(want, "generic") == 0;
    const bool avx2_only = want != nullptr && std::strcmp(want, "avx2") == 0;
#if defined(JAXFLASH_CPU_X86)  // the AVX tables are built on x86-64 only (CMakeLists.txt)
    __builtin_cpu_init();
    if (!low && !avx2_only && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      return KernelsAvx512();
    if (!low && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return KernelsAvx2();
#else
    (void)low;
    (void)avx2_only;
#endif
    return KernelsGeneric();
  }();
  return table;
}

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

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// --- parallel-for on the caller's thread plus a task pool ----------------------------------------------
// Items are claimed from an atomic counter by the calling thread and by up to num_threads - 1 pool tasks.
// The caller waits only for items that were claimed, by threads that are running them, so a task the pool
// never starts costs nothing; the counter lives on the heap, so a task that starts after the call returned
// finds no work and leaves without touching the caller's (gone) stack. Each worker builds its scratch once,
// after it has claimed its first item.
struct ForState {
  explicit ForState(int64_t n) : n(n) {}
  const int64_t n;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;  // guarded by mu
};

template <typename MakeScratch, typename Body>
void ParallelFor(TaskPool* pool, int64_t n, int64_t flops_per_item, const MakeScratch& make_scratch,
                 const Body& body) {
  if (n <= 0) return;
  auto state = std::make_shared<ForState>(n);
  auto work = [&make_scratch, &body](ForState& s, int64_t first) {  // `first`: an item already claimed
    auto scratch = make_scratch();
    for (int64_t i = first; i < s.n; i = s.next.fetch_add(1)) {
      body(i, scratch);
      std::lock_guard<std::mutex> lock(s.mu);
      if (++s.done == s.n) s.cv.notify_all();
    }
  };
  // Handing a task to a pool costs microseconds; below ~1 MFLOP of work in all it does not pay.
  const int64_t threads = (pool == nullptr || n * flops_per_item < (int64_t(1) << 20))
                              ? 1
                              : std::min<int64_t>(std::max(pool->num_threads(), 1), n);
  using Work = decltype(work);
  const Work* w = &work;
  for (int64_t t = 1; t < threads; ++t)
    pool->Schedule([state, w] {
      const int64_t first = state->next.fetch_add(1);
      if (first < state->n) (*w)(*state, first);  // the caller waits for this item, so `w` is alive
    });
  if (const int64_t first = state->next.fetch_add(1); first < n) work(*state, first);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done == state->n; });
}

// --- tiles --------------------------------------------------------------------------------------------
// A dense float tile, rows x cols with cols padded to a multiple of the kernels' vector: the products may
// write whole vectors.
struct Tile {
  std::vector<float> data;
  int64_t ld = 0;
  Tile() = default;
  Tile(int64_t rows, int64_t cols, int64_t vec)
      : data(rows * RoundUp(std::max<int64_t>(cols, 1), vec)), ld(RoundUp(std::max<int64_t>(cols, 1), vec)) {}
  float* row(int64_t r) { return data.data() + r * ld; }
  float* ptr() { return data.data(); }
};

// dst[r][c] = src[r * stride + c] * mul for r < rows, c < d.
template <typename Tag>
void LoadRows(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, float mul,
              float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * ld + c] = ToFloat(tag, src[r * stride + c]) * mul;
}

// The transpose: dst[c][r] = src[r * stride + c] * mul, and zero in columns [rows, cols_pad) so the padding
// of a score tile holds finite numbers.
template <typename Tag>
void LoadRowsT(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, float mul,
               Tile& dst, int64_t cols_pad) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst.row(c)[r] = ToFloat(tag, src[r * stride + c]) * mul;
  for (int64_t c = 0; c < d; ++c) std::fill(dst.row(c) + rows, dst.row(c) + cols_pad, 0.f);
}

// K or V of one (batch, key head) as float rows, `ld` apart, readable up to the padded head dim: float32
// inputs whose head dim fills whole vectors are used where they lie, others converted into `buf`.
struct Rows {
  const float* ptr;
  int64_t ld;
};

template <typename Tag>
Rows KeyRows(Tag tag, const typename Tag::Storage* src, int64_t rows, int64_t d, int64_t stride, int64_t vec,
             std::vector<float>& buf) {
  if constexpr (std::is_same_v<Tag, F32>)
    if (d % vec == 0) return Rows{src, stride};
  const int64_t ld = RoundUp(d, vec);
  if (int64_t(buf.size()) < rows * ld) buf.assign(rows * ld, 0.f);
  LoadRows(tag, src, rows, d, stride, 1.f, buf.data(), ld);
  return Rows{buf.data(), ld};
}

// Where the forward reads the K/V rows of one (batch, key head): DenseKV from [batch, seqlen_k, heads_k, D],
// PagedKVRows through a block table from pages [num_pages, page_size, heads_k, D]. Both have rows heads_k * D
// apart; `Contiguous` is how many rows from key t on lie one after the other.
struct DenseKV {
  int64_t batch_stride, row_stride, head_dim;
  template <typename T>
  const T* Row(const T* base, int64_t b, int64_t hk, int64_t t) const {
    return base + b * batch_stride + t * row_stride + hk * head_dim;
  }
  static constexpr int64_t Contiguous(int64_t, int64_t) { return std::numeric_limits<int64_t>::max(); }
};

struct PagedKVRows {
  PagedKV kv;
  int64_t row_stride, head_dim;
  template <typename T>
  const T* Row(const T* base, int64_t b, int64_t hk, int64_t t) const {
    const int64_t page = kv.block_table[b * kv.pages_per_seq + t / kv.page_size];  // int64 before the product
    return base + (page * kv.page_size + t % kv.page_size) * row_stride + hk * head_dim;
  }
  int64_t Contiguous(int64_t, int64_t t) const { return kv.page_size - t % kv.page_size; }
};

// Rows [col0, col0 + cols) of K or V of (b, hk) as float rows (KeyRows); rows that span pages are gathered
// into `buf` page by page.
template <typename Tag, typename Src>
Rows SourceRows(Tag tag, const Src& src, const typename Tag::Storage* base, int64_t b, int64_t hk, int64_t col0,
                int64_t cols, int64_t d, int64_t vec, std::vector<float>& buf) {
  if (src.Contiguous(b, col0) >= cols)
    return KeyRows(tag, src.Row(base, b, hk, col0), cols, d, src.row_stride, vec, buf);
  const int64_t ld = RoundUp(d, vec);
  if (int64_t(buf.size()) < cols * ld) buf.assign(cols * ld, 0.f);
  for (int64_t t = 0; t < cols;) {
    const int64_t n = std::min(cols - t, src.Contiguous(b, col0 + t));
    LoadRows(tag, src.Row(base, b, hk, col0 + t), n, d, src.row_stride, 1.f, buf.data() + t * ld, ld);
    t += n;
  }
  return Rows{buf.data(), ld};
}

void Gemm(const Kernels& kn, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
          float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, bool accumulate,
          const float* row_scale = nullptr) {
  if (m <= 0 || n <= 0) return;
  kn.gemm(GemmArgs{a, a_row, a_col, b, ldb, c, ldc, m, n, k, accumulate, row_scale});
}

// Soft-capping and the mask on a transposed score tile st[j][i] = S(row0 + i, col0 + j), i < rows, j < cols.
// `full`: the whole tile is visible, the predicate is skipped. Without segment ids a query's visible keys
// are one interval, so only the masked scores are touched.
void CapAndMask(float* st, int64_t ld, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                const BatchMask& mask, bool full, float softcap) {
  if (softcap > 0.f)
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t i = 0; i < rows; ++i) st[j * ld + i] = softcap_score(st[j * ld + i], softcap);
  if (full) return;
  if (mask.q_seg == nullptr) {
    for (int64_t i = 0; i < rows; ++i) {
      int64_t lo, hi;
      visible_key_range(mask, row0 + i, row0 + i + 1, &lo, &hi);
      lo = std::clamp<int64_t>(lo - col0, 0, cols);
      hi = std::clamp<int64_t>(hi - col0, lo, cols);
      for (int64_t j = 0; j < lo; ++j) st[j * ld + i] = kNegInf;
      for (int64_t j = hi; j < cols; ++j) st[j * ld + i] = kNegInf;
    }
    return;
  }
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = 0; i < rows; ++i)
      if (!is_visible(mask, row0 + i, col0 + j)) st[j * ld + i] = kNegInf;
}

// Dropout of a transposed tile: x[j][i] *= keep(row0 + i, col0 + j) * keep_scale, or, with `factors`, x is
// set to that factor. One Philox call serves sixteen adjacent keys (philox.h).
void DropoutT(const DropoutDraw& d, float keep_scale, uint32_t head, int64_t row0, int64_t rows, int64_t col0,
              int64_t cols, float* x, int64_t ld, bool factors) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols;) {
      const int64_t group = (col0 + j) >> 4;
      const uint32_t bits = dropout_keep16(d, head, uint32_t(row0 + i), uint32_t(group));
      for (; j < cols && ((col0 + j) >> 4) == group; ++j) {
        const float f = ((bits >> ((col0 + j) & 15)) & 1u) ? keep_scale : 0.f;
        x[j * ld + i] = factors ? f : x[j * ld + i] * f;
      }
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

// What both passes derive from a call: the element type, the vector kernels, the padded head dim and the tiling.
template <typename Tag>
struct Pass {
  using T = typename Tag::Storage;
  explicit Pass(const AttnDims& dims) : dm(dims) {}
  template <typename Src>
  void Forward(const FwdParams& p, const Src& src, TaskPool* pool) const;
  void Backward(const BwdParams& p, TaskPool* pool) const;

  const Tag tag{};
  const Kernels& kn = Isa();
  const AttnDims& dm;
  const int64_t W = kn.vec, D = dm.head_dim, group = dm.group(), Dp = RoundUp(D, W);
  const BlockSizes bs = ComputeBlockSizes(D);
  const int64_t br = bs.rows_q, bc = bs.rows_k;
  const int64_t num_q_blocks = (dm.seqlen_q + br - 1) / br;
};

// --- forward --------------------------------------------------------------------------------------
template <typename Tag>
template <typename Src>
void Pass<Tag>::Forward(const FwdParams& p, const Src& src, TaskPool* pool) const {
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* o = static_cast<T*>(p.o);

  struct Scratch {
    Tile qt, st, o;
    std::vector<float> m, l, alpha, kbuf, vbuf;
  };
  auto make_scratch = [&] {
    const int64_t n = RoundUp(br, W);
    return Scratch{Tile(D, br, W), Tile(bc, br, W), Tile(br, D, W), std::vector<float>(n), std::vector<float>(n),
                   std::vector<float>(n), {}, {}};
  };
  // Query heads of one GQA group are adjacent items, so the K/V blocks they share are still in cache.
  const int64_t items = dm.batch * dm.heads_k * num_q_blocks * group;
  const int64_t flops = 4 * br * dm.seqlen_k * D;
  ParallelFor(pool, items, flops, make_scratch, [&](int64_t item, Scratch& w) {
    const int64_t h = (item / (num_q_blocks * group)) % dm.heads_k * group + item % group;
    const int64_t qb = (item / group) % num_q_blocks;
    const int64_t b = item / (dm.heads_k * num_q_blocks * group);
    const int64_t hk = h / group;
    const int64_t row0 = qb * br, rows = std::min(br, dm.seqlen_q - row0);
    const BatchMask mask = batch_mask(p.mask, b, dm.seqlen_q, dm.seqlen_k);
    const int64_t valid = ValidRows(mask, row0, rows);  // rows past q_len keep l = 0: O = 0, LSE = -inf
    const int64_t nq = RoundUp(std::max<int64_t>(valid, 1), W);  // query columns of the score tile
    const bool dropout = p.dropout.rate > 0.f;
    const DropoutDraw draw = dropout ? dropout_draw(p.dropout, b) : DropoutDraw{};
    const float keep_scale = p.dropout.keep_scale;
    const T* qp = q + b * dm.q_batch_stride() + row0 * dm.q_row_stride() + h * D;

    LoadRowsT(tag, qp, valid, D, dm.q_row_stride(), p.scale, w.qt, nq);  // scale folded into Q once
    std::fill(w.o.data.begin(), w.o.data.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);
    std::fill(w.l.begin(), w.l.end(), 0.f);

    int64_t key_begin, key_end;
    visible_key_range(mask, row0, row0 + valid, &key_begin, &key_end);
    for (int64_t col0 = key_begin; col0 < key_end; col0 += bc) {  // fully masked blocks never visited
      const int64_t cols = std::min(bc, key_end - col0);
      if (!SegmentsMeet(mask, row0, valid, col0, cols)) continue;
      const Rows kr = SourceRows(tag, src, k, b, hk, col0, cols, D, W, w.kbuf);
      const Rows vr = SourceRows(tag, src, v, b, hk, col0, cols, D, W, w.vbuf);
      Gemm(kn, kr.ptr, kr.ld, 1, w.qt.ptr(), w.qt.ld, w.st.ptr(), w.st.ld, cols, nq, D, false);  // S^T = K Q^T
      const bool full = block_fully_visible(mask, row0, row0 + valid, col0, col0 + cols);
      CapAndMask(w.st.ptr(), w.st.ld, valid, cols, row0, col0, mask, full, p.softcap);
      // S^T becomes P^T; l sums the probabilities before dropout.
      kn.softmax(SoftmaxArgs{w.st.ptr(), w.st.ld, cols, nq, w.m.data(), w.l.data(), w.alpha.data()});
      if (dropout) DropoutT(draw, keep_scale, uint32_t(h), row0, valid, col0, cols, w.st.ptr(), w.st.ld, false);
      Gemm(kn, w.st.ptr(), 1, w.st.ld, vr.ptr, vr.ld, w.o.ptr(), w.o.ld, valid, Dp, cols, true,
           w.alpha.data());  // O = alpha O + P V
    }

    T* op = o + b * dm.q_batch_stride() + row0 * dm.q_row_stride() + h * D;
    float* lse = p.lse + (b * dm.heads_q + h) * dm.seqlen_q + row0;
    for (int64_t r = 0; r < rows; ++r) {
      const float l = r < valid ? w.l[r] : 0.f;
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key: O = 0, LSE = -inf
      for (int64_t c = 0; c < D; ++c)  // a select, not a product: a padded row's O is never used
        op[r * dm.q_row_stride() + c] = FromFloat(tag, l > 0.f ? w.o.row(r)[c] * inv : 0.f);
      lse[r] = l > 0.f ? w.m[r] + std::log(l) : kNegInf;
    }
  });
}

// --- backward -------------------------------------------------------------------------------------
template <typename Tag>
void Pass<Tag>::Backward(const BwdParams& p, TaskPool* pool) const {
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* o = static_cast<const T*>(p.o);
  const T* dout = static_cast<const T*>(p.dout);
  auto q_off = [&](int64_t b, int64_t row, int64_t h) { return b * dm.q_batch_stride() + row * dm.q_row_stride() + h * D; };
  auto k_off = [&](int64_t b, int64_t row, int64_t h) { return b * dm.k_batch_stride() + row * dm.k_row_stride() + h * D; };
  auto stat_off = [&](int64_t b, int64_t h, int64_t row) { return (b * dm.heads_q + h) * dm.seqlen_q + row; };

  // Shares: the query blocks of a (batch, key head) are dealt round-robin into `shares` items, enough for
  // ~kItems items in all so two threads stay busy when batch x heads is 1 to 3; each share keeps its own
  // fp32 dK and dV (zeroed, then summed in a second pass). Chosen from the shapes alone, so the sums never
  // depend on the number of threads. At B=1, H=4 kItems = 4 (one share) against 8 (two), fwd+bwd ms on the
  // 2-core CI machine, interleaved: D=128 S=256 9.6 / 10.8, S=1024 98 / 101; D=64 S=256 6.2 / 5.9, S=1024
  // 63 / 62, S=2048 174 / 187 (loaded by a CI run: the ratios count, not the times).
  constexpr int64_t kItems = 4;
  const int64_t bh = dm.batch * dm.heads_k;
  const int64_t shares = std::clamp<int64_t>((kItems + bh - 1) / bh, 1, std::max<int64_t>(num_q_blocks, 1));
  const int64_t head_elems = dm.seqlen_k * Dp;  // one fp32 dK (or dV) of a key head
  std::vector<float> partial(shares > 1 ? bh * shares * 2 * head_elems : 0);

  struct Scratch {
    Tile qr, qt, dor, dot, st, dpt, zt, dq;
    std::vector<float> lse, delta, kbuf, vbuf, dkv;
  };
  auto make_scratch = [&] {
    const int64_t n = RoundUp(br, W);
    return Scratch{Tile(br, D, W),  Tile(D, br, W),  Tile(br, D, W), Tile(D, br, W),
                   Tile(bc, br, W), Tile(bc, br, W), Tile(p.dropout.rate > 0.f ? bc : 0, br, W),
                   Tile(br, D, W),  std::vector<float>(n), std::vector<float>(n), {}, {},
                   std::vector<float>(shares > 1 ? 0 : 2 * head_elems)};
  };
  const int64_t items = bh * shares;
  const int64_t flops = 10 * dm.seqlen_q * dm.seqlen_k * D * group / shares;
  ParallelFor(pool, items, flops, make_scratch, [&](int64_t item, Scratch& w) {
    const int64_t share = item % shares;
    const int64_t hk = (item / shares) % dm.heads_k;
    const int64_t b = item / (shares * dm.heads_k);
    const BatchMask mask = batch_mask(p.mask, b, dm.seqlen_q, dm.seqlen_k);
    float* dk = shares > 1 ? partial.data() + item * 2 * head_elems : w.dkv.data();
    float* dv = dk + head_elems;
    std::fill(dk, dk + 2 * head_elems, 0.f);
    const Rows kr = KeyRows(tag, k + k_off(b, 0, hk), dm.seqlen_k, D, dm.k_row_stride(), W, w.kbuf);
    const Rows vr = KeyRows(tag, v + k_off(b, 0, hk), dm.seqlen_k, D, dm.k_row_stride(), W, w.vbuf);
    const bool dropout = p.dropout.rate > 0.f;
    const DropoutDraw draw = dropout ? dropout_draw(p.dropout, b) : DropoutDraw{};
    const float keep_scale = p.dropout.keep_scale;

    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t qb = share; qb < num_q_blocks; qb += shares) {
        const int64_t row0 = qb * br;
        const int64_t valid = ValidRows(mask, row0, std::min(br, dm.seqlen_q - row0));  // others: dQ = 0
        if (valid == 0) continue;
        const int64_t nq = RoundUp(valid, W);
        LoadRows(tag, q + q_off(b, row0, h), valid, D, dm.q_row_stride(), p.scale, w.qr.ptr(), w.qr.ld);
        LoadRowsT(tag, q + q_off(b, row0, h), valid, D, dm.q_row_stride(), p.scale, w.qt, nq);
        LoadRows(tag, dout + q_off(b, row0, h), valid, D, dm.q_row_stride(), 1.f, w.dor.ptr(), w.dor.ld);
        LoadRowsT(tag, dout + q_off(b, row0, h), valid, D, dm.q_row_stride(), 1.f, w.dot, nq);
        // delta = rowsum(dO * O) - dLSE, in fp32 from the stored (rounded) O, as the CUDA kernel does.
        for (int64_t r = 0; r < valid; ++r) {
          const T* orow = o + q_off(b, row0 + r, h);
          float s = 0.f;
          for (int64_t c = 0; c < D; ++c) s += w.dor.row(r)[c] * ToFloat(tag, orow[c]);
          const int64_t at = stat_off(b, h, row0 + r);
          p.delta[at] = s - p.dlse[at];
          w.delta[r] = p.delta[at];
          w.lse[r] = p.lse[at];
        }
        std::fill(w.lse.begin() + valid, w.lse.end(), kNegInf);  // padding columns get P = 0
        std::fill(w.delta.begin() + valid, w.delta.end(), 0.f);
        std::fill(w.dq.data.begin(), w.dq.data.end(), 0.f);

        int64_t key_begin, key_end;
        visible_key_range(mask, row0, row0 + valid, &key_begin, &key_end);
        for (int64_t col0 = key_begin; col0 < key_end; col0 += bc) {
          const int64_t cols = std::min(bc, key_end - col0);
          if (!SegmentsMeet(mask, row0, valid, col0, cols)) continue;
          const float* kb = kr.ptr + col0 * kr.ld;
          const float* vb = vr.ptr + col0 * vr.ld;
          Gemm(kn, kb, kr.ld, 1, w.qt.ptr(), w.qt.ld, w.st.ptr(), w.st.ld, cols, nq, D, false);  // S^T = K Q^T
          const bool full = block_fully_visible(mask, row0, row0 + valid, col0, col0 + cols);
          CapAndMask(w.st.ptr(), w.st.ld, valid, cols, row0, col0, mask, full, p.softcap);
          Gemm(kn, vb, vr.ld, 1, w.dot.ptr(), w.dot.ld, w.dpt.ptr(), w.dpt.ld, cols, nq, D, false);  // dP^T
          // With dropout (keep mask Z, kept values scaled by keep_scale): O = (P * Z') V, so dV uses
          // P * Z', dP is dO V^T * Z', and dS = P (dP - delta) as without.
          if (dropout)
            DropoutT(draw, keep_scale, uint32_t(h), row0, valid, col0, cols, w.zt.ptr(), w.zt.ld, true);
          // q is pre-scaled, so dS is d(loss)/d(scaled S), through the softcap's 1 - tanh^2 when one is set.
          kn.probs_grads(ProbsGradsArgs{w.st.ptr(), w.dpt.ptr(), dropout ? w.zt.ptr() : nullptr, w.st.ld, cols,
                                        nq, w.lse.data(), w.delta.data(), p.softcap});
          Gemm(kn, w.st.ptr(), w.st.ld, 1, w.dor.ptr(), w.dor.ld, dv + col0 * Dp, Dp, cols, Dp, valid,
               true);  // dV += P^T dO
          Gemm(kn, w.dpt.ptr(), w.dpt.ld, 1, w.qr.ptr(), w.qr.ld, dk + col0 * Dp, Dp, cols, Dp, valid,
               true);  // dK += dS^T (scale Q)
          Gemm(kn, w.dpt.ptr(), 1, w.dpt.ld, kb, kr.ld, w.dq.ptr(), w.dq.ld, valid, Dp, cols,
               true);  // dQ += dS K
        }
        T* dqp = static_cast<T*>(p.dq) + q_off(b, row0, h);
        float* acc = p.dq_accum + q_off(b, row0, h);
        for (int64_t r = 0; r < valid; ++r)
          for (int64_t c = 0; c < D; ++c) {
            const float g = w.dq.row(r)[c] * p.scale;
            acc[r * dm.q_row_stride() + c] = g;
            dqp[r * dm.q_row_stride() + c] = FromFloat(tag, g);
          }
      }
    }
    if (shares > 1) return;
    T* dkp = static_cast<T*>(p.dk) + k_off(b, 0, hk);
    T* dvp = static_cast<T*>(p.dv) + k_off(b, 0, hk);
    for (int64_t r = 0; r < dm.seqlen_k; ++r)
      for (int64_t c = 0; c < D; ++c) {
        dkp[r * dm.k_row_stride() + c] = FromFloat(tag, dk[r * Dp + c]);
        dvp[r * dm.k_row_stride() + c] = FromFloat(tag, dv[r * Dp + c]);
      }
  });
  if (shares == 1) return;

  // dK and dV: the shares' sums, added in share order.
  const int64_t chunk = 256;  // key rows per item
  const int64_t chunks = (dm.seqlen_k + chunk - 1) / chunk;
  ParallelFor(pool, bh * chunks, 2 * shares * chunk * D, [] { return 0; }, [&](int64_t item, int) {
    const int64_t r0 = (item % chunks) * chunk, r1 = std::min(dm.seqlen_k, r0 + chunk);
    const int64_t hk = (item / chunks) % dm.heads_k, b = item / (chunks * dm.heads_k);
    const float* base = partial.data() + (b * dm.heads_k + hk) * shares * 2 * head_elems;
    T* dkp = static_cast<T*>(p.dk) + k_off(b, 0, hk);
    T* dvp = static_cast<T*>(p.dv) + k_off(b, 0, hk);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < D; ++c) {
        float sk = 0.f, sv = 0.f;
        for (int64_t s = 0; s < shares; ++s) {
          sk += base[s * 2 * head_elems + r * Dp + c];
          sv += base[s * 2 * head_elems + head_elems + r * Dp + c];
        }
        dkp[r * dm.k_row_stride() + c] = FromFloat(tag, sk);
        dvp[r * dm.k_row_stride() + c] = FromFloat(tag, sv);
      }
  });
}

}  // namespace

// Br = 64 queries (four AVX-512 vectors along a score tile's row), Bc = 128 keys: the Bc x Br score tile
// (32 KiB) and its gradient stay in L2 beside the K/V rows. Measured on the 2-core CI machine (AVX-512,
// float32, H=4, S=2048, D in {64, 128}, causal or not, fwd and fwd+bwd, every choice interleaved in one
// process): of Br x Bc in {32, 64, 128} x {64, 128, 256}, 64 x 128 was the best or within 4% of it in 7 of
// the 8 cases (128 x 128 was 17% faster for the D=64 forward alone), so the head dim does not enter.
BlockSizes ComputeBlockSizes(int64_t /*head_dim*/) { return {64, 128}; }


namespace {

// run(pass) with the Pass of `dtype`.
template <typename Run>
void WithPass(DType dtype, const AttnDims& dims, const Run& run) {
  switch (dtype) {
    case DType::kF32: return run(Pass<F32>(dims));
    case DType::kBF16: return run(Pass<BF16>(dims));
    case DType::kF16: return run(Pass<F16>(dims));
  }
}

}  // namespace

void Forward(const FwdParams& p, DType dtype, TaskPool* pool) {
  const DenseKV src{p.dims.k_batch_stride(), p.dims.k_row_stride(), p.dims.head_dim};
  WithPass(dtype, p.dims, [&](const auto& pass) { pass.Forward(p, src, pool); });
}

void PagedForward(const FwdParams& p, const PagedKV& kv, DType dtype, TaskPool* pool) {
  const PagedKVRows src{kv, p.dims.k_row_stride(), p.dims.head_dim};
  WithPass(dtype, p.dims, [&](const auto& pass) { pass.Forward(p, src, pool); });
}

void Backward(const BwdParams& p, DType dtype, TaskPool* pool) {
  WithPass(dtype, p.dims, [&](const auto& pass) { pass.Backward(p, pool); });
}

}  // namespace jaxflash::cpu
