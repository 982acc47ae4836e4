// What the launchers and the dispatch need to know of a GPU, read once per device and cached: compute
// capability (which kernel family runs), multiprocessors and their shared memory (grid sizes). Host code, CUDA runtime only.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>

namespace jaxflash {

struct DeviceInfo {
  int cc_major = 0;
  int cc_minor = 0;
  int multiprocessors = 0;
  int smem_per_multiprocessor = 0;  // bytes
};

// Fills *info for `device` (an ordinal below 64); the attribute queries never synchronise.
inline cudaError_t device_info(int device, DeviceInfo* info) {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static DeviceInfo cache[kMaxDevices];
  static cudaError_t status[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(once[device], [device] {
    DeviceInfo d;
    cudaError_t err = cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.multiprocessors, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&d.smem_per_multiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    cache[device] = d;
    status[device] = err;
  });
  *info = cache[device];
  return status[device];
}

}  // namespace jaxflash
