// The panel kernel (12..16 rows where its grid runs in one wave;
// sm90_linear_plan.h says where): 8 warps on 128 rows of W over one chunk of
// K, whose 16 rows of x a tensor copy puts in shared memory at the start;
// each warp streams its W tile through a cp.async ring as the stream kernel
// does (nvfp4_mainloops.cuh panel_mainloop). K splits add up in a cluster (two)
// or through FP32 partials.
#include <algorithm>
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/tensor_map.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

using mma::kThreads;

// grid (ceil(N / 128), ceil(M / 16), splits): 8 warps on 8 consecutive W
// tiles over one K split, x's chunk in shared memory (nvfp4_mainloops.cuh,
// panel_mainloop). K splits: partials null, a cluster (1, 1, splits) adds
// them (wide_cluster_finish); else FP32 partials for split_reduce_kernel.
// Dynamic shared memory: panel_smem_bytes(kPanelMt, k-tiles per split), or
// more (panel_spread_smem).
template <typename T>
__global__ void __launch_bounds__(kThreads, kPanelCtasPerSm) linear_panel_kernel(
    const __grid_constant__ CUtensorMap x_map, cuda::ReadOnly<uint8_t> weight, cuda::ReadOnly<uint8_t> scale,
    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias, T* __restrict__ out,
    float* __restrict__ partials, int64_t m, int64_t n, int64_t k, int64_t tiles_per_split) {
  constexpr int MT = kPanelMt;
  static_assert(mma::kPanelWarps * 32 == kThreads, "wide_cluster_finish: 8 warps");
  static_assert(mma::panel_smem_bytes(MT, 0) >= kDumpBytes<MT>, "the dump reuses the rings");
  cuda::allow_dependent_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nt = int64_t(blockIdx.x) * mma::kPanelWarps + warp;
  const bool active = nt < n / kTileN;
  const int64_t m0 = int64_t(blockIdx.y) * 8 * MT;
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t kc0 = int64_t(blockIdx.z) * tiles_per_split, kc1 = min(tiles_k, kc0 + tiles_per_split);
  const uint4* wtiles = mma::tile_row_codes(weight, active ? nt : 0, tiles_k);
  const uint4* stiles = mma::tile_row_scales(scale, active ? nt : 0, tiles_k);
  // The first W k-tiles start towards L2 while the previous kernel (which
  // may write x) finishes.
  if (active && lane == 0) mma::prefetch_ktiles_l2(wtiles, stiles, kc0, min(kc1, kc0 + mma::kPanelStages - 1));
  cuda::wait_for_previous_grid();
  extern __shared__ __align__(128) uint4 panel_smem[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(panel_smem);
  float acc[MT][4];
  mma::panel_mainloop<T, MT>(acc, smem, &x_map, m0, wtiles, stiles, active, kc0, kc1);
  if (gridDim.z > 1 && partials == nullptr) {
    wide_cluster_finish<T, MT>(acc, reinterpret_cast<float*>(smem), m0, int64_t(blockIdx.x) * mma::kPanelWarps * kTileN,
                               m, n, global_scale, bias, out);
    return;
  }
  if (active) store_warp_tile<T, MT>(acc, nt, m0, m, n, global_scale, bias, out, partials);
}

// Shared memory for a panel launch of `ctas` CTAs in clusters of `cluster`:
// padded so that each SM takes the fewest CTAs that still run the grid in
// one wave, and never more than kPanelCtasPerSm (24 warps). Left to fill SMs
// as far as shared memory allows, a grid smaller than the device is packed
// onto fewer SMs (docs/perf/log/linear.md, Linear v13); 32 warps per SM ran slower
// (Linear v15).
template <typename Kernel>
int panel_spread_smem(Kernel kernel, int bytes, int64_t ctas, int cluster) {
  const int64_t sms = cuda::num_sms();
  for (int per_sm = static_cast<int>(std::max<int64_t>(1, cuda::ceil_div(ctas, sms))); per_sm < kPanelCtasPerSm;
       ++per_sm) {
    const int padded = cuda::smem_for_ctas_per_sm(bytes, per_sm);
    if (cuda::resident_clusters(kernel, kThreads, padded, cluster) * cluster >= ctas) return padded;
  }
  return cuda::smem_for_ctas_per_sm(bytes, kPanelCtasPerSm);
}

template <typename T>
cudaError_t launch_panel(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  constexpr int MT = kPanelMt;
  const int64_t tiles_k = padded_k(a.k) / kTileK, per_split = cuda::ceil_div(tiles_k, p.splits);
  const dim3 grid(unsigned(cuda::ceil_div(a.n / kTileN, mma::kPanelWarps)), unsigned(cuda::ceil_div(a.m, 8 * MT)),
                  unsigned(p.splits));
  const int cluster = p.splits_in_cluster ? static_cast<int>(p.splits) : 1;
  const int smem = panel_spread_smem(linear_panel_kernel<T>, mma::panel_smem_bytes(MT, per_split),
                                     int64_t(grid.x) * grid.y * grid.z, cluster);
  cudaError_t err = cuda::allow_dynamic_smem(linear_panel_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  CUtensorMap x_map;
  err = cuda::make_tensor_map(&x_map, a.x,
                              a.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                              a.m, a.k, a.k * 2, 8 * MT, mma::kPanelXBoxCols, CU_TENSOR_MAP_SWIZZLE_NONE);
  if (err != cudaSuccess) return err;
  float* partials = p.splits > 1 && !p.splits_in_cluster ? static_cast<float*>(a.workspace) : nullptr;
  err = cuda::launch_dependent_clusters(linear_panel_kernel<T>, grid, dim3(1, 1, cluster),
                                        dim3(kThreads), smem, stream, x_map, a.weight, a.scale, a.global_scale,
                                        static_cast<const T*>(a.bias), static_cast<T*>(a.out), partials, a.m, a.n,
                                        a.k, per_split);
  if (err != cudaSuccess || partials == nullptr) return err;
  return launch_split_reduce<T>(a, p.splits, stream);
}

}  // namespace

template <typename T>
cudaError_t launch_linear_panel(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  return launch_panel<T>(a, p, stream);
}

template cudaError_t launch_linear_panel<__nv_bfloat16>(const LinearArgs&, const LinearPlan&, cudaStream_t);
template cudaError_t launch_linear_panel<__half>(const LinearArgs&, const LinearPlan&, cudaStream_t);

int64_t panel_resident_ctas(int smem, int cluster) {
  return cuda::resident_clusters(linear_panel_kernel<__nv_bfloat16>, kThreads, smem, cluster) * cluster;
}

}  // namespace lowbit::nvfp4::gemm
