// The stream and narrow kernels (M <= 16; sm90_linear_plan.h says which
// runs where): one CTA of 1, 2, 4 or 8 warps per 16-row tile of W (or tile
// pair, and per split of K); the weight is read once, in 1 KB coalesced
// pieces, by all SMs at once. The stream kernel's warps feed their k-tiles
// through cp.async rings in shared memory (nvfp4_mainloops.cuh stream_mainloop,
// up to 32 warps per SM; 16 on grids that would otherwise leave SMs idle),
// the narrow kernel's through register stages (warp_mainloop, 16 warps per
// SM). The warps' partial sums are added in a fixed order in shared memory;
// K splits write FP32 partials that split_reduce_kernel (nvfp4_linear.cu)
// adds in split order. Launched as programmatic dependents: their first W
// tiles go to L2 while the previous kernel finishes.
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

// grid: (ceil(M / (8 MT)), N / 16, splits), W warps per CTA sharing one
// 16-row W tile (K split between them). Output tile: 16 rows of W x 8 MT
// rows of x. The stream kernel (M <= 8) runs nvfp4_mainloops.cuh stream_mainloop
// (a cp.async ring per warp in shared memory, 32 warps per SM), the narrow
// one warp_mainloop (register stages, 16 warps per SM). Both are launched as
// programmatic dependents: the CTA's first W tiles are prefetched into L2
// while the previous kernel (which may write x) finishes.
// The warps' sums of the CTA's output tile, added in a fixed order, then
// written (finish_output). Ends the kernel.
template <typename T, int MT, int W>
__device__ __forceinline__ void narrow_finish(const float (&acc)[MT][4], int64_t m0, int64_t nt, int64_t m, int64_t n,
                                              const float* global_scale, const T* bias, T* out, float* workspace) {
  __shared__ mma::CtaPartials<MT, W> partial;
  partial.store(acc, threadIdx.x / 32, threadIdx.x % 32);
  __syncthreads();
  for (int e = threadIdx.x; e < 16 * 8 * MT; e += 32 * W) {
    const int r = e % 16, mc = e / 16;  // r: row of the W tile, mc: row of x in the CTA
    const int64_t row = m0 + mc, o = nt * 16 + r;
    if (row >= m) continue;
    finish_output(partial.sum(r, mc), row * n + o, o, blockIdx.z, gridDim.z, m * n, global_scale, bias, out,
                  workspace);
  }
}

// The CTA's W tile row (grid y) and K split (grid z): its k-tiles and where
// their codes and scales start. Lets the next kernel launch, has thread 0
// start moving the first `ahead` k-tiles (the warps' first stages) into L2,
// then waits for the previous kernel, which may write x.
struct SplitRun {
  int64_t nt, kc_begin, kc_end;
  const uint4* codes;
  const uint4* scales;
};
// nt: the first W tile row; tile_rows: the rows the CTA reads from it on.
__device__ __forceinline__ SplitRun begin_split_run(const uint8_t* weight, const uint8_t* scale, int64_t k,
                                                    int64_t tiles_per_split, int64_t ahead, int64_t nt,
                                                    int tile_rows = 1) {
  cuda::allow_dependent_launch();
  SplitRun r;
  r.nt = nt;
  const int64_t tiles_k = padded_k(k) / kTileK;
  r.kc_begin = int64_t(blockIdx.z) * tiles_per_split;
  r.kc_end = min(tiles_k, r.kc_begin + tiles_per_split);
  r.codes = mma::tile_row_codes(weight, r.nt, tiles_k);
  r.scales = mma::tile_row_scales(scale, r.nt, tiles_k);
  if (threadIdx.x == 0)
    for (int i = 0; i < tile_rows; ++i)
      mma::prefetch_ktiles_l2(r.codes + i * tiles_k * (kTileBytes / 16), r.scales + i * tiles_k * (kTileScaleBytes / 16),
                              r.kc_begin, min(r.kc_end, r.kc_begin + ahead));
  cuda::wait_for_previous_grid();
  return r;
}

// CTAs per SM: 16 warps in all (the register budget of kMinBlocks 8-warp CTAs).
template <int MT, int W> constexpr int kNarrowCtasPerSm = mma::kMinBlocks<MT> * mma::kWarps / W;

// The stream kernel's last step with kTiles W tiles per warp: as
// narrow_finish, for the CTA's tiles nt0 .. nt0 + kTiles - 1 below ntiles,
// the warps' sums kept in the rings' shared memory `smem` (every copy has
// landed: the main loop's last wait, then the barrier below), so a CTA
// needs no shared memory beyond its rings.
template <typename T, int MT, int W, int kTiles>
__device__ __forceinline__ void stream_tiles_finish(const float (&acc)[kTiles * MT][4], void* smem, int64_t nt0,
                                                    int64_t m, int64_t n, const float* global_scale, const T* bias,
                                                    T* out, float* workspace) {
  using Partials = mma::CtaPartials<kTiles * MT, W>;
  static_assert(sizeof(Partials) <= W * mma::stream_warp_bytes(1, kTiles, 2),
                "the partial sums fit in the smallest rings");
  __syncthreads();  // every warp is past its ring
  Partials& partial = *static_cast<Partials*>(smem);
  partial.store(acc, threadIdx.x / 32, threadIdx.x % 32);
  __syncthreads();
  const int64_t ntiles = n / kTileN;
  for (int e = threadIdx.x; e < kTiles * kTileN * 8 * MT; e += 32 * W) {
    const int r = e % kTileN, c = e / kTileN;  // r: row of the W tile; c: its tile (c / 8 MT) and x row (c % 8 MT)
    const int64_t nt = nt0 + c / (8 * MT), row = c % (8 * MT), o = nt * kTileN + r;
    if (nt >= ntiles || row >= m) continue;
    finish_output(partial.sum(r, c), row * n + o, o, blockIdx.z, gridDim.z, m * n, global_scale, bias, out,
                  workspace);
  }
}

template <typename T, int MT, int W>
__global__ void __launch_bounds__(32 * W, kNarrowCtasPerSm<MT, W>) linear_narrow_kernel(
    const T* x, cuda::ReadOnly<uint8_t> weight, cuda::ReadOnly<uint8_t> scale,
    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias, T* __restrict__ out,
    float* __restrict__ workspace, int64_t m, int64_t n, int64_t k, int64_t tiles_per_split) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t m0 = int64_t(blockIdx.x) * 8 * MT;
  const SplitRun run = begin_split_run(weight, scale, k, tiles_per_split, mma::kStages<MT> * W, blockIdx.y);

  const T* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t row = min(m0 + mt * 8 + lane / 4, m - 1);  // rows past M: computed, never stored
    xrow[mt] = x + row * k + (lane % 4) * 4;
  }
  float acc[MT][4];
  mma::warp_mainloop<T, MT, W>(acc, run.codes, run.scales, xrow, k, run.kc_begin, run.kc_end, warp, lane);
  narrow_finish<T, MT, W>(acc, m0, run.nt, m, n, global_scale, bias, out, workspace);
}

// M <= 2 kPairs (x rows copied in pairs); dynamic shared memory: W *
// stream_warp_bytes(M). The loop's k-tile and column counters are 32-bit
// (padded K <= kStreamMaxPaddedK, linear_plan): the 64-bit compares and
// adds cost ~12 of a k-tile's ~220 SASS instructions (Linear v19). The
// decode goes two k-tiles at a time (Linear v20). With one W tile per
// warp, built for 32 warps per SM: the 128-register build for plans that
// hold an SM to 16 warps ran no faster (Linear v22). kTiles = 2: a warp
// takes W tiles 2 y and 2 y + 1 (the second a stand-in for the first past
// N), M <= 2 kPairs <= 16 (Linear v23). kStages: ring slots per warp
// (Linear v25).
template <typename T, int W, int kPairs, int kTiles, int kStages>
__global__ void __launch_bounds__(32 * W, stream_warps_per_sm(kTiles) / W) linear_stream_kernel(
    const T* x, cuda::ReadOnly<uint8_t> weight, cuda::ReadOnly<uint8_t> scale,
    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias, T* __restrict__ out,
    float* __restrict__ workspace, int64_t m, int64_t n, int64_t k, int64_t tiles_per_split) {
  constexpr int MT = mma::kStreamMtiles<kPairs>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nt0 = int64_t(blockIdx.y) * kTiles;
  const int tile_rows = static_cast<int>(min(int64_t{kTiles}, n / kTileN - nt0));
  const SplitRun run =
      begin_split_run(weight, scale, k, tiles_per_split, (kStages - 1) * W, nt0, tile_rows);

  const int rows = static_cast<int>(m);
  const T* xsrc[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) xsrc[j] = x + min(lane / 16 + 2 * j, rows - 1) * k + (lane % 16) * 8;
  extern __shared__ uint4 stream_ring[];
  float acc[kTiles * MT][4];
  uint4* ring = stream_ring + warp * (mma::stream_warp_bytes(rows, kTiles, kStages) / 16);
  const int64_t tile_step = tile_rows > 1 ? padded_k(k) / kTileK : 0;
  mma::stream_mainloop<T, W, kPairs, true, int32_t, kTiles, MT, kStages>(
      acc, ring, rows, xsrc, run.codes, run.scales, k, run.kc_begin, run.kc_end, warp, lane, tile_step);
  if constexpr (kTiles == 1)
    narrow_finish<T, 1, W>(acc, 0, run.nt, m, n, global_scale, bias, out, workspace);
  else
    stream_tiles_finish<T, MT, W, kTiles>(acc, stream_ring, nt0, m, n, global_scale, bias, out, workspace);
}

template <typename T, int MT, int W>
cudaError_t launch_narrow(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  const int64_t tiles_k = padded_k(a.k) / kTileK;
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.m, 8 * MT)), static_cast<unsigned>(a.n / kTileN),
                  static_cast<unsigned>(p.splits));
  cudaError_t err = cuda::launch_dependent(
      linear_narrow_kernel<T, MT, W>, grid, dim3(32 * W), 0, stream, static_cast<const T*>(a.x), a.weight, a.scale,
      a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out), static_cast<float*>(a.workspace), a.m,
      a.n, a.k, cuda::ceil_div(tiles_k, p.splits));
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_split_reduce<T>(a, p.splits, stream);
}

template <typename T, int W, int kPairs, int kTiles>
cudaError_t launch_stream(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  const int64_t tiles_k = padded_k(a.k) / kTileK;
  const int stages = p.stream_stages == 2 ? 2 : mma::kStreamStages;
  const int smem =
      cuda::smem_for_ctas_per_sm(W * mma::stream_warp_bytes(static_cast<int>(a.m), kTiles, stages), p.ctas_per_sm);
  auto* kernel = stages == 2 ? linear_stream_kernel<T, W, kPairs, kTiles, 2>
                             : linear_stream_kernel<T, W, kPairs, kTiles, mma::kStreamStages>;
  cudaError_t err = cuda::allow_dynamic_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(1, static_cast<unsigned>(cuda::ceil_div(a.n / kTileN, kTiles)), static_cast<unsigned>(p.splits));
  err = cuda::launch_dependent(kernel, grid, dim3(32 * W), smem, stream,
                               static_cast<const T*>(a.x), a.weight, a.scale, a.global_scale,
                               static_cast<const T*>(a.bias), static_cast<T*>(a.out),
                               static_cast<float*>(a.workspace), a.m, a.n, a.k, cuda::ceil_div(tiles_k, p.splits));
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_split_reduce<T>(a, p.splits, stream);
}

template <typename T, int kPairs, int kTiles>
cudaError_t launch_stream(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  switch (p.warps) {
    case 1: return launch_stream<T, 1, kPairs, kTiles>(a, p, stream);
    case 2: return launch_stream<T, 2, kPairs, kTiles>(a, p, stream);
    case 4: return launch_stream<T, 4, kPairs, kTiles>(a, p, stream);
    case 8: return launch_stream<T, 8, kPairs, kTiles>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The stream kernel built for as few x row pairs as M needs: 1 at M <= 2,
// 2 at M <= 4, 4 at M <= 8, so the copies of pairs past M are not issued,
// predicated off, every k-tile (Linear v17 in docs/perf/log/linear.md). The products
// and their order do not depend on the build. Two W tiles per warp: built
// for 5..8 and 9..16 rows.
template <typename T>
cudaError_t launch_stream(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  if (p.stream_tiles == 2) {
    if (a.m <= 4) return cudaErrorInvalidValue;  // no such build (linear_plan)
    if (a.m <= 8) return launch_stream<T, mma::kStreamMaxRows / 2, 2>(a, p, stream);
    return launch_stream<T, mma::kStreamTilesMaxRows / 2, 2>(a, p, stream);
  }
  if (a.m <= 2) return launch_stream<T, 1, 1>(a, p, stream);
  if (a.m <= 4) return launch_stream<T, 2, 1>(a, p, stream);
  return launch_stream<T, mma::kStreamMaxRows / 2, 1>(a, p, stream);
}

template <typename T, int MT>
cudaError_t launch_narrow(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  switch (p.warps) {
    case 1: return launch_narrow<T, MT, 1>(a, p, stream);
    case 2: return launch_narrow<T, MT, 2>(a, p, stream);
    case 4: return launch_narrow<T, MT, 4>(a, p, stream);
    case 8: return launch_narrow<T, MT, 8>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

template <typename T>
cudaError_t launch_linear_stream(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  return launch_stream<T>(a, p, stream);
}

template <typename T>
cudaError_t launch_linear_narrow(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  return p.mt == 1 ? launch_narrow<T, 1>(a, p, stream) : launch_narrow<T, 2>(a, p, stream);
}

template cudaError_t launch_linear_stream<__nv_bfloat16>(const LinearArgs&, const LinearPlan&, cudaStream_t);
template cudaError_t launch_linear_stream<__half>(const LinearArgs&, const LinearPlan&, cudaStream_t);
template cudaError_t launch_linear_narrow<__nv_bfloat16>(const LinearArgs&, const LinearPlan&, cudaStream_t);
template cudaError_t launch_linear_narrow<__half>(const LinearArgs&, const LinearPlan&, cudaStream_t);

}  // namespace lowbit::nvfp4::gemm
