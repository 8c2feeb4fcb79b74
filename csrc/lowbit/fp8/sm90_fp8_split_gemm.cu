// The split-K row-scaled FP8 GEMM (fp8_split_gemm.h) on Hopper: one cluster
// of S CTAs per 128 x 192 output tile, CTA r of the cluster summing K-blocks
// [r kb / S, (r + 1) kb / S). Three warpgroups per CTA:
//   producer  one thread: tensor-copies the A (128 x 128) and B (192 x 128)
//             code tiles of each of its K-blocks into a ring of stages
//             (128-byte swizzle, zeros past the edges);
//   2 x MMA   each owns 64 rows of the tile: per K-block four m64n192k32
//             wgmmas, the accumulator added into FP32 registers every
//             block (every kFastPromoteBlocks with fast_accum).
// Then every CTA writes its FP32 partial tile into its own shared memory
// (over the stages, which are no longer read), the cluster synchronizes,
// and CTA r reads the r-th share of the tile's valid rows from all S
// partials (ld.shared::cluster, the S loads of a 4-column group in flight
// together), adds them in rank order, scales them, adds the bias and
// stores the output; a second cluster barrier keeps every CTA resident
// until its partial has been read. Measurements: docs/perf/log/linear.md,
// "Linear v37".
#include <cuda.h>

#include <algorithm>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/sm90.cuh"
#include "lowbit/arch/tensor_map.h"
#include "lowbit/fp8/fp8_split_gemm.h"

namespace lowbit::fp8 {
namespace {

constexpr int kTileM = 128, kTileN = 192, kTileK = 128;
constexpr int kStages = 4;
constexpr int kMaxSplits = 8;      // the portable cluster size
constexpr int kMinBlocksPerSplit = 4;
constexpr int kFastPromoteBlocks = 4;  // K-blocks per tensor-core accumulation with fast_accum
constexpr int kMmaWarpgroups = 2;
constexpr int kMmaWarps = 4 * kMmaWarpgroups;
constexpr int kThreads = 128 * (1 + kMmaWarpgroups);
constexpr int kAccum = kTileN / 2;       // accumulator registers per thread (m64 x 192)
constexpr int kJ = kTileN / 8;           // 8-column groups per thread row
constexpr int kRowFloats = kTileN + 8;   // a partial row, padded: the 8 rows of a quad write hit distinct banks
constexpr int kUnitsPerRow = kTileN / 4; // float4 units of the reduction

struct __align__(1024) Stages {
  uint8_t a[kStages][kTileM * kTileK];  // 1024-aligned: the swizzle's 8-row groups
  uint8_t b[kStages][kTileN * kTileK];
};
struct __align__(1024) Smem {
  union {
    Stages stages;
    float partial[kTileM * kRowFloats];  // this CTA's sums, written after its last stage is read
  };
  uint64_t full[kStages], empty[kStages];
};
constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + alignment slack

struct Problem {
  const float* scale_a;  // [m]
  const float* scale_b;  // [n]
  const void* bias;      // [n] or null
  void* out;             // [m, n]
  int m, n, kb;          // kb: 128-wide K-blocks
  int tiles_n, splits;
  int promote;           // K-blocks per tensor-core accumulation
};

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1)
    split_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                      const Problem p) {
  extern __shared__ uint8_t smem_raw[];
  Smem& s = sm90::smem_1024_aligned<Smem>(smem_raw);
  const int warpgroup = threadIdx.x / 128;
  const int rank = static_cast<int>(sm90::cluster_rank());
  const int tile = blockIdx.x / p.splits;
  const int m0 = (tile / p.tiles_n) * kTileM, n0 = (tile % p.tiles_n) * kTileN;
  const int kb0 = static_cast<int>(static_cast<int64_t>(rank) * p.kb / p.splits);
  const int kb1 = static_cast<int>(static_cast<int64_t>(rank + 1) * p.kb / p.splits);  // > kb0: splits <= kb
  const int valid = min(kTileM, p.m - m0);          // the tile's rows inside m
  const int share = (valid + p.splits - 1) / p.splits;  // rows each CTA finishes

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(&s.full[i], 1);
      sm90::mbar_init(&s.empty[i], kMmaWarps);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    sm90::regs_dealloc<40>();
    if (threadIdx.x == 0) {
      constexpr uint32_t kCodeBytes = (kTileM + kTileN) * kTileK;
      for (int i = 0; kb0 + i < kb1; ++i) {
        const int stage = i % kStages;
        const uint32_t phase = (i / kStages) & 1u;
        sm90::mbar_wait(&s.empty[stage], phase ^ 1u);
        sm90::mbar_arrive_expect_tx(&s.full[stage], kCodeBytes);
        sm90::tma_load_2d(s.stages.a[stage], &a_map, (kb0 + i) * kTileK, m0, &s.full[stage]);
        sm90::tma_load_2d(s.stages.b[stage], &b_map, (kb0 + i) * kTileK, n0, &s.full[stage]);
      }
    }
    // The MMA threads' two cluster barriers (below): every partial written,
    // then every partial read.
    __syncwarp();
    sm90::cluster_sync();
    sm90::cluster_sync();
  } else {  // MMA warpgroups
    sm90::regs_alloc<232>();
    const int mma_wg = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int quad = lane % 4;
    float acc[kAccum], out[kAccum];
#pragma unroll
    for (int i = 0; i < kAccum; ++i) out[i] = 0.f;
    for (int i = 0; kb0 + i < kb1; ++i) {
      const int stage = i % kStages;
      sm90::mbar_wait(&s.full[stage], (i / kStages) & 1u);
      const uint64_t a_desc = sm90::desc_k_major_sw128(sm90::smem_addr(s.stages.a[stage] + mma_wg * 64 * kTileK));
      const uint64_t b_desc = sm90::desc_k_major_sw128(sm90::smem_addr(s.stages.b[stage]));
      const bool fresh = i % p.promote == 0;
#pragma unroll
      for (int r = 0; r < kAccum; ++r) sm90::fence_operand(acc[r]);
      sm90::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kTileK / 32; ++ks)  // a k32 slice is 32 bytes: 2 in the descriptor's address field
        sm90::WgmmaFp8<false, false>::m64n192k32_ss(acc, a_desc + 2 * ks, b_desc + 2 * ks, ks > 0 || !fresh);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int r = 0; r < kAccum; ++r) sm90::fence_operand(acc[r]);
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(&s.empty[stage]);
      if ((i + 1) % p.promote == 0 || kb0 + i + 1 == kb1) {
#pragma unroll
        for (int r = 0; r < kAccum; ++r) out[r] += acc[r];
      }
    }
    // Both MMA warpgroups are past their last wgmma before either writes
    // its partial over the stages (named barrier 1: the 256 MMA threads).
    asm volatile("bar.sync 1, %0;" ::"n"(kMmaWarpgroups * 128) : "memory");
    const int row = mma_wg * 64 + warp * 16 + lane / 4;  // and row + 8
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(&s.partial[(row + 8 * h) * kRowFloats + 8 * j + 2 * quad]) =
            make_float2(out[4 * j + 2 * h], out[4 * j + 2 * h + 1]);
    }
    __syncwarp();
    sm90::cluster_sync();  // every CTA's partial written, visible to the cluster

    // This CTA's rows [r0, r1) of the tile: the S partials added in rank
    // order, scaled, the bias added, stored.
    const int r0 = min(valid, rank * share), r1 = min(valid, r0 + share);
    const OutT* bias = static_cast<const OutT*>(p.bias);
    OutT* y = static_cast<OutT*>(p.out);
    constexpr int kMmaThreads = kThreads - 128;
    for (int u = threadIdx.x - 128; u < (r1 - r0) * kUnitsPerRow; u += kMmaThreads) {
      const int r = u / kUnitsPerRow, c = 4 * (u % kUnitsPerRow);
      const int col = n0 + c;
      if (col >= p.n) continue;  // n is a multiple of 16: a 4-column group is all in or all out
      const float* src = &s.partial[(r0 + r) * kRowFloats + c];
      float4 part[kMaxSplits];
#pragma unroll
      for (int q = 0; q < kMaxSplits; ++q)  // every load in flight before the first add
        if (q < p.splits) part[q] = sm90::ld_shared_cluster_f4(src, static_cast<uint32_t>(q));
      float4 sum = part[0];
#pragma unroll
      for (int q = 1; q < kMaxSplits; ++q) {
        if (q < p.splits) {
          sum.x += part[q].x;
          sum.y += part[q].y;
          sum.z += part[q].z;
          sum.w += part[q].w;
        }
      }
      const int64_t grow = m0 + r0 + r;
      const float sa = __ldg(p.scale_a + grow);
      const float4 sb = __ldg(reinterpret_cast<const float4*>(p.scale_b + col));
      // (sum * scale_a) * scale_b + bias: the CPU reference's order.
      float v[4] = {sum.x * sa * sb.x, sum.y * sa * sb.y, sum.z * sa * sb.z, sum.w * sa * sb.w};
      if (bias != nullptr) {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] += cuda::to_float(bias[col + e]);
      }
      alignas(8) OutT o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = cuda::from_float<OutT>(v[e]);
      *reinterpret_cast<uint2*>(y + grow * p.n + col) = *reinterpret_cast<const uint2*>(o);
    }
    __syncwarp();
    sm90::cluster_sync();  // no CTA leaves while a peer may still read its partial
  }
}

template <typename OutT>
auto kernel_for() {
  return split_gemm_kernel<OutT>;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int64_t output_tiles(const SplitGemmArgs& a) {
  return ((a.m + kTileM - 1) / kTileM) * ((a.n + kTileN - 1) / kTileN);
}

}  // namespace

bool split_gemm_takes(const SplitGemmArgs& a) {
  constexpr int64_t kMax = int64_t{1} << 30;  // tile, row and column indices stay in 32 bits
  if (a.m <= 0 || a.n <= 0 || a.k <= 0 || a.m >= kMax || a.n >= kMax || a.k >= kMax) return false;
  if (a.k % 16 != 0 || a.n % 16 != 0) return false;
  if (a.out_dtype != DType::kBFloat16 && a.out_dtype != DType::kFloat16) return false;
  if (!aligned16(a.a) || !aligned16(a.b) || !aligned16(a.scale_b)) return false;
  return output_tiles(a) * kMaxSplits < kMax;
}

int split_gemm_splits(const SplitGemmArgs& a) {
  if (!split_gemm_takes(a)) return 0;
  const int64_t tiles = output_tiles(a);
  const int64_t kb = (a.k + kTileK - 1) / kTileK;
  // At least kMinBlocksPerSplit K-blocks per CTA: with fewer, exchanging the
  // partial tiles costs more than the products they split.
  int64_t splits = std::min<int64_t>(
      {kMaxSplits, std::max<int64_t>(1, kb / kMinBlocksPerSplit), std::max<int64_t>(1, cuda::num_sms() / tiles)});
  // Every tile's cluster resident at once: a cluster needs its SMs in one
  // GPC, so fewer large clusters fit than the SM count alone says.
  for (; splits > 1; --splits)
    if (cuda::resident_clusters(kernel_for<__nv_bfloat16>(), kThreads, kSmemBytes, static_cast<int>(splits)) >= tiles)
      break;
  return static_cast<int>(splits);
}

cudaError_t split_gemm_cuda(const SplitGemmArgs& a, int splits, cudaStream_t stream) {
  const int64_t kb = (a.k + kTileK - 1) / kTileK;
  if (!split_gemm_takes(a) || !aligned16(a.out) || splits < 1 || splits > kMaxSplits || splits > kb)
    return cudaErrorInvalidValue;
  CUtensorMap a_map, b_map;
  cudaError_t err = cuda::make_tensor_map(&a_map, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.m, a.k, a.k, kTileM, kTileK,
                                          CU_TENSOR_MAP_SWIZZLE_128B);
  if (err == cudaSuccess)
    err = cuda::make_tensor_map(&b_map, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.n, a.k, a.k, kTileN, kTileK,
                                CU_TENSOR_MAP_SWIZZLE_128B);
  if (err != cudaSuccess) return err;
  const Problem p{a.scale_a,
                  a.scale_b,
                  a.bias,
                  a.out,
                  static_cast<int>(a.m),
                  static_cast<int>(a.n),
                  static_cast<int>((a.k + kTileK - 1) / kTileK),
                  static_cast<int>((a.n + kTileN - 1) / kTileN),
                  splits,
                  a.fast_accum ? kFastPromoteBlocks : 1};
  const dim3 grid(static_cast<unsigned>(output_tiles(a) * splits));
  const dim3 cluster(static_cast<unsigned>(splits), 1, 1);
  auto launch = [&](auto kernel) {
    cudaError_t e = cuda::allow_dynamic_smem(kernel, kSmemBytes);
    if (e != cudaSuccess) return e;
    return cuda::launch_clusters(kernel, grid, cluster, dim3(kThreads), kSmemBytes, stream, a_map, b_map, p);
  };
  return a.out_dtype == DType::kBFloat16 ? launch(kernel_for<__nv_bfloat16>()) : launch(kernel_for<__half>());
}

}  // namespace lowbit::fp8
