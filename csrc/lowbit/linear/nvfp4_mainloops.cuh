// The main loops of the NVFP4 W4A16 GEMMs on mma.sync and the wide CTA on
// wgmma (the Linear's forms in sm90_linear_*.cu, the MoE experts in
// nvfp4_moe.cu): the register-staged warp loop, the wide CTA with x in
// shared memory (mma.sync or wgmma), the streaming warps with a cp.async
// ring (also walking runs of k-tiles across W tiles, for stream-K) and the
// panel CTA; the W tile addressing of the prepacked layout
// (nvfp4_linear_layout.h) and the fixed-order sum of the warps' partial
// fragments. The FP4 decode they share is nvfp4_decode.cuh.
// Shared with the MoE as nvfp4_wgmma.cuh is, and kept in linear/ with it.
//
// CTA shape shared by both GEMMs: kWarps warps per 16-row tile of W; the
// warps take the tile's 128-column k-tiles in turn (warp w: w, w + kWarps,
// ...), each holding FP32 accumulators for 16 W rows x 8 MT rows of x.
// Each warp decodes its A fragments (nvfp4_decode.cuh) and issues
// mma.m16n8k16 with the weights as the 16-row operand and x as the 8-wide
// one ("swap AB").
#pragma once

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/sm90.cuh"
#include "lowbit/linear/nvfp4_decode.cuh"
#include "lowbit/linear/nvfp4_linear_layout.h"

namespace lowbit::nvfp4::gemm::mma {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// First k-tile of W tile row `tile_row` in the prepacked layout: its codes
// and its scales.
__device__ __forceinline__ const uint4* tile_row_codes(const uint8_t* weight, int64_t tile_row, int64_t tiles_k) {
  return reinterpret_cast<const uint4*>(weight) + tile_row * tiles_k * (kTileBytes / 16);
}
__device__ __forceinline__ const uint4* tile_row_scales(const uint8_t* scale, int64_t tile_row, int64_t tiles_k) {
  return reinterpret_cast<const uint4*>(scale) + tile_row * tiles_k * (kTileScaleBytes / 16);
}

// Starts moving k-tiles [kc_begin, kc_end) of a W tile row (codes and
// scales, from tile_row_codes / tile_row_scales) into L2 without waiting.
__device__ __forceinline__ void prefetch_ktiles_l2(const uint4* wtiles, const uint4* stiles, int64_t kc_begin,
                                                   int64_t kc_end) {
  if (kc_end <= kc_begin) return;
  sm90::prefetch_l2(wtiles + kc_begin * (kTileBytes / 16), uint32_t((kc_end - kc_begin) * kTileBytes));
  sm90::prefetch_l2(stiles + kc_begin * (kTileScaleBytes / 16), uint32_t((kc_end - kc_begin) * kTileScaleBytes));
}

// One 128-column tile's operands held by a lane.
template <int MT>
struct Stage {
  uint4 w[2];      // k-tiles 0..3, 4..7
  uint4 s;         // scales of rows g, g+8
  uint2 x[MT][8];  // activations of row (m-tile, g), 4 values per k-tile
};

// xrow[mt]: this lane's activation row (m-tile mt, row g; rows past the
// problem's end point at a valid row whose results the epilogue never
// stores) at column 4 t, computed once per kernel, so a full tile's 8
// activation loads need no address arithmetic or predicates. Only a partial
// last tile (K not a multiple of 128) checks columns. W and its scales are
// module state (non-coherent loads); x may be the previous grid's output, so
// its loads are coherent: see cuda::ReadOnly.
template <typename T, int MT>
__device__ __forceinline__ void load_stage(Stage<MT>& st, const uint4* __restrict__ wtile,
                                           const uint4* __restrict__ stile, const T* const (&xrow)[MT],
                                           int64_t k, int64_t col0, int lane) {
  st.w[0] = __ldg(wtile + lane);
  st.w[1] = __ldg(wtile + 32 + lane);
  st.s = __ldg(stile + lane / 4);
  if (col0 + kTileK <= k) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kt = 0; kt < 8; ++kt)
        st.x[mt][kt] = cuda::ld_coherent(reinterpret_cast<const uint2*>(xrow[mt] + col0 + kt * 16));
  } else {
    const int t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kt = 0; kt < 8; ++kt)
        st.x[mt][kt] = col0 + kt * 16 + t * 4 < k
                           ? cuda::ld_coherent(reinterpret_cast<const uint2*>(xrow[mt] + col0 + kt * 16))
                           : make_uint2(0, 0);
  }
}

// One 128-column tile, shared by the mma.sync main loops: this lane's A
// fragments of k-tiles kt, kt + 1 decoded from code words w[kt], w[kt + 1]
// and scale word s[kt / 2] (kDecodePairs; one at a time otherwise, 4 fewer
// registers), then one mma per k-tile and m-tile with the B fragment
// b_of(mt, kt) (a uint2 of x).
template <typename T, int MT, bool kDecodePairs = true, typename BOf>
__device__ __forceinline__ void mma_tile(const uint32_t* w, const uint32_t* s, BOf&& b_of, float (&acc)[MT][4]) {
#pragma unroll
  for (int kt = 0; kt < 8; kt += 2) {
    uint32_t a[2][4];
    if constexpr (kDecodePairs) {
      decode_fragment_pair<T>(w[kt], w[kt + 1], s[kt / 2], a);
    } else {
      decode_fragment<T>(w[kt], s[kt / 2], kt, a[0]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if constexpr (!kDecodePairs) {
        if (i == 1) decode_fragment<T>(w[kt + 1], s[kt / 2], kt + 1, a[1]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint2 b = b_of(mt, kt + i);
        Mma<T>::mma(acc[mt], a[i], b.x, b.y);
      }
    }
  }
}

template <typename T, int MT>
__device__ __forceinline__ void compute_stage(const Stage<MT>& st, float (&acc)[MT][4]) {
  mma_tile<T, MT>(reinterpret_cast<const uint32_t*>(st.w), reinterpret_cast<const uint32_t*>(&st.s),
                  [&](int mt, int kt) { return st.x[mt][kt]; }, acc);
}

// Register stages in flight per warp: three (two tiles loading while one is
// decoded) for one m-tile; two for more, where three would cost occupancy
// (177 registers at MT = 2, measured slower at M = 16).
template <int MT> constexpr int kStages = MT == 1 ? 3 : 2;
// CTAs per SM the kernels are compiled for (register budget).
template <int MT> constexpr int kMinBlocks = MT <= 2 ? 2 : 1;

// One warp's share of a 16-row W tile: k-tiles kc_begin + warp, + kW, ...
// (kW warps share the tile)
// below kc_end, accumulated into acc (16 W rows x 8 MT x rows, mma C layout).
// wtiles / stiles point at the tile row's first k-tile.
template <typename T, int MT, int kW = kWarps>
__device__ __forceinline__ void warp_mainloop(float (&acc)[MT][4], const uint4* __restrict__ wtiles,
                                              const uint4* __restrict__ stiles, const T* const (&xrow)[MT],
                                              int64_t k, int64_t kc_begin, int64_t kc_end, int warp, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
  auto load = [&](Stage<MT>& st, int64_t kc) {
    if (kc < kc_end)
      load_stage<T, MT>(st, wtiles + kc * (kTileBytes / 16), stiles + kc * (kTileScaleBytes / 16), xrow, k,
                        kc * kTileK, lane);
  };
  const int64_t kc0 = kc_begin + warp;
  if constexpr (kStages<MT> == 3) {
    Stage<MT> s0, s1, s2;
    load(s0, kc0);
    load(s1, kc0 + kW);
    for (int64_t kc = kc0; kc < kc_end; kc += 3 * kW) {
      load(s2, kc + 2 * kW);
      compute_stage<T, MT>(s0, acc);
      if (kc + kW >= kc_end) break;
      load(s0, kc + 3 * kW);
      compute_stage<T, MT>(s1, acc);
      if (kc + 2 * kW >= kc_end) break;
      load(s1, kc + 4 * kW);
      compute_stage<T, MT>(s2, acc);
    }
  } else {
    Stage<MT> cur, nxt;
    load(cur, kc0);
    for (int64_t kc = kc0; kc < kc_end; kc += kW) {
      load(nxt, kc + kW);
      compute_stage<T, MT>(cur, acc);
      cur = nxt;
    }
  }
}

// The warps' fragments, summed in a fixed order (deterministic).
template <int MT, int kW = kWarps>
struct CtaPartials {
  float v[kW][MT][4][32];

  // Every warp stores its fragments; the caller synchronizes before sum().
  __device__ __forceinline__ void store(const float (&acc)[MT][4], int warp, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[warp][mt][i][lane] = acc[mt][i];
  }
  // Sum over warps at W row r (0..15) and x row mc (0 .. 8 MT - 1) of the CTA.
  __device__ __forceinline__ float sum(int r, int mc) const {
    const int mt = mc / 8, col = mc % 8;
    const int src_lane = (r % 8) * 4 + col / 2, reg = (r / 8) * 2 + (col % 2);
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) s += v[w][mt][reg][src_lane];
    return s;
  }
};


// ---- wide CTA (many rows of x) ---------------------------------------------
// 8 warps over 8 consecutive 16-row W tiles (128 rows of W), all sharing the
// activations of 8 MT rows of x: each 128-column k-tile of x is staged once
// per CTA in shared memory and read by all 8 warps, so x is read once per
// 128 W rows instead of once per 16. Each warp stages its own W tile beside
// it. A ring of kWideStages<MT> k-tiles is filled with cp.async (all but one
// in flight while one is computed, one CTA barrier per k-tile); x rows are
// padded by 32 bytes so the 8-byte fragment reads of a half-warp hit
// distinct banks. Every warp sums the whole K range itself: no cross-warp
// reduction.

constexpr int kWideRowElems = kTileK + 16;  // padded row: 72 words, lanes g / g+1 8 banks apart
// Ring depth in k-tiles: 4 for 16 rows of x, whose stages are small (three
// 55 KB CTAs per SM), 3 above (docs/perf/log/linear.md, Linear v10).
template <int MT> constexpr int kWideStages = MT == 2 ? 4 : 3;
constexpr int kTileChunks = (kTileBytes + kTileScaleBytes) / 16;  // 72: codes, then scales

template <typename T, int MT>
struct WideSmem {
  static_assert(MT % 2 == 0, "each thread stages MT / 2 16-byte chunks of x per k-tile");
  T x[kWideStages<MT>][8 * MT][kWideRowElems];
  uint4 w[kWideStages<MT>][kWarps][kTileChunks];
};

// xsrc[j]: this thread's staged row j (x row threadIdx.x / 16 + 16 j of the
// CTA, clamped to a valid row by the caller) at column 8 (threadIdx.x % 16).
// wtiles / stiles: this warp's W tile row (ignored when !warp_active, for
// warps past N). Sums k-tiles [kc_begin, kc_end). Columns >= k are staged as
// zeros (the weight's padding codes are zero, and 0 * stale data could be
// NaN). sm: dynamic shared memory of sizeof(WideSmem<T, MT>) bytes.
template <typename T, int MT>
__device__ __forceinline__ void wide_mainloop(float (&acc)[MT][4], WideSmem<T, MT>& sm,
                                              const T* const (&xsrc)[MT / 2], const uint4* __restrict__ wtiles,
                                              const uint4* __restrict__ stiles, bool warp_active, int64_t k,
                                              int64_t kc_begin, int64_t kc_end) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int chunk = threadIdx.x % 16, row0 = threadIdx.x / 16;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
  // One commit group per k-tile (empty past the end), so wait_group counts
  // stay uniform. Ring slot of k-tile kc: (kc - kc_begin) % kWideStages<MT>.
  auto stage = [&](int64_t kc) {
    if (kc < kc_end) {
      const int buf = static_cast<int>((kc - kc_begin) % kWideStages<MT>);
      const bool valid = kc * kTileK + chunk * 8 < k;  // xsrc already points at column 8 chunk
#pragma unroll
      for (int j = 0; j < MT / 2; ++j)
        sm90::cp_async16(&sm.x[buf][row0 + 16 * j][chunk * 8], xsrc[j] + (valid ? kc * kTileK : 0), valid);
      if (warp_active) {
        const uint4* wp = wtiles + kc * (kTileBytes / 16);
        sm90::cp_async16(&sm.w[buf][warp][lane], wp + lane, true);
        sm90::cp_async16(&sm.w[buf][warp][32 + lane], wp + 32 + lane, true);
        if (lane < kTileScaleBytes / 16)
          sm90::cp_async16(&sm.w[buf][warp][64 + lane], stiles + kc * (kTileScaleBytes / 16) + lane, true);
      }
    }
    sm90::cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kWideStages<MT> - 1; ++i) stage(kc_begin + i);
  for (int64_t kc = kc_begin; kc < kc_end; ++kc) {
    const int buf = static_cast<int>((kc - kc_begin) % kWideStages<MT>);
    sm90::cp_async_wait<kWideStages<MT> - 2>();  // this thread's copies of tile kc have landed
    __syncthreads();                        // everyone's have; and tile kc - 1's buffer is free
    stage(kc + kWideStages<MT> - 1);
    if (!warp_active) continue;
    const uint4 w0 = sm.w[buf][warp][lane], w1 = sm.w[buf][warp][32 + lane];
    const uint4 sc = sm.w[buf][warp][64 + lane / 4];
    const uint32_t w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    const uint32_t s[4] = {sc.x, sc.y, sc.z, sc.w};
    mma_tile<T, MT>(
        w, s, [&](int mt, int kt) { return *reinterpret_cast<const uint2*>(&sm.x[buf][mt * 8 + g][kt * 16 + t * 4]); },
        acc);
  }
}


// ---- wide CTA on warpgroup MMAs ----------------------------------------------
// The wide CTA's shape (8 warps over 128 W rows, 8 MT rows of x per k-tile,
// a ring of kWideStages<MT> k-tiles) with wgmma instead of mma.sync: each
// warpgroup issues wgmma.m64n(8 MT)k16 with its 4 warps' decoded A
// fragments in registers (the fragments the mma.sync loop builds; the
// accumulators come out in the same layout) and x as the shared-memory
// operand, read by the tensor cores once per 64 W rows. The MMAs of one half
// k-tile run while the warp decodes the next.
// The prepacked layout permutes K inside each 16-column block (lane t's A
// registers hold columns 4t..4t+3 as the MMA's k 2t, 2t+1, 2t+8, 2t+9), so x
// must reach shared memory in the MMA's order: word w (columns 2w, 2w+1) of
// a block at the block's k-group w & 1, word w / 2. A pass before the GEMM
// (the x image: gemm's wide_x_image_kernel) writes x in exactly the stage
// layout, so one bulk copy per k-tile stages it and the warps spend no
// instructions on x. Stage layout: K-major core matrices (8 rows x 8
// columns, 128 bytes) of row group p and k-group c at c * kLbo + p * 128.
template <int MT>
struct WideWgmmaX {
  static constexpr int kLbo = 128 * MT;
  static constexpr int kStageBytes = (kTileK / 8) * kLbo;  // 16 k-groups
};

// The ring is kWideStages<MT> deep, as the mma.sync loop's. (Two x stages
// beside three or four W stages, for three CTAs per SM at MT = 8, measured
// slower: ptxas then serializes the MMAs for registers.)
template <typename T, int MT>
struct WideWgmmaSmem {
  alignas(128) uint8_t x[kWideStages<MT>][WideWgmmaX<MT>::kStageBytes];
  uint4 w[kWideStages<MT>][kWarps][kTileChunks];
  uint64_t x_full[kWideStages<MT>];  // a slot's x bytes have landed
};

// image: the x image of the CTA's row block at k-tile 0 (kStageBytes per
// k-tile), written by the previous grid in the stream (this loop waits for
// it after starting the first W copies). wtiles / stiles: this warp's W tile
// row; every warp needs one, since all of a warpgroup's warps take part in
// its MMAs (the caller points warps past N at any row and does not store
// their output). Otherwise as wide_mainloop.
template <typename T, int MT>
__device__ __forceinline__ void wide_wgmma_mainloop(float (&acc)[MT][4], WideWgmmaSmem<T, MT>& sm,
                                                    const uint8_t* __restrict__ image,
                                                    const uint4* __restrict__ wtiles,
                                                    const uint4* __restrict__ stiles, int64_t kc_begin,
                                                    int64_t kc_end) {
  using X = WideWgmmaX<MT>;
  constexpr int S = kWideStages<MT>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float(&d)[4 * MT] = reinterpret_cast<float(&)[4 * MT]>(acc);
#pragma unroll
  for (int i = 0; i < 4 * MT; ++i) d[i] = 0.f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < S; ++i) sm90::mbar_init(&sm.x_full[i], 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const uint32_t x0 = sm90::smem_addr(&sm.x[0][0]);
  // One cp.async group per k-tile for this warp's W tile (empty past the
  // end), so wait_group counts stay uniform. Called for consecutive k-tiles
  // from kc_begin: the sources advance one tile per call.
  const uint4* wsrc = wtiles + kc_begin * (kTileBytes / 16) + lane;
  const uint4* ssrc = stiles + kc_begin * (kTileScaleBytes / 16) + lane % (kTileScaleBytes / 16);
  auto stage_w = [&](int64_t kc, int slot) {
    if (kc < kc_end) {
      sm90::cp_async16(&sm.w[slot][warp][lane], wsrc, true);
      sm90::cp_async16(&sm.w[slot][warp][32 + lane], wsrc + 32, true);
      if (lane < kTileScaleBytes / 16) sm90::cp_async16(&sm.w[slot][warp][64 + lane], ssrc, true);
    }
    sm90::cp_async_commit();
    wsrc += kTileBytes / 16;
    ssrc += kTileScaleBytes / 16;
  };
  auto stage_x = [&](int64_t kc, int slot) {  // thread 0
    if (kc < kc_end) {
      sm90::mbar_arrive_expect_tx(&sm.x_full[slot], X::kStageBytes);
      sm90::bulk_copy_g2s(&sm.x[slot][0], image + kc * X::kStageBytes, X::kStageBytes, &sm.x_full[slot]);
    }
  };
  // A fragments of k-steps 4 half .. 4 half + 3 of the W tile in the slot.
  auto decode_half = [&](int slot, int half, uint32_t(&a)[4][4]) {
    const uint4 wq = sm.w[slot][warp][32 * half + lane];
    const uint4 sc = sm.w[slot][warp][64 + lane / 4];
    const uint32_t w[4] = {wq.x, wq.y, wq.z, wq.w};
    decode_fragment_pair<T>(w[0], w[1], half ? sc.z : sc.x, reinterpret_cast<uint32_t(&)[2][4]>(a[0]));
    decode_fragment_pair<T>(w[2], w[3], half ? sc.w : sc.y, reinterpret_cast<uint32_t(&)[2][4]>(a[2]));
  };
  // Descriptors differ only in the start address (bits 0..13, in 16-byte
  // units, no carry: shared memory is below 256 KB): one add per MMA.
  const uint64_t desc0 = sm90::desc_k_major_interleave(x0, X::kLbo, 128);
  auto issue_half = [&](int slot, int half, const uint32_t(&a)[4][4]) {
    const uint64_t desc = desc0 + static_cast<uint32_t>(slot * (X::kStageBytes / 16));
    sm90::wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) sm90::WgmmaRs<T, 8 * MT>::run(d, a[j], desc + 2 * (4 * half + j) * (X::kLbo / 16));
    sm90::wgmma_commit();
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) stage_w(kc_begin + i, i);
  cuda::wait_for_previous_grid();  // the x image
  if (threadIdx.x == 0)
#pragma unroll
    for (int i = 0; i < S - 1; ++i) stage_x(kc_begin + i, i);
  uint32_t a0[4][4], a1[4][4];
  int slot = 0, fill = S - 1;  // slots of k-tiles kc and kc + S - 1
  uint32_t parity = 0;         // of slot's x barrier phase for k-tile kc
  for (int64_t kc = kc_begin; kc < kc_end; ++kc) {
    sm90::cp_async_wait<S - 2>();  // this thread's W copies of tile kc have landed
    __syncwarp();            // and every lane's of the warp
    sm90::wgmma_wait<1>();   // the previous tile's first half is done with a0
    decode_half(slot, 0, a0);
    sm90::wgmma_wait<0>();  // and its second half with a1 and its x
    sm90::mbar_wait(&sm.x_full[slot], parity);
    __syncthreads();  // no MMA of the CTA reads tile kc - 1's slot any more
    stage_w(kc + S - 1, fill);
    if (threadIdx.x == 0) stage_x(kc + S - 1, fill);
    issue_half(slot, 0, a0);
    decode_half(slot, 1, a1);
    issue_half(slot, 1, a1);
    fill = slot;
    if (++slot == S) {
      slot = 0;
      parity ^= 1u;
    }
  }
  sm90::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 4 * MT; ++i) sm90::fence_operand(d[i]);
  sm90::cp_async_wait<0>();
}

// ---- streaming warps (at most 8 rows of x) -----------------------------------
// The narrow kernels' main loop for 1-8 rows of x: each warp streams its
// k-tiles (codes, scales and the x rows of the same 128 columns) through a
// ring of kStreamStages slots of its own in shared memory, filled with
// cp.async. Nothing waits in registers, so a warp needs ~60 registers
// instead of ~120 and an SM holds twice the warps, and the copies carry no
// register dependences (docs/perf/log/linear.md, Linear v9). x rows are copied in
// pairs (lanes 0-15 and 16-31), a slot holding an even number of them, each
// padded to 288 bytes so the 8-byte fragment reads of a half-warp (4 rows)
// hit distinct banks.
//
// A warp may take two W tiles (kTiles, the stream kernel at 5..16 rows):
// each stage then holds both tiles' k-tile and one copy of x, whose
// fragments feed both tiles' MMAs, so x costs half the shared memory and
// the L2 reads per W byte, and a warp keeps twice the W bytes in flight
// (docs/perf/log/linear.md, Linear v23). Above 8 rows, x is two m-tiles (MT = 2).
// A ring has kStreamStages slots, or 2 where the plan gives each warp a
// short run of k-tiles (kStages; Linear v25).
constexpr int kStreamStages = 3;
constexpr int kStreamMaxRows = 8;       // one W tile per warp
constexpr int kStreamTilesMaxRows = 16;  // two W tiles per warp
constexpr int kStreamRowBytes = (kTileK + 16) * 2;  // a padded x row of a k-tile
constexpr int kStreamWBytes = kTileBytes + kTileScaleBytes;  // a W k-tile in a stage: codes, then scales
// 8-row m-tiles of x for a build of kPairs row pairs.
template <int kPairs> constexpr int kStreamMtiles = kPairs > 4 ? 2 : 1;
LOWBIT_HD constexpr int stream_stage_bytes(int rows, int tiles = 1) {
  return tiles * kStreamWBytes + (rows + 1) / 2 * 2 * kStreamRowBytes;
}
// One W k-tile into the stage at shared address st: the 1 KB of codes from
// wsrc (this lane's 16 bytes at lane * 16 and 512 + lane * 16), then the
// 128 bytes of scales from ssrc (lanes 0..7), past L1 (read once).
__device__ __forceinline__ void copy_w_ktile(uint32_t st, const char* wsrc, const char* ssrc, int lane) {
  sm90::cp_async16_cg(st + lane * 16, wsrc, 16);
  sm90::cp_async16_cg(st + 512 + lane * 16, wsrc + 512, 16);
  if (lane < kTileScaleBytes / 16) sm90::cp_async16_cg(st + kTileBytes + lane * 16, ssrc, 16);
}
// Shared memory of one streaming warp's ring of `stages` slots for `rows`
// rows of x and `tiles` W tiles.
LOWBIT_HD constexpr int stream_warp_bytes(int rows, int tiles = 1, int stages = kStreamStages) {
  return stages * stream_stage_bytes(rows, tiles);
}

// The x copies of one k-tile into the stage at shared address st: pair j
// from xp[j] (bytes: 16, or 0 to zero-fill columns past K); pairs up to
// kPairs / 2 always, the rest while below `pairs` (stream_mainloop).
template <typename T, int kPairs>
__device__ __forceinline__ void copy_x_ktile(uint32_t st, const T* const (&xp)[kPairs], uint32_t bytes, int pairs) {
#pragma unroll
  for (int j = 0; j < kPairs; ++j)
    if (j <= kPairs / 2 || j < pairs) sm90::cp_async16_ca(st + j * 2 * kStreamRowBytes, xp[j], bytes);
}
// The MMAs of the k-tile in the stage at st (generic address); xoff: this
// lane's x fragment in a stage (m-tile 0; xoff_hi: m-tile 1). acc: kTiles
// W tiles' MT m-tiles, tile j's at acc[j MT ...]. The __syncwarp between
// the shared-memory reads and the math lets the caller refill the stage
// next.
template <typename T, bool kDecodePairs, int kTiles = 1, int MT = 1>
__device__ __forceinline__ void stream_ktile_mma(const char* st, int xoff, int lane, float (&acc)[kTiles * MT][4],
                                                 int xoff_hi = 0) {
  uint4 w0[kTiles], w1[kTiles], sc[kTiles];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const uint4* tile = reinterpret_cast<const uint4*>(st + j * kStreamWBytes);
    w0[j] = tile[lane];
    w1[j] = tile[32 + lane];
    sc[j] = tile[kTileBytes / 16 + lane / 4];
  }
  uint2 xv[MT][8];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) xv[mt][kt] = *reinterpret_cast<const uint2*>(st + (mt ? xoff_hi : xoff) + kt * 32);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const uint32_t w[8] = {w0[j].x, w0[j].y, w0[j].z, w0[j].w, w1[j].x, w1[j].y, w1[j].z, w1[j].w};
    const uint32_t s[4] = {sc[j].x, sc[j].y, sc[j].z, sc[j].w};
    mma_tile<T, MT, kDecodePairs>(w, s, [&](int mt, int kt) { return xv[mt][kt]; },
                                  *reinterpret_cast<float(*)[MT][4]>(&acc[j * MT]));
  }
}

// kPairs: the most row pairs the caller's x may have (rows <= 2 kPairs;
// fewer pointers to carry and copies to issue when the caller knows x is
// short); pairs up to kPairs / 2 are always copied (a caller with fewer
// rows builds a smaller kPairs). kDecodePairs: mma_tile's paired decode
// (fits the 64 registers at every kPairs: Linear v20 in docs/perf/log/linear.md).
// xsrc[j]: x row lane / 16 + 2 j of the warp's rows at column 8 (lane % 16),
// or a valid row where that row is past `rows`: its copy is never read (the
// fragment reads below take row min(g, rows - 1)), so it needs no predicate.
// Index: the type of the loop's k-tile and column counters; int32_t needs
// padded K + 32 k-tiles below 2^31 (the Linear's kernel: Linear v19).
// ring: this warp's stream_warp_bytes(rows, kTiles, kStages) bytes (16-byte
// aligned), kStages - 1 k-tiles' copies in flight while one is computed.
// Sums k-tiles kc_begin + warp, + kW, ... below kc_end into acc (per W
// tile, MT m-tiles of 16 W rows x 8 rows of x, mma C layout; rows past
// `rows` repeat the last one). kTiles: W tiles per warp, tile j at
// wtiles / stiles + j tile_step k-tiles (tile_step 0: the caller's stand-in
// for a tile past N, whose sums it drops).
// Columns >= k are copied as zeros (the weight's padding codes are zero, and
// 0 * stale data could be NaN). W bypasses L1 (read once); x goes through it
// (every warp of the SM reads the same columns of x). Every address a copy
// needs is kept running (one add per k-tile), so a k-tile costs the decode
// and the mma and little else.
template <typename T, int kW, int kPairs = kStreamMaxRows / 2, bool kDecodePairs = false, typename Index = int64_t,
          int kTiles = 1, int MT = kStreamMtiles<kPairs>, int kStages = kStreamStages>
__device__ __forceinline__ void stream_mainloop(float (&acc)[kTiles * MT][4], uint4* ring, int rows,
                                                const T* const (&xsrc)[kPairs],
                                                const uint4* __restrict__ wtiles, const uint4* __restrict__ stiles,
                                                int64_t k, int64_t kc_begin, int64_t kc_end, int warp, int lane,
                                                int64_t tile_step = 0) {
#pragma unroll
  for (int a = 0; a < kTiles * MT; ++a)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[a][i] = 0.f;
  const int pairs = (rows + 1) / 2;  // warp-uniform
  const uint32_t stage_bytes = stream_stage_bytes(rows, kTiles);
  const uint32_t ring0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t dst_x = kTiles * kStreamWBytes + (lane / 16) * kStreamRowBytes + (lane % 16) * 16;
  // Bytes from one of the warp's W tiles to the next: codes, scales.
  const int64_t wstep = tile_step * kTileBytes, sstep = tile_step * kTileScaleBytes;
  // The copy sources of k-tile kc_issue, advanced by kW k-tiles per issue.
  const Index kc_first = static_cast<Index>(kc_begin) + warp, kc_stop = static_cast<Index>(kc_end);
  const Index k_cols = static_cast<Index>(k);
  Index kc_issue = kc_first;
  const char* wsrc = reinterpret_cast<const char*>(wtiles + kc_issue * (kTileBytes / 16) + lane);
  const char* ssrc = reinterpret_cast<const char*>(stiles + kc_issue * (kTileScaleBytes / 16) + lane % 8);
  const T* xp[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) xp[j] = xsrc[j] + kc_issue * kTileK;
  Index col = kc_issue * kTileK + (lane % 16) * 8;  // this lane's first x column at kc_issue
  uint32_t slot_issue = 0;
  // One commit group per k-tile (empty past the end), so wait_group counts
  // stay uniform.
  auto issue = [&]() {
    if (kc_issue < kc_stop) {
      const uint32_t st = ring0 + slot_issue * stage_bytes;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) copy_w_ktile(st + j * kStreamWBytes, wsrc + j * wstep, ssrc + j * sstep, lane);
      copy_x_ktile<T, kPairs>(st + dst_x, xp, col < k_cols ? 16 : 0, pairs);
    }
    sm90::cp_async_commit();
    kc_issue += kW;
    wsrc += kW * kTileBytes;
    ssrc += kW * kTileScaleBytes;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) xp[j] += kW * kTileK;
    col += kW * kTileK;
    slot_issue = slot_issue + 1 == kStages ? 0 : slot_issue + 1;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue();
  const int g = lane / 4, t = lane % 4;
  // This lane's x fragments in a slot (bytes): m-tile 0, m-tile 1.
  const int xoff = kTiles * kStreamWBytes + min(g, rows - 1) * kStreamRowBytes + t * 8;
  const int xoff_hi = kTiles * kStreamWBytes + min(g + 8, rows - 1) * kStreamRowBytes + t * 8;
  int slot = 0;
  for (Index kc = kc_first; kc < kc_stop; kc += kW) {
    // Refill the slot the previous iteration read (every lane is past it:
    // the __syncwarp below ordered its reads before this point).
    issue();
    sm90::cp_async_wait<kStages - 1>();  // this lane's copies of k-tile kc have landed
    __syncwarp();                  // and every lane's
    stream_ktile_mma<T, kDecodePairs, kTiles, MT>(reinterpret_cast<const char*>(ring) + slot * stage_bytes, xoff, lane,
                                                  acc, xoff_hi);
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  sm90::cp_async_wait<0>();  // no copy outlives the loop (the ring may be reused)
}

// stream_mainloop over a run of units that crosses W tile rows, walked
// downwards, for the stream-K kernel: unit u is the W k-tile at wtiles + u
// (codes) and stiles + u (scales) -- a row's k-tiles lie one after
// another, and rows follow each other -- with x's columns of k-tile
// u mod tiles_k. The warp takes units top, top - kW, ... down to bottom,
// its copies running kStreamStages - 1 units ahead of its MMAs across
// calls of run(), so the caller can stop at a tile row's start, add the
// row up, and go on without draining the ring. Counters are 32-bit (units
// + 32 k-tiles below 2^31) and kW <= tiles_k (one addition wraps x's
// columns); the rest as stream_mainloop, whose k-tile steps it shares
// (copy_w_ktile, copy_x_ktile, stream_ktile_mma). A loop of its own: made
// an instance of this class, stream_mainloop's 4-pair loop took 3 more
// SASS instructions per k-tile and spilled at 64 registers.
template <typename T, int kW, int kPairs>
class StreamRunWarp {
 public:
  // Issues the first kStreamStages - 1 units' copies. top_kc: top mod
  // tiles_k. lane: the caller's, passed to every call rather than kept (one
  // register fewer).
  __device__ __forceinline__ StreamRunWarp(uint4* ring, int rows, const T* const (&xsrc)[kPairs],
                                           const uint4* __restrict__ wtiles, const uint4* __restrict__ stiles,
                                           int64_t k, int32_t tiles_k, int32_t top, int32_t top_kc, int32_t bottom,
                                           int lane)
      : ring_(reinterpret_cast<const char*>(ring)),
        ring0_(static_cast<uint32_t>(__cvta_generic_to_shared(ring))),
        stage_bytes_(stream_stage_bytes(rows)),
        dst_x_(kStreamWBytes + (lane / 16) * kStreamRowBytes + (lane % 16) * 16),
        rows_(rows),
        pairs_((rows + 1) / 2),
        tiles_k_(tiles_k),
        bottom_(bottom),
        // Only the last k-tile of a row may hold columns >= k.
        kc_in_k_(int64_t{tiles_k - 1} * kTileK + (lane % 16) * 8 < k ? tiles_k : tiles_k - 1),
        next_(top),
        kc_x_(top_kc),
        wsrc_(reinterpret_cast<const char*>(wtiles + int64_t{top} * (kTileBytes / 16) + lane)),
        ssrc_(reinterpret_cast<const char*>(stiles + int64_t{top} * (kTileScaleBytes / 16) + lane % 8)) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) xp_[j] = xsrc[j] + int64_t{kc_x_} * kTileK;
#pragma unroll
    for (int i = 0; i < kStreamStages - 1; ++i) issue(next_ - i * kW, lane);
  }

  // Adds this warp's units down to `end` (>= bottom) into acc (16 W rows x
  // 8 rows of x, mma C layout; rows past `rows` repeat the last one).
  __device__ __forceinline__ void run(float (&acc)[1][4], int32_t end, int lane) {
    const int xoff = kStreamWBytes + min(lane / 4, rows_ - 1) * kStreamRowBytes + (lane % 4) * 8;
    for (; next_ >= end; next_ -= kW) {
      // Into the slot the previous unit read (__syncwarp'ed past).
      issue(next_ - (kStreamStages - 1) * kW, lane);
      sm90::cp_async_wait<kStreamStages - 1>();  // this lane's copies of the unit have landed
      __syncwarp();                        // and every lane's
      stream_ktile_mma<T, true>(ring_ + slot_ * stage_bytes_, xoff, lane, acc);
      slot_ = slot_ + 1 == kStreamStages ? 0 : slot_ + 1;
    }
  }

  // No copy outlives the warp's run (the ring may be reused).
  __device__ __forceinline__ void finish() { sm90::cp_async_wait<0>(); }

 private:
  // Unit u's copies (none below bottom; u is kW under the last call's), one
  // commit group per unit (empty past the end), so wait_group counts stay
  // uniform.
  __device__ __forceinline__ void issue(int32_t u, int lane) {
    if (u >= bottom_) {
      const uint32_t st = ring0_ + slot_issue_ * stage_bytes_;
      copy_w_ktile(st, wsrc_, ssrc_, lane);
      copy_x_ktile<T, kPairs>(st + dst_x_, xp_, kc_x_ < kc_in_k_ ? 16 : 0, pairs_);
    }
    sm90::cp_async_commit();
    wsrc_ -= kW * kTileBytes;
    ssrc_ -= kW * kTileScaleBytes;
    kc_x_ -= kW;
    int32_t x_step = -kW * kTileK;
    if (kc_x_ < 0) {  // the previous W tile row: x from its last columns again
      kc_x_ += tiles_k_;
      x_step += tiles_k_ * kTileK;
    }
#pragma unroll
    for (int j = 0; j < kPairs; ++j) xp_[j] += x_step;
    slot_issue_ = slot_issue_ + 1 == kStreamStages ? 0 : slot_issue_ + 1;
  }

  const char* const ring_;
  const uint32_t ring0_, stage_bytes_, dst_x_;  // dst_x_: this lane's x copy in a stage
  const int rows_, pairs_;
  const int32_t tiles_k_, bottom_;
  const int32_t kc_in_k_;  // x's k-tiles whose columns of this lane are below k
  int32_t next_;           // the next unit to add
  int32_t kc_x_;           // x's k-tile of the next unit to copy
  const char* wsrc_;
  const char* ssrc_;
  const T* xp_[kPairs];
  uint32_t slot_issue_ = 0;
  int slot_ = 0;
};

// ---- panel: streaming warps over a chunk of x held in shared memory -----------
// For 12..16 rows of x (linear_plan), where the narrow kernel reads x again
// for every 16-row W tile (on 8192 x 4096, 67 MB through L2 beside 19 MB of
// W: docs/perf/log/linear.md, Linear v13) and the wide kernel's CTA-wide ring waits on
// its slowest warp every k-tile. A panel CTA: kPanelWarps warps on as many
// consecutive W tiles, all over one chunk of K. The chunk's x rows arrive
// in shared memory at the start, one tensor copy per k-tile counted on a
// barrier of its own; every warp streams its own W tile through a private
// cp.async ring, as stream_mainloop does, and reads x where it lies: no CTA
// barrier in the loop, and x crosses L2 once per 128 W rows and chunk.
constexpr int kPanelWarps = 8;
constexpr int kPanelStages = 4;
constexpr int kPanelStageBytes = kStreamWBytes;  // a W k-tile: codes, then scales
constexpr int kPanelMaxChunk = 16;                              // k-tiles of x a CTA holds
// x of a k-tile as its tensor copy leaves it: 8 MT rows of kStreamRowBytes
// (the k-tile's 128 columns and the next 16, which nothing reads: padded
// rows, so the 8-byte fragment reads of a half-warp hit distinct banks).
constexpr int kPanelXBoxCols = kStreamRowBytes / 2;
// Shared memory: the chunk's x (k-tile j at j * 8 MT * kStreamRowBytes),
// one W ring per warp, a barrier per k-tile of x.
LOWBIT_HD constexpr int panel_x_bytes(int mt, int64_t ktiles) {
  return static_cast<int>(ktiles) * 8 * mt * kStreamRowBytes;
}
LOWBIT_HD constexpr int panel_smem_bytes(int mt, int64_t ktiles) {
  return panel_x_bytes(mt, ktiles) + kPanelWarps * kPanelStages * kPanelStageBytes + 8 * kPanelMaxChunk;
}

// smem: panel_smem_bytes(MT, kc_end - kc_begin) bytes, 128-byte aligned;
// kc_end - kc_begin <= kPanelMaxChunk. x_map: x [M, K] in boxes of 8 MT
// rows x kPanelXBoxCols columns, zeros past M and K (the weight's padding
// codes are zero, and 0 * stale data could be NaN); the CTA's rows start at
// m0. wtiles / stiles: this warp's W tile row (ignored when !active: warps
// past N leave at once). Every thread of the CTA must call it (one CTA
// barrier: the x barriers' initialization). acc: 16 W rows x 8 MT rows of
// x, mma C layout.
template <typename T, int MT>
__device__ __forceinline__ void panel_mainloop(float (&acc)[MT][4], uint8_t* smem, const void* x_map,
                                               int64_t m0, const uint4* __restrict__ wtiles,
                                               const uint4* __restrict__ stiles, bool active, int64_t kc_begin,
                                               int64_t kc_end) {
  constexpr int kRows = 8 * MT;
  constexpr int S = kPanelStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
  const int ktiles = static_cast<int>(kc_end - kc_begin);
  const uint32_t xs = sm90::smem_addr(smem);
  uint64_t* x_full = reinterpret_cast<uint64_t*>(smem + panel_x_bytes(MT, ktiles) +
                                                 kPanelWarps * kPanelStages * kPanelStageBytes);
  if (threadIdx.x == 0) {
    for (int j = 0; j < ktiles; ++j) sm90::mbar_init(&x_full[j], 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int j = 0; j < ktiles; ++j) {
      sm90::mbar_arrive_expect_tx(&x_full[j], kRows * kStreamRowBytes);
      sm90::tma_load_2d(smem + j * kRows * kStreamRowBytes, x_map, static_cast<int32_t>((kc_begin + j) * kTileK),
                        static_cast<int32_t>(m0), &x_full[j]);
    }
  if (!active) return;
  // This warp's W ring: one commit group per k-tile (empty past the end),
  // so wait_group counts stay uniform.
  const uint32_t ring0 = xs + panel_x_bytes(MT, ktiles) + warp * (S * kPanelStageBytes);
  const char* wsrc = reinterpret_cast<const char*>(wtiles + kc_begin * (kTileBytes / 16) + lane);
  const char* ssrc = reinterpret_cast<const char*>(stiles + kc_begin * (kTileScaleBytes / 16) + lane % 8);
  int issued = 0, slot_issue = 0;
  auto issue = [&]() {
    if (issued < ktiles) copy_w_ktile(ring0 + slot_issue * kPanelStageBytes, wsrc, ssrc, lane);
    sm90::cp_async_commit();
    ++issued;
    wsrc += kTileBytes;
    ssrc += kTileScaleBytes;
    slot_issue = slot_issue + 1 == S ? 0 : slot_issue + 1;
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue();
  const int g = lane / 4, t = lane % 4;
  const uint8_t* xrow = smem + g * kStreamRowBytes + t * 8;
  const uint8_t* ring = smem + (ring0 - xs);
  int slot = 0;
  for (int j = 0; j < ktiles; ++j) {
    issue();  // refills the slot the previous k-tile read (the __syncwarp below ordered its reads first)
    sm90::cp_async_wait<S - 1>();  // this lane's W copies of k-tile j have landed
    __syncwarp();            // and every lane's
    const uint8_t* st = ring + slot * kPanelStageBytes;
    const uint4 w0 = reinterpret_cast<const uint4*>(st)[lane], w1 = reinterpret_cast<const uint4*>(st)[32 + lane];
    const uint4 sc = reinterpret_cast<const uint4*>(st + kTileBytes)[lane / 4];
    __syncwarp();
    sm90::mbar_wait(&x_full[j], 0);  // x's k-tile j has landed
    const uint8_t* xk = xrow + j * kRows * kStreamRowBytes;
    const uint32_t w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    const uint32_t s[4] = {sc.x, sc.y, sc.z, sc.w};
    mma_tile<T, MT>(
        w, s, [&](int mt, int kt) { return *reinterpret_cast<const uint2*>(xk + mt * 8 * kStreamRowBytes + kt * 32); },
        acc);
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  sm90::cp_async_wait<0>();  // no copy outlives the loop (the epilogue reuses the buffers)
}

}  // namespace lowbit::nvfp4::gemm::mma
