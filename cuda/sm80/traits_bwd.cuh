// Tile shapes of the backward kernels, one specialisation per head dim: the backward's only home of tuning
// numbers (the forward's live in traits.cuh). An unlisted head dim has no config and fails to compile.
//
// dK/dV kernel (one block per K/V block, looping over the query blocks of every head of its GQA group):
//   kBlockM query rows per step, kBlockN keys held, 8 warps. Warps form a grid per GEMM (FlashAttention-2's
//   choice for the same tiles): S = Q·Kᵀ and dP = dO·Vᵀ on kAtomMSdP x (8 / kAtomMSdP) warps over (M, N);
//   dV = Pᵀ·dO and dK = dSᵀ·Q on kAtomNdKV x (8 / kAtomNdKV) over (N, D); dQ = dS·K on kAtomMdQ x (8 / kAtomMdQ)
//   over (M, D). Each warp tile must divide its GEMM (16·atoms rows, 16·warps columns).
//   Registers per thread (fp32): dK + dV = 2·N·D / 256, S + dP = 2·M·N / 256, dQ = M·D / 256:
//     d<=128: 64 x 128 -> dK+dV <= 128, S+dP 64, dQ <= 32 (1 block/SM, 255 registers)
//     d>=192: 64 x 64  -> dK+dV 96 / 128, S+dP 32, dQ 48 / 64
//   Shared memory: K, V + 2 stages of Q and dO + P and dS (bf16):
//     d=128: 32+32 + 2·(16+16) + 16+16 = 160 KB; d=256: 32+32 + 2·(32+32) + 8+8 = 208 KB (H100/H200 only).
// dQ kernel (deterministic mode only; one block per query block, like the forward): 64 query rows, 4 warps
//   along the rows, kBlockN keys per step in 2 stages; dQ in registers (D/2 fp32 per thread).
#pragma once

namespace jaxflash::sm80 {

template <int kHeadDim>
struct BwdTileConfig;

template <>
struct BwdTileConfig<32> {
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4, kAtomMdQ = 4;
  static constexpr int kDqBlockN = 128;
};
template <>
struct BwdTileConfig<64> {
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4, kAtomMdQ = 2;
  static constexpr int kDqBlockN = 128;
};
template <>
struct BwdTileConfig<96> {
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4, kAtomMdQ = 4;
  static constexpr int kDqBlockN = 64;
};
template <>
struct BwdTileConfig<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4, kAtomMdQ = 2;
  static constexpr int kDqBlockN = 64;
};
template <>
struct BwdTileConfig<192> {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 8, kAtomMSdP = 4, kAtomNdKV = 2, kAtomMdQ = 2;
  static constexpr int kDqBlockN = 64;
};
template <>
struct BwdTileConfig<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 8, kAtomMSdP = 4, kAtomNdKV = 2, kAtomMdQ = 2;
  static constexpr int kDqBlockN = 64;
};

}  // namespace jaxflash::sm80
