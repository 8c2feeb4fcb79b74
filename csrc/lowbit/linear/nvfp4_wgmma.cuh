// The warp-specialized NVFP4 wgmma GEMM shared by the Linear (129..2048
// rows, sm90_linear_wgmma.cu) and the MoE experts with many rows
// (nvfp4_moe.cu): the weight decoded into shared memory by warps of its own.
// It is the Linear's GEMM machinery, so it lives in linear/; the MoE
// (moe/nvfp4_moe.cu) includes it from here.
//
// Per output tile of 128 W rows x NT tokens (NT = 256 or 128), K in steps of
// 64, computed transposed (y^T = W x^T):
//   MMA warpgroups  two, each wgmma.m64nNTk16 with 64 decoded W rows as A
//                   and x (NT rows) as B, both from shared memory, FP32
//                   accumulators in registers. Thread 0 also issues the x
//                   loads (a TMA box of NT rows x 64 columns, 128-byte
//                   swizzle; rows and columns past the map arrive as zeros)
//                   as soon as both warpgroups have released a slot.
//   transform warps 4 (NT = 256) or 8 (NT = 128) decode raw W (8 prepacked
//                   16-row tiles per 128 columns: codes and block scales, one
//                   TMA copy each, issued by warp 0) with nvfp4_mainloops.cuh
//                   decode_fragment (e2m1 * block scale * 2^-8, exact) into
//                   bf16/fp16 in the K-major core-matrix operand layout,
//                   undoing the layout's K permutation as they store, so x
//                   needs none (no x image, no extra pass).
// The tensor pipe never waits on the decode as long as the decode keeps up,
// and each decoded W step serves all NT tokens of the tile. What the decode
// still costs (docs/perf/log/linear.md, Linear v8): its ALU/FMA instructions slow the
// tensor pipe of the same SM by ~10%.
//
// A Problem says which tile a CTA computes (W tile rows and x rows: a token
// tile of the Linear, a work item of an expert) and how the tile is stored
// (the Linear: global scale and bias; the MoE: the clamped SwiGLU, or the
// expert's global scale). Split K (few output tiles): the CTAs of one tile's
// K splits form a cluster; each dumps its FP32 tile into its shared memory
// and each stores its share of tokens, adding the cluster's tiles
// (distributed shared memory) in rank order: deterministic, no workspace.
// Pairs (kPair, many token tiles, no K split): two CTAs on the same W rows
// and adjacent token tiles form a cluster; each copies and decodes half of
// the W tiles and copies what it decoded into the other's shared memory
// (bulk copies counted on the other's barrier), so the decode that slows
// the tensor pipe is half as much per CTA.
#pragma once

#include <algorithm>
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/sm90.cuh"
#include "lowbit/arch/tensor_map.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"

namespace lowbit::nvfp4::gemm::wgmma {

constexpr int kBN = 128;                                              // W rows per tile
constexpr int kRawTiles = kBN / kTileN;                               // prepacked tiles per raw stage
constexpr int kStepK = 64;                                            // columns per x / decoded step
constexpr int kRowBytes = kStepK * 2;                                 // 128: one swizzled x row
constexpr int kMaxSplits = 8;                                         // portable cluster size
// Decoded W of a step, in two contiguous halves of 64 rows (one per MMA
// warpgroup; in pairs, one per CTA): core matrices (8 rows x 8 columns, 128
// contiguous bytes) of row group rg of half hf and column group kc at hf *
// kDecHalfBytes + kc * kDecLbo + rg * 128. The 64 extra bytes per column
// group put the two column groups that one 8-byte store instruction writes
// into opposite halves of the banks.
constexpr int kDecLbo = (kBN / 16) * 128 + 64;                        // 1088
constexpr int kDecHalfBytes = (kStepK / 8) * kDecLbo;                 // 8.5 KB
constexpr int kDecBytes = 2 * kDecHalfBytes;                          // 17 KB

// NT tokens per tile. The MMA warpgroups hold NT / 2 FP32 accumulators per
// thread; the registers left over decide how many transform warps fit
// (ptxas gives every thread the launch bound's share): 8 (one W tile each
// per step) at NT = 128, 4 (two tiles each) at NT = 256. (NT = 192 with 8
// warps measured slower than NT = 256 with 4: docs/perf/log/linear.md, Linear v8.)
template <int NT, bool kPair = false>
struct Config {
  static_assert(NT == 128 || NT == 256, "tokens per tile");
  static_assert(!kPair || NT == 256, "pairs: 4 transform warps, one W tile each");
  static constexpr int kTransformWarps = NT == 256 ? 4 : 8;
  static constexpr int kRawTilesCta = kPair ? kRawTiles / 2 : kRawTiles;  // W tiles this CTA copies and decodes
  static constexpr int kRawBytesCta = kRawTilesCta * (kTileBytes + kTileScaleBytes);  // a raw stage: 9 KB, pairs 4.5
  static constexpr int kTilesPerWarp = kRawTilesCta / kTransformWarps;  // W tiles a transform warp decodes per step
  static constexpr int kThreads = 256 + 32 * kTransformWarps;        // 2 MMA warpgroups + transform warps
  static constexpr int kXBytes = NT * kRowBytes;                      // 16 or 32 KB
  static constexpr int kRawStages = 3;
  static constexpr int kXStages = 4;
  static constexpr int kDecStages = NT == 256 ? 4 : 6;
  static constexpr int kXOff = 0;
  static constexpr int kDecOff = kXOff + kXStages * kXBytes;
  static constexpr int kRawOff = kDecOff + kDecStages * kDecBytes;
  static constexpr int kBarOff = kRawOff + kRawStages * kRawBytesCta;
  static constexpr int kBars = 2 * (kRawStages + kDecStages + kXStages);
  static constexpr int kSmemBytes = kBarOff + 8 * kBars + 1024;  // + alignment slack
  static constexpr int kDumpStride = kBN + 4;                    // FP32 token row of the epilogue dump
  static constexpr int kDumpBytes = NT * kDumpStride * 4;
  static_assert(kXOff % 1024 == 0 && kXBytes % 1024 == 0, "swizzled x must be 1024-byte aligned");
  static_assert(kRawOff % 16 == 0 && kDecBytes % 16 == 0, "tensor copies and core matrices: 16-byte aligned");
  static_assert(kDumpBytes <= kBarOff, "the epilogue dump reuses the pipeline buffers");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");
  static_assert(kRawTilesCta % kTransformWarps == 0, "every transform warp decodes as many tiles");
};

// Stage use i of a ring of S slots: slot i % S, phase (i / S) & 1.
template <int S> __device__ __forceinline__ int slot_of(int i) { return i % S; }
template <int S> __device__ __forceinline__ uint32_t phase_of(int i) { return static_cast<uint32_t>((i / S) & 1); }

template <typename T, int NT> struct MmaStep;
template <typename T> struct MmaStep<T, 256> {
  static constexpr int kAcc = 128;
  __device__ __forceinline__ static void run(float (&d)[kAcc], uint64_t a, uint64_t b, uint32_t acc) {
    sm90::Wgmma<T>::m64n256k16_ss(d, a, b, acc);
  }
};
template <typename T> struct MmaStep<T, 128> {
  static constexpr int kAcc = 64;
  __device__ __forceinline__ static void run(float (&d)[kAcc], uint64_t a, uint64_t b, uint32_t acc) {
    sm90::Wgmma<T>::m64n128k16_ss(d, a, b, acc);
  }
};

// The FP32 tiles of a cluster's CTAs after the mainloop ([token][W row]
// in each CTA's shared memory): sum8 adds the K splits' values of 8
// consecutive W rows in rank order.
template <int NT>
struct DumpView {
  const float* dump;
  int splits;
  __device__ __forceinline__ void sum8(int r, int c, float (&v)[8]) const {
    const float* src = dump + r * Config<NT>::kDumpStride + c;
    if (splits == 1) {
      const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
      v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
      v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
      return;
    }
    // Every rank's loads in flight before the first add: remote shared
    // memory is slow to answer, one round trip instead of one per rank.
    float4 part[2 * kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      if (s < splits) {
        part[2 * s] = sm90::ld_shared_cluster_f4(src, s);
        part[2 * s + 1] = sm90::ld_shared_cluster_f4(src + 4, s);
      }
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      if (s < splits) {
        v[0] += part[2 * s].x; v[1] += part[2 * s].y; v[2] += part[2 * s].z; v[3] += part[2 * s].w;
        v[4] += part[2 * s + 1].x; v[5] += part[2 * s + 1].y; v[6] += part[2 * s + 1].z;
        v[7] += part[2 * s + 1].w;
      }
  }
};

// What a CTA computes: W tile rows [w_tile_row, + 8) of the code and scale
// maps (128 W rows), x rows [x_row, x_row + NT) of the x map from column
// x_col on (0 but for a grouped Linear: its group's slice of x); group and
// rows are the problem's own (the MoE: the item's expert and row count).
struct Tile {
  int32_t w_tile_row;
  int32_t x_row;
  int32_t x_col;
  int32_t group;
  int32_t rows;
};

// grid (splits, N / 128 W blocks, token tiles or work items); cluster
// (splits, 1, 1); pairs: grid (2, N / 128, token tiles / 2), cluster (2, 1,
// 1), no split. K: the reduction length (columns of x). The problem says
// which tile the CTA computes (Problem::tile; false: nothing to do, which
// only a problem without K splits or pairs may answer, as the whole CTA
// leaves) and stores it (Problem::store, by the 256 MMA threads, for token
// rows [r0, r1) of the tile).
template <typename T, int NT, bool kPair, typename Problem>
__global__ void __launch_bounds__(Config<NT, kPair>::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap code_map,
                const __grid_constant__ CUtensorMap scale_map, const Problem problem, int64_t k, int tiles_per_split) {
  using C = Config<NT, kPair>;
  Tile tile;
  if (!problem.tile(tile)) return;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - sm90::smem_addr(smem_raw) % 1024) % 1024);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kBarOff);
  uint64_t* raw_full = bars;
  uint64_t* raw_empty = raw_full + C::kRawStages;
  uint64_t* dec_full = raw_empty + C::kRawStages;
  uint64_t* dec_empty = dec_full + C::kDecStages;
  uint64_t* x_full = dec_empty + C::kDecStages;
  uint64_t* x_empty = x_full + C::kXStages;
  auto raw_stage = [&](int s) { return smem + C::kRawOff + s * C::kRawBytesCta; };
  auto dec_stage = [&](int s) { return smem + C::kDecOff + s * kDecBytes; };
  auto x_stage = [&](int s) { return smem + C::kXOff + s * C::kXBytes; };

  const int64_t tiles_k = padded_k(k) / kTileK;
  const int split = kPair ? 0 : blockIdx.x, splits = kPair ? 1 : gridDim.x;
  const uint32_t rank = kPair ? blockIdx.x : 0;  // pairs: this CTA's place in the pair
  // Pairs: the other CTA's shared::cluster address of a byte of this CTA's
  // shared memory (the same offset there).
  const uint32_t peer_base = kPair ? sm90::peer_smem_addr(smem, rank ^ 1) : 0;
  auto in_peer = [&](const void* p) {
    return peer_base + static_cast<uint32_t>(static_cast<const uint8_t*>(p) - smem);
  };
  const int kc0 = split * tiles_per_split;
  const int ktiles = static_cast<int>(std::min<int64_t>(tiles_k, kc0 + tiles_per_split)) - kc0;
  const int steps = 2 * ktiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kRawStages; ++s) {
      sm90::mbar_init(&raw_full[s], 1);
      sm90::mbar_init(&raw_empty[s], C::kTransformWarps);
    }
    for (int s = 0; s < C::kDecStages; ++s) {
      sm90::mbar_init(&dec_full[s], C::kTransformWarps);  // per transform warp (pairs: + the other's bytes)
      sm90::mbar_init(&dec_empty[s], kPair ? 16 : 8);     // per MMA warp (pairs: of both CTAs)
    }
    for (int s = 0; s < C::kXStages; ++s) {
      sm90::mbar_init(&x_full[s], 1);
      sm90::mbar_init(&x_empty[s], 8);
    }
    sm90::fence_barrier_init();
  }
  if (kPair) {
    sm90::cluster_sync();  // the other CTA arrives on these barriers
  } else {
    __syncthreads();
  }

  // x step h: columns [64 h, 64 h + 64) of this split, rows [x_row, x_row + NT).
  auto load_x = [&](int h) {
    const int xs = slot_of<C::kXStages>(h);
    sm90::mbar_arrive_expect_tx(&x_full[xs], C::kXBytes);
    sm90::tma_load_2d(x_stage(xs), &x_map, static_cast<int32_t>(tile.x_col + kc0 * kTileK + h * kStepK), tile.x_row,
                      &x_full[xs]);
  };

  if (warp < 8) {
    // ---- MMA warpgroups --------------------------------------------------------
    if (NT == 256) sm90::regs_alloc<208>();  // the transform warps need fewer
    using Step = MmaStep<T, NT>;
    float acc[Step::kAcc];
    const int wg = warp / 4;
    if (threadIdx.x == 0) {
      cuda::wait_for_previous_grid();  // x may come from the previous kernel
      for (int h = 0; h < min(steps, int{C::kXStages}); ++h) load_x(h);
    }
    for (int h = 0; h < steps; ++h) {
      const int xs = slot_of<C::kXStages>(h), ds = slot_of<C::kDecStages>(h);
      sm90::mbar_wait(&dec_full[ds], phase_of<C::kDecStages>(h));
      sm90::mbar_wait(&x_full[xs], phase_of<C::kXStages>(h));
      const uint32_t a_addr = sm90::smem_addr(dec_stage(ds)) + wg * kDecHalfBytes;
      const uint32_t b_addr = sm90::smem_addr(x_stage(xs));
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kStepK / 16; ++kk)
        Step::run(acc, sm90::desc_k_major_interleave(a_addr + 2 * kk * kDecLbo, kDecLbo, 128),
                  sm90::desc_k_major_sw128(b_addr + kk * 32), h > 0 || kk > 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // step h - 1's MMAs are done: release its buffers
      if (h > 0) {
        const int prev = h - 1;
        if (lane == 0) {
          sm90::mbar_arrive(&x_empty[slot_of<C::kXStages>(prev)]);
          sm90::mbar_arrive(&dec_empty[slot_of<C::kDecStages>(prev)]);
          if (kPair) sm90::mbar_arrive_remote(in_peer(&dec_empty[slot_of<C::kDecStages>(prev)]));
        }
        if (threadIdx.x == 0 && prev + C::kXStages < steps) {  // refill the slot once both warpgroups left it
          sm90::mbar_wait(&x_empty[slot_of<C::kXStages>(prev)], phase_of<C::kXStages>(prev));
          load_x(prev + C::kXStages);
        }
      }
    }
    sm90::wgmma_wait<0>();
    if (steps == 0) {  // an empty K split adds zeros
#pragma unroll
      for (int i = 0; i < Step::kAcc; ++i) acc[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < Step::kAcc; ++i) sm90::fence_operand(acc[i]);
    // Once both MMA warpgroups are done, the pipeline buffers hold nothing
    // anyone still reads (the transform warps and the copies finished before
    // the MMAs could consume them): the FP32 tile goes over them, as
    // [token][W row]. acc[4j + 2h + e]: W row 16 warp + lane / 4 + 8h of the
    // CTA, token 8j + 2 (lane % 4) + e. Pairs wait for the other CTA too:
    // once its MMAs are done, it has every decoded tile this CTA copied to
    // it (the copies no longer read these buffers) and sends nothing more.
    if (kPair) {
      sm90::cluster_sync();
    } else {
      asm volatile("bar.sync 1, 256;" ::: "memory");
    }
    float* dump = reinterpret_cast<float*>(smem);
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) dump[(8 * j + col + e) * C::kDumpStride + row + 8 * h] = acc[4 * j + 2 * h + e];
    cuda::allow_dependent_launch();
    // Every CTA of the cluster has its tile in shared memory; the second
    // cluster barrier keeps it there until the cluster has read it.
    if (splits > 1) {
      sm90::cluster_sync();
    } else {
      asm volatile("bar.sync 1, 256;" ::: "memory");
    }
    const int split_rank = splits > 1 ? static_cast<int>(sm90::cluster_rank()) : 0;
    const int rows_per_rank = (NT + splits - 1) / splits;
    problem.store(DumpView<NT>{dump, splits}, tile, split_rank * rows_per_rank,
                  min((split_rank + 1) * rows_per_rank, NT));
    if (splits > 1) sm90::cluster_sync();
  } else {
    // ---- transform warps ------------------------------------------------------
    // Warp tw decodes W tiles tw, tw + kTransformWarps (two at NT = 256, one
    // at 128 and in pairs) of the CTA's raw stage: 4 k16 fragments each, 8
    // codes of two rows per lane, and stores every lane's 4 consecutive
    // physical columns of a row as one 8-byte word (row r, column c of a
    // step at (r / 64) * kDecHalfBytes + (c / 8) * kDecLbo + (r % 64 / 8) *
    // 128 + (r % 8) * 16 + (c % 8) * 2). Pairs: each CTA decodes half r
    // (its rank) and warp 0 copies it into the other CTA once all four warps
    // have stored it. Warp 0 (lane 0) also issues the raw W copies.
    if (NT == 256) sm90::regs_dealloc<88>();
    const int tw = warp - 8, g = lane / 4, t = lane % 4;
    const bool copier = tw == 0 && lane == 0;
    // Raw stage q: k-tile kc0 + q of the CTA's kRawTilesCta W tile rows
    // (from tile.w_tile_row; pairs: the first or second half of the 8),
    // codes then scales, one tensor copy each (rows past the map: zeros).
    const int raw_tile0 = static_cast<int>(rank) * C::kRawTilesCta;  // the CTA's first tile of the 8
    auto load_raw = [&](int q) {
      const int rs = slot_of<C::kRawStages>(q);
      sm90::mbar_arrive_expect_tx(&raw_full[rs], C::kRawBytesCta);
      sm90::tma_load_2d(raw_stage(rs), &code_map, (kc0 + q) * (kTileBytes / 4), tile.w_tile_row + raw_tile0,
                        &raw_full[rs]);
      sm90::tma_load_2d(raw_stage(rs) + C::kRawTilesCta * kTileBytes, &scale_map, (kc0 + q) * (kTileScaleBytes / 4),
                        tile.w_tile_row + raw_tile0, &raw_full[rs]);
    };
    if (copier) {
      cuda::wait_for_previous_grid();
      for (int q = 0; q < min(ktiles, int{C::kRawStages}); ++q) load_raw(q);
    }
    for (int q = 0; q < ktiles; ++q) {
      if (copier && q >= 1 && q - 1 + C::kRawStages < ktiles) {  // refill stage q - 1's slot once every warp left it
        sm90::mbar_wait(&raw_empty[slot_of<C::kRawStages>(q - 1)], phase_of<C::kRawStages>(q - 1));
        load_raw(q - 1 + C::kRawStages);
      }
      const int rs = slot_of<C::kRawStages>(q);
      sm90::mbar_wait(&raw_full[rs], phase_of<C::kRawStages>(q));
      const uint8_t* raw = raw_stage(rs);
      uint4 codes_all[2][C::kTilesPerWarp];
      uint2 sw_all[2][C::kTilesPerWarp];
      auto load_codes = [&](int half) {
#pragma unroll
        for (int u = 0; u < C::kTilesPerWarp; ++u) {
          const int i = tw + u * C::kTransformWarps;
          codes_all[half][u] = reinterpret_cast<const uint4*>(raw + i * kTileBytes)[half * 32 + lane];
          sw_all[half][u] =
              reinterpret_cast<const uint2*>(raw + C::kRawTilesCta * kTileBytes + i * kTileScaleBytes + g * 16)[half];
        }
      };
      load_codes(0);  // both halves' codes at once: the second half's loads are in flight early
      load_codes(1);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int h = 2 * q + half, ds = slot_of<C::kDecStages>(h);
        const uint4* codes = codes_all[half];
        const uint2* sw = sw_all[half];
        if (h >= C::kDecStages) sm90::mbar_wait(&dec_empty[ds], phase_of<C::kDecStages>(h) ^ 1);
#pragma unroll
        for (int u = 0; u < C::kTilesPerWarp; ++u) {
          const int i = tw + u * C::kTransformWarps;
          const uint32_t w[4] = {codes[u].x, codes[u].y, codes[u].z, codes[u].w};
          const int bi = raw_tile0 + i;  // the tile's place among the 8: half bi / 4, row groups 2 (bi % 4) ..
          uint8_t* row_g =
              dec_stage(ds) + (bi / 4) * kDecHalfBytes + (t / 2) * kDecLbo + 2 * (bi % 4) * 128 + g * 16 + (t % 2) * 8;
#pragma unroll
          for (int f = 0; f < 4; ++f) {
            uint32_t a[4];
            mma::decode_fragment<T>(w[f], f < 2 ? sw[u].x : sw[u].y, half * 4 + f, a);
            uint8_t* p = row_g + 2 * f * kDecLbo;
            *reinterpret_cast<uint2*>(p) = make_uint2(a[0], a[2]);        // row g
            *reinterpret_cast<uint2*>(p + 128) = make_uint2(a[1], a[3]);  // row g + 8: the next row group
          }
        }
        sm90::fence_proxy_async();
        if (kPair) {
          // Every transform warp has stored its tile (named barrier 2; an
          // arrive-only barrier would let warps 1-3 run a step ahead and
          // count twice): warp 0 sends the half. The other CTA's warp 0
          // sends as many bytes here (the count may go below zero first).
          asm volatile("bar.sync 2, %0;" ::"n"(32 * C::kTransformWarps) : "memory");
        } else {
          __syncwarp();
        }
        if (lane == 0) {
          if (kPair && tw == 0) {
            sm90::mbar_arrive_expect_tx(&dec_full[ds], kDecHalfBytes);
            const uint8_t* src = dec_stage(ds) + rank * kDecHalfBytes;
            sm90::bulk_copy_s2peer(in_peer(src), src, kDecHalfBytes, in_peer(&dec_full[ds]));
          } else {
            sm90::mbar_arrive(&dec_full[ds]);
          }
          if (half == 1) sm90::mbar_arrive(&raw_empty[rs]);
        }
      }
    }
    cuda::allow_dependent_launch();
    if (splits > 1) {  // the MMA warps' two cluster barriers
      sm90::cluster_sync();
      sm90::cluster_sync();
    }
    if (kPair) sm90::cluster_sync();  // the MMA warps' one
  }

}

// The kernel's three tensor maps: x [rows, x_cols] (dtype; x_cols 0: K) in
// boxes of NT rows x 64 columns (128-byte swizzle, the wgmma B operand); the
// prepacked weight
// ([N rows, Kp / 2] codes, [N, Kp / 16] scales; N a multiple of 16, all
// experts of a stack) as [N / 16 tile rows, tiles of 1024 / 128 bytes] of
// 32-bit words, in boxes of raw_tiles tile rows x one tile (a raw stage:
// 8, pairs 4).
struct Maps {
  CUtensorMap x, code, scale;
};
inline cudaError_t make_maps(Maps& maps, const void* x, DType dtype, int64_t x_rows, int64_t k, int nt,
                             const uint8_t* weight, const uint8_t* scale, int64_t n, int raw_tiles = kRawTiles,
                             int64_t x_cols = 0) {
  const int64_t tiles_k = padded_k(k) / kTileK, row_tiles = n / kTileN;
  const CUtensorMapDataType x_type =
      dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (x_cols == 0) x_cols = k;
  cudaError_t err =
      cuda::make_tensor_map(&maps.x, x, x_type, x_rows, x_cols, x_cols * 2, nt, kStepK, CU_TENSOR_MAP_SWIZZLE_128B);
  if (err == cudaSuccess)
    err = cuda::make_tensor_map(&maps.code, weight, CU_TENSOR_MAP_DATA_TYPE_UINT32, row_tiles,
                                tiles_k * kTileBytes / 4, tiles_k * kTileBytes, raw_tiles, kTileBytes / 4,
                                CU_TENSOR_MAP_SWIZZLE_NONE);
  if (err == cudaSuccess)
    err = cuda::make_tensor_map(&maps.scale, scale, CU_TENSOR_MAP_DATA_TYPE_UINT32, row_tiles,
                                tiles_k * kTileScaleBytes / 4, tiles_k * kTileScaleBytes, raw_tiles,
                                kTileScaleBytes / 4, CU_TENSOR_MAP_SWIZZLE_NONE);
  return err;
}

// Launches gemm_kernel<T, NT, kPair, Problem> on grid (splits, w_blocks,
// tiles) (cluster of `splits`), or for pairs (splits 1; maps with 4 raw
// tiles) on grid (2, w_blocks, tiles / 2 rounded up) in clusters of 2, as a
// programmatic dependent launch.
template <typename T, int NT, bool kPair = false, typename Problem>
cudaError_t launch(const Maps& maps, const Problem& problem, int64_t k, int splits, int64_t w_blocks, int64_t tiles,
                   cudaStream_t stream) {
  using C = Config<NT, kPair>;
  auto kernel = gemm_kernel<T, NT, kPair, Problem>;
  cudaError_t err = cuda::allow_dynamic_smem(kernel, C::kSmemBytes);
  if (err != cudaSuccess) return err;
  if (kPair && splits != 1) return cudaErrorInvalidValue;
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int tiles_per_split = static_cast<int>(cuda::ceil_div(tiles_k, splits));
  const int cluster = kPair ? 2 : splits;
  const int64_t z = kPair ? cuda::ceil_div(tiles, 2) : tiles;
  return cuda::launch_dependent_clusters(
      kernel, dim3(static_cast<unsigned>(cluster), static_cast<unsigned>(w_blocks), static_cast<unsigned>(z)),
      dim3(static_cast<unsigned>(cluster), 1, 1), dim3(C::kThreads), C::kSmemBytes, stream, maps.x, maps.code,
      maps.scale, problem, k, tiles_per_split);
}

// How many clusters of `splits` CTAs of the NT kernel the device runs at
// once (one CTA per SM; cuda::resident_clusters).
template <int NT, typename Problem>
int64_t resident_clusters(int splits) {
  using C = Config<NT>;
  return cuda::resident_clusters(gemm_kernel<__nv_bfloat16, NT, false, Problem>, C::kThreads, C::kSmemBytes, splits);
}

}  // namespace lowbit::nvfp4::gemm::wgmma
