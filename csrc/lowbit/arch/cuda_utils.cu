// Host-side CUDA helpers (device properties, kernel attributes).
#include "lowbit/arch/cuda_utils.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
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

int smem_for_ctas_per_sm(int bytes, int ctas) {
  if (ctas <= 0) return bytes;
  constexpr int kReservedPerCta = 1024;  // shared memory the system keeps per CTA
  const int cap = cached_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(232448);
  // One more CTA than `ctas` must not fit: (ctas + 1) (padded + reserved) >
  // per SM; in the 128-byte units shared memory is allocated in.
  constexpr int kUnit = 128;
  const int padded = (smem_per_sm() / (ctas + 1) - kReservedPerCta + kUnit) / kUnit * kUnit;
  return std::min(cap, std::max(bytes, padded));
}

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

int64_t resident_clusters(const void* kernel, int threads, int smem, int cluster) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int>, int64_t> cached;  // (kernel, device, cluster, smem)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const std::lock_guard<std::mutex> lock(mutex);
  int64_t& slot = cached[{kernel, dev, cluster, smem}];
  if (slot > 0) return slot;
  int clusters = 0;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(cluster), 1, 1);
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.attrs = attr;
  config.numAttrs = 1;
  if (allow_dynamic_smem(kernel, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters <= 0) {
    cudaGetLastError();  // no cluster query on this device: assume one CTA per SM
    clusters = num_sms() / cluster;
  }
  slot = std::max(1, clusters);
  return slot;
}

}  // namespace lowbit::cuda
