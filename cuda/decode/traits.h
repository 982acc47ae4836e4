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

// Splits of each tile's keys, each split at least kMinBlocksPerSplit key blocks. Below a full wave of thread
// blocks the time follows the busiest SM: it holds c = ceil(tiles * n / SMs) blocks of ceil(key blocks / n)
// key blocks each, plus about two key blocks' worth of fixed cost per block (Q, the first stage, the epilogue),
// and a block alone on its SM streams at about half speed (its chain of copies, MMAs and softmax leaves the
// memory idle). The cheapest count wins, the fewest splits on a tie. Measured on the H200 (B=1, 8 tiles, Sk=128k,
// 3 blocks per SM): 16 splits (one block per SM) 220 us, 24 173, 32 138, 47 (20 SMs one block short) 139.5, 49
// 136. From a full wave up: the fewest splits whose waves are at least 95 % as full as the best count's (after
// FlashAttention-2's rule: a last wave that is mostly empty costs as much as a full one).
inline int choose_num_splits(long long tiles, long long seqlen_k, long long sms, long long per_sm) {
  const long long blocks = (seqlen_k + kBlockN - 1) / kBlockN, slots = sms * per_sm;
  long long most = blocks / kMinBlocksPerSplit;
  most = most < kMaxSplits ? most : kMaxSplits;
  if (tiles <= 0 || sms <= 0 || per_sm <= 0 || most <= 1) return 1;
  if (tiles < slots) {
    constexpr long long kFixed = 2;  // key blocks
    long long best = 0, best_cost = 0;
    for (long long n = 1; n <= most && tiles * n <= slots; ++n) {
      const long long c = (tiles * n + sms - 1) / sms, per = (blocks + n - 1) / n;
      const long long cost = (c == 1 ? 2 : c) * (per + kFixed);
      if (best == 0 || cost < best_cost) best = n, best_cost = cost;
    }
    return int(best);
  }
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
