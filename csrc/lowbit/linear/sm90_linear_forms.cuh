// What the Linear's kernel forms share, and what the plan needs to know
// about how they are built. The forms: sm90_linear_stream.cu (stream and
// narrow), sm90_linear_stream_k.cu, sm90_linear_wide.cu, sm90_linear_panel.cu,
// sm90_linear_wgmma.cu; nvfp4_linear.cu runs a plan on them. Here: the CTAs
// per SM each form is compiled for, the workspace it needs, the device code
// that writes outputs or FP32 partials (finish_output; the wide and panel
// kernels' cluster sum and warp-tile store), each form's launcher and the
// occupancy queries the plan (sm90_linear_plan.cu) asks of the kernels.
#pragma once

#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/sm90.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"

namespace lowbit::nvfp4::gemm {

// The fused GEMMs' last step for output (row, column o) at flat index
// row * N + o: the whole-K sum with one split, written as
// sum * global * 2^8 (+ bias) in T; with several, this split's FP32 partial
// at partials[split][row][o].
template <typename T>
__device__ __forceinline__ void finish_output(float sum, int64_t index, int64_t o, int64_t split, int64_t splits,
                                              int64_t outputs, const float* global_scale, const T* bias, T* out,
                                              float* partials) {
  if (splits > 1) {
    partials[split * outputs + index] = sum;
    return;
  }
  float y = sum * (__ldg(global_scale) * kDecodeUnscale);
  if (bias) y += cuda::to_float(bias[o]);
  out[index] = cuda::from_float<T>(y);
}

// Stream kernel: up to 32 warps per SM (64 registers), as shared memory
// and the plan's ctas_per_sm allow; with two W tiles per warp, 16 (128
// registers: its rings hold fewer warps anyway).
constexpr int kStreamWarpsPerSm = 32;
constexpr int kStreamTilesWarpsPerSm = 16;
static_assert(kStreamMaxM <= mma::kStreamMaxRows, "the stream main loop takes at most 8 rows of x");
static_assert(kStreamTilesMaxM <= mma::kStreamTilesMaxRows, "two tiles per warp take at most 16 rows of x");
LOWBIT_HD constexpr int stream_warps_per_sm(int tiles) { return tiles == 1 ? kStreamWarpsPerSm : kStreamTilesWarpsPerSm; }

// ---- stream-K (sm90_linear_stream_k.cu) ---------------------------------------
// 16 warps per SM, at up to 128 registers: at 64, ptxas recomputes the
// loop's bounds every unit.
constexpr int kStreamKWarpsPerSm = 16;
// The workspace of the stream-K kernel: a slot per CTA, then a flag per CTA.
constexpr int kStreamKSlotFloats = kTileN * mma::kStreamMaxRows;
inline int64_t stream_k_workspace_bytes(int64_t runs) {
  return runs * (kStreamKSlotFloats * int64_t{sizeof(float)} + int64_t{sizeof(uint64_t)});
}

// ---- wide (sm90_linear_wide.cu) and panel (sm90_linear_panel.cu) --------------
// CTAs per SM the wide kernel is compiled for (registers; shared memory
// holds as many).
template <int MT> constexpr int kWideCtasPerSm = MT <= 4 ? 3 : 2;
static_assert(kWideCtasPerSm<2> == kWideCtasPerSm<4>, "linear_plan counts MT = 2 CTAs as MT = 4 ones");

// The wgmma wide kernel's K splits form a cluster (1, 1, splits): each CTA
// dumps its FP32 tile [8 MT x rows][128 W rows] into its shared memory (the
// ring, done with), and after a cluster barrier rank r adds the splits'
// values in rank order for units r, r + splits, ... (4 W rows of one x row),
// reading the others' dumps through distributed shared memory, and stores
// them: deterministic, and no partials through HBM (at M = 64 on 7168 x
// 18432, three splits wrote and read 28 MB) and no reduce launch.
constexpr int kWideMaxSplits = 8;  // portable cluster size
constexpr int kDumpStride = mma::kWarps * kTileN + 4;  // floats per x row: 4-word skew, conflict-free dump
template <int MT> constexpr int kDumpBytes = 8 * MT * kDumpStride * 4;
// dump: kDumpBytes<MT> of the CTA's shared memory, free once every warp is
// past its main loop (the panel kernel uses it too).
template <typename T, int MT>
__device__ __forceinline__ void wide_cluster_finish(const float (&acc)[MT][4], float* dump, int64_t m0, int64_t o0,
                                                    int64_t m, int64_t n, const float* __restrict__ global_scale,
                                                    const T* __restrict__ bias, T* __restrict__ out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  __syncthreads();  // every warp is past its last read of the ring
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i)  // acc[mt][i]: W row 16 warp + g (+ 8 for i >= 2), x row 8 mt + 2 tq + i % 2
      dump[(8 * mt + 2 * tq + (i & 1)) * kDumpStride + 16 * warp + g + 8 * (i >> 1)] = acc[mt][i];
  sm90::cluster_sync();
  const int splits = static_cast<int>(gridDim.z), rank = static_cast<int>(sm90::cluster_rank());
  const float scale = __ldg(global_scale) * kDecodeUnscale;
  for (int u = rank * mma::kThreads + static_cast<int>(threadIdx.x); u < 8 * MT * 32; u += splits * mma::kThreads) {
    const int r = u / 32, q = u % 32;
    const float* src = dump + r * kDumpStride + 4 * q;
    float4 part[kWideMaxSplits];
#pragma unroll
    for (int sp = 0; sp < kWideMaxSplits; ++sp)
      if (sp < splits) part[sp] = sm90::ld_shared_cluster_f4(src, sp);  // all loads in flight first
    float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int sp = 0; sp < kWideMaxSplits; ++sp)
      if (sp < splits) {
        v[0] += part[sp].x;
        v[1] += part[sp].y;
        v[2] += part[sp].z;
        v[3] += part[sp].w;
      }
    const int64_t row = m0 + r, o = o0 + 4 * q;
    if (row >= m || o >= n) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float y = v[e] * scale;
      if (bias) y += cuda::to_float(bias[o + e]);
      out[row * n + o + e] = cuda::from_float<T>(y);
    }
  }
  sm90::cluster_sync();  // no CTA leaves while another reads its dump
}

// A warp's sums (16 rows of W tile nt x 8 MT rows of x from m0, mma C
// layout) through finish_output: the output, or split blockIdx.z's partials.
template <typename T, int MT>
__device__ __forceinline__ void store_warp_tile(const float (&acc)[MT][4], int64_t nt, int64_t m0, int64_t m,
                                                int64_t n, const float* __restrict__ global_scale,
                                                const T* __restrict__ bias, T* __restrict__ out, float* partials) {
  const int lane = threadIdx.x % 32, tq = lane % 4;
  const int64_t o = nt * kTileN + lane / 4;  // acc[mt][i]: W row o at x row 8 mt + 2 tq + i; acc[mt][2 + i]: row o + 8
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t row = m0 + mt * 8 + 2 * tq + i;
      if (row >= m) continue;
      finish_output(acc[mt][i], row * n + o, o, blockIdx.z, gridDim.z, m * n, global_scale, bias, out, partials);
      finish_output(acc[mt][2 + i], row * n + o + 8, o + 8, blockIdx.z, gridDim.z, m * n, global_scale, bias, out,
                    partials);
    }
}

constexpr int kPanelCtasPerSm = 3;  // at most (panel_spread_smem)
constexpr int kPanelMt = 2;         // 16 rows of x (fewer: zeros)  // (sm90_linear_panel.cu)

// Bytes of the wide wgmma kernel's x image: a stage per row block and k-tile.
inline int64_t wide_image_bytes(int64_t m, int64_t k, int mt) {
  return cuda::ceil_div(m, 8 * mt) * (padded_k(k) / kTileK) * (kTileK / 8) * 128 * mt;
}

// ---- launchers: each runs its form of a plan (nvfp4_linear.cu picks) --------
// T: __nv_bfloat16 or __half, instantiated beside each form's kernels.
// out = sum of the FP32 partials [splits, M, N] in args.workspace, in split
// order, * global (+ bias); launched as a programmatic dependent.
template <typename T>
cudaError_t launch_split_reduce(const LinearArgs& a, int64_t splits, cudaStream_t stream);
template <typename T>
cudaError_t launch_linear_stream(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream);
template <typename T>
cudaError_t launch_linear_stream_k(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream);
template <typename T>
cudaError_t launch_linear_narrow(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream);
template <typename T>
cudaError_t launch_linear_wide(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream);
template <typename T>
cudaError_t launch_linear_panel(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream);

// ---- occupancy queries of the kernels (for the plan's cost models) -----------
// CTAs of the wgmma wide kernel (8 mt rows of x) the device runs at once in
// clusters of `splits`.
int64_t wide_wgmma_resident_ctas(int mt, int splits);
// CTAs of the panel kernel the device runs at once with `smem` bytes of
// dynamic shared memory each, in clusters of `cluster`.
int64_t panel_resident_ctas(int smem, int cluster);
// Clusters of `splits` CTAs of the wgmma kernel on tiles of `tokens` tokens
// the device runs at once.
int64_t linear_wgmma_resident_clusters(int tokens, int splits);

}  // namespace lowbit::nvfp4::gemm
