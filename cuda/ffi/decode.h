// What the CPU and CUDA handlers share: the binding of the two targets (operands, results and one struct of
// static attributes), and their decoding into FwdParams / BwdParams with every shape, dtype and option
// checked. Every failure is an ffi::Error whose message starts with the target name and names the value
// received; nothing here aborts. Both platforms bind through BindFwd / BindBwd, so the CPU handler (tested in
// CI) and the CUDA one decode the same call the same way.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "config.h"
#include "params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

namespace ffi = xla::ffi;

// The static attributes of both targets, decoded by name (the Python layer passes exactly these). New
// options add a field here and one StructMember below.
struct Options {
  float scale;
  float softcap;         // 0: off
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded; causal is 0
  bool bottom_right;     // causal diagonal at Sk - Sq (FlashAttention) rather than 0 (jax.nn)
  int64_t diagonal_shift;  // added to that diagonal: the key offset of a query block (ring steps, chunks)
  bool segment_ids;      // the segment-id operands are meaningful
  bool lengths;          // the length operands are meaningful
  float dropout_rate;    // 0: off
  bool deterministic;    // backward summing dQ in a fixed order (the forward ignores it)
};

}  // namespace jaxflash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxflash::Options, StructMember<float>("scale"),
                                      StructMember<float>("softcap"), StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"), StructMember<bool>("bottom_right"),
                                      StructMember<int64_t>("diagonal_shift"),
                                      StructMember<bool>("segment_ids"), StructMember<bool>("lengths"),
                                      StructMember<float>("dropout_rate"), StructMember<bool>("deterministic"));

namespace jaxflash {

// The mask and dropout operands both targets take after their tensors. Ones that a flag marks unused are
// neither read nor shape-checked: the Python layer passes empty arrays there, which cost XLA no kernel to make.
struct OptionOperands {
  ffi::Buffer<ffi::S32> q_segment_ids;   // [..., Sq]
  ffi::Buffer<ffi::S32> kv_segment_ids;  // [..., Sk]
  ffi::Buffer<ffi::S32> q_lengths;       // [...]
  ffi::Buffer<ffi::S32> kv_lengths;      // [...]
  ffi::Buffer<ffi::U32> dropout_state;   // [..., 5]: key words, batch index, first row and column
};

template <typename Binding>
auto BindOptionOperands(Binding b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::U32>>();
}

// The two fp32 workspaces of the split-KV decode kernel (DecodeParams), flat: o_part [n x rows x D] and
// lse_part [n x rows], rows = batch x Sq x Hq, n the split count (0: no split).
template <typename Binding>
auto BindSplitWorkspaces(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>().template Ret<ffi::Buffer<ffi::F32>>();
}

// jaxflash_fwd: (q, k, v, option operands) -> (o, lse), attributes Options; jaxflash_decode_fwd
// (kSplitWorkspaces) returns the workspaces too. (Bindings cannot be moved into named variables, so each step
// is passed on as a temporary.)
template <typename Binding>
auto BindFwdResults(Binding&& b) {  // by reference: a Binding cannot be moved
  return BindOptionOperands(std::move(b)
                                .template Arg<ffi::AnyBuffer>()    // q [..., Sq, Hq, D]
                                .template Arg<ffi::AnyBuffer>()    // k [..., Sk, Hk, D]
                                .template Arg<ffi::AnyBuffer>())   // v [..., Sk, Hk, D]
      .template Ret<ffi::AnyBuffer>()                              // o   [..., Sq, Hq, D]
      .template Ret<ffi::Buffer<ffi::F32>>();                      // lse [..., Hq, Sq]
}

template <bool kSplitWorkspaces = false, typename Binding>
auto BindFwd(Binding b) {
  if constexpr (kSplitWorkspaces) {
    return BindSplitWorkspaces(BindFwdResults(std::move(b))).template Attrs<Options>();
  } else {
    return BindFwdResults(std::move(b)).template Attrs<Options>();
  }
}

// jaxflash_bwd: (do, q, k, v, o, lse, dlse, option operands) -> (dq, dk, dv, dq_accum, delta), attributes
// Options.
template <typename Binding>
auto BindBwd(Binding b) {
  return BindOptionOperands(std::move(b)
                                .template Arg<ffi::AnyBuffer>()          // do   [..., Sq, Hq, D]
                                .template Arg<ffi::AnyBuffer>()          // q
                                .template Arg<ffi::AnyBuffer>()          // k    [..., Sk, Hk, D]
                                .template Arg<ffi::AnyBuffer>()          // v
                                .template Arg<ffi::AnyBuffer>()          // o    [..., Sq, Hq, D]
                                .template Arg<ffi::Buffer<ffi::F32>>()   // lse  [..., Hq, Sq]
                                .template Arg<ffi::Buffer<ffi::F32>>())  // dlse [..., Hq, Sq]
      .template Ret<ffi::AnyBuffer>()                                    // dq
      .template Ret<ffi::AnyBuffer>()                                    // dk
      .template Ret<ffi::AnyBuffer>()                                    // dv
      .template Ret<ffi::Buffer<ffi::F32>>()   // dq_accum [..., dq_accum_rows(Sq), Hq, D] (workspace)
      .template Ret<ffi::Buffer<ffi::F32>>()   // delta    [..., Hq, Sq]    (workspace)
      .template Attrs<Options>();
}

inline std::string ShapeStr(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline const char* DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    default: return "unsupported";
  }
}

inline ffi::Error Invalid(const char* target, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

// The kernels' DType of an XLA element type.
inline ffi::Error ToDType(const char* target, ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = DType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = DType::kF16; return ffi::Error::Success();
    default: return Invalid(target, "dtype must be float32, bfloat16 or float16");
  }
}

// Reads q [..., Sq, Hq, D] and k, v [..., Sk, Hk, D] into `dims` (leading dims collapsed into batch).
// Returns ffi::Error + out-param rather than ErrorOr, which differs between jaxlib 0.10 and 0.11 headers.
inline ffi::Error ParseDims(const char* target, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, AttnDims* dims) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 3) return Invalid(target, "q must have rank >= 3 ([..., Sq, H, D]); got " + ShapeStr(qd));
  if (kd.size() != qd.size() || vd.size() != qd.size())
    return Invalid(target, "q, k and v must have the same rank; got q " + ShapeStr(qd) + ", k " + ShapeStr(kd) +
                               ", v " + ShapeStr(vd));
  const size_t r = qd.size();
  int64_t batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (kd[i] != qd[i] || vd[i] != qd[i])
      return Invalid(target, "q, k and v must share leading dims; got q " + ShapeStr(qd) + ", k " + ShapeStr(kd) +
                                 ", v " + ShapeStr(vd));
    batch *= qd[i];
  }
  for (size_t i = r - 3; i < r; ++i)
    if (kd[i] != vd[i]) return Invalid(target, "k and v must have the same shape; got k " + ShapeStr(kd) + ", v " + ShapeStr(vd));
  if (kd[r - 1] != qd[r - 1])
    return Invalid(target, "q and k must have the same head dim; got " + std::to_string(qd[r - 1]) + " and " +
                               std::to_string(kd[r - 1]));
  if (kd[r - 2] <= 0 || qd[r - 2] % kd[r - 2] != 0)
    return Invalid(target, "query heads must be a multiple of key/value heads; got " + std::to_string(qd[r - 2]) +
                               " and " + std::to_string(kd[r - 2]));
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return Invalid(target, std::string("q, k and v must share a dtype; got ") + DTypeName(q.element_type()) + ", " +
                               DTypeName(k.element_type()) + ", " + DTypeName(v.element_type()));
  dims->batch = batch;
  dims->seqlen_q = qd[r - 3];
  dims->seqlen_k = kd[r - 3];
  dims->heads_q = qd[r - 2];
  dims->heads_k = kd[r - 2];
  dims->head_dim = qd[r - 1];
  return ffi::Error::Success();
}

// `got` must be exactly the shape `want` (used for outputs and for the backward pass's inputs).
inline ffi::Error CheckShape(const char* target, const char* name, ffi::Span<const int64_t> got,
                             ffi::Span<const int64_t> want) {
  bool same = got.size() == want.size();
  for (size_t i = 0; same && i < got.size(); ++i) same = got[i] == want[i];
  if (!same) return Invalid(target, std::string(name) + " must have shape " + ShapeStr(want) + "; got " + ShapeStr(got));
  return ffi::Error::Success();
}

// lse / delta shape for q of shape [..., Sq, H, D]: [..., H, Sq].
inline std::vector<int64_t> StatShape(ffi::Span<const int64_t> qd) {
  std::vector<int64_t> s(qd.begin(), qd.end() - 3);
  s.push_back(qd[qd.size() - 2]);
  s.push_back(qd[qd.size() - 3]);
  return s;
}

// Checks the mask arrays against q [..., Sq, H, D] / k [..., Sk, Hk, D] and fills `mask`: segment ids
// [..., Sq] and [..., Sk], lengths [...], all int32. Arrays that a flag marks unused are ignored (any shape).
inline ffi::Error ParseMask(const char* target, ffi::Span<const int64_t> qd, const AttnDims& dims,
                            const OptionOperands& ops, const Options& opts, MaskParams* mask) {
  if (opts.window_left < -1 || opts.window_right < -1)
    return Invalid(target, "window sides must be >= -1; got (" + std::to_string(opts.window_left) + ", " +
                               std::to_string(opts.window_right) + ")");
  std::vector<int64_t> lead(qd.begin(), qd.end() - 3);
  std::vector<int64_t> want_q = lead, want_k = lead;
  want_q.push_back(dims.seqlen_q);
  want_k.push_back(dims.seqlen_k);
  if (opts.segment_ids) {
    if (auto e = CheckShape(target, "q_segment_ids", ops.q_segment_ids.dimensions(), want_q); e.failure()) return e;
    if (auto e = CheckShape(target, "kv_segment_ids", ops.kv_segment_ids.dimensions(), want_k); e.failure())
      return e;
  }
  if (opts.lengths) {
    if (auto e = CheckShape(target, "q_lengths", ops.q_lengths.dimensions(), lead); e.failure()) return e;
    if (auto e = CheckShape(target, "kv_lengths", ops.kv_lengths.dimensions(), lead); e.failure()) return e;
  }
  mask->diag_offset = (opts.bottom_right ? dims.seqlen_k - dims.seqlen_q : 0) + opts.diagonal_shift;
  mask->diag_follows_lengths = opts.bottom_right;  // bottom-right per sequence: kv_len[b] - q_len[b]
  mask->window_left = opts.window_left;
  mask->window_right = opts.window_right;
  mask->q_segment_ids = opts.segment_ids ? ops.q_segment_ids.typed_data() : nullptr;
  mask->kv_segment_ids = opts.segment_ids ? ops.kv_segment_ids.typed_data() : nullptr;
  mask->q_lengths = opts.lengths ? ops.q_lengths.typed_data() : nullptr;
  mask->kv_lengths = opts.lengths ? ops.kv_lengths.typed_data() : nullptr;
  return ffi::Error::Success();
}

// Dropout's rate into its 8-bit step (philox.h): threshold and keep_scale; 0 turns dropout off.
inline ffi::Error ParseDropoutRate(const char* target, float rate, DropoutParams* dropout) {
  if (!(rate >= 0.f && rate < 1.f))
    return Invalid(target, "dropout_rate must be in [0, 1); got " + std::to_string(rate));
  // Exact in double, and the same rounding as jaxflash.dropout.threshold.
  const double steps = std::floor(double(rate) * 256.0 + 0.5);
  if (rate > 0.f && !(steps >= 1.0 && steps <= 255.0))
    return Invalid(target, "dropout_rate " + std::to_string(rate) + " rounds to " + std::to_string(int(steps)) +
                               "/256; the kernels draw the rate in steps of 1/256 and need 1/256 .. 255/256");
  dropout->rate = rate;
  dropout->threshold = rate > 0.f ? uint32_t(steps) : 0u;
  dropout->keep_scale = rate > 0.f ? float(256.0 / (256.0 - steps)) : 1.f;
  return ffi::Error::Success();
}

// Dropout: the rate as above; state [..., kDropoutStateWords] uint32 (params.h), checked and read when rate > 0.
inline ffi::Error ParseDropout(const char* target, ffi::Span<const int64_t> qd, const ffi::Buffer<ffi::U32>& state,
                               float rate, DropoutParams* dropout) {
  if (auto e = ParseDropoutRate(target, rate, dropout); e.failure()) return e;
  std::vector<int64_t> want(qd.begin(), qd.end() - 3);
  want.push_back(kDropoutStateWords);
  if (rate > 0.f) {
    if (auto e = CheckShape(target, "dropout_state", state.dimensions(), want); e.failure()) return e;
  }
  dropout->state = rate > 0.f ? state.typed_data() : nullptr;
  return ffi::Error::Success();
}

// The kernels multiply scores by scale / softcap and 1 / softcap: below the smallest normal float either is
// flushed to 0 (fast math), and every score with it.
inline ffi::Error CheckScaleSoftcap(const char* target, float scale, float softcap) {
  auto str = [](float x) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", double(x));
    return std::string(buf);
  };
  if (!(scale > 0.f) || scale == INFINITY)
    return Invalid(target, "scale must be finite and positive; got " + str(scale));
  if (!(softcap >= 0.f) || softcap == INFINITY)
    return Invalid(target, "softcap must be finite and >= 0 (0: off); got " + str(softcap));
  if (softcap > 0.f && std::fmin(scale, 1.f) / softcap < FLT_MIN)
    return Invalid(target, "softcap is too large for the scale: min(scale, 1) / softcap must be >= 1.18e-38; got "
                           "softcap " + str(softcap) + ", scale " + str(scale));
  return ffi::Error::Success();
}

// What both passes decode alike: dims, scale, softcap, mask, dropout.
template <class Params>
ffi::Error ParseCommon(const char* target, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                       const ffi::AnyBuffer& v, const OptionOperands& ops, const Options& opts, Params* p) {
  if (auto e = ParseDims(target, q, k, v, &p->dims); e.failure()) return e;
  if (auto e = CheckScaleSoftcap(target, opts.scale, opts.softcap); e.failure()) return e;
  if (auto e = ParseMask(target, q.dimensions(), p->dims, ops, opts, &p->mask); e.failure()) return e;
  if (auto e = ParseDropout(target, q.dimensions(), ops.dropout_state, opts.dropout_rate, &p->dropout); e.failure())
    return e;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->scale = opts.scale;
  p->softcap = opts.softcap;
  return ffi::Error::Success();
}

// Everything both platforms decode for jaxflash_fwd, checked, into `p`.
inline ffi::Error ParseFwd(const char* target, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                           const ffi::AnyBuffer& v, const OptionOperands& ops, ffi::Result<ffi::AnyBuffer>& o,
                           ffi::ResultBuffer<ffi::F32>& lse, const Options& opts, FwdParams* p) {
  if (auto e = ParseCommon(target, q, k, v, ops, opts, p); e.failure()) return e;
  if (auto e = CheckShape(target, "o", o->dimensions(), q.dimensions()); e.failure()) return e;
  if (auto e = CheckShape(target, "lse", lse->dimensions(), StatShape(q.dimensions())); e.failure()) return e;
  if (o->element_type() != q.element_type())
    return Invalid(target, std::string("o must have q's dtype ") + DTypeName(q.element_type()) + "; got " +
                               DTypeName(o->element_type()));
  p->o = o->untyped_data();
  p->lse = lse->typed_data();
  return ffi::Error::Success();
}

// The same for jaxflash_bwd.
inline ffi::Error ParseBwd(const char* target, const ffi::AnyBuffer& dout, const ffi::AnyBuffer& q,
                           const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const ffi::AnyBuffer& o,
                           const ffi::Buffer<ffi::F32>& lse, const ffi::Buffer<ffi::F32>& dlse,
                           const OptionOperands& ops, ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dk,
                           ffi::Result<ffi::AnyBuffer>& dv, ffi::ResultBuffer<ffi::F32>& dq_accum,
                           ffi::ResultBuffer<ffi::F32>& delta, const Options& opts, BwdParams* p) {
  if (auto e = ParseCommon(target, q, k, v, ops, opts, p); e.failure()) return e;
  const auto stat = StatShape(q.dimensions());
  if (auto e = CheckShape(target, "do", dout.dimensions(), q.dimensions()); e.failure()) return e;
  if (auto e = CheckShape(target, "o", o.dimensions(), q.dimensions()); e.failure()) return e;
  if (auto e = CheckShape(target, "lse", lse.dimensions(), stat); e.failure()) return e;
  if (auto e = CheckShape(target, "dlse", dlse.dimensions(), stat); e.failure()) return e;
  if (auto e = CheckShape(target, "dq", dq->dimensions(), q.dimensions()); e.failure()) return e;
  if (auto e = CheckShape(target, "dk", dk->dimensions(), k.dimensions()); e.failure()) return e;
  if (auto e = CheckShape(target, "dv", dv->dimensions(), v.dimensions()); e.failure()) return e;
  std::vector<int64_t> accum(q.dimensions().begin(), q.dimensions().end());
  accum[accum.size() - 3] = dq_accum_rows(accum[accum.size() - 3]);
  if (auto e = CheckShape(target, "dq_accum", dq_accum->dimensions(), accum); e.failure()) return e;
  if (auto e = CheckShape(target, "delta", delta->dimensions(), stat); e.failure()) return e;
  for (auto t : {dout.element_type(), o.element_type(), dq->element_type(), dk->element_type(), dv->element_type()})
    if (t != q.element_type())
      return Invalid(target, std::string("do, o, dq, dk and dv must have q's dtype ") + DTypeName(q.element_type()) +
                                 "; got " + DTypeName(t));
  p->dout = dout.untyped_data();
  p->o = o.untyped_data();
  p->lse = lse.typed_data();
  p->dlse = dlse.typed_data();
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->dq_accum = dq_accum->typed_data();
  p->delta = delta->typed_data();
  p->deterministic = opts.deterministic;
  return ffi::Error::Success();
}

}  // namespace jaxflash
