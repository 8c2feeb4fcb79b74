// CUDA kernels of the NVFP4 Linear: prepack, unpack (dequantize the prepacked
// weight, used by the largest-M path: unpack + cuBLAS in the binding), the
// four mma.sync GEMMs below and linear_plan, which also picks the wgmma
// kernel of nvfp4_linear_wgmma.cu (nvfp4_linear.h):
//
// Stream (M <= 8; 5..16 with two W tiles per warp) and narrow (M <= 16):
// one CTA of 1, 2, 4 or 8 warps per 16-row tile of W (or tile pair, and per
// split of K); the weight is read once, in 1 KB
// coalesced pieces, by all SMs at once. The stream kernel's warps feed
// their k-tiles through cp.async rings in shared memory (stream_mainloop,
// up to 32 warps per SM; 16 on grids that would otherwise leave SMs idle),
// the narrow kernel's through register stages
// (warp_mainloop, 16 warps per SM). The warps' partial sums are added in a
// fixed order in shared memory. Where whole tiles would sit unevenly on the
// SMs, the stream kernel's stream-K form: a wave of CTAs on equal runs of
// k-tiles across tiles, a tile's pieces added in the kernel. Launched as
// programmatic dependents: their first W tiles go to L2 while the previous
// kernel finishes.
// Panel (M 12..16 where it runs in one wave): 8 warps on 128 rows of W over
// one chunk of K, whose 16 rows of x a tensor copy puts in shared memory at
// the start; each warp streams its W tile as the stream kernel does
// (panel_mainloop). K splits add up in a cluster (two) or through partials.
// Wide (M <= 128, and 9..16 with many W tiles): 8 warps on 128 rows of W
// sharing 16, 32 or 64 rows of x staged in shared memory, K split to fill
// the SMs; the MMAs on mma.sync (wide_mainloop) or, after a pass that writes
// x in the shared-memory layout (the x image), on wgmma with x staged by one
// bulk copy per k-tile (wide_wgmma_mainloop).
// All apply global * 2^8 and the bias in the epilogue when K is not split;
// otherwise they write FP32 partials and split_reduce_kernel, launched as a
// programmatic dependent, adds them in split order (deterministic: no
// atomics), or add the splits in a cluster.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/tensor_map.h"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mma.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

// A development knob (nvfp4_linear.h): the integer in environment variable
// `name`, or `unset`. Callers read it once (a function-local static).
int env_int(const char* name, int unset) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : unset;
}

// ---- prepack / unpack ---------------------------------------------------------

// One thread per (row, 16-column block): encodes the block's scale and ORs
// its 16 codes into the lane words. Blocks never share bits of a word but do
// share words (a word holds codes of two rows), hence the atomicOr.
__global__ void prepack_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ block_scale, int64_t n,
                               int64_t k, int64_t kp, uint32_t* __restrict__ weight, uint8_t* __restrict__ scale) {
  const int64_t blocks = k / 16;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * blocks) return;
  const int64_t row = i / blocks, b = i % blocks;
  const ScaleCode s = encode_scale(block_scale[i]);
  scale[element_pos(row, b * 16, kp).scale_byte] = s.byte;
  for (int64_t kk = b * 16; kk < b * 16 + 16; ++kk) {
    uint32_t code = (codes[row * (k / 2) + kk / 2] >> (4 * (kk & 1))) & 0xfu;
    if (s.zero) code = 0;
    if (s.negative) code ^= 8u;
    const ElementPos p = element_pos(row, kk, kp);
    const uint32_t bits = ((code & 7u) << p.slot.mag) | ((code >> 3) << p.slot.sign);
    if (bits) atomicOr(weight + p.word_byte / 4, bits);
  }
}

__global__ void fill_scale_kernel(uint8_t* __restrict__ scale, int64_t count, uint8_t value) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) scale[i] = value;
}

using mma::kThreads;
using mma::kWarps;

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

// Unpack: one thread per lane word (8 codes of two rows in one k-tile),
// decoded exactly as the GEMM does (e2m1 * scale * 2^-8 in bf16), then
// * global * 2^8 in FP32 and one rounding to T; each row's 4 values are
// consecutive columns (the K permutation of the layout), one 8-byte store.
template <typename T>
__global__ void unpack_kernel(const uint32_t* __restrict__ weight, const uint8_t* __restrict__ scale,
                              const float* __restrict__ global_scale, int64_t n, int64_t k, int64_t kp,
                              T* __restrict__ out) {
  const int64_t words = n * kp / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= words) return;
  const int64_t tile = i / 256;
  const int within = static_cast<int>(i % 256);
  const int half = within / 128, lane = (within % 128) / 4, kt = half * 4 + within % 4;
  const int64_t tiles_k = kp / kTileK;
  const int64_t col = (tile % tiles_k) * kTileK + kt * 16 + (lane % 4) * 4;
  if (col >= k) return;
  const int64_t row = (tile / tiles_k) * kTileN + lane / 4;
  const uint32_t word = __ldg(weight + i);
  const uint32_t sw = __ldg(reinterpret_cast<const uint32_t*>(scale + tile * kTileScaleBytes + (lane / 4) * 16) + kt / 2);
  float v_lo[4], v_hi[4];  // rows g and g + 8
  mma::decode_word_rows(word, sw, kt, v_lo, v_hi);
  const float g = __ldg(global_scale) * kDecodeUnscale;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v_lo[j] *= g;
    v_hi[j] *= g;
  }
  cuda::store4(out + row * k + col, v_lo);
  cuda::store4(out + (row + 8) * k + col, v_hi);
}

// ---- small M: the stream and narrow kernels -----------------------------------
// grid: (ceil(M / (8 MT)), N / 16, splits), W warps per CTA sharing one
// 16-row W tile (K split between them). Output tile: 16 rows of W x 8 MT
// rows of x. The stream kernel (M <= 8) runs nvfp4_mma.cuh stream_mainloop
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
// Stream kernel: up to 32 warps per SM (64 registers), as shared memory
// and the plan's ctas_per_sm allow; with two W tiles per warp, 16 (128
// registers: its rings hold fewer warps anyway).
constexpr int kStreamWarpsPerSm = 32;
constexpr int kStreamTilesWarpsPerSm = 16;
static_assert(kStreamMaxM <= mma::kStreamMaxRows, "the stream main loop takes at most 8 rows of x");
static_assert(kStreamTilesMaxM <= mma::kStreamTilesMaxRows, "two tiles per warp take at most 16 rows of x");
LOWBIT_HD constexpr int stream_warps_per_sm(int tiles) { return tiles == 1 ? kStreamWarpsPerSm : kStreamTilesWarpsPerSm; }

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

// ---- small M, stream-K: the stream kernel over even runs of k-tiles ---------
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
struct StreamKRuns {
  int32_t base, rem;  // every run has base units, the first rem one more
  LOWBIT_HD int32_t begin(int32_t c) const { return c * base + (c < rem ? c : rem); }
  __device__ __forceinline__ int32_t run_of(int32_t u) const {
    const int32_t long_units = rem * (base + 1);
    return u < long_units ? u / (base + 1) : rem + (u - long_units) / base;
  }
};

// The workspace of the stream-K kernel: a slot per CTA, then a flag per CTA.
constexpr int kStreamKSlotFloats = kTileN * mma::kStreamMaxRows;
int64_t stream_k_workspace_bytes(int64_t runs) {
  return runs * (kStreamKSlotFloats * int64_t{sizeof(float)} + int64_t{sizeof(uint64_t)});
}

// A flag is set to this launch's %gridid once its slot is written, and the
// CTA that reads the slot sets it back to zero: a workspace fresh from the
// allocator needs no zeroing (a stale word is some other launch's id, or
// zero), and a graph replay, which may launch with the same id, finds its
// flags at zero.
__device__ __forceinline__ uint64_t launch_id() {
  uint64_t id;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(id));
  return id;
}

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
// stream_k_workspace_bytes(G). 16 warps per SM, at up to 128 registers:
// at 64, ptxas recomputes the loop's bounds every unit.
constexpr int kStreamKWarpsPerSm = 16;
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
  const uint64_t id = launch_id();
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
          while (cuda::ld_acquire_gpu(flags + r) != id) __nanosleep(64);
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
      if (threadIdx.x == 0)
        for (int32_t r = first; r < cta; ++r) cuda::st_relaxed_gpu(flags + r, uint64_t{0});
    } else {  // publish: the slot, then (after the CTA barrier) the flag
      for (int e = threadIdx.x; e < elems; e += 32 * W) slots[int64_t{cta} * kStreamKSlotFloats + e] = piece.sum(e);
      __syncthreads();
      if (threadIdx.x == 0) cuda::st_release_gpu(flags + cta, id);
    }
    __syncthreads();  // piece is reused by the next one
  }
  walk.finish();
}

// ---- medium M: the wide kernel ----------------------------------------------
// grid (ceil(N / 128), ceil(M / (8 MT)), splits): 8 warps on 8 consecutive
// 16-row W tiles sharing x's rows staged in shared memory
// (nvfp4_mma.cuh, wide_mainloop or wide_wgmma_mainloop: kWg), each over one
// split of K. One split: the output directly; more: FP32 partials [splits,
// M, N] added in split order by split_reduce_kernel.

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
constexpr int kDumpStride = kWarps * kTileN + 4;  // floats per x row: 4-word skew, conflict-free dump
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
  for (int u = rank * kThreads + static_cast<int>(threadIdx.x); u < 8 * MT * 32; u += splits * kThreads) {
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

// ---- 12..16 rows: the panel kernel -------------------------------------------
// grid (ceil(N / 128), ceil(M / 16), splits): 8 warps on 8 consecutive W
// tiles over one K split, x's chunk in shared memory (nvfp4_mma.cuh,
// panel_mainloop). K splits: partials null, a cluster (1, 1, splits) adds
// them (wide_cluster_finish); else FP32 partials for split_reduce_kernel.
// Dynamic shared memory: panel_smem_bytes(kPanelMt, k-tiles per split), or
// more (panel_spread_smem).
constexpr int kPanelCtasPerSm = 3;  // at most (panel_spread_smem)
constexpr int kPanelMt = 2;         // 16 rows of x (fewer: zeros)
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

// out = sum over splits of partials [splits, M, N], in split order, * global
// + bias; a thread per 4 consecutive outputs (N is a multiple of 16). The
// loads of 8 splits are all in flight before the first add: one round trip
// to L2 per 8 splits, not per split.
template <typename T>
__global__ void split_reduce_kernel(const float* partials, int64_t splits, int64_t m, int64_t n,
                                    cuda::ReadOnly<float> global_scale, cuda::ReadOnly<T> bias,
                                    T* __restrict__ out) {
  constexpr int kBatch = 8;
  cuda::allow_dependent_launch();  // the next kernel's prologue (its first W copies) overlaps this one
  cuda::wait_for_previous_grid();
  const int64_t i = 4 * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x), outputs = m * n;
  if (i >= outputs) return;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t s0 = 0; s0 < splits; s0 += kBatch) {
    float4 part[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (s0 + b < splits) part[b] = *reinterpret_cast<const float4*>(partials + (s0 + b) * outputs + i);
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (s0 + b < splits) {
        v[0] += part[b].x;
        v[1] += part[b].y;
        v[2] += part[b].z;
        v[3] += part[b].w;
      }
  }
  const float scale = __ldg(global_scale) * kDecodeUnscale;
  const int64_t o = i % n;
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = v[e] * scale + (bias ? cuda::to_float(bias[o + e]) : 0.f);
  cuda::store4(out + i, v);
}

template <typename T>
cudaError_t launch_split_reduce(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  const dim3 grid(unsigned(cuda::ceil_div(a.m * a.n, 4 * 256)));
  return cuda::launch_dependent(split_reduce_kernel<T>, grid, dim3(256), 0, stream,
                                static_cast<const float*>(a.workspace), splits, a.m, a.n, a.global_scale,
                                static_cast<const T*>(a.bias), static_cast<T*>(a.out));
}

// x [M, K] as the wide wgmma kernel's stages (nvfp4_mma.cuh, WideWgmmaX):
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

// Bytes of the wide wgmma kernel's x image: a stage per row block and k-tile.
int64_t wide_image_bytes(int64_t m, int64_t k, int mt) {
  return cuda::ceil_div(m, 8 * mt) * (padded_k(k) / kTileK) * (kTileK / 8) * 128 * mt;
}

// The wide kernel's MMAs: wgmma (x image pass + bulk copies; fewer
// instructions per k-tile) or mma.sync (no extra pass). The extra launch
// pays off on long GEMMs and with many rows of x; measured on an H100
// (docs/perf/log/linear.md, Linear v11). LOWBIT_LINEAR_WIDE_WGMMA=0|1 forces either.
bool wide_uses_wgmma(int64_t m, int64_t n, int64_t k, int mt) {
  static const int forced = env_int("LOWBIT_LINEAR_WIDE_WGMMA", -1);
  if (forced >= 0) return forced == 1;
  const int64_t weights = n * k;
  if (mt == 2) return weights >= (int64_t{1} << 25);  // Linear v14b: 1024 x 32768, 1536 x 24576
  if (mt == 4) return n >= 7168 || k >= 7168;
  return m > 64 || weights > (int64_t{1} << 23);
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

// The stream-K kernel's runs: its units (N / 16 tiles x k-tiles) in
// p.stream_k_ctas runs.
StreamKRuns stream_k_runs(const LinearArgs& a, const LinearPlan& p) {
  const int64_t units = a.n / kTileN * (padded_k(a.k) / kTileK);
  return {static_cast<int32_t>(units / p.stream_k_ctas), static_cast<int32_t>(units % p.stream_k_ctas)};
}

template <typename T, int W, int kPairs, int kTiles>
cudaError_t launch_stream(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  const int64_t tiles_k = padded_k(a.k) / kTileK;
  const int stages = p.stream_stages == 2 ? 2 : mma::kStreamStages;  // stream-K: linear_plan sets the latter
  const int smem =
      cuda::smem_for_ctas_per_sm(W * mma::stream_warp_bytes(static_cast<int>(a.m), kTiles, stages), p.ctas_per_sm);
  if constexpr (kTiles == 1) {  // stream-K: one tile per warp only
    if (p.stream_k_ctas > 0) {
      cudaError_t err = cuda::allow_dynamic_smem(linear_stream_k_kernel<T, W, kPairs>, smem);
      if (err != cudaSuccess) return err;
      return cuda::launch_dependent(linear_stream_k_kernel<T, W, kPairs>, dim3(static_cast<unsigned>(p.stream_k_ctas)),
                                    dim3(32 * W), smem, stream, static_cast<const T*>(a.x), a.weight, a.scale,
                                    a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out),
                                    static_cast<float*>(a.workspace), a.m, a.n, a.k, stream_k_runs(a, p));
    }
  }
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

template <typename T>
cudaError_t launch_typed(const LinearArgs& a, const LinearPlan& p, cudaStream_t stream) {
  switch (p.path) {
    case LinearPath::kStream:
      return launch_stream<T>(a, p, stream);
    case LinearPath::kNarrow:
      return p.mt == 1 ? launch_narrow<T, 1>(a, p, stream) : launch_narrow<T, 2>(a, p, stream);
    case LinearPath::kWide:
      if (p.wide_wgmma) {
        if (p.mt == 2) return launch_wide<T, 2, true>(a, p, stream);
        return p.mt == 4 ? launch_wide<T, 4, true>(a, p, stream) : launch_wide<T, 8, true>(a, p, stream);
      }
      if (p.mt == 2) return launch_wide<T, 2, false>(a, p, stream);
      return p.mt == 4 ? launch_wide<T, 4, false>(a, p, stream) : launch_wide<T, 8, false>(a, p, stream);
    case LinearPath::kWgmma:
      return linear_wgmma_cuda(a, p, stream);
    case LinearPath::kPanel:
      return launch_panel<T>(a, p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t prepack_cuda(const PrepackArgs& a, cudaStream_t stream) {
  const int64_t kp = padded_k(a.k);
  if (a.n == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(a.weight, 0, a.n * kp / 2, stream);
  if (err != cudaSuccess) return err;
  const int64_t scale_bytes = a.n * kp / 16;
  fill_scale_kernel<<<cuda::ceil_div(scale_bytes, 256), 256, 0, stream>>>(a.scale, scale_bytes,
                                                                          encode_scale(0x38).byte);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const int64_t blocks = a.n * (a.k / 16);
  if (blocks == 0) return cudaSuccess;
  prepack_kernel<<<cuda::ceil_div(blocks, 256), 256, 0, stream>>>(a.codes, a.block_scale, a.n, a.k, kp,
                                                                  reinterpret_cast<uint32_t*>(a.weight), a.scale);
  return cudaGetLastError();
}

cudaError_t unpack_cuda(const UnpackArgs& a, cudaStream_t stream) {
  const int64_t kp = padded_k(a.k);
  const int64_t count = a.n * kp / 8;
  if (count == 0 || a.k == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(cuda::ceil_div(count, 256));
  switch (a.out_dtype) {
    case DType::kBFloat16:
      unpack_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                             static_cast<__nv_bfloat16*>(a.out));
      break;
    case DType::kFloat16:
      unpack_kernel<__half><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                      static_cast<__half*>(a.out));
      break;
    case DType::kFloat32:
      unpack_kernel<float><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                     static_cast<float*>(a.out));
      break;
  }
  return cudaGetLastError();
}

int one_wave_warps_per_tile(int64_t tiles) {
  const int64_t sms = cuda::num_sms();
  for (int w : {1, 2, 4})
    if (tiles * w >= 10 * sms && tiles * w <= 16 * sms) return w;
  return 0;
}

static_assert(kStreamRingSlots == mma::kStreamStages, "one count of ring slots");
int stream_ctas_per_sm_max(int warps, int rows, int tiles_per_warp, int stages) {
  // A CTA: its rings, its partial sums (static with one tile per warp, in
  // the rings with two), and the 1 KB the system reserves.
  const int partials = tiles_per_warp == 1 ? 512 : 0;
  const int64_t cta_bytes = warps * (mma::stream_warp_bytes(rows, tiles_per_warp, stages) + partials) + 1024;
  return static_cast<int>(
      std::min<int64_t>(stream_warps_per_sm(tiles_per_warp) / warps, cuda::smem_per_sm() / cta_bytes));
}

namespace {
// LOWBIT_STREAM_WARPS (nvfp4_linear.h): the forced warps per stream CTA, or 0.
int forced_stream_warps() {
  static const int forced = [] {
    const int w = env_int("LOWBIT_STREAM_WARPS", 0);
    return w == 1 || w == 2 || w == 4 || w == 8 ? w : 0;
  }();
  return forced;
}
}  // namespace

int stream_warps_per_tile(int64_t tiles, int64_t tiles_k, int rows, int tiles_per_warp) {
  if (forced_stream_warps() > 0) return forced_stream_warps();
  const int64_t sms = cuda::num_sms();
  for (int w : {8, 4, 2}) {
    const int64_t warps_per_wave = int64_t{stream_ctas_per_sm_max(w, rows, tiles_per_warp)} * w * sms;
    if (tiles_k >= 4 * w && tiles * w <= 3 * warps_per_wave) return w;
  }
  return 1;
}

namespace {
// LOWBIT_LINEAR_PATH (nvfp4_linear.h): the forced path, or -1.
int forced_path() {
  static const int path = [] {
    const char* v = std::getenv("LOWBIT_LINEAR_PATH");
    if (!v) return -1;
    const std::string s(v);
    if (s == "stream") return static_cast<int>(LinearPath::kStream);
    if (s == "narrow") return static_cast<int>(LinearPath::kNarrow);
    if (s == "wide") return static_cast<int>(LinearPath::kWide);
    if (s == "wgmma") return static_cast<int>(LinearPath::kWgmma);
    if (s == "panel") return static_cast<int>(LinearPath::kPanel);
    if (s == "unpack") return static_cast<int>(LinearPath::kUnpack);
    return -1;
  }();
  return path;
}
}  // namespace

namespace {
// CTAs of the wgmma wide kernel (MT) the device runs at once in clusters of
// `splits`.
template <int MT>
int64_t wide_wgmma_resident_clusters(int splits) {
  using T = __nv_bfloat16;  // fp16 takes the same resources
  return cuda::resident_clusters(linear_wide_kernel<T, MT, true>, kThreads, sizeof(mma::WideWgmmaSmem<T, MT>), splits);
}
int64_t wide_wgmma_resident_ctas(int mt, int splits) {
  const int64_t clusters = mt == 2   ? wide_wgmma_resident_clusters<2>(splits)
                           : mt == 4 ? wide_wgmma_resident_clusters<4>(splits)
                                     : wide_wgmma_resident_clusters<8>(splits);
  return clusters * splits;
}

// Ring slots per stream warp for runs of `run` k-tiles: 2 (one copy in
// flight while one k-tile is computed) for runs of 6 or fewer, else 3.
// Measured in docs/perf/log/linear.md, Linear v25: with 2, 4096 x 4096 at M = 1-8
// (runs of 4) 4-9% faster (M = 8: 5.6 -> 5.1-5.2 us) and 2048 x 7168 (4)
// 0-6%, but 8192 x 4096 at M = 4-8 (8) and 7168 x 18432 at M = 4 (7) 4%
// slower. Fewer slots also let more two-tile CTAs fit (1536 x 24576 at
// M = 16, runs of 6: 12.5 -> 10.9 us). Two tiles per warp above 8 rows
// (`wide_pairs`) always take 2: their 16 x rows make a slot 6.9 KB, and 2
// slots let 4-warp CTAs sit 4 a SM (Linear v26). LOWBIT_STREAM_STAGES=2|3
// (read once) forces it.
int stream_stages(int64_t run, bool wide_pairs) {
  static const int forced = env_int("LOWBIT_STREAM_STAGES", 0);
  if (forced == 2 || forced == 3) return forced;
  return wide_pairs || run <= 6 ? 2 : 3;
}

// Two W tiles per warp at 9..16 rows in 8-warp CTAs over the whole K: no
// partials, no split_reduce, and 16 warps a SM where two CTAs sit on one.
// They pay (Linear v27 in docs/perf/log/linear.md, against 4-warp CTAs)
//   - where the pairs give 90-100% of the SMs one CTA each, runs of 2
//     k-tiles or more (the N = 4096 shapes, which split K in 2 before:
//     5-9% faster on 8192 x 4096 and 7168 x 4096 at 9..16 rows, 11-14% on
//     4096 x 4096, 16-19% on 2048 x 4096);
//   - where the pairs are more than the SMs, runs of 4 or more, and two
//     CTAs a SM leave 32 KB of the shared-memory carveout to L1 (at most 12
//     rows): 18432 x 7168 at M = 9 / 12 30.8 / 32.0 against 33.4 / 32.8 us,
//     7168 x 18432 (over two waves) at 9..12 33.3 against 36.0 on the wide
//     kernel. At 13..16 rows two such CTAs take 223 KB, L1 shrinks to 28
//     KB, and they ran 11-22% slower. The bound is where they were
//     measured to turn, not a cause found: 2-warp pair CTAs at 8 a SM
//     (1024 x 32768, L1 as small) ran slower capped to fewer.
bool eight_warp_pairs(int64_t m, int64_t pairs, int64_t tiles_k) {
  if (m <= kStreamMaxM || m > kStreamTilesMaxM) return false;
  const int64_t sms = cuda::num_sms();
  if (pairs <= sms) return 10 * pairs >= 9 * sms && tiles_k >= 2 * 8;
  constexpr int kL1Keeps = 32 * 1024;
  const int64_t cta_bytes = 8 * int64_t{mma::stream_warp_bytes(static_cast<int>(m), 2, 2)} + 1024;
  return tiles_k >= 4 * 8 && 2 * cta_bytes <= cuda::smem_per_sm() - kL1Keeps;
}

// The stream kernel's shape: warps per tile, and K split as the narrow
// kernel's when the tiles are fewer than the SMs. Its CTAs are capped per
// SM: left to fill SMs up to what their rings allow (32 warps at 1-4 rows,
// some shapes at 5-8), a grid smaller than the device is packed onto fewer
// SMs. Where the grid fits one wave at 16 warps per SM, the cap is the
// fewest CTAs per SM that hold it (every SM busy); where 16 warps per SM
// hold it in at most 1.5 waves, 16 warps. Measured in docs/perf/log/linear.md: Linear
// v13, at M = 1 on 8192 x 4096 10.9 us uncapped, 8.2 capped (narrow
// kernel: 9.2); v16, 1536 x 24576 (1536 one-warp CTAs) 10.6 us at 16 per
// SM (96 SMs), 9.4 at 12 (128 SMs). One warp per tile (its whole K) when
// the tiles alone bring 10 warps or more per SM and fit the cap in 1.5
// waves: 1024 x 32768, M = 1, 9.1 us on 2 warps per tile, 8.5 on one;
// 1536 x 24576 10.2 on 2, 9.4 on one (v16).
// With two W tiles per warp (tiles_per_warp 2) the same rules hold for
// the tile pairs.
LinearPlan stream_shape(int64_t m, int64_t ntiles, int64_t tiles_k, int tiles_per_warp = 1) {
  constexpr int kSpreadWarpsPerSm = 16;
  const int64_t sms = cuda::num_sms();
  const int64_t units = cuda::ceil_div(ntiles, tiles_per_warp);  // a CTA's W tiles (per K split)
  LinearPlan p{};
  p.path = LinearPath::kStream;
  p.mt = 1;
  p.stream_tiles = tiles_per_warp;
  p.warps = units >= 10 * sms && 2 * units <= 3 * kSpreadWarpsPerSm * sms
                ? 1
                : stream_warps_per_tile(units, tiles_k, static_cast<int>(m), tiles_per_warp);
  // Two tiles per warp above 8 rows: 8-warp CTAs over the whole K where
  // they pay, else CTAs of at most 4 warps (8-warp CTAs ran 10-20% slower
  // at 14..16 rows where two sit on an SM, Linear v26).
  const bool wide_pairs = tiles_per_warp == 2 && m > kStreamMaxM;
  const bool eight_whole = wide_pairs && forced_stream_warps() == 0 && eight_warp_pairs(m, units, tiles_k);
  if (wide_pairs && forced_stream_warps() == 0) p.warps = eight_whole ? 8 : std::min(p.warps, 4);
  static const int forced_splits = env_int("LOWBIT_STREAM_SPLITS", 0);
  const int64_t splits =
      forced_splits > 0 ? std::min<int64_t>(forced_splits, tiles_k)
      : units >= sms || eight_whole
          ? 1
          : std::min(cuda::ceil_div(sms, units), std::max<int64_t>(1, tiles_k / p.warps));
  p.splits = cuda::ceil_div(tiles_k, cuda::ceil_div(tiles_k, splits));
  p.stream_stages = stream_stages(cuda::ceil_div(cuda::ceil_div(tiles_k, p.splits), p.warps), wide_pairs);
  // Two tiles per warp at 9..16 rows: the rings may hold fewer CTAs than
  // 16 warps per SM (one tile per warp: they always hold that many).
  const int spread =
      std::min(kSpreadWarpsPerSm / p.warps,
               stream_ctas_per_sm_max(p.warps, static_cast<int>(m), tiles_per_warp, p.stream_stages));
  const int64_t ctas = units * p.splits;
  if (ctas <= spread * sms)
    p.ctas_per_sm = static_cast<int>(cuda::ceil_div(ctas, sms));
  else if (2 * ctas <= 3 * spread * sms)
    p.ctas_per_sm = spread;
  return p;
}
}  // namespace

// The panel kernel's shape at M <= 16: its K splits and how they are added.
// A CTA holds its chunk of x in shared memory, so a split has at most
// kPanelMaxChunk k-tiles; among the split counts that allow, the one
// minimizing waves x (k-tiles per split + 4), the 4 standing for a CTA's
// fill and the sum. Two splits add up in a cluster (distributed shared
// memory); more write FP32 partials for split_reduce_kernel, as clusters of
// 4-8 of these CTAs are placed badly (docs/perf/log/linear.md, Linear v15).
// LOWBIT_PANEL_SPLITS (read once) forces the count, for benchmarks.
// splits 0: K is too long for the chunk.
struct PanelShape {
  int64_t splits = 0;
  bool cluster = false;
  bool one_wave = false;
};
PanelShape panel_shape(int64_t m, int64_t ntiles, int64_t tiles_k) {
  static const int forced = env_int("LOWBIT_PANEL_SPLITS", 0);
  const int64_t ctas = cuda::ceil_div(ntiles, mma::kPanelWarps) * cuda::ceil_div(m, 8 * kPanelMt);
  PanelShape best;
  int64_t best_cost = INT64_MAX;
  for (int64_t s = 1; s <= kWideMaxSplits && s <= tiles_k; ++s) {
    const int64_t per = cuda::ceil_div(tiles_k, s);
    if (cuda::ceil_div(tiles_k, per) != s || per > mma::kPanelMaxChunk) continue;  // no empty split; x fits
    if (forced > 0 && s != forced) continue;
    const int cluster = s == 2 ? 2 : 1;
    const int smem = cuda::smem_for_ctas_per_sm(mma::panel_smem_bytes(kPanelMt, per), kPanelCtasPerSm);
    const int64_t resident =
        cuda::resident_clusters(linear_panel_kernel<__nv_bfloat16>, kThreads, smem, cluster) * cluster;
    const int64_t waves = cuda::ceil_div(ctas * s, std::max<int64_t>(1, resident)), cost = waves * (per + 4);
    if (cost < best_cost) {
      best = {s, cluster > 1, waves == 1};
      best_cost = cost;
    }
  }
  return best;
}

// LOWBIT_STREAM_CTAS_PER_SM (nvfp4_linear.h): the forced cap, or 0.
int forced_stream_cap() {
  static const int cap = env_int("LOWBIT_STREAM_CTAS_PER_SM", 0);
  return cap;
}

// The stream-K kernel's CTAs (0: the stream kernel's whole tiles), W warps
// each, one wave of 16 warps per SM (or fewer: LOWBIT_STREAM_CTAS_PER_SM).
// It can run where W <= tiles_k and the units fit its 32-bit counters. It
// does where whole tiles would sit unevenly on the SMs and the runs are
// long enough to repay the pieces' adds:
//   - 10% or more unevenly (the busiest SM's tiles against the average),
//     runs of 128 units or more (Linear v21 in docs/perf/log/linear.md: 18432 x 7168
//     ran 10% faster at M = 1-4 and 1% at 8, the bench's shapes of shorter
//     runs 20-65% slower, the even 7168 x 18432 0-4%);
//   - at 5..8 rows, where the one-tile plan (`one`) runs CTAs of 4 or 8
//     warps uncapped and they take more than one wave at what an SM holds
//     (rings of 9-10 KB a warp: 16-24 warps a SM), runs of 96 units or more
//     (Linear v24 in docs/perf/log/linear.md: 7168 x 18432 at M = 8, 122-unit runs,
//     3-5% faster in three sessions; six other such shapes -3% to +8%,
//     +2% on average; with CTAs of 1-2 warps, 7168 x 65536, 6-7% slower).
// LOWBIT_STREAM_K=0|1 (read once) turns it off, or on wherever it can
// run, for probes.
int64_t stream_k_ctas(int64_t m, int64_t ntiles, int64_t tiles_k, const LinearPlan& one) {
  static const int forced = env_int("LOWBIT_STREAM_K", -1);
  const int forced_cap = forced_stream_cap();
  const int warps = one.warps;
  const int64_t units = ntiles * tiles_k, sms = cuda::num_sms();
  if (forced == 0 || m < 1 || m > kStreamMaxM || warps > tiles_k || units > (int64_t{1} << 30)) return 0;
  const int most = std::min(stream_ctas_per_sm_max(warps, static_cast<int>(m)), kStreamKWarpsPerSm / warps);
  const int per_sm = forced_cap > 0 ? std::min(most, forced_cap) : most;
  const int64_t ctas = std::min(units, int64_t{per_sm} * sms);
  const bool uneven = 10 * cuda::ceil_div(ntiles, sms) * sms >= 11 * ntiles;
  const bool past_a_wave = m > 4 && warps >= 4 && one.splits == 1 && one.ctas_per_sm == 0 &&
                           ntiles > int64_t{stream_ctas_per_sm_max(warps, static_cast<int>(m))} * sms;
  if (forced == 1 || (uneven && units >= 128 * ctas) || (past_a_wave && units >= 96 * ctas)) return ctas;
  return 0;
}

// Whether two W tiles per warp pay at 5..16 rows (Linear v23 in
// docs/perf/log/linear.md). They halve x's shared memory and L2 reads per W byte and
// double a warp's W bytes in flight, but halve the CTAs. At 9..16 rows
// they pay wherever eight_warp_pairs does (8-warp CTAs over the whole K,
// Linear v27), and otherwise, in CTAs of at most 4 warps with rings of 2
// slots (stream_shape), beat the panel and wide kernels wherever their
// CTAs run in one wave at what the rings hold, with at most 2 K splits
// (Linear v26: 18432 x 7168 at 16 rows 34.1 against 35.0 us; 4096 x
// 1536, 3 splits, 10-14% slower at 12..16 rows); 7168 x 18432 at 13..16
// rows (576 pairs: more than a wave) stays on the wide kernel. At 5..8
// rows they beat one warp per tile (1536 x 24576, 12 a SM: 9.8-10.1 ->
// 9.3-9.5 us; 1024 x 32768, 16 a SM, on 2-warp CTAs with 2-slot rings:
// 9.0-9.1 -> 8.5 us at M = 7-8, the same at 5-6, Linear v26), and lost to
// the other stream plans (0-40%). LOWBIT_STREAM_TILES=1|2 (read
// once) turns them off, or on at 5..16 rows wherever the stream kernel can
// run, for probes. one / two: stream_shape's plans with one and two tiles
// per warp (one: M <= 8 only).
bool stream_tiles_pay(int64_t m, int64_t ntiles, int64_t tiles_k, const LinearPlan& one, const LinearPlan& two) {
  static const int forced = env_int("LOWBIT_STREAM_TILES", 0);
  if (m < kStreamTilesMinM || m > kStreamTilesMaxM || forced == 1) return false;
  if (forced == 2) return true;
  if (m <= kStreamMaxM) return one.warps == 1 && one.splits == 1 && one.ctas_per_sm > 0;
  const int64_t pairs = cuda::ceil_div(ntiles, 2);
  if (eight_warp_pairs(m, pairs, tiles_k)) return true;  // stream_shape's 8-warp CTAs, whole K
  // One wave at what the rings hold: stream_shape's cap then covers the grid.
  return two.splits <= 2 && two.ctas_per_sm > 0 && pairs * two.splits <= two.ctas_per_sm * cuda::num_sms();
}

LinearPlan linear_plan(int64_t m, int64_t n, int64_t k) {
  LinearPlan p{};
  const int64_t tiles_k = padded_k(k) / kTileK, ntiles = n / kTileN;
  const int64_t sms = cuda::num_sms();
  // M 9..16 on the wide kernel (x shared by 8 W tiles through shared memory)
  // when its unsplit CTAs fill 40% of the SMs: there the narrow kernel's x
  // loads (16 rows, read again for every W tile) cost more than the W loads.
  const bool wide_small_m = m > 8 && 10 * cuda::ceil_div(ntiles, 8) >= 4 * sms;
  // The stream kernel (twice the warps per SM) for 5..8 rows, where the
  // narrow kernel's x fragments cost it most, and for fewer rows when the
  // narrow kernel needs several waves (no one-wave shape, more than 4 W
  // tiles per SM); measured in docs/perf/log/linear.md, Linear v9. Also for 1..4 rows
  // where its CTAs are capped at 16 warps per SM (stream_shape) and bring
  // 10 warps or more per SM: then it beats the narrow kernel (Linear v13).
  // Two W tiles per warp at 5..16 rows where they pay (Linear v23).
  const LinearPlan stream_one = m <= kStreamMaxM ? stream_shape(m, ntiles, tiles_k) : LinearPlan{};
  const LinearPlan stream_two =
      m >= kStreamTilesMinM && m <= kStreamTilesMaxM ? stream_shape(m, ntiles, tiles_k, 2) : LinearPlan{};
  const bool stream_tiles = stream_tiles_pay(m, ntiles, tiles_k, stream_one, stream_two);
  const LinearPlan& stream_plan = stream_tiles ? stream_two : stream_one;
  const bool stream_spread =
      stream_plan.ctas_per_sm > 0 && ntiles * stream_plan.splits * stream_plan.warps >= 10 * sms;
  const int64_t stream_k =
      m <= kStreamMaxM && !stream_tiles ? stream_k_ctas(m, ntiles, tiles_k, stream_plan) : 0;
  const bool stream = stream_tiles || (m <= kStreamMaxM && (stream_k > 0 || m > 4 || stream_spread ||
                                                            (one_wave_warps_per_tile(ntiles) == 0 && ntiles > 4 * sms)));
  // M 12..16: the panel kernel where its grid runs in one wave (Linear v15):
  // x crosses L2 once per 128 W rows and K chunk, not once per 16 W rows.
  // Longer K or more W tiles (the 71 MB shapes) stay on the wide kernel.
  // Below 12 rows the narrow kernel's x traffic (distinct rows only) is
  // small enough that it matches or beats the panel kernel's fixed cost.
  const bool panel_asked =
      m <= kPanelMaxM && (m >= kPanelMinM || forced_path() == static_cast<int>(LinearPath::kPanel));
  const PanelShape panel = panel_asked ? panel_shape(m, ntiles, tiles_k) : PanelShape{};
  LinearPath path = stream                               ? LinearPath::kStream
                    : m >= kPanelMinM && panel.one_wave ? LinearPath::kPanel
                    : m <= kNarrowMaxM && !wide_small_m ? LinearPath::kNarrow
                    : m <= kWideMaxM                    ? LinearPath::kWide
                    : m <= kWgmmaMaxM                   ? LinearPath::kWgmma
                                                        : LinearPath::kUnpack;
  if (forced_path() >= 0) path = static_cast<LinearPath>(forced_path());
  p.path = path;
  if (path == LinearPath::kStream &&
      (m > (stream_tiles ? kStreamTilesMaxM : kStreamMaxM) || padded_k(k) > kStreamMaxPaddedK))
    p.path = path = LinearPath::kNarrow;
  if (path == LinearPath::kPanel && panel.splits == 0) p.path = path = LinearPath::kWide;  // M or K too large
  // The stream and narrow kernels put the 16-row W tiles on grid y, at most
  // 65535 of them (N <= 1048560); the wide kernel's 128-row blocks are on x.
  if ((path == LinearPath::kStream || path == LinearPath::kNarrow) && ntiles > cuda::kMaxGridDimYZ)
    p.path = path = LinearPath::kWide;
  if (path == LinearPath::kStream) {
    p = stream_plan;
    if (stream_k > 0) {
      p.splits = 1;
      p.stream_stages = mma::kStreamStages;  // its kernel's rings (runs of 96 units or more)
      p.ctas_per_sm = static_cast<int>(cuda::ceil_div(stream_k, sms));
      p.stream_k_ctas = stream_k;
      p.workspace_bytes = stream_k_workspace_bytes(stream_k);
      return p;
    }
    const int forced_cap = forced_stream_cap();
    if (forced_cap > 0)
      p.ctas_per_sm = std::min(forced_cap,
                               stream_ctas_per_sm_max(p.warps, static_cast<int>(m), p.stream_tiles, p.stream_stages));
  } else if (path == LinearPath::kNarrow) {
    p.mt = m <= 8 ? 1 : 2;
    // Warps per W tile: the fewest (longest K runs per warp, no CTA sum)
    // that give every SM 10 to 16 warps in one wave; otherwise 8, with K
    // split when the W tiles alone do not give each SM a CTA (every warp of
    // a split gets a tile; no empty split). (docs/perf/log/linear.md, Linear v7)
    const int one_wave = one_wave_warps_per_tile(ntiles);
    p.warps = one_wave > 0 ? one_wave : kWarps;
    const int64_t splits = p.warps < kWarps || ntiles >= sms
                               ? 1
                               : std::min(cuda::ceil_div(sms, ntiles), std::max<int64_t>(1, tiles_k / kWarps));
    p.splits = cuda::ceil_div(tiles_k, cuda::ceil_div(tiles_k, splits));
  } else if (path == LinearPath::kWide) {
    // Split K to fill the SMs: the splits s (at least 4 k-tiles each)
    // minimizing waves(CTAs * s) * (k-tiles per split + 6), the 6 standing
    // for a CTA's pipeline fill, epilogue and partials. Fitted on H100 runs
    // (docs/perf/log/linear.md, Linear v5): at M = 64, 8192 x 4096 best at 8 splits,
    // 7168 x 18432 at 3, K = 1024 unsplit; at M = 128, 1536 x 24576 unsplit.
    // On wgmma with many W blocks (N >= 8192) the splits of a tile are a
    // cluster (at most 8) that adds them in the kernel, and a wave is as
    // many clusters as the device runs at once; with fewer W blocks the
    // splits needed are many and large clusters fit badly, so they write
    // partials (docs/perf/log/linear.md, Linear v11); N = 7168 is between: clusters
    // win there with 33..128 rows of x and lose with 17..32 (Linear v12).
    p.mt = m <= 16 ? 2 : m <= 32 ? 4 : 8;
    const int64_t ctas = cuda::ceil_div(ntiles, 8) * cuda::ceil_div(m, 8 * p.mt);
    p.wide_wgmma = wide_uses_wgmma(m, n, k, p.mt);
    p.splits_in_cluster = p.wide_wgmma && (n >= 8192 || (p.mt == 8 && n >= 7168));
    const int64_t max_splits = std::max<int64_t>(1, p.splits_in_cluster ? std::min<int64_t>(kWideMaxSplits, tiles_k / 4)
                                                                   : tiles_k / 4);
    int64_t best = 1, best_cost = INT64_MAX;
    for (int64_t splits = 1; splits <= max_splits; ++splits) {
      const int64_t per = cuda::ceil_div(tiles_k, splits);
      const int64_t used = cuda::ceil_div(tiles_k, per);  // no empty split
      const int64_t resident = p.splits_in_cluster ? wide_wgmma_resident_ctas(p.mt, static_cast<int>(used))
                                            : (p.mt == 8 ? kWideCtasPerSm<8> : kWideCtasPerSm<4>) * sms;  // MT 2 as 4
      const int64_t cost = cuda::ceil_div(ctas * used, resident) * (per + 6);
      if (cost < best_cost) {
        best = splits;
        best_cost = cost;
      }
    }
    p.splits = cuda::ceil_div(tiles_k, cuda::ceil_div(tiles_k, best));
  } else if (path == LinearPath::kPanel) {
    p.mt = kPanelMt;
    p.splits = panel.splits;
    p.splits_in_cluster = panel.cluster;
  } else if (path == LinearPath::kWgmma) {
    p.mt = linear_wgmma_tokens(m);
    p.splits = linear_wgmma_splits(m, n, k);
    p.wgmma_pair = linear_wgmma_pairs(m, p.splits);
    return p;
  } else {
    p.splits = 1;
    return p;
  }
  p.workspace_bytes = p.splits > 1 && !p.splits_in_cluster ? p.splits * m * n * int64_t{sizeof(float)} : 0;
  if (p.wide_wgmma) p.workspace_bytes += wide_image_bytes(m, k, p.mt);  // the image, then any partials
  return p;
}

cudaError_t linear_fused_cuda(const LinearArgs& a, const LinearPlan& plan, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16) return launch_typed<__nv_bfloat16>(a, plan, stream);
  if (a.dtype == DType::kFloat16) return launch_typed<__half>(a, plan, stream);
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4::gemm
