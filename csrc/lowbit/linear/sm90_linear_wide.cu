// The wide kernel (M <= 128, and 9..16 rows on many W tiles;
// sm90_linear_plan.h says where): 8 warps on 128 rows of W sharing 16, 32 or
// 64 rows of x staged in shared memory, K split to fill the SMs; the MMAs on
// mma.sync (nvfp4_mainloops.cuh wide_mainloop) or, after a pass that writes x in
// the shared-memory layout (the x image, wide_x_image_kernel), on wgmma
// with x staged by one bulk copy per k-tile (wide_wgmma_mainloop). K splits
// add up in a cluster (wide_cluster_finish) or through FP32 partials.
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

using mma::kThreads;

// grid (ceil(N / 128), ceil(M / (8 MT)), splits): 8 warps on 8 consecutive
// 16-row W tiles sharing x's rows staged in shared memory
// (nvfp4_mainloops.cuh, wide_mainloop or wide_wgmma_mainloop: kWg), each over one
// split of K. One split: the output directly; more: FP32 partials [splits,
// M, N] added in split order by split_reduce_kernel.
template <typename T, int MT, bool kWg>
__global__ void __launch_bounds__(kThreads, kWideCtasPerSm<MT>) linear_wide_kernel(
    const T* x, cuda::ReadOnly<uint8_t> weight, cuda::ReadOnly<uint8_t> scale,
    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias, T* __restrict__ out,
    float* __restrict__ partials, int64_t m, int64_t n, int64_t k, int64_t tiles_per_split) {
  cuda::allow_dependent_launch();
  const int warp = threadIdx.x / 32;
  const int64_t nt = int64_t(blockIdx.x) * 8 + warp;
  const bool active = nt < n / kTileN;
  const int64_t m0 = int64_t(blockIdx.y) * 8 * MT;
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t kc0 = int64_t(blockIdx.z) * tiles_per_split, kc1 = min(tiles_k, kc0 + tiles_per_split);
  const int64_t row_tile = active ? nt : 0;
  const uint4* wtiles = mma::tile_row_codes(weight, row_tile, tiles_k);
  const uint4* stiles = mma::tile_row_scales(scale, row_tile, tiles_k);
  extern __shared__ uint4 wide_smem[];
  float acc[MT][4];
  if constexpr (kWg) {  // x: its image (wide_x_image_kernel)
    static_assert(kDumpBytes<MT> <= sizeof(mma::WideWgmmaSmem<T, MT>), "the dump reuses the ring");
    const uint8_t* image =
        reinterpret_cast<const uint8_t*>(x) + blockIdx.y * tiles_k * mma::WideWgmmaX<MT>::kStageBytes;
    auto& sm = *reinterpret_cast<mma::WideWgmmaSmem<T, MT>*>(wide_smem);
    mma::wide_wgmma_mainloop<T, MT>(acc, sm, image, wtiles, stiles, kc0, kc1);
    if (gridDim.z > 1 && partials == nullptr) {  // splits in a cluster
      wide_cluster_finish<T, MT>(acc, reinterpret_cast<float*>(wide_smem), m0, int64_t(blockIdx.x) * 8 * kTileN, m, n,
                                 global_scale, bias, out);
      return;
    }
  } else {
    const T* xsrc[MT / 2];
#pragma unroll
    for (int j = 0; j < MT / 2; ++j)
      xsrc[j] = x + min(m0 + threadIdx.x / 16 + 16 * j, m - 1) * k + (threadIdx.x % 16) * 8;
    auto& sm = *reinterpret_cast<mma::WideSmem<T, MT>*>(wide_smem);
    mma::wide_mainloop<T, MT>(acc, sm, xsrc, wtiles, stiles, active, k, kc0, kc1);
  }
  if (active) store_warp_tile<T, MT>(acc, nt, m0, m, n, global_scale, bias, out, partials);
}

// x [M, K] as the wide wgmma kernel's stages (nvfp4_mainloops.cuh, WideWgmmaX):
// per block of 8 MT rows and k-tile, kStageBytes in the stage layout; rows
// past M and columns past K zero. A thread moves one row's 16-column block
// (its even words to one k-group, its odd words to the next); consecutive
// threads take consecutive rows, so the stores of a warp are contiguous.
template <typename T, int MT>
__global__ void wide_x_image_kernel(const T* __restrict__ x, uint8_t* __restrict__ image, int64_t m, int64_t k,
                                    int64_t tiles_k, int64_t blocks) {
  using X = mma::WideWgmmaX<MT>;
  constexpr int kRows = 8 * MT;
  cuda::allow_dependent_launch();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const int r = static_cast<int>(i % kRows), s = static_cast<int>(i / kRows % 8);
  const int64_t kc = i / (8 * kRows) % tiles_k, rb = i / (8 * kRows * tiles_k);
  const int64_t row = rb * kRows + r, col = kc * kTileK + s * 16;
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (row < m && col < k) {
    const uint4* src = reinterpret_cast<const uint4*>(x + row * k + col);
    lo = src[0];
    hi = src[1];
  }
  uint8_t* dst = image + (rb * tiles_k + kc) * X::kStageBytes + (r / 8) * 128 + (r % 8) * 16;
  *reinterpret_cast<uint4*>(dst + 2 * s * X::kLbo) = make_uint4(lo.x, lo.z, hi.x, hi.z);
  *reinterpret_cast<uint4*>(dst + (2 * s + 1) * X::kLbo) = make_uint4(lo.y, lo.w, hi.y, hi.w);
}

template <typename T, int MT, bool kWg>
cudaError_t launch_wide(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  constexpr int smem = kWg ? sizeof(mma::WideWgmmaSmem<T, MT>) : sizeof(mma::WideSmem<T, MT>);
  cudaError_t err = cuda::allow_dynamic_smem(linear_wide_kernel<T, MT, kWg>, smem);
  if (err != cudaSuccess) return err;
  const int64_t tiles_k = padded_k(a.k) / kTileK;
  const dim3 grid(unsigned(cuda::ceil_div(a.n / kTileN, 8)), unsigned(cuda::ceil_div(a.m, 8 * MT)),
                  unsigned(p.splits));
  const int64_t per_split = cuda::ceil_div(tiles_k, p.splits);
  float* partials = static_cast<float*>(a.workspace);
  if constexpr (kWg) {
    // The image (the workspace) first, then the GEMM as its dependent: its
    // first W copies overlap the image pass.
    uint8_t* image = static_cast<uint8_t*>(a.workspace);
    const int64_t blocks = int64_t(grid.y) * 8 * MT * tiles_k * 8;
    wide_x_image_kernel<T, MT><<<unsigned(cuda::ceil_div(blocks, 256)), 256, 0, stream>>>(
        static_cast<const T*>(a.x), image, a.m, a.k, tiles_k, blocks);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    // K splits: one cluster per tile, added in the kernel (wide_cluster_finish),
    // or FP32 partials after the image, added by split_reduce_kernel.
    partials = p.splits_in_cluster ? nullptr : reinterpret_cast<float*>(image + wide_image_bytes(a.m, a.k, MT));
    err = cuda::launch_dependent_clusters(linear_wide_kernel<T, MT, kWg>, grid,
                                          dim3(1, 1, p.splits_in_cluster ? grid.z : 1), dim3(kThreads), smem, stream,
                                          reinterpret_cast<const T*>(image), a.weight, a.scale, a.global_scale,
                                          static_cast<const T*>(a.bias), static_cast<T*>(a.out), partials, a.m, a.n,
                                          a.k, per_split);
  } else {
    linear_wide_kernel<T, MT, kWg><<<grid, kThreads, smem, stream>>>(
        static_cast<const T*>(a.x), a.weight, a.scale, a.global_scale, static_cast<const T*>(a.bias),
        static_cast<T*>(a.out), partials, a.m, a.n, a.k, per_split);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess || p.splits == 1 || partials == nullptr) return err;
  LinearArgs reduce_args = a;
  reduce_args.workspace = partials;
  return launch_split_reduce<T>(reduce_args, p.splits, stream);
}

template <int MT>
int64_t wide_wgmma_resident_clusters(int splits) {
  using T = __nv_bfloat16;  // fp16 takes the same resources
  return cuda::resident_clusters(linear_wide_kernel<T, MT, true>, kThreads, sizeof(mma::WideWgmmaSmem<T, MT>), splits);
}

}  // namespace

template <typename T>
cudaError_t launch_linear_wide(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  if (p.wide_wgmma) {
    if (p.mt == 2) return launch_wide<T, 2, true>(a, p, stream);
    return p.mt == 4 ? launch_wide<T, 4, true>(a, p, stream) : launch_wide<T, 8, true>(a, p, stream);
  }
  if (p.mt == 2) return launch_wide<T, 2, false>(a, p, stream);
  return p.mt == 4 ? launch_wide<T, 4, false>(a, p, stream) : launch_wide<T, 8, false>(a, p, stream);
}

template cudaError_t launch_linear_wide<__nv_bfloat16>(const LinearArgs&, const LinearPlan&, cudaStream_t);
template cudaError_t launch_linear_wide<__half>(const LinearArgs&, const LinearPlan&, cudaStream_t);

int64_t wide_wgmma_resident_ctas(int mt, int splits) {
  const int64_t clusters = mt == 2   ? wide_wgmma_resident_clusters<2>(splits)
                           : mt == 4 ? wide_wgmma_resident_clusters<4>(splits)
                                     : wide_wgmma_resident_clusters<8>(splits);
  return clusters * splits;
}

}  // namespace lowbit::nvfp4::gemm
