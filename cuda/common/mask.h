// The one definition of which (query i, key j) pairs are visible, shared by the CPU and CUDA kernels.
// See MaskParams in params.h for the rule.
#pragma once

#include <cmath>
#include <cstdint>

#include "params.h"

namespace jaxflash {

// --- the structural part: window / causal diagonal ---------------------------------------------------
JAXFLASH_HD bool is_visible(const MaskParams& m, int64_t i, int64_t j) {
  const int64_t c = i + m.diag_offset;
  if (m.window_right >= 0 && j > c + m.window_right) return false;
  if (m.window_left >= 0 && j < c - m.window_left) return false;
  return true;
}

// Keys that any query row in [row_begin, row_end) can see lie in [*key_begin, *key_end) (clamped to
// [0, seqlen_k]); the range is empty when key_begin >= key_end. Used to skip fully masked K/V blocks.
JAXFLASH_HD void visible_key_range(const MaskParams& m, int64_t row_begin, int64_t row_end,
                                   int64_t seqlen_k, int64_t* key_begin, int64_t* key_end) {
  int64_t lo = 0, hi = seqlen_k;
  if (m.window_left >= 0) lo = row_begin + m.diag_offset - m.window_left;
  if (m.window_right >= 0) hi = (row_end - 1) + m.diag_offset + m.window_right + 1;
  lo = lo < 0 ? 0 : lo;
  hi = hi > seqlen_k ? seqlen_k : hi;
  *key_begin = lo;
  *key_end = hi;
}

// Query rows that can see some key of [key_begin, key_end) lie in [*row_begin, *row_end) (clamped to
// [0, seqlen_q]): the inverse of visible_key_range, so a K/V block skips the query blocks that see none of it.
JAXFLASH_HD void visible_query_range(const MaskParams& m, int64_t key_begin, int64_t key_end, int64_t seqlen_q,
                                     int64_t* row_begin, int64_t* row_end) {
  int64_t lo = 0, hi = seqlen_q;
  if (m.window_right >= 0) lo = key_begin - m.diag_offset - m.window_right;         // j <= i + off + r
  if (m.window_left >= 0) hi = (key_end - 1) - m.diag_offset + m.window_left + 1;  // j >= i + off - l
  lo = lo < 0 ? 0 : lo;
  hi = hi > seqlen_q ? seqlen_q : hi;
  *row_begin = lo;
  *row_end = hi;
}

// True when every (i, j) in the block [row_begin, row_end) x [key_begin, key_end) is visible, so the
// kernel can skip the per-element predicate.
JAXFLASH_HD bool block_fully_visible(const MaskParams& m, int64_t row_begin, int64_t row_end,
                                     int64_t key_begin, int64_t key_end) {
  if (m.window_right >= 0 && key_end - 1 > row_begin + m.diag_offset + m.window_right) return false;
  if (m.window_left >= 0 && key_begin < (row_end - 1) + m.diag_offset - m.window_left) return false;
  return true;
}

// Query rows that see every key of [key_begin, key_end) lie in [*row_begin, *row_end) (not clamped): a block of
// rows inside it is block_fully_visible with those keys. Lets a K/V block decide that test per query block with
// two comparisons.
JAXFLASH_HD void fully_visible_query_range(const MaskParams& m, int64_t key_begin, int64_t key_end,
                                           int64_t* row_begin, int64_t* row_end) {
  *row_begin = m.window_right >= 0 ? (key_end - 1) - m.diag_offset - m.window_right : INT64_MIN;
  *row_end = m.window_left >= 0 ? key_begin - m.diag_offset + m.window_left + 1 : INT64_MAX;
}

// --- the whole mask of one batch element: structure + lengths + segment ids -----------------------------
struct BatchMask {
  MaskParams m;
  int64_t q_len;               // rows at or past q_len see nothing
  int64_t kv_len;              // keys at or past kv_len are invisible
  const int32_t* q_seg;        // this element's [seqlen_q] ids, or null
  const int32_t* kv_seg;       // this element's [seqlen_k] ids, or null
};

JAXFLASH_HD int64_t clamp_length(const int32_t* lengths, int64_t b, int64_t full) {
  if (lengths == nullptr) return full;
  const int64_t n = lengths[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

JAXFLASH_HD BatchMask batch_mask(const MaskParams& m, int64_t b, int64_t seqlen_q, int64_t seqlen_k) {
  BatchMask bm;
  bm.m = m;
  bm.q_len = clamp_length(m.q_lengths, b, seqlen_q);
  bm.kv_len = clamp_length(m.kv_lengths, b, seqlen_k);
  bm.q_seg = m.q_segment_ids ? m.q_segment_ids + b * seqlen_q : nullptr;
  bm.kv_seg = m.kv_segment_ids ? m.kv_segment_ids + b * seqlen_k : nullptr;
  // The diagonal takes the lengths as given, unclamped: a ring step passes a piece's lengths counted from the
  // piece's start (negative, or past its end), and they carry where the piece sits in the sequence.
  if (m.diag_follows_lengths) {
    const int64_t kv = m.kv_lengths ? m.kv_lengths[b] : seqlen_k, q = m.q_lengths ? m.q_lengths[b] : seqlen_q;
    bm.m.diag_offset += (kv - q) - (seqlen_k - seqlen_q);
  }
  return bm;
}

JAXFLASH_HD bool is_visible(const BatchMask& bm, int64_t i, int64_t j) {
  if (i >= bm.q_len || j >= bm.kv_len) return false;
  if (bm.q_seg != nullptr && bm.q_seg[i] != bm.kv_seg[j]) return false;
  return is_visible(bm.m, i, j);
}

// As above, for one batch element: rows past q_len are dropped, keys clamped to kv_len.
JAXFLASH_HD void visible_key_range(const BatchMask& bm, int64_t row_begin, int64_t row_end, int64_t* key_begin,
                                   int64_t* key_end) {
  row_end = row_end < bm.q_len ? row_end : bm.q_len;
  if (row_begin >= row_end) {
    *key_begin = *key_end = 0;
    return;
  }
  visible_key_range(bm.m, row_begin, row_end, bm.kv_len, key_begin, key_end);
}

// Query rows of one batch element that can see some key of [key_begin, key_end): keys clamped to kv_len,
// rows to q_len.
JAXFLASH_HD void visible_query_range(const BatchMask& bm, int64_t key_begin, int64_t key_end, int64_t* row_begin,
                                     int64_t* row_end) {
  key_end = key_end < bm.kv_len ? key_end : bm.kv_len;
  if (key_begin >= key_end) {
    *row_begin = *row_end = 0;
    return;
  }
  visible_query_range(bm.m, key_begin, key_end, bm.q_len, row_begin, row_end);
}

// Segment ids let a block be skipped when the ids of its rows and of its keys cannot meet: with ids
// sorted (packed documents) their [min, max] ranges are disjoint. Unsorted ids only lose the skip.
struct IdRange {
  int32_t lo, hi;
};

JAXFLASH_HD IdRange id_range(const int32_t* ids, int64_t begin, int64_t end) {
  IdRange r{ids[begin], ids[begin]};
  for (int64_t i = begin + 1; i < end; ++i) {
    r.lo = ids[i] < r.lo ? ids[i] : r.lo;
    r.hi = ids[i] > r.hi ? ids[i] : r.hi;
  }
  return r;
}

JAXFLASH_HD bool ranges_meet(IdRange a, IdRange b) { return a.lo <= b.hi && b.lo <= a.hi; }

// Every (i, j) of the block visible (rows below q_len, keys below kv_len): the per-element predicate can
// be skipped. With segment ids only when both sides carry one and the same id.
JAXFLASH_HD bool block_fully_visible(const BatchMask& bm, int64_t row_begin, int64_t row_end, int64_t key_begin,
                                     int64_t key_end) {
  if (row_end > bm.q_len || key_end > bm.kv_len) return false;
  if (bm.q_seg != nullptr) {
    const IdRange q = id_range(bm.q_seg, row_begin, row_end), k = id_range(bm.kv_seg, key_begin, key_end);
    if (!(q.lo == q.hi && k.lo == k.hi && q.lo == k.lo)) return false;
  }
  return block_fully_visible(bm.m, row_begin, row_end, key_begin, key_end);
}

// Soft-capping of the scores: s -> cap * tanh(s / cap) when cap > 0.
JAXFLASH_HD float softcap_score(float s, float cap) { return cap > 0.f ? cap * tanhf(s / cap) : s; }

}  // namespace jaxflash
