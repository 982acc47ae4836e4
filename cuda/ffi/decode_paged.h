// The jaxflash_paged_fwd target: attention of q against a paged KV cache, forward only. Its binding, its static
// attributes and their decoding into FwdParams + PagedKV, every shape and dtype checked; failures are ffi::Errors
// that start with the target name and name the value received.
//
//   q            [B, Sq, Hq, D]
//   k_cache      [num_pages, page_size, Hk, D]   v_cache the same
//   block_tables [B, pages_per_seq] int32        key t of sequence b: page block_tables[b, t / page_size]
//   kv_lengths   [B] int32                       keys of sequence b: [0, kv_lengths[b])
//   -> o [B, Sq, Hq, D], lse [B, Hq, Sq] float32
//
// The causal diagonal and the window are bottom-right per sequence (query i sits at kv_lengths[b] - Sq + i).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "decode.h"

namespace jaxflash {

struct PagedOptions {
  float scale;
  float softcap;         // 0: off
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded; causal is 0
};

}  // namespace jaxflash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxflash::PagedOptions, StructMember<float>("scale"),
                                      StructMember<float>("softcap"), StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"));

namespace jaxflash {

template <typename Binding>
auto BindPagedResults(Binding&& b) {  // by reference: a Binding cannot be moved
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()           // q            [B, Sq, Hq, D]
      .template Arg<ffi::AnyBuffer>()           // k_cache      [num_pages, page_size, Hk, D]
      .template Arg<ffi::AnyBuffer>()           // v_cache      [num_pages, page_size, Hk, D]
      .template Arg<ffi::Buffer<ffi::S32>>()    // block_tables [B, pages_per_seq]
      .template Arg<ffi::Buffer<ffi::S32>>()    // kv_lengths   [B]
      .template Ret<ffi::AnyBuffer>()           // o            [B, Sq, Hq, D]
      .template Ret<ffi::Buffer<ffi::F32>>();   // lse          [B, Hq, Sq]
}

// The CUDA handler (kSplitWorkspaces) also returns the split-KV workspaces (BindSplitWorkspaces).
template <bool kSplitWorkspaces = false, typename Binding>
auto BindPagedFwd(Binding b) {
  if constexpr (kSplitWorkspaces) {
    return BindSplitWorkspaces(BindPagedResults(std::move(b))).template Attrs<PagedOptions>();
  } else {
    return BindPagedResults(std::move(b)).template Attrs<PagedOptions>();
  }
}

// Shapes, dtypes and options into `p` and `kv`. The table and lengths are device data, so checking their
// values is the handler's business (the CPU one can read them).
inline ffi::Error ParsePagedFwd(const char* target, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& block_tables,
                                const ffi::Buffer<ffi::S32>& kv_lengths, ffi::Result<ffi::AnyBuffer>& o,
                                ffi::ResultBuffer<ffi::F32>& lse, const PagedOptions& opts, FwdParams* p,
                                PagedKV* kv) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4) return Invalid(target, "q must have shape [B, Sq, Hq, D]; got " + ShapeStr(qd));
  if (kd.size() != 4)
    return Invalid(target, "k_cache must have shape [num_pages, page_size, Hk, D]; got " + ShapeStr(kd));
  if (auto e = CheckShape(target, "v_cache", vd, kd); e.failure()) return e;
  if (td.size() != 2 || td[0] != qd[0])
    return Invalid(target, "block_tables must have shape [B, pages_per_seq] with B = " + std::to_string(qd[0]) +
                               "; got " + ShapeStr(td));
  if (auto e = CheckShape(target, "kv_lengths", kv_lengths.dimensions(), std::vector<int64_t>{qd[0]}); e.failure())
    return e;
  if (kd[3] != qd[3])
    return Invalid(target, "q and the caches must have the same head dim; got " + std::to_string(qd[3]) + " and " +
                               std::to_string(kd[3]));
  if (kd[2] <= 0 || qd[2] % kd[2] != 0)
    return Invalid(target, "query heads must be a multiple of key/value heads; got " + std::to_string(qd[2]) +
                               " and " + std::to_string(kd[2]));
  if (kd[1] <= 0) return Invalid(target, "page_size must be positive; got " + std::to_string(kd[1]));
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return Invalid(target, std::string("q and the caches must share a dtype; got ") + DTypeName(q.element_type()) +
                               ", " + DTypeName(k.element_type()) + ", " + DTypeName(v.element_type()));
  if (auto e = CheckScaleSoftcap(target, opts.scale, opts.softcap); e.failure()) return e;
  if (opts.window_left < -1 || opts.window_right < -1)
    return Invalid(target, "window sides must be >= -1; got (" + std::to_string(opts.window_left) + ", " +
                               std::to_string(opts.window_right) + ")");
  if (auto e = CheckShape(target, "o", o->dimensions(), qd); e.failure()) return e;
  if (auto e = CheckShape(target, "lse", lse->dimensions(), StatShape(qd)); e.failure()) return e;
  if (o->element_type() != q.element_type())
    return Invalid(target, std::string("o must have q's dtype ") + DTypeName(q.element_type()) + "; got " +
                               DTypeName(o->element_type()));
  p->dims = AttnDims{qd[0], qd[1], td[1] * kd[1], qd[2], kd[2], qd[3]};
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->o = o->untyped_data();
  p->lse = lse->typed_data();
  p->scale = opts.scale;
  p->softcap = opts.softcap;
  // Written for the static capacity; diag_follows_lengths moves it to each sequence's own kv_lengths[b] - Sq.
  p->mask.diag_offset = p->dims.seqlen_k - p->dims.seqlen_q;
  p->mask.diag_follows_lengths = true;
  p->mask.window_left = opts.window_left;
  p->mask.window_right = opts.window_right;
  p->mask.kv_lengths = kv_lengths.typed_data();
  kv->block_table = block_tables.typed_data();
  kv->pages_per_seq = td[1];
  kv->page_size = kd[1];
  kv->num_pages = kd[0];
  return ffi::Error::Success();
}

}  // namespace jaxflash
