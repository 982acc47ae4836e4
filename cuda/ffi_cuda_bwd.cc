// XLA FFI handler of the CUDA backward kernels (target jaxflash_bwd, platform "CUDA"). Decode, check, fill
// params, dispatch, launch; never synchronises, never allocates (the fp32 workspaces dq_accum and delta are
// outputs owned by XLA), and launches the same work for the same shapes, so it can be captured in a graph.
// The binding matches the CPU handler's (ffi_cpu.cc) exactly.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "dispatch.h"
#include "ffi_common.h"
#include "launch_bwd.h"

namespace jaxflash {
namespace {

constexpr const char* kBwdTarget = "jaxflash_bwd";

struct LaunchBwd {
  const BwdParams& params;
  bool deterministic;
  cudaStream_t stream;
  int device;

  template <DType kDType, int kHeadDim>
  ffi::Error operator()() const {
    if (cudaError_t err = run_bwd<kDType, kHeadDim>(params, deterministic, stream, device); err != cudaSuccess)
      return ffi::Error::Internal(std::string(kBwdTarget) + ": kernel launch failed: " + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
};

// Only checks the pair is compiled (degenerate shapes launch no kernel).
struct CheckCompiled {
  template <DType, int>
  ffi::Error operator()() const {
    return ffi::Error::Success();
  }
};

ffi::Error ZeroFill(cudaStream_t stream, void* ptr, size_t bytes) {
  if (bytes == 0) return ffi::Error::Success();
  if (cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream); err != cudaSuccess)
    return ffi::Error::Internal(std::string(kBwdTarget) + ": cudaMemsetAsync failed: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error BwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::ResultBuffer<ffi::F32> dq_accum,
                   ffi::ResultBuffer<ffi::F32> delta, float scale, float softcap, int64_t window_left,
                   int64_t window_right, bool bottom_right, bool use_segment_ids, bool use_lengths,
                   float dropout_rate, bool deterministic) {
  BwdParams p;
  const MaskAttrs attrs{window_left, window_right, bottom_right, use_segment_ids, use_lengths};
  if (auto e = ParseBwd(kBwdTarget, dout, q, k, v, o, lse, dlse, q_seg, kv_seg, q_len, kv_len, dropout_state, dq,
                        dk, dv, dq_accum, delta, scale, softcap, attrs, dropout_rate, &p);
      e.failure())
    return e;
  // The kernels number their blocks in one 32-bit grid dimension (>= 64 rows or keys per block).
  const int64_t q_blocks = p.dims.batch * p.dims.heads_q * ((p.dims.seqlen_q + 63) / 64);
  const int64_t k_blocks = p.dims.batch * p.dims.heads_k * ((p.dims.seqlen_k + 63) / 64);
  const int64_t rows = p.dims.batch * p.dims.heads_q * p.dims.seqlen_q;
  if (q_blocks > INT32_MAX || k_blocks > INT32_MAX || (rows + 7) / 8 > INT32_MAX)
    return Invalid(kBwdTarget, "batch x heads x ceil(length / 64) must be below 2^31; got " +
                                   std::to_string(q_blocks > k_blocks ? q_blocks : k_blocks));

  if (q.element_count() == 0 || k.element_count() == 0) {
    // Nothing to differentiate through: every gradient (and workspace) is 0. Still report an unsupported
    // dtype or head dim, as for any other shape.
    if (auto e = Dispatch(kBwdTarget, q.element_type(), p.dims.head_dim, CheckCompiled{}); e.failure()) return e;
    for (auto [ptr, bytes] : {std::pair<void*, size_t>{dq->untyped_data(), dq->size_bytes()},
                              {dk->untyped_data(), dk->size_bytes()},
                              {dv->untyped_data(), dv->size_bytes()},
                              {dq_accum->untyped_data(), dq_accum->size_bytes()},
                              {delta->untyped_data(), delta->size_bytes()}})
      if (auto e = ZeroFill(stream, ptr, bytes); e.failure()) return e;
    return ffi::Error::Success();
  }

  return Dispatch(kBwdTarget, q.element_type(), p.dims.head_dim, LaunchBwd{p, deterministic, stream, device});
}

}  // namespace
}  // namespace jaxflash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashBwdCuda, jaxflash::BwdCuda,
                              jaxflash::BindBwd(xla::ffi::Ffi::Bind()
                                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<xla::ffi::DeviceOrdinal>()));
