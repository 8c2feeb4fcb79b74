// Host-side CUDA helpers (device properties, kernel attributes).
#include "lowbit/cuda_utils.cuh"

#include <map>
#include <mutex>
#include <utility>

namespace lowbit::cuda {

namespace {
// A device attribute of the current device, cached per device (fallback:
// the H100's value).
template <cudaDeviceAttr kAttr>
int cached_attribute(int fallback) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return fallback;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, kAttr, dev) != cudaSuccess || n <= 0) n = fallback;
    cached[dev] = n;
  }
  return cached[dev];
}
}  // namespace

int num_sms() { return cached_attribute<cudaDevAttrMultiProcessorCount>(132); }
int smem_per_sm() { return cached_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(233472); }

cudaError_t allow_dynamic_smem(const void* kernel, int bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes set
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  int& set = allowed[{kernel, dev}];
  if (bytes <= set) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) set = bytes;
  return err;
}

}  // namespace lowbit::cuda
