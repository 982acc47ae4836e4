// The CPU twin of the CUDA kernels: the same FlashAttention-2 algorithm (tiles, online softmax, LSE,
// recompute-based backward) in plain C++17 with float32 accumulation.
#pragma once

#include <cstdint>
#include <functional>

#include "config.h"
#include "params.h"

namespace jaxflash::cpu {

struct BlockSizes {
  int64_t rows_q;  // Br: query rows per block
  int64_t rows_k;  // Bc: key/value rows per block
};

// Block sizes from an on-chip budget (bytes) and the head dim; see the definition for the rule.
BlockSizes ComputeBlockSizes(int64_t head_dim, int64_t budget_bytes);

// The budget used on this machine: the L2 cache size (1 MiB when the OS does not report it).
int64_t CacheBudgetBytes();

// The threads the kernels may use, e.g. XLA's intra-op pool. The calling thread always works too, and a
// scheduled task that starts after all work is taken returns at once, so a pool that runs tasks late, inline
// or never (the caller then does everything) is fine.
struct TaskPool {
  virtual int num_threads() const = 0;
  virtual void Schedule(std::function<void()> task) = 0;
  virtual ~TaskPool() = default;
};

// pool: null runs everything on the calling thread.
void Forward(const FwdParams& p, DType dtype, TaskPool* pool);
void Backward(const BwdParams& p, DType dtype, TaskPool* pool);

}  // namespace jaxflash::cpu
