// The block-scaled FP8 GEMM (fp8_block_gemm.h) on Hopper: a persistent,
// warp-specialized wgmma kernel in clusters of two CTAs.
//
// Tiles of 128 x 192 outputs, K in steps of one scale block (128). The two
// CTAs of a cluster take the two row tiles of a pair that share their
// column tile, so each loads its own A tile and half of the B tile, which a
// multicast copy puts into both CTAs' shared memory. A cluster walks pairs
// p = cluster, + clusters, ... in groups of kGroupPairs row pairs (the
// clusters of a wave share A and B tiles in L2). Three warpgroups per CTA:
//   producer  one thread: for each tile and K-block, waits until the stage
//             is free in both CTAs, then tensor-copies A's 128 x 128 code
//             tile and its half of B's 192 x 128 one (128-byte swizzle,
//             zeros past the edges) and, for 1 x 128 B scales, the block's
//             192 column scales;
//   2 x MMA   each owns 64 rows of the tile: per K-block four m64n192k32
//             wgmmas into a fresh accumulator, then out += acc * sa[row] *
//             sb[col] in FP32, so the tensor cores' short accumulator never
//             sums more than one block. A stage is released to both CTAs'
//             producers once its last reader is done. The epilogue writes
//             the rows from registers while the producer fills the stages of
//             the next tile.
// Versions and their measurements: docs/perf/log/fp8_train.md, "Block GEMM".
// Row scales are read from global memory (a thread's two rows keep all their
// K-blocks' scales in one or a few L1 lines); 128 x 128 B scales are two
// values per tile and block (a 192-column tile spans two 128-column blocks).
#include <cuda.h>

#include <algorithm>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/sm90.cuh"
#include "lowbit/arch/tensor_map.h"
#include "lowbit/fp8/fp8_block_gemm.h"

namespace lowbit::fp8 {
namespace {

constexpr int kTileM = 128, kTileN = 192, kTileK = kBlockSize;
constexpr int kCluster = 2;                      // CTAs sharing a B tile
constexpr int kHalfN = kTileN / kCluster;        // B rows each CTA loads
constexpr int kStages = 5;
constexpr int kGroupPairs = 8;
constexpr int kMmaWarpgroups = 2;
constexpr int kMmaWarps = 4 * kMmaWarpgroups;
constexpr int kThreads = 128 * (1 + kMmaWarpgroups);
constexpr int kAccum = kTileN / 2;               // accumulator registers per thread (m64 x 192)
constexpr int kJ = kTileN / 8;                   // 8-column groups per thread row
static_assert(kHalfN % 8 == 0, "a B half is whole 8-row swizzle groups");

struct __align__(1024) Smem {
  uint8_t a[kStages][kTileM * kTileK];  // 1024-aligned: the swizzle's 8-row groups
  uint8_t b[kStages][kTileN * kTileK];
  float col_scale[kStages][kTileN];     // 1 x 128 B scales of the stage's block
  uint64_t full[kStages], empty[kStages];
};
constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + alignment slack

struct Problem {
  const float* scale_a;  // [m, kb]
  const float* scale_b;  // 2d: [ceil(n/128), kb]; per column: [kb, n]
  const float* bias;     // [n] or null
  void* out;
  int m, n, kb;           // kb: K-blocks
  int pairs_m, tiles_n;   // row-tile pairs, column tiles
};

// Row-tile pair and column tile of the cluster's i-th pair tile.
__device__ __forceinline__ void pair_coords(const Problem& p, int t, int& pm, int& tn) {
  const int per_group = kGroupPairs * p.tiles_n;
  const int group = t / per_group;
  const int first = group * kGroupPairs;
  const int rows = min(p.pairs_m - first, kGroupPairs);
  const int r = t - group * per_group;
  pm = first + r % rows;
  tn = r / rows;
}

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* out, float v0, float v1);
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* out, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(v0, v1);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* out, float v0, float v1) {
  *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
}

// The promotion of one K-block: out += acc * sa[row] * sb[col] in FP32,
// acc[4j + 2r + e] being row r (0: row0, 1: row0 + 8), column 8j + 2 quad + e
// of the tile. Explicit FMAs: the build compiles with --fmad=false.
//
// 128 x 128 B scales: factor f_r for columns before 8 kSplit, g_r after (the
// tile's two column blocks). kSplit is a template argument so that the
// choice costs no instruction per element (a runtime split took a compare,
// a select and a multiply for each of the 24 column groups).
template <int kSplit>
__device__ __forceinline__ void promote_blocks(const float (&acc)[kAccum], float (&out)[kAccum], float f0, float f1,
                                               float g0, float g1) {
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const float r0 = j < kSplit ? f0 : g0, r1 = j < kSplit ? f1 : g1;
    out[4 * j + 0] = __fmaf_rn(acc[4 * j + 0], r0, out[4 * j + 0]);
    out[4 * j + 1] = __fmaf_rn(acc[4 * j + 1], r0, out[4 * j + 1]);
    out[4 * j + 2] = __fmaf_rn(acc[4 * j + 2], r1, out[4 * j + 2]);
    out[4 * j + 3] = __fmaf_rn(acc[4 * j + 3], r1, out[4 * j + 3]);
  }
}
// 1 x 128 B scales: one per column, from the stage's copy (col_scale[c]).
__device__ __forceinline__ void promote_columns(const float (&acc)[kAccum], float (&out)[kAccum], float sa0, float sa1,
                                                const float* col_scale, int quad) {
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const float2 c = *reinterpret_cast<const float2*>(&col_scale[8 * j + 2 * quad]);
    out[4 * j + 0] = __fmaf_rn(acc[4 * j + 0], sa0 * c.x, out[4 * j + 0]);
    out[4 * j + 1] = __fmaf_rn(acc[4 * j + 1], sa0 * c.y, out[4 * j + 1]);
    out[4 * j + 2] = __fmaf_rn(acc[4 * j + 2], sa1 * c.x, out[4 * j + 2]);
    out[4 * j + 3] = __fmaf_rn(acc[4 * j + 3], sa1 * c.y, out[4 * j + 3]);
  }
}

template <typename OutT, bool kColScales, bool kA5, bool kB5>
__global__ void __launch_bounds__(kThreads, 1)
    block_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                      const Problem p) {
  extern __shared__ uint8_t smem_raw[];
  Smem& s = sm90::smem_1024_aligned<Smem>(smem_raw);
  const int warpgroup = threadIdx.x / 128;
  const uint32_t rank = sm90::cluster_rank();
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const int pair_tiles = p.pairs_m * p.tiles_n;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(&s.full[i], 1);
      sm90::mbar_init(&s.empty[i], kCluster * kMmaWarps);  // every MMA warp of both CTAs
    }
    sm90::fence_barrier_init();
  }
  sm90::cluster_sync();  // the peer's barriers are initialized before anything reaches them

  if (warpgroup == 0) {  // producer
    sm90::regs_dealloc<40>();
    if (threadIdx.x == 0) {
      constexpr uint32_t kCodeBytes = (kTileM + kTileN) * kTileK;  // A, and B from both halves
      int stage = 0;
      uint32_t phase = 0;
      for (int t = cluster; t < pair_tiles; t += clusters) {
        int pm, tn;
        pair_coords(p, t, pm, tn);
        const int m0 = (pm * kCluster + static_cast<int>(rank)) * kTileM, n0 = tn * kTileN;
        // n is a multiple of 16, so the scale copy is a multiple of 64 bytes.
        const uint32_t col_bytes = kColScales ? static_cast<uint32_t>(min(kTileN, p.n - n0)) * 4u : 0u;
        for (int kb = 0; kb < p.kb; ++kb) {
          sm90::mbar_wait(&s.empty[stage], phase ^ 1u);
          sm90::mbar_arrive_expect_tx(&s.full[stage], kCodeBytes + col_bytes);
          sm90::tma_load_2d(s.a[stage], &a_map, kb * kTileK, m0, &s.full[stage]);
          sm90::tma_load_2d_multicast(s.b[stage] + rank * kHalfN * kTileK, &b_map, kb * kTileK,
                                      n0 + static_cast<int>(rank) * kHalfN, &s.full[stage], (1u << kCluster) - 1);
          if (kColScales)
            sm90::bulk_copy_g2s(s.col_scale[stage], p.scale_b + static_cast<int64_t>(kb) * p.n + n0, col_bytes,
                                &s.full[stage]);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
  } else {  // MMA warpgroups
    sm90::regs_alloc<232>();
    const int mma_wg = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int quad = lane % 4;
    const uint32_t peer_empty = sm90::peer_smem_addr(&s.empty[0], rank ^ 1u);
    int stage = 0;
    uint32_t phase = 0;
    float acc[kAccum], out[kAccum];
    for (int t = cluster; t < pair_tiles; t += clusters) {
      int pm, tn;
      pair_coords(p, t, pm, tn);
      const int m0 = (pm * kCluster + static_cast<int>(rank)) * kTileM, n0 = tn * kTileN;
      const int row0 = m0 + mma_wg * 64 + warp * 16 + lane / 4;  // and row0 + 8
      // Rows past m read row m - 1's scales (their codes are zeros; never stored).
      const float* sa0 = p.scale_a + static_cast<int64_t>(min(row0, p.m - 1)) * p.kb;
      const float* sa1 = p.scale_a + static_cast<int64_t>(min(row0 + 8, p.m - 1)) * p.kb;
      // 128 x 128 B scales: the tile's columns [n0, n0 + 192) span blocks
      // n0 / 128 and the next (clamped: columns past n are never stored);
      // n0 is a multiple of 64, so the second starts at column 64 or 128.
      const int blk = n0 / kBlockSize;
      const float* sb_lo = p.scale_b + static_cast<int64_t>(blk) * p.kb;
      const float* sb_hi = p.scale_b + static_cast<int64_t>(min(blk + 1, (p.n - 1) / kBlockSize)) * p.kb;
      const bool split_at_128 = n0 % kBlockSize == 0;
#pragma unroll
      for (int i = 0; i < kAccum; ++i) out[i] = 0.f;
      for (int kb = 0; kb < p.kb; ++kb) {
        sm90::mbar_wait(&s.full[stage], phase);
        const uint64_t a_desc = sm90::desc_k_major_sw128(sm90::smem_addr(s.a[stage] + mma_wg * 64 * kTileK));
        const uint64_t b_desc = sm90::desc_k_major_sw128(sm90::smem_addr(s.b[stage]));
#pragma unroll
        for (int i = 0; i < kAccum; ++i) sm90::fence_operand(acc[i]);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kTileK / 32; ++ks)  // a k32 slice is 32 bytes: 2 in the descriptor's address field
          sm90::WgmmaFp8<kA5, kB5>::m64n192k32_ss(acc, a_desc + 2 * ks, b_desc + 2 * ks, ks > 0);
        sm90::wgmma_commit();
        const float scale_a0 = __ldg(sa0 + kb), scale_a1 = __ldg(sa1 + kb);
        float scale_lo = 1.f, scale_hi = 1.f;
        if (!kColScales) scale_lo = __ldg(sb_lo + kb), scale_hi = __ldg(sb_hi + kb);
        sm90::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kAccum; ++i) sm90::fence_operand(acc[i]);
        if (kColScales) {
          promote_columns(acc, out, scale_a0, scale_a1, s.col_scale[stage], quad);
        } else {
          const float f0 = scale_a0 * scale_lo, f1 = scale_a1 * scale_lo;
          const float g0 = scale_a0 * scale_hi, g1 = scale_a1 * scale_hi;
          if (split_at_128)
            promote_blocks<kBlockSize / 8>(acc, out, f0, f1, g0, g1);
          else
            promote_blocks<(kBlockSize / 2) / 8>(acc, out, f0, f1, g0, g1);
        }
        // The stage (codes and, read just above, column scales) is free in
        // this CTA and, for the B half this CTA's producer multicast, in the peer.
        __syncwarp();
        if (lane == 0) {
          sm90::mbar_arrive(&s.empty[stage]);
          sm90::mbar_arrive_remote(peer_empty + stage * sizeof(uint64_t));
        }
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      // Epilogue: n is a multiple of 16, so a pair is in range iff its first column is.
      OutT* y = static_cast<OutT*>(p.out);
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int col = n0 + 8 * j + 2 * quad;
        if (col >= p.n) continue;
        float b0 = 0.f, b1 = 0.f;
        if (p.bias != nullptr) {
          b0 = __ldg(p.bias + col);
          b1 = __ldg(p.bias + col + 1);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + 8 * h;
          if (row < p.m)
            store_pair<OutT>(y + static_cast<int64_t>(row) * p.n + col, out[4 * j + 2 * h] + b0,
                             out[4 * j + 2 * h + 1] + b1);
        }
      }
    }
  }
  // Neither CTA leaves while the other may still multicast into its shared
  // memory or arrive on its barriers.
  __syncwarp();
  sm90::cluster_sync();
}

template <typename OutT, bool kColScales, bool kA5, bool kB5>
cudaError_t launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const Problem& p, cudaStream_t stream) {
  auto kernel = block_gemm_kernel<OutT, kColScales, kA5, kB5>;
  cudaError_t err = cuda::allow_dynamic_smem(kernel, kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t pair_tiles = static_cast<int64_t>(p.pairs_m) * p.tiles_n;
  const int64_t clusters = std::min(pair_tiles, cuda::resident_clusters(kernel, kThreads, kSmemBytes, kCluster));
  return cuda::launch_clusters(kernel, dim3(static_cast<unsigned>(clusters * kCluster)), dim3(kCluster, 1, 1),
                               dim3(kThreads), kSmemBytes, stream, a_map, b_map, p);
}

template <typename OutT, bool kColScales>
cudaError_t launch_formats(const BlockGemmArgs& a, const CUtensorMap& am, const CUtensorMap& bm, const Problem& p,
                           cudaStream_t stream) {
  const bool a5 = a.format_a == Format::kE5M2, b5 = a.format_b == Format::kE5M2;
  if (a5) return launch<OutT, kColScales, true, false>(am, bm, p, stream);
  if (b5) return launch<OutT, kColScales, false, true>(am, bm, p, stream);
  return launch<OutT, kColScales, false, false>(am, bm, p, stream);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

bool block_gemm_takes(const BlockGemmArgs& a) {
  constexpr int64_t kMaxRows = int64_t{1} << 30;  // tile and row indices stay in 32 bits
  if (a.m <= 0 || a.n <= 0 || a.k <= 0 || a.m >= kMaxRows || a.n >= kMaxRows || a.k >= kMaxRows) return false;
  if (a.k % kBlockSize != 0 || a.n % 16 != 0) return false;
  if (a.format_a == Format::kE5M2 && a.format_b == Format::kE5M2) return false;
  if (a.out_dtype != DType::kBFloat16 && a.out_dtype != DType::kFloat32) return false;
  if (a.scaling_b != Scaling::kBlock && a.scaling_b != Scaling::kBlock2d) return false;
  if (!aligned16(a.a) || !aligned16(a.b)) return false;
  if (a.scaling_b == Scaling::kBlock && !aligned16(a.scale_b)) return false;
  const int64_t tiles = ((a.m + kTileM - 1) / kTileM) * ((a.n + kTileN - 1) / kTileN);
  return tiles < kMaxRows;
}

cudaError_t block_gemm_cuda(const BlockGemmArgs& a, cudaStream_t stream) {
  if (!block_gemm_takes(a)) return cudaErrorInvalidValue;
  CUtensorMap a_map, b_map;  // B in boxes of half a tile: each CTA of a cluster loads one
  cudaError_t err = cuda::make_tensor_map(&a_map, a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.m, a.k, a.k, kTileM, kTileK,
                                          CU_TENSOR_MAP_SWIZZLE_128B);
  if (err == cudaSuccess)
    err = cuda::make_tensor_map(&b_map, a.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.n, a.k, a.k, kHalfN, kTileK,
                                CU_TENSOR_MAP_SWIZZLE_128B);
  if (err != cudaSuccess) return err;
  const int64_t tiles_m = (a.m + kTileM - 1) / kTileM;
  Problem p{a.scale_a,
            a.scale_b,
            a.bias,
            a.out,
            static_cast<int>(a.m),
            static_cast<int>(a.n),
            static_cast<int>(a.k / kBlockSize),
            static_cast<int>((tiles_m + kCluster - 1) / kCluster),
            static_cast<int>((a.n + kTileN - 1) / kTileN)};
  const bool col = a.scaling_b == Scaling::kBlock;
  if (a.out_dtype == DType::kBFloat16)
    return col ? launch_formats<__nv_bfloat16, true>(a, a_map, b_map, p, stream)
               : launch_formats<__nv_bfloat16, false>(a, a_map, b_map, p, stream);
  return col ? launch_formats<float, true>(a, a_map, b_map, p, stream)
             : launch_formats<float, false>(a, a_map, b_map, p, stream);
}

}  // namespace lowbit::fp8
