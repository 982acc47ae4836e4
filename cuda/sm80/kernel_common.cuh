// What the sm80 kernel files share: their includes, and where one query block of the grid lies together with
// the keys it can see (the forward and the deterministic dQ kernel both run one block per query block).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "mask.h"
#include "mask_tile.cuh"
#include "operands.cuh"
#include "params.h"
#include "softmax.cuh"
#include "tile.cuh"

namespace jaxflash::sm80 {

// kBlockM query rows of one (batch, head) and the K/V head they read (GQA/MQA by index).
struct QueryBlock {
  int64_t m_block, batch, head, head_k;
  int64_t m0, m_end;  // its rows [m0, m_end); the last block of a head is partial
  // Element strides of the contiguous layouts (params.h's helpers are host-only).
  int64_t q_row_stride, k_row_stride;
  // 64-bit element offsets (tensors may exceed 2^31 elements) of this (batch, head) in q, o, do, dq and
  // dq_accum, of its K/V head in k and v, and of its row in lse and delta.
  int64_t q_off, k_off, stat_off;
};

// The query block this thread block owns. Blocks of one head are adjacent in launch order (they share K/V
// in L2); the heaviest causal block of each head goes first so the light ones fill the tail of the grid.
template <int kBlockM, int kHeadDim>
__forceinline__ __device__ QueryBlock this_query_block(const AttnDims& dims) {
  const int64_t seqlen_q = dims.seqlen_q, seqlen_k = dims.seqlen_k;
  const int64_t num_m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t block_id = blockIdx.x;
  const int64_t m_block = num_m_blocks - 1 - block_id % num_m_blocks;
  const int64_t bh = block_id / num_m_blocks;
  const int64_t head = bh % dims.heads_q, batch = bh / dims.heads_q;
  const int64_t head_k = head / (dims.heads_q / dims.heads_k);
  const int64_t q_row_stride = dims.heads_q * kHeadDim, k_row_stride = dims.heads_k * kHeadDim;
  const int64_t m0 = m_block * kBlockM;
  const int64_t m_end = cute::min(m0 + int64_t(kBlockM), seqlen_q);
  const int64_t q_off = batch * seqlen_q * q_row_stride + head * kHeadDim;
  const int64_t k_off = batch * seqlen_k * k_row_stride + head_k * kHeadDim;
  const int64_t stat_off = (batch * dims.heads_q + head) * seqlen_q;
  return {m_block, batch, head, head_k, m0, m_end, q_row_stride, k_row_stride, q_off, k_off, stat_off};
}

// The keys [*key_begin, *key_end) that some row of the block can see; with segment ids (`segments`) only the
// keys of the block's documents. Every thread of the block calls it; `scratch` is shared memory (4 ints).
template <int kThreads>
__forceinline__ __device__ void visible_keys(const BatchMask& bm, const QueryBlock& qb, bool segments, int* scratch,
                                             int64_t* key_begin, int64_t* key_end) {
  visible_key_range(bm, qb.m0, qb.m_end, key_begin, key_end);
  if (segments && *key_begin < *key_end)
    narrow_by_ids<kThreads>(bm.q_seg, qb.m0, cute::min(qb.m_end, bm.q_len), bm.kv_seg, key_begin, key_end, scratch);
}

}  // namespace jaxflash::sm80
