// The one GPU-architecture check of every CUDA op: the kernels are built for
// sm_90a only (lowbit::gpu_arch_supported), so an op on any other GPU raises
// one clear error instead of a CUDA launch failure. Only the CUDA adapters
// (*_cuda.cpp) include this header.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "lowbit/common.h"

namespace lowbit::ops {

namespace detail {

// Per device: 0 not yet looked at, 1 supported, 2 not supported. After the
// first call on a device the check is one relaxed atomic load.
inline std::atomic<int8_t>& gpu_support_state(c10::DeviceIndex device) {
  static std::array<std::atomic<int8_t>, C10_COMPILE_TIME_MAX_GPUS> state{};
  return state[static_cast<size_t>(device)];
}

}  // namespace detail

// Raises NotImplementedError naming the op, the GPU (name and compute
// capability) and what this build supports unless CUDA device `device` can
// run lowbit's kernels.
inline void check_supported_gpu(c10::DeviceIndex device, const char* op) {
  TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS, "lowbit.", op, ": CUDA device index ", int(device),
              " out of range");
  auto& state = detail::gpu_support_state(device);
  int8_t s = state.load(std::memory_order_relaxed);
  if (s == 0) {
    const auto* props = at::cuda::getDeviceProperties(device);
    s = gpu_arch_supported(props->major, props->minor) ? 1 : 2;
    state.store(s, std::memory_order_relaxed);
  }
  if (s == 1) return;
  const auto* props = at::cuda::getDeviceProperties(device);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "lowbit.", op, ": GPU cuda:", int(device), " (", props->name,
                              ") has compute capability ", props->major, ".", props->minor,
                              ", but this build of lowbit has CUDA kernels for compute capability 9.0 only (",
                              kCudaArchBuilt, ": Hopper, e.g. H100/H200). Run the op on a Hopper GPU or on the CPU.");
}

// The same for the GPU of `t`. Does nothing for a tensor not on a CUDA
// device (the op's own device checks report those).
inline void check_supported_gpu(const at::Tensor& t, const char* op) {
  if (!t.is_cuda()) return;
  check_supported_gpu(t.device().index() >= 0 ? t.device().index() : at::cuda::current_device(), op);
}

}  // namespace lowbit::ops
