// XLA FFI handlers of the CPU kernels (targets jaxflash_fwd, jaxflash_bwd and jaxflash_paged_fwd, platform
// "cpu") and the nanobind module that hands them to Python. Decode, check, fill params, call the kernel.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "decode.h"
#include "decode_paged.h"
#include "flash_cpu.h"
#include "philox.h"

namespace nb = nanobind;

namespace jaxflash {
namespace {

constexpr int64_t kMaxHeadDim = 256;

ffi::Error CheckHeadDim(const char* target, int64_t d) {
  if (d < 1 || d > kMaxHeadDim)
    return Invalid(target, "head dim must be in [1, " + std::to_string(kMaxHeadDim) + "]; got " + std::to_string(d));
  return ffi::Error::Success();
}

// XLA's intra-op thread pool as the kernels' TaskPool (without one, num_threads() is 0 and Schedule runs the
// task inline: the kernels then run on the calling thread).
class XlaPool final : public cpu::TaskPool {
 public:
  explicit XlaPool(ffi::ThreadPool& pool) : pool_(pool) {}
  int num_threads() const override { return int(pool_.num_threads()); }
  void Schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
};

// Nothing to attend to: O = 0, LSE = -inf.
ffi::Error NoKeys(ffi::Result<ffi::AnyBuffer>& o, ffi::ResultBuffer<ffi::F32>& lse) {
  std::memset(o->untyped_data(), 0, o->size_bytes());
  std::fill_n(lse->typed_data(), lse->element_count(), -std::numeric_limits<float>::infinity());
  return ffi::Error::Success();
}

ffi::Error FwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                  ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state, ffi::Result<ffi::AnyBuffer> o,
                  ffi::ResultBuffer<ffi::F32> lse, Options opts) {
  constexpr const char* kTarget = "jaxflash_fwd";
  FwdParams p;
  DType dtype;
  if (auto e = ParseFwd(kTarget, q, k, v, {q_seg, kv_seg, q_len, kv_len, dropout_state}, o, lse, opts, &p);
      e.failure())
    return e;
  if (auto e = CheckHeadDim(kTarget, p.dims.head_dim); e.failure()) return e;
  if (auto e = ToDType(kTarget, q.element_type(), &dtype); e.failure()) return e;
  if (q.element_count() == 0) return ffi::Error::Success();
  if (p.dims.seqlen_k == 0) return NoKeys(o, lse);
  XlaPool tasks(pool);
  cpu::Forward(p, dtype, &tasks);
  return ffi::Error::Success();
}

// The CPU backward pass never uses atomics, so it is deterministic whatever `deterministic` says.
ffi::Error BwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k,
                  ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse,
                  ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                  ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::U32> dropout_state, ffi::Result<ffi::AnyBuffer> dq,
                  ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, ffi::ResultBuffer<ffi::F32> dq_accum,
                  ffi::ResultBuffer<ffi::F32> delta, Options opts) {
  constexpr const char* kTarget = "jaxflash_bwd";
  BwdParams p;
  DType dtype;
  if (auto e = ParseBwd(kTarget, dout, q, k, v, o, lse, dlse, {q_seg, kv_seg, q_len, kv_len, dropout_state}, dq, dk,
                        dv, dq_accum, delta, opts, &p);
      e.failure())
    return e;
  if (auto e = CheckHeadDim(kTarget, p.dims.head_dim); e.failure()) return e;
  if (auto e = ToDType(kTarget, q.element_type(), &dtype); e.failure()) return e;
  // Every output is written even when a length is 0 (zero gradients), so no caller sees garbage.
  for (auto* r : {&dq, &dk, &dv}) std::memset((*r)->untyped_data(), 0, (*r)->size_bytes());
  std::memset(dq_accum->untyped_data(), 0, dq_accum->size_bytes());
  std::memset(delta->untyped_data(), 0, delta->size_bytes());
  if (q.element_count() == 0 || k.element_count() == 0) return ffi::Error::Success();
  XlaPool tasks(pool);
  cpu::Backward(p, dtype, &tasks);
  return ffi::Error::Success();
}

// The block table and lengths live in host memory here, so they are checked before any page is read: a
// length past the table's capacity or a page outside the cache is an error, never a stray read.
ffi::Error CheckPages(const char* target, const FwdParams& p, const PagedKV& kv, int64_t num_pages) {
  for (int64_t b = 0; b < p.dims.batch; ++b) {
    const int64_t len = p.mask.kv_lengths[b];
    if (len < 0 || len > p.dims.seqlen_k)
      return Invalid(target, "kv_lengths[" + std::to_string(b) + "] must be in [0, " +
                                 std::to_string(p.dims.seqlen_k) + "] (pages_per_seq x page_size); got " +
                                 std::to_string(len));
    for (int64_t i = 0; i < (len + kv.page_size - 1) / kv.page_size; ++i) {
      const int64_t page = kv.block_table[b * kv.pages_per_seq + i];
      if (page < 0 || page >= num_pages)
        return Invalid(target, "block_tables[" + std::to_string(b) + ", " + std::to_string(i) + "] must be a page " +
                                   "in [0, " + std::to_string(num_pages) + "); got " + std::to_string(page));
    }
  }
  return ffi::Error::Success();
}

ffi::Error PagedFwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                       ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lengths,
                       ffi::Result<ffi::AnyBuffer> o, ffi::ResultBuffer<ffi::F32> lse, PagedOptions opts) {
  constexpr const char* kTarget = "jaxflash_paged_fwd";
  FwdParams p;
  PagedKV kv;
  DType dtype;
  if (auto e = ParsePagedFwd(kTarget, q, k_cache, v_cache, block_tables, kv_lengths, o, lse, opts, &p, &kv);
      e.failure())
    return e;
  if (auto e = CheckHeadDim(kTarget, p.dims.head_dim); e.failure()) return e;
  if (auto e = ToDType(kTarget, q.element_type(), &dtype); e.failure()) return e;
  if (auto e = CheckPages(kTarget, p, kv, k_cache.dimensions()[0]); e.failure()) return e;
  if (q.element_count() == 0) return ffi::Error::Success();
  if (p.dims.seqlen_k == 0) return NoKeys(o, lse);  // a table of no pages
  XlaPool tasks(pool);
  cpu::PagedForward(p, kv, dtype, &tasks);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxflash

namespace ffi = xla::ffi;

// The kernels run on XLA's intra-op thread pool, bound first so it is the handlers' first parameter.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashFwdCpu, jaxflash::FwdCpu,
                              jaxflash::BindFwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashBwdCpu, jaxflash::BwdCpu,
                              jaxflash::BindBwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashPagedFwdCpu, jaxflash::PagedFwdCpu,
                              jaxflash::BindPagedFwd(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

NB_MODULE(_jaxflash_cpu, m) {
  m.def("ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "The XLA FFI API version of the headers this module was built against.");
  m.def("registrations", [] {
    nb::dict d;
    d["jaxflash_fwd"] = nb::capsule(reinterpret_cast<void*>(&JaxflashFwdCpu));
    d["jaxflash_bwd"] = nb::capsule(reinterpret_cast<void*>(&JaxflashBwdCpu));
    d["jaxflash_paged_fwd"] = nb::capsule(reinterpret_cast<void*>(&JaxflashPagedFwdCpu));
    return d;
  });
  m.def("block_sizes", [](int64_t head_dim) {
    auto bs = jaxflash::cpu::ComputeBlockSizes(head_dim);
    return nb::make_tuple(bs.rows_q, bs.rows_k);
  }, "(Br, Bc) the CPU kernel uses for this head dim.");
  m.def("philox4x32", [](uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1, int rounds) {
    const jaxflash::Philox4 ctr{{c0, c1, c2, c3}};
    jaxflash::Philox4 r;
    if (rounds == 7) r = jaxflash::philox4x32<7>(ctr, k0, k1);
    else if (rounds == 10) r = jaxflash::philox4x32<10>(ctr, k0, k1);
    else throw nb::value_error(("philox4x32: rounds must be 7 or 10, got " + std::to_string(rounds)).c_str());
    return nb::make_tuple(r.x[0], r.x[1], r.x[2], r.x[3]);
  }, nb::arg("c0"), nb::arg("c1"), nb::arg("c2"), nb::arg("c3"), nb::arg("k0"), nb::arg("k1"),
     nb::arg("rounds") = jaxflash::kDropoutRounds,
     "The kernels' Philox4x32 with 7 (dropout's) or 10 rounds (counter words c0..c3, key words k0, k1), for "
     "known-answer tests.");
  m.def("dropout_keep16", [](uint32_t k0, uint32_t k1, uint32_t batch, uint32_t head, uint32_t row, uint32_t group,
                             float rate) {
    jaxflash::DropoutParams p;
    if (auto e = jaxflash::ParseDropoutRate("dropout_keep16", rate, &p); e.failure())
      throw nb::value_error(e.message().c_str());
    const jaxflash::DropoutDraw d{k0, k1, batch, 0, 0, p.threshold};
    return jaxflash::dropout_keep16(d, head, row, group);
  }, "The kernels' 16 keep bits of key columns 16 group .. 16 group + 15 (bit c: column 16 group + c) at `rate`.");
}
