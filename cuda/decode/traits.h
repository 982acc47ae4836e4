// Tile sizes of the decode kernel (split-KV, GQA rows packed), as plain constants: the host side reads them
// too (the split heuristic needs the shared memory of a thread block).
#pragma once

namespace jaxflash::decode {

constexpr int kRows = 16;        // packed (query, head) rows of one tile: one m16 MMA tile
constexpr int kWarps = 4;        // each warp takes 16 keys of every stage, with its own softmax state
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockN = 16 * kWarps;  // keys per pipeline stage
constexpr int kMaxPackedRows = 64;  // past 4 tiles per K/V head the prefill kernels' wider tiles win
constexpr int kMinBlocksPerSplit = 4;  // a split reads at least 256 keys: below that, launch and merge dominate
constexpr int kMaxSplits = 64;

// Shared-memory rows are padded by 8 elements (16 bytes): the ldmatrix of 8 consecutive rows then hits 8
// different bank groups.
constexpr int row_elems(int head_dim) { return head_dim + 8; }
constexpr int stage_bytes(int head_dim) { return 2 * kBlockN * row_elems(head_dim) * 2; }  // K and V, 2-byte
// Thread blocks meant to share an SM: the loop of one warp is a chain of dependent steps (copies, MMAs,
// softmax), so a Hopper SM needs 12 warps to keep its memory busy, not 8 (measured: 3.3-3.9 TB/s with two
// blocks of 4 warps). Registers are capped to match (launch bounds); head dims past 128 keep one block.
constexpr int blocks_per_sm(int head_dim) { return head_dim <= 128 ? 3 : 1; }
// About 72 KiB of K/V stages at most (three blocks in the 228 KiB of an H100/H200 SM), 2 to 4 stages.
constexpr int num_stages(int head_dim) {
  const int n = (72 * 1024) / stage_bytes(head_dim);
  return n < 2 ? 2 : (n > 4 ? 4 : n);
}
constexpr int q_bytes(int head_dim) { return kRows * row_elems(head_dim) * 2; }
// After the loop the stages are reused for each warp's unnormalised O (fp32, padded rows) and row max/sum.
constexpr int o_row_floats(int head_dim) { return head_dim + 4; }
constexpr int epilogue_bytes(int head_dim) { return kWarps * kRows * (o_row_floats(head_dim) + 2) * 4; }
constexpr int smem_bytes(int head_dim) {
  const int stages = num_stages(head_dim) * stage_bytes(head_dim), epi = epilogue_bytes(head_dim);
  return q_bytes(head_dim) + (stages > epi ? stages : epi);
}

// Whether jaxflash_fwd runs this kernel: no dropout, and Sq x (Hq / Hk) packed rows of at most 4 tiles (each
// tile reads the keys once; the prefill kernels read them once per query head).
inline bool takes_call(long long seqlen_q, long long group, bool dropout) {
  return !dropout && seqlen_q * group <= kMaxPackedRows;
}

// Splits of each tile's keys: the fewest whose waves of thread blocks (`slots` resident at once) are at least
// 95 % as full as the best count's (after FlashAttention-2's rule: a last wave that is mostly empty costs as
// much as a full one; 85 % left a tenth of the H200 idle at B = 1), each split at least kMinBlocksPerSplit key
// blocks. Tiles that already fill several waves evenly stay whole.
inline int choose_num_splits(long long tiles, long long seqlen_k, long long slots) {
  const long long blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  long long most = blocks / kMinBlocksPerSplit;
  most = most < kMaxSplits ? most : kMaxSplits;
  if (tiles <= 0 || slots <= 0 || most <= 1) return 1;
  auto fill = [&](long long n) {
    const long long ctas = tiles * n, waves = (ctas + slots - 1) / slots;
    return double(ctas) / double(waves * slots);
  };
  double best = 0.;
  for (long long n = 1; n <= most; ++n) best = fill(n) > best ? fill(n) : best;
  for (long long n = 1; n <= most; ++n)
    if (fill(n) >= 0.95 * best) return int(n);
  return 1;
}

}  // namespace jaxflash::decode
