// XLA FFI handlers of the CUDA kernels (targets jaxflash_fwd / jaxflash_bwd, platform "CUDA") and the
// nanobind module that hands them to Python. Decode, check, fill params, pick the kernel family, launch.
// They never synchronise and never allocate (workspaces are outputs owned by XLA), and launch the same work
// for the same shapes, so XLA may capture them in a CUDA graph (kCmdBufferCompatible).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "decode.h"
#include "device_info.h"
#include "dispatch.h"

namespace nb = nanobind;

namespace jaxflash {
namespace {

constexpr const char* kFwdTarget = "jaxflash_fwd";
constexpr const char* kBwdTarget = "jaxflash_bwd";

// "bfloat16 32, 64; float16 32" for the configurations compiled for `pass` (any family).
std::string CompiledList(Pass pass) {
  std::string out;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    std::string dims;
    for (int i = 0; i < kNumCompiledConfigs; ++i) {
      const Config& c = kCompiledConfigs[i];
      const std::string d = std::to_string(c.head_dim);
      if (c.pass != pass || c.dtype != dtype || (", " + dims + ",").find(", " + d + ",") != std::string::npos) continue;
      dims += (dims.empty() ? "" : ", ") + d;
    }
    if (!dims.empty()) out += (out.empty() ? "" : "; ") + std::string(dtype_name(dtype)) + " " + dims;
  }
  return out.empty() ? "none" : out;
}

ffi::Error CudaFailed(const char* target, const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string(target) + ": " + what + " failed: " + cudaGetErrorString(err));
}

// The kernel family that runs (pass, dtype, head dim) on `device`: kSm90 on a compute capability 9.0 GPU when
// that family has the configuration (its sm_90a code runs nowhere else), else kSm80, which runs on every GPU
// the module is built for. JAXFLASH_CUDA_KERNELS=sm80, read at every call, forces kSm80 so that both families
// can be tested on one Hopper GPU.
ffi::Error SelectFamily(const char* target, int device, Pass pass, DType dtype, int64_t head_dim, Family* family) {
  if (dtype == DType::kF32)
    return Invalid(target, "dtype must be bfloat16 or float16 on the GPU; got float32");
  const char* forced = std::getenv("JAXFLASH_CUDA_KERNELS");
  const bool force_sm80 = forced != nullptr && std::strcmp(forced, "sm80") == 0;
  if (forced != nullptr && *forced != '\0' && !force_sm80 && std::strcmp(forced, "auto") != 0)
    return Invalid(target, std::string("JAXFLASH_CUDA_KERNELS must be 'sm80' or 'auto' (or unset); got '") + forced +
                               "'");
  DeviceInfo info;
  if (cudaError_t err = device_info(device, &info); err != cudaSuccess)
    return CudaFailed(target, "reading the device's attributes", err);
  if (!force_sm80 && info.cc_major == 9 && info.cc_minor == 0 && is_compiled(Family::kSm90, pass, dtype, head_dim)) {
    *family = Family::kSm90;
  } else if (is_compiled(Family::kSm80, pass, dtype, head_dim)) {
    *family = Family::kSm80;
  } else {
    return Invalid(target, std::string(dtype_name(dtype)) + " with head dim " + std::to_string(head_dim) +
                               " is not compiled for the " + (pass == Pass::kFwd ? "forward" : "backward") +
                               " pass (compiled: " + CompiledList(pass) + ")");
  }
  return ffi::Error::Success();
}

// The kernels number their blocks in one 32-bit grid dimension (>= 64 rows or keys per block).
ffi::Error CheckGrid(const char* target, const AttnDims& d) {
  const int64_t q_blocks = d.batch * d.heads_q * ((d.seqlen_q + 63) / 64);
  const int64_t k_blocks = d.batch * d.heads_k * ((d.seqlen_k + 63) / 64);
  if (q_blocks > INT32_MAX || k_blocks > INT32_MAX || (d.batch * d.heads_q * d.seqlen_q + 7) / 8 > INT32_MAX)
    return Invalid(target, "batch x heads x ceil(length / 64) must be below 2^31; got " +
                               std::to_string(q_blocks > k_blocks ? q_blocks : k_blocks));
  return ffi::Error::Success();
}

ffi::Error FwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state, ffi::Result<ffi::AnyBuffer> o,
                   ffi::ResultBuffer<ffi::F32> lse, Options opts) {
  FwdParams p;
  DType dtype;
  Family family;
  if (auto e = ParseFwd(kFwdTarget, q, k, v, {q_seg, kv_seg, q_len, kv_len, dropout_state}, o, lse, opts, &p);
      e.failure())
    return e;
  if (auto e = ToDType(kFwdTarget, q.element_type(), &dtype); e.failure()) return e;
  // Even for empty tensors, so that an unsupported dtype or head dim is always reported.
  if (auto e = SelectFamily(kFwdTarget, device, Pass::kFwd, dtype, p.dims.head_dim, &family); e.failure()) return e;
  if (auto e = CheckGrid(kFwdTarget, p.dims); e.failure()) return e;
  if (q.element_count() == 0) return ffi::Error::Success();  // nothing to write: never launch an empty grid
  if (cudaError_t err = run_fwd(family, dtype, int(p.dims.head_dim), p, stream, device); err != cudaSuccess)
    return CudaFailed(kFwdTarget, "kernel launch", err);
  return ffi::Error::Success();
}

ffi::Error BwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::ResultBuffer<ffi::F32> dq_accum, ffi::ResultBuffer<ffi::F32> delta, Options opts) {
  BwdParams p;
  DType dtype;
  Family family;
  if (auto e = ParseBwd(kBwdTarget, dout, q, k, v, o, lse, dlse, {q_seg, kv_seg, q_len, kv_len, dropout_state}, dq,
                        dk, dv, dq_accum, delta, opts, &p);
      e.failure())
    return e;
  if (auto e = ToDType(kBwdTarget, q.element_type(), &dtype); e.failure()) return e;
  if (auto e = SelectFamily(kBwdTarget, device, Pass::kBwd, dtype, p.dims.head_dim, &family); e.failure()) return e;
  if (auto e = CheckGrid(kBwdTarget, p.dims); e.failure()) return e;
  if (q.element_count() == 0 || k.element_count() == 0) {
    // Nothing to differentiate through: every gradient (and workspace) is 0.
    for (auto [ptr, bytes] : {std::pair<void*, size_t>{dq->untyped_data(), dq->size_bytes()},
                              {dk->untyped_data(), dk->size_bytes()},
                              {dv->untyped_data(), dv->size_bytes()},
                              {dq_accum->untyped_data(), dq_accum->size_bytes()},
                              {delta->untyped_data(), delta->size_bytes()}})
      if (bytes != 0)
        if (cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream); err != cudaSuccess)
          return CudaFailed(kBwdTarget, "cudaMemsetAsync", err);
    return ffi::Error::Success();
  }
  if (cudaError_t err = run_bwd(family, dtype, int(p.dims.head_dim), p, stream, device); err != cudaSuccess)
    return CudaFailed(kBwdTarget, "kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxflash

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashFwdCuda, jaxflash::FwdCuda,
                              jaxflash::BindFwd(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashBwdCuda, jaxflash::BwdCuda,
                              jaxflash::BindBwd(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

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
        std::vector<std::tuple<std::string, std::string, std::string, int>> out;
        for (int i = 0; i < jaxflash::kNumCompiledConfigs; ++i) {
          const jaxflash::Config& c = jaxflash::kCompiledConfigs[i];
          out.emplace_back(jaxflash::family_name(c.family), jaxflash::pass_name(c.pass),
                           jaxflash::dtype_name(c.dtype), c.head_dim);
        }
        return out;
      },
      "(family, pass, dtype name, head dim) of every compiled kernel configuration.");
}
