// The stream kernel's stream-K form (M <= 8; sm90_linear_plan.h says
// where): one wave of CTAs on equal runs of k-tiles that cross W tiles, the
// pieces of a tile added in the kernel in k order.
//
// Whole W tiles per CTA leave some SMs a tile more than others when the
// tiles are few against the SMs' slots and long (18432 x 7168: 448 tiles of
// 144 k-tiles on 264 slots). Here the grid is one wave of G CTAs, and the
// units (tile t's k-tile kc is unit t * tiles_k + kc; units lie in memory
// in that order) are cut into G runs of equal length +- 1. A CTA's W warps
// walk its run downwards (StreamRunWarp) and add up at each tile row's
// start. A tile the run holds whole goes to the output. Otherwise the
// tile's pieces come from consecutive CTAs; the one holding the tile's
// last k-tile (a run's lowest tile: the CTA's last piece) adds them in k
// order (deterministic) and writes the output; the others (a run's highest
// tile, its first piece, or a run inside one tile) publish theirs: the
// CTA's one slot in the workspace, then its flag. So a CTA publishes
// before it waits, waits only for lower CTAs (dispatched before it), and
// the piece it waits for was published as those CTAs started: it loads
// them before its own last piece, not after.
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

struct StreamKRuns {
  int32_t base, rem;  // every run has base units, the first rem one more
  LOWBIT_HD int32_t begin(int32_t c) const { return c * base + (c < rem ? c : rem); }
  __device__ __forceinline__ int32_t run_of(int32_t u) const {
    const int32_t long_units = rem * (base + 1);
    return u < long_units ? u / (base + 1) : rem + (u - long_units) / base;
  }
};

// A flag is set to 1 once its slot is written. The launcher zeroes the
// flags before each launch: memory fresh from the allocator may hold any
// bytes (an int64 tensor's values, say), so no value read from it can tell
// a published slot from a stale word.

// The sums of the CTA's warps for one piece, element e of 16 x m (W row
// e % 16, x row e / 16) at partial.sum; every thread calls it.
template <int W>
struct StreamKPiece {
  mma::CtaPartials<1, W> partial;
  __device__ __forceinline__ float sum(int e) const { return partial.sum(e % kTileN, e / kTileN); }
};

template <typename T>
__device__ __forceinline__ void stream_k_store(float sum, int e, int64_t nt, int64_t n, const float* global_scale,
                                               const T* bias, T* out) {
  const int64_t o = nt * kTileN + e % kTileN;
  finish_output(sum, (e / kTileN) * n + o, o, 0, 1, 0, global_scale, bias, out, nullptr);
}

// Elements of a tile's 16 x 8 outputs per thread in a one-warp CTA.
constexpr int kStreamKElemsPerThread = kTileN * mma::kStreamMaxRows / 32;

// grid: G CTAs (one wave; G <= units), W warps each; M <= 2 kPairs.
// Dynamic shared memory: W * stream_warp_bytes(M). workspace:
// stream_k_workspace_bytes(G). kStreamKWarpsPerSm warps per SM.
template <typename T, int W, int kPairs>
__global__ void __launch_bounds__(32 * W, kStreamKWarpsPerSm / W) linear_stream_k_kernel(
    const T* x, cuda::ReadOnly<uint8_t> weight, cuda::ReadOnly<uint8_t> scale,
    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias, T* __restrict__ out,
    float* __restrict__ workspace, int64_t m, int64_t n, int64_t k, StreamKRuns runs) {
  cuda::allow_dependent_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Units, tiles and k-tiles in 32 bits (linear_plan: units below 2^30).
  const int32_t tiles_k = static_cast<int32_t>(padded_k(k) / kTileK), cta = static_cast<int32_t>(blockIdx.x);
  const int32_t u0 = runs.begin(cta), u1 = runs.begin(cta + 1);
  const uint4* codes = mma::tile_row_codes(weight, 0, tiles_k);
  const uint4* scales = mma::tile_row_scales(scale, 0, tiles_k);
  if (threadIdx.x == 0) mma::prefetch_ktiles_l2(codes, scales, max(u0, u1 - (mma::kStreamStages - 1) * W), u1);
  cuda::wait_for_previous_grid();  // x, and the workspace (a previous kernel's until it ends)

  const int rows = static_cast<int>(m), elems = kTileN * rows;
  const T* xsrc[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) xsrc[j] = x + min(lane / 16 + 2 * j, rows - 1) * k + (lane % 16) * 8;
  extern __shared__ uint4 stream_ring[];
  uint4* ring = stream_ring + warp * (mma::stream_warp_bytes(rows) / 16);
  float* slots = workspace;
  auto* flags = reinterpret_cast<uint64_t*>(workspace + int64_t{gridDim.x} * kStreamKSlotFloats);
  const int32_t top = u1 - 1 - warp, first_tile = u0 / tiles_k, last_tile = (u1 - 1) / tiles_k;
  const int32_t top_kc = ((top % tiles_k) + tiles_k) % tiles_k;
  mma::StreamRunWarp<T, W, kPairs> walk(ring, rows, xsrc, codes, scales, k, tiles_k, top, top_kc, u0, lane);
  __shared__ StreamKPiece<W> piece;
  for (int32_t nt = last_tile; nt >= first_tile; --nt) {
    const int32_t lo = max(u0, nt * tiles_k), hi = min(u1, (nt + 1) * tiles_k);
    const bool head = lo == nt * tiles_k, tail = hi == (nt + 1) * tiles_k;  // the piece holds k-tile 0 / the last
    // The last piece of a tile whose head is in lower CTAs (first .. cta -
    // 1): their pieces, added in k order, loaded while this one runs.
    const int32_t first = tail && !head ? runs.run_of(nt * tiles_k) : cta;
    float before[kStreamKElemsPerThread] = {};
    if (first < cta) {
      if (threadIdx.x == 0)
        for (int32_t r = first; r < cta; ++r)
          while (cuda::ld_acquire_gpu(flags + r) == 0) __nanosleep(64);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kStreamKElemsPerThread; ++i) {
        const int e = threadIdx.x + i * 32 * W;
        if (e < elems)
          for (int32_t r = first; r < cta; ++r) before[i] += __ldcg(slots + int64_t{r} * kStreamKSlotFloats + e);
      }
    }
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    walk.run(acc, lo, lane);
    piece.partial.store(acc, warp, lane);
    __syncthreads();
    if (tail) {  // the tile is complete here
#pragma unroll
      for (int i = 0; i < kStreamKElemsPerThread; ++i) {
        const int e = threadIdx.x + i * 32 * W;
        if (e < elems) stream_k_store(before[i] + piece.sum(e), e, nt, n, global_scale.get(), bias.get(), out);
      }
    } else {  // publish: the slot, then (after the CTA barrier) the flag
      for (int e = threadIdx.x; e < elems; e += 32 * W) slots[int64_t{cta} * kStreamKSlotFloats + e] = piece.sum(e);
      __syncthreads();
      if (threadIdx.x == 0) cuda::st_release_gpu(flags + cta, uint64_t{1});
    }
    __syncthreads();  // piece is reused by the next one
  }
  walk.finish();
}

// The stream-K kernel's runs: its units (N / 16 tiles x k-tiles) in
// p.stream_k_ctas runs.
StreamKRuns stream_k_runs(const LinearArgs& a, const LinearPlan& p) {
  const int64_t units = a.n / kTileN * (padded_k(a.k) / kTileK);
  return {static_cast<int32_t>(units / p.stream_k_ctas), static_cast<int32_t>(units % p.stream_k_ctas)};
}

template <typename T, int W, int kPairs>
cudaError_t launch_stream_k(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  const int stages = p.stream_stages == 2 ? 2 : mma::kStreamStages;  // linear_plan sets the latter
  const int smem =
      cuda::smem_for_ctas_per_sm(W * mma::stream_warp_bytes(static_cast<int>(a.m), 1, stages), p.ctas_per_sm);
  cudaError_t err = cuda::allow_dynamic_smem(linear_stream_k_kernel<T, W, kPairs>, smem);
  if (err != cudaSuccess) return err;
  // The flags after the slots (stream_k_workspace_bytes), zeroed in stream order.
  float* flags = static_cast<float*>(a.workspace) + p.stream_k_ctas * kStreamKSlotFloats;
  err = cudaMemsetAsync(flags, 0, p.stream_k_ctas * sizeof(uint64_t), stream);
  if (err != cudaSuccess) return err;
  return cuda::launch_dependent(linear_stream_k_kernel<T, W, kPairs>, dim3(static_cast<unsigned>(p.stream_k_ctas)),
                                dim3(32 * W), smem, stream, static_cast<const T*>(a.x), a.weight, a.scale,
                                a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out),
                                static_cast<float*>(a.workspace), a.m, a.n, a.k, stream_k_runs(a, p));
}

template <typename T, int kPairs>
cudaError_t launch_stream_k(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  switch (p.warps) {
    case 1: return launch_stream_k<T, 1, kPairs>(a, p, stream);
    case 2: return launch_stream_k<T, 2, kPairs>(a, p, stream);
    case 4: return launch_stream_k<T, 4, kPairs>(a, p, stream);
    case 8: return launch_stream_k<T, 8, kPairs>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Built for as few x row pairs as M needs, as the stream kernel.
template <typename T>
cudaError_t launch_linear_stream_k(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  if (a.m <= 2) return launch_stream_k<T, 1>(a, p, stream);
  if (a.m <= 4) return launch_stream_k<T, 2>(a, p, stream);
  return launch_stream_k<T, mma::kStreamMaxRows / 2>(a, p, stream);
}

template cudaError_t launch_linear_stream_k<__nv_bfloat16>(const LinearArgs&, const LinearPlan&, cudaStream_t);
template cudaError_t launch_linear_stream_k<__half>(const LinearArgs&, const LinearPlan&, cudaStream_t);

}  // namespace lowbit::nvfp4::gemm
