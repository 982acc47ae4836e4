// Parameter structs shared by the CPU and CUDA kernels: raw pointers, element strides, sizes, scale and the
// mask description. No XLA or CUDA types here, so both backends and the FFI handlers include it.
//
// Layout contract (all row-major, leading dims collapsed into `batch`):
//   q, o, do, dq   [batch, seqlen_q, heads_q, head_dim]
//   k, v, dk, dv   [batch, seqlen_k, heads_k, head_dim]
//   lse, dlse, delta [batch, heads_q, seqlen_q]          float32; lse natural log, -inf for rows that see no key
//   dq_accum       [batch, dq_accum_rows(seqlen_q), heads_q, head_dim]  float32 workspace of the backward pass,
//                  laid out as each kernel family chooses (the sm80 family and the CPU kernel use its first
//                  batch·seqlen_q·heads_q·head_dim floats as [batch, seqlen_q, heads_q, head_dim])
// K/V head of query head h is h / (heads_q / heads_k) (GQA/MQA share K/V by index, never repeated).
#pragma once

#include <cstdint>

// The functions of the headers that host and device code share (mask.h, philox.h, schedules): inline on
// the host, forced inline on the device.
#if defined(__CUDACC__)
#define JAXFLASH_HD __host__ __device__ __forceinline__
#else
#define JAXFLASH_HD inline
#endif

namespace jaxflash {

// dq_accum's rows: seqlen_q rounded up to a whole number of query tiles of every Hopper backward kernel (64, 80
// and 128 rows), so that a kernel can add whole tiles of dQ without a bound check, then dq_flag_rows more
// (jaxflash/_ffi.py sizes it by the same rule).
constexpr int64_t dq_accum_tile_rows(int64_t seqlen_q) {
  const int64_t by128 = (seqlen_q + 127) / 128 * 128, by80 = (seqlen_q + 79) / 80 * 80;
  return by128 > by80 ? by128 : by80;
}
// In the tile layout of dq_accum ([batch · heads_q, rows, head_dim]), the rows after each head's tiles hold one
// int per query tile, that says whether a block has stored the tile (kernels that store first rather than clear
// dq_accum): one per 64 rows at least, in rows of 32 floats or more.
constexpr int64_t dq_flag_rows(int64_t seqlen_q) { return (seqlen_q + 2047) / 2048; }
constexpr int64_t dq_accum_rows(int64_t seqlen_q) { return dq_accum_tile_rows(seqlen_q) + dq_flag_rows(seqlen_q); }
constexpr bool dq_accum_tiles_whole(int rows) { return rows == 64 || rows == 80 || rows == 128; }

// Which (query i, key j) pairs of batch element b are visible. With c = i + diag_offset (Sk - Sq is the
// bottom-right alignment FlashAttention uses, 0 the top-left one of jax.nn), j is visible iff
//   c - window_left <= j <= c + window_right   (a negative side is unbounded; causal is window_right = 0)
//   and j < kv_lengths[b] and i < q_lengths[b]  (when given; rows past q_lengths see nothing)
//   and q_segment_ids[b, i] == kv_segment_ids[b, j]  (when given).
// The predicate itself lives in mask.h.
struct MaskParams {
  int64_t diag_offset = 0;
  int64_t window_left = -1;
  int64_t window_right = -1;
  const int32_t* q_segment_ids = nullptr;   // [batch, seqlen_q], or null
  const int32_t* kv_segment_ids = nullptr;  // [batch, seqlen_k], or null
  const int32_t* q_lengths = nullptr;       // [batch], or null: every row is valid
  const int32_t* kv_lengths = nullptr;      // [batch], or null: every key is valid
  // true: diag_offset, written for the static shapes, moves with b's lengths to
  // diag_offset + (kv_len[b] - q_len[b]) - (Sk - Sq): bottom-right per element (a paged KV cache, whose Sk is
  // the block table's capacity, and every bottom-right call with lengths: a partly filled cache's new tokens
  // sit at its end). false (top-left calls) leaves the rule above as is.
  bool diag_follows_lengths = false;
};

// Dropout of the attention probabilities (philox.h has the rule). rate = 0: off, state unused.
// Per batch element: key word 0, key word 1, the element's batch index, and the position of the call's first
// query row and first key column in the whole sequence (0 and 0 but for a slice of it: a ring attention step;
// the column a multiple of 16, the width of one Philox draw).
constexpr int kDropoutStateWords = 5;

struct DropoutParams {
  float rate = 0.0f;                // as asked; > 0 turns dropout on
  uint32_t threshold = 0;           // round(rate * 256), in [1, 255]: bytes below it drop their element
  float keep_scale = 1.0f;          // 256 / (256 - threshold): kept probabilities are multiplied by it
  const uint32_t* state = nullptr;  // [batch, kDropoutStateWords]
};

struct AttnDims {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_k = 0;
  int64_t head_dim = 0;

  // Element strides of the contiguous layouts above.
  int64_t q_row_stride() const { return heads_q * head_dim; }
  int64_t q_batch_stride() const { return seqlen_q * heads_q * head_dim; }
  int64_t k_row_stride() const { return heads_k * head_dim; }
  int64_t k_batch_stride() const { return seqlen_k * heads_k * head_dim; }
  int64_t group() const { return heads_q / heads_k; }
};

struct FwdParams {
  AttnDims dims;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  float scale = 1.0f;
  float softcap = 0.0f;  // > 0: scores become softcap * tanh(scores / softcap) before the softmax
  MaskParams mask;
  DropoutParams dropout;
  // Scratch of a kernel that splits tiles between thread blocks (the sm90 forward: sm90/schedule.h), an FFI
  // output; null: no split.
  float* workspace = nullptr;
  int64_t workspace_floats = 0;
};

struct BwdParams {
  AttnDims dims;
  const void* dout = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const float* lse = nullptr;
  const float* dlse = nullptr;  // cotangent of lse (zeros unless the caller differentiates through it)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dq_accum = nullptr;  // workspace, an FFI output
  float* delta = nullptr;     // rowsum(dO * O) - dlse, an FFI output
  float scale = 1.0f;
  float softcap = 0.0f;
  MaskParams mask;
  DropoutParams dropout;
  bool deterministic = false;  // dQ summed in a fixed order: bitwise-reproducible gradients (CPU: always)
};

// A paged KV cache: FwdParams::k and ::v point at caches [num_pages, page_size, heads_k, head_dim], and key t
// of batch element b is row t % page_size of page block_table[b, t / page_size]. dims.seqlen_k is the block
// table's capacity, pages_per_seq * page_size; entries past an element's kv_lengths[b] are never read.
struct PagedKV {
  const int32_t* block_table = nullptr;  // [batch, pages_per_seq]
  int64_t pages_per_seq = 0;
  int64_t page_size = 0;
  int64_t num_pages = 0;
};

// The decode kernel (split-KV, query heads of a K/V head packed into the rows of one tile). Keys come from
// fwd.k / fwd.v, contiguous when paged.block_table is null. With num_splits > 1 the visible keys of each tile
// are cut into that many chunks whose results (normalised O and LSE) go to the fp32 workspaces, merged into
// fwd.o / fwd.lse by a second kernel; with 1 the workspaces are unused (may be null).
struct DecodeParams {
  FwdParams fwd;
  PagedKV paged;
  int num_splits = 1;
  float* o_part = nullptr;    // [num_splits, batch, seqlen_q, heads_q, head_dim]
  float* lse_part = nullptr;  // [num_splits, batch, heads_q, seqlen_q]
};

}  // namespace jaxflash
