// The only place where runtime values become template arguments: (dtype, head dim) -> run_fwd<...>.
// kFwdConfigs is the one list of compiled configurations; supported_configs() exports it to Python.
#pragma once

#include <cstdint>
#include <string>

#include "ffi_common.h"
#include "launch.h"

namespace jaxflash {

inline constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};

struct FwdConfig {
  DType dtype;
  const char* dtype_name;  // as numpy spells it
  int head_dim;
};

inline constexpr FwdConfig kFwdConfigs[] = {
    {DType::kBF16, "bfloat16", 32},  {DType::kBF16, "bfloat16", 64},  {DType::kBF16, "bfloat16", 96},
    {DType::kBF16, "bfloat16", 128}, {DType::kBF16, "bfloat16", 192}, {DType::kBF16, "bfloat16", 256},
    {DType::kFP16, "float16", 32},   {DType::kFP16, "float16", 64},   {DType::kFP16, "float16", 96},
    {DType::kFP16, "float16", 128},  {DType::kFP16, "float16", 192},  {DType::kFP16, "float16", 256},
};

inline std::string CompiledHeadDims() {
  std::string s;
  for (int d : kHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

// Calls f.template operator()<kDType, kHeadDim>() for the compiled pair, or returns InvalidArgument.
template <DType kDType, class F>
ffi::Error DispatchHeadDim(const char* target, int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 32: return f.template operator()<kDType, 32>();
    case 64: return f.template operator()<kDType, 64>();
    case 96: return f.template operator()<kDType, 96>();
    case 128: return f.template operator()<kDType, 128>();
    case 192: return f.template operator()<kDType, 192>();
    case 256: return f.template operator()<kDType, 256>();
    default:
      return Invalid(target, "head dim " + std::to_string(head_dim) + " not compiled (have " + CompiledHeadDims() + ")");
  }
}

template <class F>
ffi::Error Dispatch(const char* target, ffi::DataType dtype, int64_t head_dim, F&& f) {
  switch (dtype) {
    case ffi::DataType::BF16: return DispatchHeadDim<DType::kBF16>(target, head_dim, f);
    case ffi::DataType::F16: return DispatchHeadDim<DType::kFP16>(target, head_dim, f);
    default:
      return Invalid(target, std::string("dtype must be bfloat16 or float16 on the GPU; got ") + DTypeName(dtype));
  }
}

}  // namespace jaxflash
