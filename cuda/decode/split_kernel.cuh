// The decode kernel: few query rows against many keys, where the work is reading K and V once at the memory's
// speed. Two ideas (FlashDecoding): the query heads that share a K/V head are packed into the rows of one tile
// (Sq x group rows), so each key is read once per group rather than once per query head; and when the tiles
// cannot fill the GPU, each tile's keys are split into chunks handled by separate thread blocks, merged after.
//
// One thread block: (batch b, K/V head, 16 packed rows, split s). Keys stream through a cp.async pipeline in
// stages of 64; warp w multiplies the 16 rows by keys [16w, 16w + 16) of each stage (mma.sync m16n8k16) and
// keeps its own online-softmax state, so no warp waits on another inside the loop. The four states merge in
// shared memory at the end. Keys may sit in pages (PagedKV): each row's address goes through the block table.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "config.h"
#include "fast_math.cuh"
#include "mask.h"
#include "params.h"
#include "decode/traits.h"

namespace jaxflash::decode {

template <DType kDType>
struct Elem;
template <>
struct Elem<DType::kBF16> {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ T from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<DType::kF16> {
  using T = __half;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ T from_float(float x) { return __float2half_rn(x); }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; `valid` false writes zeros instead (rows past the keys: finite, so 0 x V stays 0).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a·b, m16n8k16, fp32 accumulators.
template <DType kDType>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kDType == DType::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Where a tile's keys lie: element offset of key j's row (this tile's K/V head) in k or v. Through a block
// table, key j is slot j % page_size of page table[j / page_size]; the division is a multiply by a 64-bit
// reciprocal (exact for 32-bit j: Lemire's fastmod), since a real one costs dozens of instructions per row.
// A page outside the cache reads page 0 instead and raises `bad` (the tile then writes NaN).
struct KeyRows {
  int64_t base;          // contiguous: b's first key; paged: the head's offset within a row
  int64_t row_stride;    // heads_k * head_dim
  const int32_t* table;  // b's block-table row, or null
  uint32_t page_size;
  uint64_t page_inverse;  // ceil(2^64 / page_size)
  int64_t num_pages;

  __device__ __forceinline__ uint32_t page_index(int64_t j) const {
    return uint32_t(__umul64hi(page_inverse, uint64_t(j)));
  }
  // Contiguous keys; or paged, with `page` = table[page_index(j)] read earlier.
  __device__ __forceinline__ int64_t offset(int64_t j, int32_t page, bool& bad) const {
    if (table == nullptr) return base + j * row_stride;
    if (page < 0 || page >= num_pages) {
      bad = true;
      page = 0;
    }
    const uint32_t slot = uint32_t(j) - page_index(j) * page_size;
    return base + (int64_t(page) * page_size + slot) * row_stride;
  }
};

template <DType kDType, int kHeadDim>
__global__ void __launch_bounds__(kThreads, blocks_per_sm(kHeadDim)) decode_split_kernel(const DecodeParams p) {
  using E = Elem<kDType>;
  using T = typename E::T;
  constexpr int kRowElems = row_elems(kHeadDim), kStages = num_stages(kHeadDim);
  constexpr int kStageElems = 2 * kBlockN * kRowElems;  // K rows, then V rows
  constexpr int kChunks = kHeadDim / 8;                 // 16-byte chunks per row
  constexpr int kKSteps = kHeadDim / 16;
  constexpr int kONTiles = kHeadDim / 8;
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = reinterpret_cast<T*>(smem_raw + q_bytes(kHeadDim));

  const FwdParams& f = p.fwd;
  const AttnDims& d = f.dims;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t group = d.heads_q / d.heads_k;
  const int64_t packed = d.seqlen_q * group;  // packed rows of one (b, K/V head): row r is query r / group,
                                              // head hk * group + r % group
  const int row_blocks = int((packed + kRows - 1) / kRows);
  int64_t tile = blockIdx.x;
  const int mb = int(tile % row_blocks);
  tile /= row_blocks;
  const int64_t hk = tile % d.heads_k;
  const int64_t b = tile / d.heads_k;
  const int split = blockIdx.y;

  const BatchMask bm = batch_mask(f.mask, b, d.seqlen_q, d.seqlen_k);
  const int64_t r_begin = int64_t(mb) * kRows;
  const int64_t r_end = r_begin + kRows < packed ? r_begin + kRows : packed;
  const int64_t i_lo = r_begin / group, i_hi = (r_end - 1) / group + 1;

  // This split's keys: the tile's visible range cut into num_splits runs of whole 64-key blocks.
  int64_t k_lo, k_hi;
  visible_key_range(bm, i_lo, i_hi, &k_lo, &k_hi);
  const int64_t n_blocks_all = k_hi > k_lo ? (k_hi - k_lo + kBlockN - 1) / kBlockN : 0;
  const int64_t per_split = (n_blocks_all + p.num_splits - 1) / p.num_splits;
  const int64_t blk_begin = split * per_split;
  const int64_t blk_end = blk_begin + per_split < n_blocks_all ? blk_begin + per_split : n_blocks_all;
  const int n_blocks = blk_end > blk_begin ? int(blk_end - blk_begin) : 0;
  const int64_t key0 = k_lo + blk_begin * kBlockN;
  const int64_t key_end = k_lo + blk_end * kBlockN < k_hi ? k_lo + blk_end * kBlockN : k_hi;

  const T* q = static_cast<const T*>(f.q);
  const T* k = static_cast<const T*>(f.k);
  const T* v = static_cast<const T*>(f.v);
  const int64_t kv_row_stride = d.heads_k * d.head_dim;
  KeyRows rows;
  if (p.paged.block_table == nullptr) {
    rows = {(b * d.seqlen_k * d.heads_k + hk) * d.head_dim, kv_row_stride, nullptr, 1, 0, 0};
  } else {
    const uint32_t ps = uint32_t(p.paged.page_size);
    rows = {hk * d.head_dim, kv_row_stride, p.paged.block_table + b * p.paged.pages_per_seq, ps,
            ~uint64_t(0) / ps + 1, p.paged.num_pages};
  }
  // A paged sequence's length outside [0, capacity] is an error the host cannot see: NaN, like a bad page.
  bool bad = p.paged.block_table != nullptr &&
             (f.mask.kv_lengths[b] < 0 || f.mask.kv_lengths[b] > d.seqlen_k);

  // Q: the packed rows (zeros past the last one), in the first cp.async group.
  for (int c = tid; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int64_t pr = r_begin + r;
    const bool valid = pr < packed;
    const int64_t i = valid ? pr / group : 0, h = hk * group + (valid ? pr % group : 0);
    const T* src = q + ((b * d.seqlen_q + i) * d.heads_q + h) * d.head_dim + col;
    cp_async_16(smem_addr(sQ + r * kRowElems + col), src, valid);
  }
  // Each thread copies kLoads 16-byte chunks of K and the same of V per stage. With a block table, the page
  // numbers of the rows of the next stage to load are read one iteration ahead, so the table's latency
  // overlaps a stage of compute instead of stalling the copy.
  constexpr int kLoads = kBlockN * kChunks / kThreads;
  static_assert(kBlockN * kChunks % kThreads == 0, "a stage must split evenly over the threads");
  int32_t pages[kLoads] = {};
  auto fetch_pages = [&](int blk) {
    if (rows.table == nullptr || blk >= n_blocks) return;
    const int64_t j0 = key0 + int64_t(blk) * kBlockN;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t j = j0 + (tid + l * kThreads) / kChunks;
      pages[l] = j < key_end ? rows.table[rows.page_index(j)] : 0;
    }
  };
  auto load_stage = [&](int stage, int blk) {
    T* sK = sKV + stage * kStageElems;
    T* sV = sK + kBlockN * kRowElems;
    const int64_t j0 = key0 + int64_t(blk) * kBlockN;
    if constexpr (kThreads % kChunks == 0) {
      // A thread's chunks share a column and sit kRowStep rows apart (every head dim but 96 and 192): one
      // address computation per stage, then fixed strides.
      constexpr int kRowStep = kThreads / kChunks;
      const int r0 = tid / kChunks, col = (tid % kChunks) * 8;
      const uint32_t dst_k = smem_addr(sK + r0 * kRowElems + col), dst_v = smem_addr(sV + r0 * kRowElems + col);
      const int64_t first = j0 + r0, left = key_end - first;  // chunk l is valid while l * kRowStep < left
      if (rows.table == nullptr) {
        const int64_t off = rows.base + first * rows.row_stride + col, step = kRowStep * rows.row_stride;
#pragma unroll
        for (int l = 0; l < kLoads; ++l) {
          const bool valid = l * kRowStep < left;
          const int64_t o = valid ? off + l * step : 0;
          cp_async_16(dst_k + l * kRowStep * kRowElems * 2, k + o, valid);
          cp_async_16(dst_v + l * kRowStep * kRowElems * 2, v + o, valid);
        }
      } else {
#pragma unroll
        for (int l = 0; l < kLoads; ++l) {
          const bool valid = l * kRowStep < left;
          const int64_t o = valid ? rows.offset(first + l * kRowStep, pages[l], bad) + col : 0;
          cp_async_16(dst_k + l * kRowStep * kRowElems * 2, k + o, valid);
          cp_async_16(dst_v + l * kRowStep * kRowElems * 2, v + o, valid);
        }
      }
    } else {
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const int c = tid + l * kThreads, r = c / kChunks, col = (c % kChunks) * 8;
        const int64_t j = j0 + r;
        const bool valid = j < key_end;
        const int64_t o = valid ? rows.offset(j, pages[l], bad) + col : 0;
        cp_async_16(smem_addr(sK + r * kRowElems + col), k + o, valid);
        cp_async_16(smem_addr(sV + r * kRowElems + col), v + o, valid);
      }
    }
  };
  for (int s = 0; s < kStages - 1; ++s) {
    fetch_pages(s);
    if (s < n_blocks) load_stage(s, s);
    cp_async_commit();
  }
  fetch_pages(kStages - 1);

  // Per thread: rows g and g + 8 of the tile (g = lane / 4), columns 2 (lane % 4) + {0, 1} of each n8 tile.
  const int g = lane / 4, qd = lane % 4;
  float o_acc[kONTiles][4];
#pragma unroll
  for (int t = 0; t < kONTiles; ++t) o_acc[t][0] = o_acc[t][1] = o_acc[t][2] = o_acc[t][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  int64_t row_i[2];  // query index of each row, or -1 for padding rows
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t pr = r_begin + g + 8 * h;
    row_i[h] = pr < packed ? pr / group : -1;
  }
  const bool segments = bm.q_seg != nullptr;
  constexpr float kLog2e = 1.4426950408889634f;
  const float cap = f.softcap;
  const float score_scale = (cap > 0.f ? 1.f : f.scale) * kLog2e;  // softcap: tanh first, then to log2 units
  const float cap_in = cap > 0.f ? f.scale / cap : 0.f;

  for (int it = 0; it < n_blocks; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (it + kStages - 1 < n_blocks) load_stage((it + kStages - 1) % kStages, it + kStages - 1);
    cp_async_commit();
    fetch_pages(it + kStages);

    const T* sK = sKV + (it % kStages) * kStageElems + warp * 16 * kRowElems;
    const T* sV = sK + kBlockN * kRowElems;
    // S = Q Kᵀ for this warp's 16 keys: two n8 tiles.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t a[4], bk[4];
      ldmatrix_x4(a, smem_addr(sQ + (lane % 16) * kRowElems + kk * 16 + (lane / 16) * 8));
      ldmatrix_x4(bk, smem_addr(sK + ((lane / 16) * 8 + lane % 8) * kRowElems + kk * 16 + ((lane / 8) % 2) * 8));
      mma_16816<kDType>(s[0], a, bk[0], bk[1]);
      mma_16816<kDType>(s[1], a, bk[2], bk[3]);
    }
    // Scores in log2 units; hidden ones -inf. The whole stage is checked once; elements only at edges.
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (cap > 0.f) s[t][e] = cap * tanh_fast(s[t][e] * cap_in);
        s[t][e] *= score_scale;
      }
    const int64_t j0 = key0 + int64_t(it) * kBlockN, jw = j0 + warp * 16;
    if (segments || j0 + kBlockN > key_end || !block_fully_visible(bm, i_lo, i_hi, j0, j0 + kBlockN)) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t i = row_i[e / 2], j = jw + 8 * t + 2 * qd + (e % 2);
          if (i < 0 || j >= key_end || !is_visible(bm, i, j)) s[t][e] = -INFINITY;
        }
    }
    // Online softmax, per row (a row's 16 scores sit in one quad).
    uint32_t pa[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mx = quad_max(fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1])));
      const float m_new = fmaxf(row_max[h], mx);
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;
      const float corr = exp2f(row_max[h] - m_safe);  // 0 while the old max was -inf
      row_max[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[t][e] = exp2f(s[t][e] - m_safe);
          sum += s[t][e];
        }
      row_sum[h] = row_sum[h] * corr + sum;
#pragma unroll
      for (int t = 0; t < kONTiles; ++t) {
        o_acc[t][2 * h] *= corr;
        o_acc[t][2 * h + 1] *= corr;
      }
    }
    // P (16 x 16) is exactly one A operand: the accumulator layout of S is the A layout of the next MMA.
    pa[0] = E::pack(s[0][0], s[0][1]);
    pa[1] = E::pack(s[0][2], s[0][3]);
    pa[2] = E::pack(s[1][0], s[1][1]);
    pa[3] = E::pack(s[1][2], s[1][3]);
    // O += P V over this warp's 16 keys, 16 columns of V per ldmatrix.
#pragma unroll
    for (int dd = 0; dd < kHeadDim / 16; ++dd) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, smem_addr(sV + (lane % 8 + ((lane / 8) % 2) * 8) * kRowElems + dd * 16 + (lane / 16) * 8));
      mma_16816<kDType>(o_acc[2 * dd], pa, bv[0], bv[1]);
      mma_16816<kDType>(o_acc[2 * dd + 1], pa, bv[2], bv[3]);
    }
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad);

  // Merge the four warps' states: each writes its unnormalised O and row max / sum, then every thread
  // finishes D / 8 columns of one row.
  float* sO = reinterpret_cast<float*>(smem_raw + q_bytes(kHeadDim));
  constexpr int kORow = o_row_floats(kHeadDim);
  float* sM = sO + kWarps * kRows * kORow;
  float* sL = sM + kWarps * kRows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    const float l = quad_sum(row_sum[h]);
    if (qd == 0) {
      sM[warp * kRows + r] = row_max[h];
      sL[warp * kRows + r] = l;
    }
#pragma unroll
    for (int t = 0; t < kONTiles; ++t) {
      float* dst = sO + (warp * kRows + r) * kORow + 8 * t + 2 * qd;
      dst[0] = o_acc[t][2 * h];
      dst[1] = o_acc[t][2 * h + 1];
    }
  }
  __syncthreads();

  constexpr int kThreadsPerRow = kThreads / kRows, kCols = kHeadDim / kThreadsPerRow;
  const int r = tid / kThreadsPerRow, c0 = (tid % kThreadsPerRow) * kCols;
  const int64_t pr = r_begin + r;
  if (pr >= packed) return;
  const int64_t i = pr / group, h = hk * group + pr % group;
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sM[w * kRows + r]);
  float wt[kWarps], total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    wt[w] = m == -INFINITY ? 0.f : exp2f(sM[w * kRows + r] - m);
    total += wt[w] * sL[w * kRows + r];
  }
  const bool empty = !(total > 0.f);
  const float inv = empty ? 0.f : 1.f / total;
  const float lse = bad ? NAN : (empty ? -INFINITY : (m + log2f(total)) * 0.6931471805599453f);
  float out[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += wt[w] * sO[(w * kRows + r) * kORow + c0 + c];
    out[c] = bad ? NAN : acc * inv;
  }
  if (p.num_splits <= 1) {
    T* o = static_cast<T*>(f.o) + ((b * d.seqlen_q + i) * d.heads_q + h) * d.head_dim + c0;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) *reinterpret_cast<uint32_t*>(o + c) = E::pack(out[c], out[c + 1]);
    if (c0 == 0) f.lse[(b * d.heads_q + h) * d.seqlen_q + i] = lse;
  } else {
    const int64_t rows_all = d.batch * d.seqlen_q * d.heads_q;
    float* o = p.o_part + (split * rows_all + (b * d.seqlen_q + i) * d.heads_q + h) * d.head_dim + c0;
#pragma unroll
    for (int c = 0; c < kCols; c += 4)
      *reinterpret_cast<float4*>(o + c) = make_float4(out[c], out[c + 1], out[c + 2], out[c + 3]);
    if (c0 == 0) p.lse_part[split * rows_all + (b * d.heads_q + h) * d.seqlen_q + i] = lse;
  }
}

// Merges the splits of every (b, query, head) row: LSE = logsumexp of the parts', O = the parts weighted by
// exp(LSE_s - LSE). Parts with LSE -inf (no visible key) weigh 0; a row with none gives 0 and -inf; a NaN part
// (a page outside the cache) makes the row NaN. One thread block per row, one dependent round of loads: every
// thread issues its parts of O (4 columns of every kGroups-th split) while the first warp reads the LSEs and
// reduces them with shuffles, then the weighted sums of the groups add up in shared memory. (Looping over the
// splits, the LSEs first and then the parts, made the merge 5.4 us of a 141 us step at B=1.)
constexpr int kCombineThreads = 128;
static_assert(kMaxSplits <= 64, "the first warp reads two LSEs per lane");

template <DType kDType, int kHeadDim>
__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(const DecodeParams p) {
  using E = Elem<kDType>;
  constexpr int kColGroups = kHeadDim / 4, kGroups = kCombineThreads / kColGroups;
  constexpr int kPerThread = (kMaxSplits + kGroups - 1) / kGroups;
  static_assert(kHeadDim % 4 == 0 && kGroups >= 1, "float4 columns");
  __shared__ float s_weight[kMaxSplits];
  __shared__ float s_lse;
  __shared__ float4 s_acc[kGroups][kColGroups];
  const AttnDims& d = p.fwd.dims;
  const int64_t rows_all = d.batch * d.seqlen_q * d.heads_q;
  const int64_t row = blockIdx.x;  // (b, i, h) in o's order
  const int tid = threadIdx.x, n = p.num_splits;
  const int cg = tid % kColGroups, g = tid / kColGroups;
  float4 part[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int s = g + k * kGroups;
    if (g < kGroups && s < n)
      part[k] = reinterpret_cast<const float4*>(p.o_part + (s * rows_all + row) * d.head_dim)[cg];
  }
  if (tid < 32) {
    const int64_t h = row % d.heads_q, bi = row / d.heads_q, i = bi % d.seqlen_q, b = bi / d.seqlen_q;
    const int64_t stat = (b * d.heads_q + h) * d.seqlen_q + i;  // in lse's order
    const float l0 = tid < n ? p.lse_part[tid * rows_all + stat] : -INFINITY;
    const float l1 = tid + 32 < n ? p.lse_part[(tid + 32) * rows_all + stat] : -INFINITY;
    const bool nan = __any_sync(0xffffffffu, l0 != l0 || l1 != l1);
    float m = fmaxf(l0, l1);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float w0 = m == -INFINITY ? 0.f : expf(l0 - m), w1 = m == -INFINITY ? 0.f : expf(l1 - m);
    float total = w0 + w1;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
    const bool empty = !(total > 0.f);
    const float inv = empty ? 0.f : 1.f / total;
    s_weight[tid] = w0 * inv;
    s_weight[tid + 32] = w1 * inv;
    if (tid == 0) {
      const float lse = nan ? NAN : (empty ? -INFINITY : m + logf(total));
      s_lse = lse;
      p.fwd.lse[stat] = lse;
    }
  }
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (g < kGroups) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int s = g + k * kGroups;
      if (s < n) {
        const float w = s_weight[s];
        acc.x += w * part[k].x;
        acc.y += w * part[k].y;
        acc.z += w * part[k].z;
        acc.w += w * part[k].w;
      }
    }
    s_acc[g][cg] = acc;
  }
  __syncthreads();
  if (g != 0) return;
  for (int k = 1; k < kGroups; ++k) {
    const float4 x = s_acc[k][cg];
    acc.x += x.x;
    acc.y += x.y;
    acc.z += x.z;
    acc.w += x.w;
  }
  if (s_lse != s_lse) acc = make_float4(NAN, NAN, NAN, NAN);
  using T = typename E::T;
  T* o = static_cast<T*>(p.fwd.o) + row * d.head_dim + 4 * cg;
  *reinterpret_cast<uint32_t*>(o) = E::pack(acc.x, acc.y);
  *reinterpret_cast<uint32_t*>(o + 2) = E::pack(acc.z, acc.w);
}

}  // namespace jaxflash::decode
