// Deterministic mode's launch order of the backward's K/V blocks (host and device; no CuTe, so the CUDA module
// shows it to tests without a GPU). A deterministic block adds its dQ into each query block after its
// predecessor has, and waits for it there: the predecessor must be launched first, or blocks that wait could
// fill the GPU while the ones they wait for never start. The predecessor is n_block - 1 of the same head, or
// n_block + 1 where the mask bounds each key's queries from below (causal, a window's right side: the first
// query block of a K/V block grows with n_block, so block n reaches a query block steps before block n - 1 and
// would wait there for it at every step) and the sequence is short (ordered_launch).
#pragma once

#include <algorithm>
#include <cstdint>

#include "params.h"

namespace jaxflash {

// Groups of `heads` (batch, K/V head)s one after another; within a group, runs of `run` consecutive K/V
// blocks of each head in turn (a run's blocks adjacent in launch order).
struct OrderedLaunch {
  int64_t heads, run;
  bool descending;  // adds in descending n_block order, blocks launched in that order
};

// Whether a mask's K/V blocks add in descending order: where window_right bounds the queries from below.
JAXFLASH_HD bool adds_descending(const MaskParams& m) { return m.window_right >= 0; }

// The run length for long sequences (ordered_launch).
constexpr int kOrderedRun = 8;

// A block waits at each step (query block) for its predecessor's same step, so it should start about a step
// after it. Blocks start as earlier ones finish, about SMs / steps of them per step. With at least as many
// steps per block as SMs (long sequences) adjacent blocks start a step or more apart: runs of 8 blocks of one
// head, over every head (a run shares Q and dO in L2). With fewer (S = 1k: 8 or 16 steps against 132 SMs) a
// run's blocks started nearly together and waited for each other step by step (+20 % at d = 64); there each
// block's predecessor goes ~1.25 · SMs / steps places before it, the blocks of that many heads interleaved
// (whose lines then stay in L2). Descending adds (asked for by the mask) only then: in the long order the launch's
// tail weighs more than the waits, and descending starts a causal mask's shortest blocks first (GQA 64/8 8k causal
// took +21 %); with few steps the waits dominate (causal 1k to 4k: -16 to -33 % with descending adds).
inline OrderedLaunch ordered_launch(const AttnDims& d, int block_m, int multiprocessors, bool descending) {
  const int64_t num_bh = d.batch * d.heads_k;
  const int64_t steps = std::max<int64_t>(1, (d.seqlen_q + block_m - 1) / block_m * (d.heads_q / d.heads_k));
  const int64_t sms = std::max(1, multiprocessors);
  if (steps >= sms) return {num_bh, kOrderedRun, false};
  return {std::min(num_bh, (5 * sms + 4 * steps - 1) / (4 * steps)), 1, descending};
}

// Block `index` of the launch: its (batch · heads_k + head_k) and its K/V block.
JAXFLASH_HD void ordered_block(OrderedLaunch order, int64_t num_bh, int64_t num_n_blocks, int64_t index,
                               int64_t* bh, int64_t* n_block) {
  const int64_t group = order.heads * num_n_blocks;  // blocks of a full group
  const int64_t g = index / group, r = index - g * group;
  const int64_t left = num_bh - g * order.heads, width = order.heads < left ? order.heads : left;
  const int64_t full = width * order.run, last_run = (num_n_blocks - 1) / order.run;
  const int64_t j = r / full < last_run ? r / full : last_run, rj = r - j * full;
  const int64_t len = order.run < num_n_blocks - j * order.run ? order.run : num_n_blocks - j * order.run;
  *bh = g * order.heads + rj / len;
  *n_block = j * order.run + rj % len;
  if (order.descending) *n_block = num_n_blocks - 1 - *n_block;
}

}  // namespace jaxflash
