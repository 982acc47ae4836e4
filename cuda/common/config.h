// Element types and the names of compiled kernel configurations, shared by the CPU kernel, the FFI handlers
// and the CUDA kernels. No XLA or CUDA types here.
#pragma once

namespace jaxflash {

// Element type of q, k, v, o and the gradients. Accumulation is always float32.
enum class DType { kF32, kBF16, kF16 };

// GPU kernel families, by the instructions they are built on: kSm80 (mma.sync and cp.async; sm_80 and
// every later GPU) and kSm90 (wgmma and TMA; sm_90a only); kDecode, the split-KV kernel for few query rows
// and paged KV caches (mma.sync and cp.async, every GPU).
enum class Family { kSm80, kSm90, kDecode };

enum class Pass { kFwd, kBwd };

// One compiled (family, pass, dtype, head dim). The list of these is generated from cuda/configs.txt.
struct Config {
  Family family;
  Pass pass;
  DType dtype;
  int head_dim;
};

// Names as numpy and the configuration list spell them.
constexpr const char* dtype_name(DType t) {
  return t == DType::kF32 ? "float32" : t == DType::kBF16 ? "bfloat16" : "float16";
}
constexpr const char* family_name(Family f) {
  return f == Family::kSm80 ? "sm80" : f == Family::kSm90 ? "sm90" : "decode";
}
constexpr const char* pass_name(Pass p) { return p == Pass::kFwd ? "fwd" : "bwd"; }

}  // namespace jaxflash
