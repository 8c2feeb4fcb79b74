// Host-side CUDA helpers (device properties).
#include "lowbit/cuda_utils.cuh"

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

}  // namespace lowbit::cuda
