// The sm90 forward's persistent schedule, and how it splits the last tiles (host and device; no CuTe, so the
// CUDA handler sizes the workspace from it too).
//
// With one thread block per SM taking tiles b, b + grid, ..., tiles that all cost the same leave the last
// round to tiles % grid blocks while the rest idle: 2048 tiles (every D = 128 target shape) on 132 SMs run 16
// rounds for 15.5 rounds of work, 3 % of the time. So when the tiles cost alike (no mask that varies between
// tiles), the first tiles - tiles % grid are taken whole, round robin, and the K/V blocks of the rest are
// shared out evenly: block c takes the contiguous range [c·W/C, (c+1)·W/C) of the W = tail tiles x blocks
// blocks in tile order, at most two pieces (the end of one tile, the start of the next). A piece leaves its
// unnormalised O and its rows' max and sum in a slot of the workspace; the last piece of a tile to finish
// (a counter per tile and consumer) sums the tile's pieces in their order, so the result does not depend on
// which block finishes last, and writes O and the LSE. Nobody waits for anybody.
#pragma once

#include <cstdint>

#include "params.h"

namespace jaxflash::sm90 {

constexpr int kFwdTileRows = 128;        // every head dim's kBlockM (traits.cuh asserts it)
constexpr int kFwdConsumerThreads = 256;  // two consumer warpgroups
constexpr int64_t kTailMaxParts = 8;      // a split tile goes to at most this many blocks,
constexpr int64_t kTailMinBlocks = 16;    // each block's share at least this many K/V blocks (a piece pays a
                                          // tile's prologue and epilogue: 8-block tiles at S = 1k ran 4 % slower
                                          // split, measured)

// Where the split pays (measured on an H200): D = 128 and 256. At D = 64 the split kernel ran 4-6 % below the
// kernel without it, whose last round it would shorten by 2.5 % at most (also as its own instantiation: 441
// against 470 TFLOP/s at 16k).
constexpr bool tail_split_pays(int64_t head_dim) { return head_dim >= 128; }

// One piece's floats: per consumer thread its d/2 values of O, then its two rows' max and (partial) sum.
JAXFLASH_HD int64_t tail_slot_floats(int64_t head_dim) { return kFwdConsumerThreads * (head_dim / 2 + 4); }

// The workspace the split needs at most: two slots per block of the grid, then two counters per split tile
// (fewer than grid tiles are split).
JAXFLASH_HD int64_t tail_workspace_floats(int64_t head_dim, int64_t grid) {
  return 2 * grid * tail_slot_floats(head_dim) + 2 * grid;
}

// 32-bit (work x grid < 2^32, or no split): 64-bit divisions are calls in device code, and calls in the tile
// loop cost the kernel's inner loops their uniform registers (measured in the SASS).
struct TailSchedule {
  uint32_t dp_tiles = 0;  // tiles [0, dp_tiles) are taken whole; no split: every tile
  uint32_t n_blocks = 0;  // K/V blocks per tile
  uint32_t work = 0;      // K/V blocks of the split tiles [dp_tiles, tiles), shared by blocks [0, sk_ctas)
  uint32_t sk_ctas = 0;   // 0: no split
  float* partials = nullptr;  // slot 2c + s: piece s of block c
  int* counters = nullptr;    // 2 j + consumer: pieces of split tile j done; zeroed before the launch
};

// The split for `tiles` tiles of n_blocks K/V blocks each on `grid` blocks, given a workspace of `floats`
// floats (none: no split). A split that does not shorten the last round by an eighth of a tile is not made.
inline TailSchedule make_tail_schedule(int64_t tiles, int64_t n_blocks, int64_t grid, int64_t head_dim,
                                       float* workspace, int64_t floats) {
  TailSchedule s;
  s.dp_tiles = uint32_t(tiles);  // < 2^30: the handler's grid check
  s.n_blocks = uint32_t(n_blocks);
  const int64_t tail = tiles % grid;
  if (tail == 0 || workspace == nullptr || floats < tail_workspace_floats(head_dim, grid)) return s;
  const int64_t work = tail * n_blocks;
  if (work * (grid + 1) >= (int64_t(1) << 32)) return s;
  int64_t ctas = grid < tail * kTailMaxParts ? grid : tail * kTailMaxParts;
  if (ctas > work / kTailMinBlocks) ctas = work / kTailMinBlocks;
  if (ctas <= tail || 8 * ((work + ctas - 1) / ctas) > 7 * n_blocks) return s;
  s.dp_tiles = uint32_t(tiles - tail);
  s.work = uint32_t(work);
  s.sk_ctas = uint32_t(ctas);
  s.partials = workspace;
  s.counters = reinterpret_cast<int*>(workspace + 2 * grid * tail_slot_floats(head_dim));
  return s;
}

// One unit of a block's work: a whole tile, or a piece (K/V blocks [block_lo, block_hi)) of split tile
// `tail`, the part-th of its `parts`, in slot `slot`.
struct FwdUnit {
  uint32_t tile = 0;
  int block_lo = -1, block_hi = -1;  // -1: the whole tile
  int tail = -1, slot = -1;
  int part = 0, parts = 1;
};

// The block whose range holds split block u, and where that block's range starts.
JAXFLASH_HD uint32_t tail_cta_of(const TailSchedule& s, uint32_t u) { return ((u + 1) * s.sk_ctas - 1) / s.work; }
JAXFLASH_HD uint32_t tail_range_begin(const TailSchedule& s, uint32_t c) { return c * s.work / s.sk_ctas; }

// The slot of piece `part` of split tile j: piece s of the block that holds it, s = 1 when that block's range
// began in an earlier tile.
JAXFLASH_HD int tail_slot_of(const TailSchedule& s, uint32_t j, int part) {
  const uint32_t c = tail_cta_of(s, j * s.n_blocks) + uint32_t(part);
  return int(2 * c + (tail_range_begin(s, c) < j * s.n_blocks ? 1 : 0));
}

// Unit `step` of block b: its whole tiles first, then the (at most two) pieces of its range; false past the
// last.
JAXFLASH_HD bool fwd_unit(const TailSchedule& s, uint32_t b, uint32_t grid, uint32_t step, FwdUnit* unit) {
  const uint32_t whole = b < s.dp_tiles ? (s.dp_tiles - 1 - b) / grid + 1 : 0;
  FwdUnit u;
  if (step < whole) {
    u.tile = b + step * grid;
    *unit = u;
    return true;
  }
  const uint32_t piece = step - whole;
  if (b >= s.sk_ctas || piece > 1) return false;
  const uint32_t lo = tail_range_begin(s, b), hi = tail_range_begin(s, b + 1);
  const uint32_t first = piece == 0 ? lo : (lo / s.n_blocks + 1) * s.n_blocks;
  if (first >= hi) return false;
  const uint32_t j = first / s.n_blocks, end = hi < (j + 1) * s.n_blocks ? hi : (j + 1) * s.n_blocks;
  const uint32_t c_first = tail_cta_of(s, j * s.n_blocks), c_last = tail_cta_of(s, (j + 1) * s.n_blocks - 1);
  u.tile = s.dp_tiles + j;
  u.block_lo = int(first - j * s.n_blocks);
  u.block_hi = int(end - j * s.n_blocks);
  u.tail = int(j);
  u.parts = int(c_last - c_first + 1);
  u.part = int(b - c_first);
  u.slot = int(2 * b + piece);
  *unit = u;
  return true;
}

}  // namespace jaxflash::sm90
