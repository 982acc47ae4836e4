// XLA FFI handlers of the CUDA kernels (targets jaxflash_fwd, jaxflash_bwd and jaxflash_paged_fwd, platform
// "CUDA") and the nanobind module that hands them to Python. Decode, check, fill params, pick the kernel
// family, launch.
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

#include "bwd_order.h"
#include "decode.h"
#include "decode/traits.h"
#include "decode_paged.h"
#include "device_info.h"
#include "dispatch.h"
#include "sm90/schedule.h"

namespace nb = nanobind;

namespace jaxflash {
namespace {

constexpr const char* kFwdTarget = "jaxflash_fwd";
constexpr const char* kBwdTarget = "jaxflash_bwd";
constexpr const char* kPagedTarget = "jaxflash_paged_fwd";

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

// The kernel family that runs (pass, dtype, head dim) on `device`: kDecode for a forward call it takes
// (`decode_shape`: few query rows per K/V head, no dropout), else kSm90 on a compute capability 9.0 GPU when
// that family has the configuration (its sm_90a code runs nowhere else) and takes the call (`sm90_takes`:
// its deterministic backward takes no segment ids and head dims up to 128), else kSm80, which runs on every
// GPU the module is built for. JAXFLASH_CUDA_KERNELS=sm80, read at every call, forces kSm80 so that the
// families can be tested against each other on one Hopper GPU.
ffi::Error SelectFamily(const char* target, int device, Pass pass, DType dtype, int64_t head_dim, bool decode_shape,
                        bool sm90_takes, Family* family) {
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
  if (!force_sm80 && decode_shape && pass == Pass::kFwd && is_compiled(Family::kDecode, pass, dtype, head_dim)) {
    *family = Family::kDecode;
  } else if (!force_sm80 && sm90_takes && info.cc_major == 9 && info.cc_minor == 0 &&
             is_compiled(Family::kSm90, pass, dtype, head_dim)) {
    *family = Family::kSm90;
  } else if (is_compiled(Family::kSm80, pass, dtype, head_dim)) {
    *family = Family::kSm80;
  } else {
    // A configuration list may give the sm90 family what the sm80 family lacks; this call needs the latter.
    const bool sm90_only = is_compiled(Family::kSm90, pass, dtype, head_dim);
    return Invalid(target, std::string(dtype_name(dtype)) + " with head dim " + std::to_string(head_dim) +
                               " is not compiled for the " + (pass == Pass::kFwd ? "forward" : "backward") +
                               " pass" +
                               (sm90_only ? " of the sm80 kernels, which this call needs "
                                            "(JAXFLASH_CUDA_KERNELS=sm80, a GPU other than compute capability "
                                            "9.0, or an option the sm90 kernels do not take)"
                                          : "") +
                               " (compiled: " + CompiledList(pass) + ")");
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

// The split count is the workspaces' leading factor (chosen in Python by decode_num_splits, static per shape):
// lse_part holds n x rows floats, o_part n x rows x D; n = 0 means no split. Then the launch.
ffi::Error LaunchDecode(const char* target, DType dtype, DecodeParams& p, ffi::ResultBuffer<ffi::F32>& o_part,
                        ffi::ResultBuffer<ffi::F32>& lse_part, cudaStream_t stream, int device) {
  const AttnDims& d = p.fwd.dims;
  if (!is_compiled(Family::kDecode, Pass::kFwd, dtype, d.head_dim))
    return Invalid(target, std::string(dtype_name(dtype)) + " with head dim " + std::to_string(d.head_dim) +
                               " is not compiled for the decode kernel (compiled: " + CompiledList(Pass::kFwd) + ")");
  const int64_t rows = d.batch * d.seqlen_q * d.heads_q;
  if (rows == 0) return ffi::Error::Success();
  const int64_t n = int64_t(lse_part->element_count()) / rows;
  if (int64_t(lse_part->element_count()) != n * rows || int64_t(o_part->element_count()) != n * rows * d.head_dim ||
      n > decode::kMaxSplits)
    return Invalid(target, "the split workspaces must hold n x " + std::to_string(rows) + " and n x " +
                               std::to_string(rows * d.head_dim) + " floats, n <= " +
                               std::to_string(decode::kMaxSplits) + "; got " +
                               std::to_string(lse_part->element_count()) + " and " +
                               std::to_string(o_part->element_count()));
  p.num_splits = n > 1 ? int(n) : 1;
  p.o_part = n > 1 ? o_part->typed_data() : nullptr;
  p.lse_part = n > 1 ? lse_part->typed_data() : nullptr;
  const int64_t tiles = d.batch * d.heads_k * ((d.seqlen_q * d.group() + decode::kRows - 1) / decode::kRows);
  if (tiles > INT32_MAX || rows > INT32_MAX)
    return Invalid(target, "batch x key/value heads x ceil(Sq x group / 16) and batch x Sq x heads must be below "
                           "2^31; got " + std::to_string(tiles) + " and " + std::to_string(rows));
  if (p.paged.block_table != nullptr && d.seqlen_k > INT32_MAX)  // the kernel divides 32-bit key indices
    return Invalid(target, "pages_per_seq x page_size must be below 2^31; got " + std::to_string(d.seqlen_k));
  if (cudaError_t err = run_decode(dtype, int(d.head_dim), p, stream, device); err != cudaSuccess)
    return CudaFailed(target, "kernel launch", err);
  return ffi::Error::Success();
}

// jaxflash_fwd. The split workspaces are empty unless Python expects the decode kernel to take the call
// (decode_num_splits > 1); otherwise lse_part may hold the sm90 forward's scratch for split tiles
// (fwd_split_floats), which the kernel uses only when it is large enough.
ffi::Error FwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state, ffi::Result<ffi::AnyBuffer> o,
                   ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> o_part,
                   ffi::ResultBuffer<ffi::F32> lse_part, Options opts) {
  DecodeParams dp;
  FwdParams& p = dp.fwd;
  DType dtype;
  Family family;
  if (auto e = ParseFwd(kFwdTarget, q, k, v, {q_seg, kv_seg, q_len, kv_len, dropout_state}, o, lse, opts, &p);
      e.failure())
    return e;
  if (auto e = ToDType(kFwdTarget, q.element_type(), &dtype); e.failure()) return e;
  const bool decode_shape = decode::takes_call(p.dims.seqlen_q, p.dims.group(), p.dropout.rate > 0.f);
  // Even for empty tensors, so that an unsupported dtype or head dim is always reported.
  if (auto e = SelectFamily(kFwdTarget, device, Pass::kFwd, dtype, p.dims.head_dim, decode_shape, true, &family);
      e.failure())
    return e;
  if (family == Family::kDecode) return LaunchDecode(kFwdTarget, dtype, dp, o_part, lse_part, stream, device);
  if (auto e = CheckGrid(kFwdTarget, p.dims); e.failure()) return e;
  if (q.element_count() == 0) return ffi::Error::Success();  // nothing to write: never launch an empty grid
  p.workspace = lse_part->element_count() > 0 ? lse_part->typed_data() : nullptr;
  p.workspace_floats = int64_t(lse_part->element_count());
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
  if (auto e = SelectFamily(kBwdTarget, device, Pass::kBwd, dtype, p.dims.head_dim, false,
                            !(p.deterministic && (p.mask.q_segment_ids != nullptr || p.dims.head_dim > 128)),
                            &family);
      e.failure())
    return e;
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

ffi::Error PagedFwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Result<ffi::AnyBuffer> o, ffi::ResultBuffer<ffi::F32> lse,
                        ffi::ResultBuffer<ffi::F32> o_part, ffi::ResultBuffer<ffi::F32> lse_part,
                        PagedOptions opts) {
  DecodeParams p;
  if (auto e = ParsePagedFwd(kPagedTarget, q, k, v, block_tables, kv_lengths, o, lse, opts, &p.fwd, &p.paged);
      e.failure())
    return e;
  DType dtype;
  if (auto e = ToDType(kPagedTarget, q.element_type(), &dtype); e.failure()) return e;
  if (dtype == DType::kF32) return Invalid(kPagedTarget, "dtype must be bfloat16 or float16 on the GPU; got float32");
  return LaunchDecode(kPagedTarget, dtype, p, o_part, lse_part, stream, device);
}

}  // namespace
}  // namespace jaxflash

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashFwdCuda, jaxflash::FwdCuda,
                              jaxflash::BindFwd<true>(ffi::Ffi::Bind()
                                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashBwdCuda, jaxflash::BwdCuda,
                              jaxflash::BindBwd(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashPagedFwdCuda, jaxflash::PagedFwdCuda,
                              jaxflash::BindPagedFwd<true>(ffi::Ffi::Bind()
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
    d["jaxflash_paged_fwd"] = nb::capsule(reinterpret_cast<void*>(&JaxflashPagedFwdCuda));
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
  m.def(
      "decode_num_splits",
      [](int64_t batch, int64_t seqlen_q, int64_t heads_q, int64_t heads_k, int64_t seqlen_k, int64_t head_dim,
         int device) {
        namespace dec = jaxflash::decode;
        if (heads_k <= 0 || !dec::takes_call(seqlen_q, heads_q / heads_k, false)) return 0;
        // No GPU to ask (tracing on a machine without one): no split, which is correct anywhere.
        jaxflash::DeviceInfo info;
        if (jaxflash::device_info(device, &info) != cudaSuccess) return 1;
        const int64_t tiles = batch * heads_k * ((seqlen_q * (heads_q / heads_k) + dec::kRows - 1) / dec::kRows);
        // Resident thread blocks per SM: as many as shared memory holds, at most what the registers allow.
        int64_t per_sm = info.smem_per_multiprocessor / (dec::smem_bytes(int(head_dim)) + 1024);
        const int64_t most = dec::blocks_per_sm(int(head_dim));
        per_sm = per_sm < 1 ? 1 : (per_sm > most ? most : per_sm);
        return dec::choose_num_splits(tiles, seqlen_k, info.multiprocessors, per_sm);
      },
      nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("heads_q"), nb::arg("heads_k"), nb::arg("seqlen_k"),
      nb::arg("head_dim"), nb::arg("device") = 0,
      "Key splits of the decode kernel for this forward call without dropout on `device`: 1 for none, 0 when the "
      "decode kernel does not take the call (too many query rows per K/V head). Static per shape.");
  m.def(
      "fwd_split_floats",
      [](int64_t batch, int64_t seqlen_q, int64_t heads_q, int64_t seqlen_k, int64_t head_dim, int device) -> int64_t {
        namespace sm90 = jaxflash::sm90;
        jaxflash::DeviceInfo info;
        if (!sm90::tail_split_pays(head_dim) || jaxflash::device_info(device, &info) != cudaSuccess ||
            info.cc_major != 9 || info.cc_minor != 0 ||
            !jaxflash::is_compiled(jaxflash::Family::kSm90, jaxflash::Pass::kFwd, jaxflash::DType::kBF16, head_dim))
          return 0;
        const int64_t tiles = batch * heads_q * ((seqlen_q + sm90::kFwdTileRows - 1) / sm90::kFwdTileRows);
        // Worth a split: a partial last round and pieces of at least kTailMinBlocks blocks (of >= 64 keys).
        if (tiles % info.multiprocessors == 0 || seqlen_k < 2 * sm90::kTailMinBlocks * 64) return 0;
        return sm90::tail_workspace_floats(head_dim, info.multiprocessors);
      },
      nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("heads_q"), nb::arg("seqlen_k"), nb::arg("head_dim"),
      nb::arg("device") = 0,
      "Floats of scratch the sm90 forward may use on `device` to split its last tiles between all SMs, for a call "
      "whose tiles cost alike (no window, causal mask, segment ids or lengths); 0 when it would not split.");
  m.def(
      "fwd_split_schedule",
      [](int64_t tiles, int64_t n_blocks, int64_t grid, int64_t head_dim) {
        namespace sm90 = jaxflash::sm90;
        // A workspace of the size asked for, never touched: the schedule only looks at the pointer.
        const sm90::TailSchedule s = sm90::make_tail_schedule(tiles, n_blocks, grid, head_dim,
                                                              reinterpret_cast<float*>(alignof(float)),
                                                              sm90::tail_workspace_floats(head_dim, grid));
        std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int, int, int64_t, std::vector<int64_t>>>> out;
        for (int64_t b = 0; b < grid; ++b) {
          out.emplace_back();
          sm90::FwdUnit u;
          for (uint32_t step = 0; sm90::fwd_unit(s, uint32_t(b), uint32_t(grid), step, &u); ++step) {
            std::vector<int64_t> slots;
            for (int part = 0; u.parts > 1 && part < u.parts; ++part)
              slots.push_back(sm90::tail_slot_of(s, uint32_t(u.tail), part));
            out.back().emplace_back(u.tile, u.block_lo, u.block_hi, u.part, u.parts, u.slot, slots);
          }
        }
        return out;
      },
      nb::arg("tiles"), nb::arg("n_blocks"), nb::arg("grid"), nb::arg("head_dim"),
      "The sm90 forward's units of work per thread block for `tiles` tiles of `n_blocks` K/V blocks on `grid` "
      "blocks, given the workspace: (tile, first block, end block, part, parts, slot, the slots of every part) "
      "each, blocks -1 for a whole tile (for tests; no GPU needed).");
  m.def(
      "bwd_launch_order",
      [](int64_t batch, int64_t heads_q, int64_t heads_k, int64_t seqlen_q, int64_t seqlen_k, int block_m,
         int block_n, int multiprocessors, bool descending) {
        if (batch < 1 || heads_k < 1 || heads_q % heads_k != 0 || seqlen_q < 1 || seqlen_k < 1 || block_m < 1 ||
            block_n < 1 || multiprocessors < 1)
          throw nb::value_error("bwd_launch_order: every size must be positive and heads_q a multiple of heads_k");
        jaxflash::AttnDims d;
        d.batch = batch;
        d.heads_q = heads_q;
        d.heads_k = heads_k;
        d.seqlen_q = seqlen_q;
        d.seqlen_k = seqlen_k;
        const jaxflash::OrderedLaunch order = jaxflash::ordered_launch(d, block_m, multiprocessors, descending);
        const int64_t num_bh = batch * heads_k, num_n_blocks = (seqlen_k + block_n - 1) / block_n;
        if (num_bh * num_n_blocks > (int64_t(1) << 24)) throw nb::value_error("bwd_launch_order: too many blocks");
        std::vector<std::tuple<int64_t, int64_t>> blocks;
        for (int64_t i = 0; i < num_bh * num_n_blocks; ++i) {
          int64_t bh, n_block;
          jaxflash::ordered_block(order, num_bh, num_n_blocks, i, &bh, &n_block);
          blocks.emplace_back(bh, n_block);
        }
        return std::make_tuple(order.heads, order.run, order.descending, blocks);
      },
      nb::arg("batch"), nb::arg("heads_q"), nb::arg("heads_k"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
      nb::arg("block_m"), nb::arg("block_n"), nb::arg("multiprocessors"), nb::arg("descending") = false,
      "The deterministic sm90 backward's launch order on a GPU of `multiprocessors` SMs, for tiles of block_m "
      "query rows and block_n keys, for a mask that asks for descending adds (`descending`: causal or a window's "
      "right side): (heads per group, run length, whether the adds descend, [(batch * heads_k + head_k, K/V "
      "block) per block in launch order]) (for tests; no GPU needed).");
}
