// XLA FFI handler of the CUDA forward kernel (target jaxflash_fwd, platform "CUDA") and the nanobind
// module that hands it to Python. Decode, check, fill params, dispatch, launch; never synchronises,
// never allocates, and launches the same work for the same shapes, so it can be captured in a graph.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "dispatch.h"
#include "ffi_common.h"
#include "launch.h"

namespace nb = nanobind;

namespace jaxflash {
namespace {

constexpr const char* kFwdTarget = "jaxflash_fwd";

struct LaunchFwd {
  const FwdParams& params;
  cudaStream_t stream;
  int device;
  bool empty;  // nothing to write: never launch an empty grid

  template <DType kDType, int kHeadDim>
  ffi::Error operator()() const {
    if (empty) return ffi::Error::Success();
    if (cudaError_t err = run_fwd<kDType, kHeadDim>(params, stream, device); err != cudaSuccess)
      return ffi::Error::Internal(std::string(kFwdTarget) + ": kernel launch failed: " + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
};

ffi::Error FwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state,
                   ffi::Result<ffi::AnyBuffer> o, ffi::ResultBuffer<ffi::F32> lse,
                   float scale, float softcap, int64_t window_left, int64_t window_right, bool bottom_right,
                   bool use_segment_ids, bool use_lengths, float dropout_rate) {
  FwdParams p;
  const MaskAttrs attrs{window_left, window_right, bottom_right, use_segment_ids, use_lengths};
  if (auto e = ParseFwd(kFwdTarget, q, k, v, q_seg, kv_seg, q_len, kv_len, dropout_state, o, lse, scale,
                        softcap, attrs, dropout_rate, &p);
      e.failure())
    return e;
  // The kernel numbers its blocks in one 32-bit grid dimension (kBlockM >= 64 rows per block).
  const int64_t blocks = p.dims.batch * p.dims.heads_q * ((p.dims.seqlen_q + 63) / 64);
  if (blocks > INT32_MAX)
    return Invalid(kFwdTarget, "batch x heads x ceil(Sq / 64) must be below 2^31; got " + std::to_string(blocks));
  // Dispatch even for empty tensors, so that an unsupported dtype or head dim is always reported.
  return Dispatch(kFwdTarget, q.element_type(), p.dims.head_dim,
                  LaunchFwd{p, stream, device, q.element_count() == 0});
}

}  // namespace
}  // namespace jaxflash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashFwdCuda, jaxflash::FwdCuda,
                              jaxflash::BindFwd(xla::ffi::Ffi::Bind()
                                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<xla::ffi::DeviceOrdinal>()));

extern "C" XLA_FFI_Error* JaxflashBwdCuda(XLA_FFI_CallFrame* call_frame);  // ffi_cuda_bwd.cc

NB_MODULE(_jaxflash_cuda, m) {
  m.doc() = "jaxflash CUDA kernels as XLA FFI handlers (platform \"CUDA\")";
  m.def("ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "The XLA FFI API version of the headers this module was built against.");
  m.def("registrations", []() {
    nb::dict d;
    d["jaxflash_fwd"] = nb::capsule(reinterpret_cast<void*>(&JaxflashFwdCuda));
    d["jaxflash_bwd"] = nb::capsule(reinterpret_cast<void*>(&JaxflashBwdCuda));
    return d;
  });
  m.def(
      "supported_configs",
      []() {
        std::vector<std::tuple<std::string, int>> out;
        for (const auto& c : jaxflash::kFwdConfigs) out.emplace_back(c.dtype_name, c.head_dim);
        return out;
      },
      "(dtype name, head dim) pairs the forward kernel is compiled for.");
}
