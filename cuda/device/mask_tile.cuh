// Masks, softcap and dropout applied to a score tile in registers, shared by the forward and backward
// kernels so both passes see the same visibility (mask.h's rule) and the same dropout pattern (philox.h's).
// A tile is an mma.sync m16n8k16 accumulator seen through softmax.cuh's rowcol view: element (r, c) is query
// row0 + row(r), key col0 + col(c), with (row, col) read from an identity tensor partitioned the same way.
#pragma once

#include <climits>
#include <cstdint>

#include <cute/tensor.hpp>

#include "fast_math.cuh"
#include "mask.h"
#include "philox.h"

namespace jaxflash {

// acc <- cap · tanh(scale · acc / cap): raw Q·Kᵀ becomes the soft-capped, scaled score.
template <class TensorT>
__forceinline__ __device__ void softcap_scores(TensorT& acc, float scale, float cap) {
  const float k = scale / cap;
  CUTE_UNROLL
  for (int e = 0; e < cute::size(acc); ++e) acc(e) = cap * tanh_fast(acc(e) * k);
}

// s (rowcol view) gets −inf wherever bm hides (row, col). A row's structurally visible keys are one range
// (mask.h), compared as tile-local ints; rows past q_len see nothing; segment ids (kSegments: compiled in)
// are compared per element, columns outer so that one key id is live at a time.
template <int kTileN, bool kSegments, class TS, class TC>
__forceinline__ __device__ void mask_scores(TS& s, TC const& coords, const BatchMask& bm, int64_t row0,
                                            int64_t col0) {
  constexpr int kRows = decltype(cute::size<0>(s))::value, kCols = decltype(cute::size<1>(s))::value;
  int lo[kRows], hi[kRows];
  int32_t qid[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + cute::get<0>(coords(r, 0));
    int64_t a, b;
    visible_key_range(bm, row, row + 1, &a, &b);  // empty past q_len, clamped to kv_len
    a -= col0;
    b -= col0;
    lo[r] = int(a < 0 ? 0 : (a > kTileN ? kTileN : a));
    hi[r] = int(b < 0 ? 0 : (b > kTileN ? kTileN : b));
    qid[r] = (kSegments && bm.q_seg != nullptr && lo[r] < hi[r]) ? bm.q_seg[row] : 0;
  }
  if (kSegments && bm.q_seg != nullptr) {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int col = cute::get<1>(coords(0, c));
      const int64_t j = col0 + col;
      const int32_t kid = j < bm.kv_len ? bm.kv_seg[j] : 0;  // past kv_len the range check already hides it
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r)
        if (col < lo[r] || col >= hi[r] || kid != qid[r]) s(r, c) = -INFINITY;
    }
  } else {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int col = cute::get<1>(coords(0, c));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r)
        if (col < lo[r] || col >= hi[r]) s(r, c) = -INFINITY;
    }
  }
}

// mask_scores for a tile held key-major (rows = keys, columns = query rows, as the sm90 backward's Sᵀ):
// coords(r, c) is (key, query row) in the tile. The same visibility taken per key, as the query rows that see
// it (visible_query_range: exactly the rows whose visible_key_range holds the key), so a thread keeps two
// bounds per key it holds; segment ids compared per element, query columns outer.
template <int kTileM, bool kSegments, class TS, class TC>
__forceinline__ __device__ void mask_scores_by_key(TS& s, TC const& coords, const BatchMask& bm, int64_t key0,
                                                   int64_t row0) {
  constexpr int kKeys = decltype(cute::size<0>(s))::value, kCols = decltype(cute::size<1>(s))::value;
  int lo[kKeys], hi[kKeys];
  int32_t kid[kKeys];
  CUTE_UNROLL
  for (int r = 0; r < kKeys; ++r) {
    const int64_t key = key0 + cute::get<0>(coords(r, 0));
    int64_t a, b;
    visible_query_range(bm, key, key + 1, &a, &b);  // empty past kv_len, clamped to q_len
    a -= row0;
    b -= row0;
    lo[r] = int(a < 0 ? 0 : (a > kTileM ? kTileM : a));
    hi[r] = int(b < 0 ? 0 : (b > kTileM ? kTileM : b));
    kid[r] = (kSegments && bm.kv_seg != nullptr && lo[r] < hi[r]) ? bm.kv_seg[key] : 0;
  }
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) {
    const int col = cute::get<1>(coords(0, c));
    int32_t qid = 0;
    if (kSegments && bm.q_seg != nullptr) {
      const int64_t i = row0 + col;
      qid = i < bm.q_len ? bm.q_seg[i] : 0;  // past q_len the range check already hides it
    }
    CUTE_UNROLL
    for (int r = 0; r < kKeys; ++r)
      if (col < lo[r] || col >= hi[r] || (kSegments && bm.q_seg != nullptr && kid[r] != qid)) s(r, c) = -INFINITY;
  }
}

// Shrinks [*b_begin, *b_end) to its first and last index whose id lies in [min, max] of a_ids[a_begin, a_end):
// for packed documents (sorted ids) exactly the keys (or queries) that can meet the block; unsorted ids only
// lose some of the skipping. Every thread of the block calls it; `scratch` is 4 ints of shared memory, free
// again on return. With `pure`, also says whether every a id and every b id in the narrowed range is one and
// the same id: the ids then hide nothing inside that range (a document's interior blocks need no mask).
template <int kThreads>
__device__ void narrow_by_ids(const int32_t* a_ids, int64_t a_begin, int64_t a_end, const int32_t* b_ids,
                              int64_t* b_begin, int64_t* b_end, int* scratch, bool* pure = nullptr) {
  const int tid = threadIdx.x, lane = tid % 32;
  if (tid == 0) {
    scratch[0] = INT_MAX;
    scratch[1] = INT_MIN;
    scratch[2] = INT_MAX;
    scratch[3] = -1;
  }
  __syncthreads();
  int lo = INT_MAX, hi = INT_MIN;
  for (int64_t i = a_begin + tid; i < a_end; i += kThreads) {
    const int id = a_ids[i];
    lo = min(lo, id);
    hi = max(hi, id);
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    atomicMin(&scratch[0], lo);
    atomicMax(&scratch[1], hi);
  }
  __syncthreads();
  lo = scratch[0];
  hi = scratch[1];
  const int64_t base = *b_begin;
  const int n = int(*b_end - base);
  int first = INT_MAX, last = -1;
#pragma unroll 16  // independent loads in flight: the scan is latency-bound
  for (int j = tid; j < n; j += kThreads) {
    const int id = b_ids[base + j];
    if (id >= lo && id <= hi) {
      first = min(first, j);
      last = j;
    }
  }
  first = __reduce_min_sync(0xffffffffu, first);
  last = __reduce_max_sync(0xffffffffu, last);
  if (lane == 0) {
    atomicMin(&scratch[2], first);
    atomicMax(&scratch[3], last);
  }
  __syncthreads();
  first = scratch[2];
  last = scratch[3];
  if (pure != nullptr) {
    bool same = lo == hi;
    for (int j = first + tid; same && j <= last; j += kThreads) same = b_ids[base + j] == lo;
    *pure = __syncthreads_and(same) != 0 && last >= 0;
  }
  __syncthreads();  // scratch is free again (it aliases a tile the caller loads next)
  if (last < 0) {
    *b_end = *b_begin;
  } else {
    *b_begin = base + first;
    *b_end = base + last + 1;
  }
}

// Selection by a lane's two index bits, branch-free.
__forceinline__ __device__ uint32_t pick4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, int i) {
  const uint32_t lo = (i & 1) ? a1 : a0, hi = (i & 1) ? a3 : a2;
  return (i & 2) ? hi : lo;
}

// The quad's swap of the calls its four lanes drew: got[x] = word q of lane q ^ x's call (which sends its word
// q = its own index ^ x), three shuffles. All 32 lanes must call it together.
__forceinline__ __device__ void swap_quad_words(const Philox4& w, int q, uint32_t (&got)[4]) {
  CUTE_UNROLL
  for (int x = 0; x < 4; ++x) {
    const uint32_t mine = pick4(w.x[0], w.x[1], w.x[2], w.x[3], q ^ x);
    got[x] = x == 0 ? mine : __shfl_xor_sync(0xffffffffu, mine, x);
  }
}

// Calls f(r, c, keep) for every element of a rowcol view of an m16n8 accumulator (mma.sync or wgmma), keep =
// philox.h's decision for (head, row0 + row, col0 + col); col0 and the columns a thread's atoms start at are
// multiples of 16 and 8. The four lanes of a quad hold the same rows, lane q the columns 2q, 2q+1 (mod 8),
// whose bytes philox.h puts in word q of their (row, 16-column group)'s call. kAtomsPerGroup: 2 when a
// thread's consecutive atoms (8 columns each) are the two halves of one group (warps split only the rows), 1
// when each atom meets its group alone (warps split the columns too: another warp draws the same call for the
// other half). The quad's (row, group) pairs are split four ways: each lane draws every fourth and the lanes
// swap words, three shuffles per four calls. All 32 lanes must call it together.
template <int kAtomsPerGroup, class TC, class F>
__forceinline__ __device__ void for_each_keep(TC const& coords, const DropoutDraw& d, uint32_t head, int64_t row0,
                                              int64_t col0, F&& f) {
  constexpr int kRows = decltype(cute::size<0>(coords))::value, kCols = decltype(cute::size<1>(coords))::value;
  constexpr int kWidth = 2 * kAtomsPerGroup;  // a pair's columns in this thread
  constexpr int kGroups = kCols / kWidth;     // pairs per row
  constexpr int kPairs = kRows * kGroups;
  static_assert((kAtomsPerGroup == 1 || kAtomsPerGroup == 2) && kCols % kWidth == 0);
  const int q = threadIdx.x & 3;
  // The counter is 32-bit: so is the index arithmetic.
  auto row_of = [&](int r) { return uint32_t(row0) + uint32_t(cute::get<0>(coords(r, 0))); };
  auto group_of = [&](int g) { return (uint32_t(col0) + uint32_t(cute::get<1>(coords(0, g * kWidth)))) >> 4; };
  const uint32_t threshold24 = d.threshold << 24;
  CUTE_UNROLL
  for (int k = 0; k < (kPairs + 3) / 4; ++k) {
    // Pair u = (row u / kGroups, group u % kGroups); this lane draws pair 4k + q (past the last pair, a draw
    // nobody reads: the shuffles need every lane).
    uint32_t row, group;
    if constexpr (kAtomsPerGroup == 2 && kGroups % 4 == 0) {  // one row; consecutive groups (paired atoms)
      const int g = 4 * k % kGroups;
      row = row_of(4 * k / kGroups);
      group = group_of(g) + uint32_t(q) * (group_of(g + 1) - group_of(g));
    } else {
      auto at = [&](int u, bool want_row) {
        return u >= kPairs ? 0u : want_row ? row_of(u / kGroups) : group_of(u % kGroups);
      };
      row = pick4(at(4 * k, true), at(4 * k + 1, true), at(4 * k + 2, true), at(4 * k + 3, true), q);
      group = pick4(at(4 * k, false), at(4 * k + 1, false), at(4 * k + 2, false), at(4 * k + 3, false), q);
    }
    uint32_t got[4];  // got[x]: word q of pair 4k + (q ^ x)
    swap_quad_words(dropout_words(d, head, row, group), q, got);
    CUTE_UNROLL
    for (int j = 0; j < 4 && 4 * k + j < kPairs; ++j) {
      const int u = 4 * k + j, r = u / kGroups, c0 = (u % kGroups) * kWidth;
      const uint32_t word = pick4(got[0], got[1], got[2], got[3], q ^ j);
      CUTE_UNROLL
      for (int c = c0; c < c0 + kWidth; ++c) {
        // Byte 2 * (which half of the group) + (which of the lane's two columns), moved to the top: the
        // compare against threshold << 24 ignores the bytes below it.
        const int half =
            kAtomsPerGroup == 2 ? (c - c0) / 2 : int((uint32_t(col0) + uint32_t(cute::get<1>(coords(0, c)))) >> 3) & 1;
        const int shift = 8 * (2 * half + (c - c0) % 2);
        f(r, c, (word << (24 - shift)) >= threshold24);
      }
    }
  }
}

// The keep bits of a transposed accumulator, keys along its rows and queries along its columns (the sm90
// backward's Sᵀ = K·Qᵀ: a wgmma m64nN tile of (key, query), each warp 16 keys, one 16-key group), returned as
// one mask per thread: bit 4n + e + 2r is element (r, 2n + e) of coords' rowcol view, i.e. key row r and
// query 8n + 2q + e for lane q of its quad. Here a call's words fall on the eight lanes that share q: lane 4g
// + q holds keys g and g + 8 of the group, whose bytes are g % 2 and 2 + g % 2 of word g / 2 (philox.h). So
// each lane draws the two calls of its queries 8g + 2q + {0, 1}, decides their 32 bytes at once and packs the
// decisions into one word (bit 8b + 4e + k: byte b of word k of call e); the eight lanes then swap packed
// words (seven shuffles) and each keeps the four bits it holds. row0 is the tile's first query, col0 its
// first key (a multiple of 16). All 32 lanes must call it together.
template <class TC>
__forceinline__ __device__ uint32_t keep_bits_transposed(TC const& coords, const DropoutDraw& d, uint32_t head,
                                                         int64_t row0, int64_t col0) {
  static_assert(decltype(cute::size<0>(coords))::value == 2 && decltype(cute::size<1>(coords))::value == 16,
                "one warp's 16 keys by 16 query columns per thread (a 64-query wgmma tile)");
  const int g = (threadIdx.x >> 2) & 7;
  const uint32_t query = uint32_t(row0) + uint32_t(cute::get<1>(coords(0, 0))) + 8u * uint32_t(g);
  const uint32_t group = (uint32_t(col0) + uint32_t(cute::get<0>(coords(0, 0)))) >> 4;
  uint32_t packed = 0;
  CUTE_UNROLL
  for (int e = 0; e < 2; ++e) {
    const Philox4 w = dropout_words(d, head, query + uint32_t(e), group);
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {
      const uint32_t carry = keep_msbs(w.x[k], d.threshold);
      packed |= (carry >> (7 - k - 4 * e)) & (0x01010101u << (k + 4 * e));
    }
  }
  // This lane's bits of a packed word: byte g % 2 (key g) and 2 + g % 2 (key g + 8) of word g / 2, both
  // calls; the multiply gathers bits 0, 4, 16, 20 into bits 28..31 with no carries in between.
  const int shift = 8 * (g & 1) + (g >> 1);
  uint32_t mask = 0;
  CUTE_UNROLL
  for (int j = 0; j < 8; ++j) {  // from lane g ^ j: the queries of column pair n = g ^ j
    const uint32_t got = j == 0 ? packed : __shfl_xor_sync(0xffffffffu, packed, 4 * j);
    const uint32_t nibble = (((got >> shift) & 0x00110011u) * 0x12004800u) >> 28;
    mask |= nibble << (4 * (g ^ j));
  }
  return mask;
}

// Whether element (r, c) of keep_bits_transposed's tile is kept.
__forceinline__ __device__ bool kept_transposed(uint32_t mask, int r, int c) {
  return (mask >> (4 * (c >> 1) + (c & 1) + 2 * r)) & 1u;
}

// Dropout drawn ahead, by warps that would otherwise idle (the sm90 forward), for the consumer to apply to P
// after its conversion to 16 bits. The quad of lanes that holds a query row of an m16n8 or wgmma accumulator
// holds, in lane q, columns 2q, 2q+1 of each 8-column atom: word q of the row's call for that 16-column group,
// bytes 2h, 2h+1 for the group's half h (philox.h). Lane q's share of groups 8w .. 8w+7 is one word, group
// 8w + g at bits 8b + 7 - g for its bytes b: shifted left by g, the group's four decisions are the sign bits
// of the word's four bytes, and prmt's sign replication makes them masks for the two 16-bit pairs.
template <int kGroups>
inline constexpr int kKeepWords = (kGroups + 7) / 8;

// Rows i[0..kRows) (counted within the call) over groups g0 .. g0 + kGroups - 1, their calls interleaved:
// store(k, w, v) receives word w of the four lanes' shares of row i[k], lane q's in v's q-th component.
template <int kGroups, int kRows, class Store>
__forceinline__ __device__ void draw_row_keeps(const DropoutDraw& d, uint32_t head, const uint32_t (&i)[kRows],
                                               uint32_t g0, Store&& store) {
  CUTE_UNROLL
  for (int w = 0; w < kKeepWords<kGroups>; ++w) {
    uint32_t share[kRows][4] = {};
#pragma unroll 1  // a few calls at a time: the drawing warps have few registers
    for (int g = 0; g < 8 && 8 * w + g < kGroups; ++g) {
      CUTE_UNROLL
      for (int k = 0; k < kRows; ++k) {
        const Philox4 r = dropout_words(d, head, i[k], g0 + uint32_t(8 * w + g));
        CUTE_UNROLL
        for (int q = 0; q < 4; ++q) share[k][q] |= (keep_msbs(r.x[q], d.threshold) & 0x80808080u) >> g;
      }
    }
    CUTE_UNROLL
    for (int k = 0; k < kRows; ++k) store(k, w, make_uint4(share[k][0], share[k][1], share[k][2], share[k][3]));
  }
}

// The same decisions drawn by the quad itself: f(r, g, carry) for each of rows i[0..kRows) and groups
// g0 + g, g < kGroups, with carry = keep_msbs of word q of that call (lane q of the quad: bytes 2h, 2h+1 are
// the columns of atom 2g + h of the row). Each lane draws every fourth call and the quad swaps words, three
// shuffles per four calls (past the last group, a draw nobody reads); all 32 lanes must call it together.
template <int kGroups, int kRows, class F>
__forceinline__ __device__ void quad_keep_words(const DropoutDraw& d, uint32_t head, const uint32_t (&i)[kRows],
                                                uint32_t g0, F&& f) {
  const int q = threadIdx.x & 3;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; g += 4) {
      uint32_t got[4];  // got[x]: word q of group g + (q ^ x)
      swap_quad_words(dropout_words(d, head, i[r], g0 + uint32_t(g + q)), q, got);
      CUTE_UNROLL
      for (int j = 0; j < 4 && g + j < kGroups; ++j)
        f(r, g + j, keep_msbs(pick4(got[0], got[1], got[2], got[3], q ^ j), d.threshold));
    }
  }
}

// The mask of the 16-bit pair of atom n (columns 8n + 2q, +1 of the block) from the lane's word for group n / 2
// (see above): 0xffff in each half whose element is kept.
__forceinline__ __device__ uint32_t keep_pair_mask(uint32_t word, int n) {
  uint32_t mask;
  const uint32_t sel = (n & 1) ? 0xbbaau : 0x9988u;  // sign of byte 2h+1 over the high half, 2h the low
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(mask) : "r"(word << ((n >> 1) & 7)), "r"(sel));
  return mask;
}

}  // namespace jaxflash
