// Tile shapes of the forward kernel, one specialisation per head dim: the only home of tuning numbers.
// An unlisted head dim has no TileConfig and fails to compile.
//
// The SRAM rule of the design note jaxflash grew from: with M bytes of on-chip memory for one block,
//   Br = min(M / (4 d bytes), d) query rows,  Bc = M / (4 d bytes) key rows.
// It fixes the order of magnitude (Q, K and V tiles of ~d rows fill M), but not the numbers below, because
// (a) an mma.sync warp owns 16·k query rows, so Br is a multiple of 16·warps and Bc a multiple of 16;
// (b) registers, not SRAM, bound the tile on this path: each thread keeps its rows of O (Br·d/threads fp32)
//     and S (Br·Bc/threads fp32) in registers, and 255 registers per thread is the ceiling;
// (c) two or more blocks per SM hide one block's softmax behind another's matmuls, so we spend
//     at most ~half the SM's 228 KB (H100/H200; 164 KB on A100) per block.
// Per head dim, with bf16 (2 bytes) and the rule's M = the smem we actually use:
//   d=32 : rule Br=32  Bc=312 (M=40K)  -> 128 x 128, 4 warps, 2 stages, 40 KB (O 32 + S 128 regs/thread)
//   d=64 : rule Br=64  Bc=312 (M=80K)  -> 128 x 128, 4 warps, 2 stages, 80 KB (O 64 + S 128 regs/thread)
//   d=96 : rule Br=96  Bc=187 (M=72K)  -> 128 x 64,  4 warps, 2 stages, 72 KB (O 96 + S 64)
//   d=128: rule Br=96  Bc=96  (M=96K)  -> 128 x 64,  4 warps, 2 stages, 96 KB (O 128 + S 64): 2 blocks/SM
//   d=192: rule Br=64  Bc=64  (M=96K)  -> 128 x 64,  8 warps, 1 stage,  96 KB (O 96 + S 32)
//   d=256: rule Br=48  Bc=48  (M=96K)  -> 64 x 64,   4 warps, 1 stage,  96 KB (O 128 + S 32): 2 blocks/SM
// Measured (H200, bf16, 16k tokens, fwd TFLOP/s non-causal/causal at S=16k, commit 7f663d6,
// benchmarks/RESULTS.md): d=64 323/311, d=128 357/329, d=256 343/346. No alternative tiles were timed yet.
// Stages = how many K/V blocks are in flight in shared memory (cp.async); 1 is FlashAttention-2's schedule
// (load V_j during Q·K_jᵀ, K_{j+1} during P·V_j), 2 issues loads a whole block ahead.
#pragma once

namespace jaxflash::sm80 {

template <int kHeadDim>
struct TileConfig;

template <>
struct TileConfig<32> {
  static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4, kStages = 2;
};
template <>
struct TileConfig<64> {
  static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4, kStages = 2;
};
template <>
struct TileConfig<96> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 2;
};
template <>
struct TileConfig<128> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 2;
};
template <>
struct TileConfig<192> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1;
};
template <>
struct TileConfig<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4, kStages = 1;
};

}  // namespace jaxflash::sm80
