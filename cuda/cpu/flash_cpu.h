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

// The tile the kernels use for this head dim (the definition has the measurement behind it).
BlockSizes ComputeBlockSizes(int64_t head_dim);

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
// The forward over a paged KV cache (p.k, p.v the caches; params.h has the layout). Forward only.
void PagedForward(const FwdParams& p, const PagedKV& kv, DType dtype, TaskPool* pool);

}  // namespace jaxflash::cpu
