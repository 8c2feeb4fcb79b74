// The NVFP4 Linear for kWideMaxM < M <= kWgmmaMaxM: warpgroup MMA with the
// decoded weight as the register A operand and x as the shared-memory B
// operand.
//
// The product is computed transposed, y^T = W x^T: W rows fill wgmma's 64-row
// side, so a warp decodes exactly the A fragment of the mma.sync kernels
// (one 16-row tile of the prepacked layout per warp), and 256 rows of x
// (tokens) are the 256-wide side (wgmma.m64n256k16).
//
// x image (x_image_kernel, the workspace): wgmma reads B from shared memory
// in its canonical order, but the prepacked layout permutes K inside each
// 16-column block (nvfp4_gemm_layout.h). x is therefore copied once into an
// image that is already in shared-memory form: per (256-token tile,
// 128-column k-tile) 64 KB = two 64-column halves of 256 rows x 128 bytes,
// columns in the layout's logical order, 16-byte chunks 128-byte swizzled;
// rows past M and columns past K are zeros. One bulk copy moves such a
// piece into shared memory.
//
// Persistent CTAs of 3 warpgroups, one per SM, each looping over 128-row x
// 256-token output tiles: warpgroup 2 is the producer (one thread issues the
// bulk copies of the x piece, the 8 W tiles and their scales of each k-tile
// into a ring of stages, mbarrier "full"); warpgroups 0 and 1 each own 64 W
// rows (128 FP32 accumulators per thread), decode their fragments from
// shared memory, issue the wgmmas and release a stage ("empty") once the
// MMAs that read it have completed. The epilogue applies global * 2^8 and
// the bias and stores y while the producer already fills the next tile's
// stages. Deterministic: each output is one accumulator, fixed order.
#include <algorithm>
#include <cstdint>

#include "lowbit/cuda_utils.cuh"
#include "lowbit/nvfp4_gemm.h"
#include "lowbit/nvfp4_gemm_layout.h"
#include "lowbit/nvfp4_mma.cuh"
#include "lowbit/sm90.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

constexpr int kWgThreads = 384;                        // 2 consumer warpgroups + the producer
constexpr int kTokens = 256;                           // x rows per tile (the wgmma N)
constexpr int kRows = 128;                             // W rows per tile: 64 per consumer warpgroup
constexpr int kTiles = kRows / kTileN;                 // W tiles per k-tile
constexpr int kPieceBytes = kTokens * kTileK * 2;      // x image piece per k-tile: 64 KB
constexpr int kHalfBytes = kPieceBytes / 2;            // 64 columns x 256 rows
constexpr int kStageBytes = kPieceBytes + kTiles * (kTileBytes + kTileScaleBytes);
static_assert(kStageBytes % 1024 == 0, "x pieces must stay 1024-byte aligned");
constexpr int kStages = 3;
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;  // + barriers, alignment slack
static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");
// k16 steps per wgmma group; the k-tile's 8 steps are 2 groups (main loop).
constexpr int kGroup = 4;
constexpr int kRasterGroup = 16;                       // W blocks per raster group (L2 reuse of x)

// One thread per (token, 16-column block) of the padded problem: reads the
// block's 32 bytes and writes them as two 16-byte chunks in logical order
// (logical columns 0-7 are physical pairs 0, 2, 4, 6; 8-15 are 1, 3, 5, 7).
template <typename T>
__global__ void x_image_kernel(const T* __restrict__ x, int64_t m, int64_t k, int64_t tiles_k, int64_t rows,
                               uint8_t* __restrict__ image) {
  const int64_t blocks = tiles_k * (kTileK / 16);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * blocks) return;
  const int64_t token = i / blocks, q = i % blocks;
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (token < m && q * 16 < k) {
    const uint4* src = reinterpret_cast<const uint4*>(x + token * k + q * 16);
    lo = __ldg(src);
    hi = __ldg(src + 1);
  }
  const int r = static_cast<int>(token % kTokens), qq = static_cast<int>(q % 8);
  const int chunk = 2 * (qq % 4);
  uint8_t* row = image + ((token / kTokens) * tiles_k + q / 8) * kPieceBytes + (qq / 4) * kHalfBytes + r * 128;
  *reinterpret_cast<uint4*>(row + ((chunk ^ (r % 8)) * 16)) = make_uint4(lo.x, lo.z, hi.x, hi.z);
  *reinterpret_cast<uint4*>(row + (((chunk + 1) ^ (r % 8)) * 16)) = make_uint4(lo.y, lo.w, hi.y, hi.w);
}

template <typename T>
__global__ void __launch_bounds__(kWgThreads, 1)
    linear_wgmma_kernel(const uint8_t* __restrict__ image, const uint8_t* __restrict__ weight,
                        const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
                        const T* __restrict__ bias, T* __restrict__ out, int64_t m, int64_t n, int64_t k) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - sm90::smem_addr(smem_raw) % 1024) % 1024);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  auto piece = [&](int s) { return smem + s * kStageBytes; };
  auto wtiles = [&](int s) { return piece(s) + kPieceBytes; };
  auto stiles = [&](int s) { return piece(s) + kPieceBytes + kTiles * kTileBytes; };

  // Persistent: CTA c takes output tiles c, c + gridDim.x, ... Raster:
  // groups of kRasterGroup W blocks; inside a group the W block changes
  // fastest, so the CTAs resident together share few x tiles.
  const int64_t tiles_k = padded_k(k) / kTileK, row_tiles = n / kTileN;
  const int64_t w_blocks = cuda::ceil_div(n, kRows), token_tiles = cuda::ceil_div(m, kTokens);
  const int64_t tiles = w_blocks * token_tiles;
  auto coords = [&](int64_t t, int64_t& wb, int64_t& tb) {
    const int64_t group = t / (kRasterGroup * token_tiles), in_group = t % (kRasterGroup * token_tiles);
    const int64_t first = group * kRasterGroup, group_size = std::min<int64_t>(kRasterGroup, w_blocks - first);
    wb = first + in_group % group_size;
    tb = in_group / group_size;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], 8);  // one arrival per consumer warp
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  // Stage use `it` (counted over every k-tile of every tile of this CTA)
  // goes to stage it % kStages in phase (it / kStages) & 1.
  auto stage_of = [](int64_t it) { return static_cast<int>(it % kStages); };
  auto phase_of = [](int64_t it) { return static_cast<uint32_t>((it / kStages) & 1); };
  const int wg = threadIdx.x / 128;
  if (wg == 2) {
    sm90::regs_dealloc<40>();
    if (threadIdx.x != 256) return;
    int64_t it = 0;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      int64_t wb, tb;
      coords(t, wb, tb);
      const uint8_t* x_src = image + tb * tiles_k * kPieceBytes;
      for (int64_t kc = 0; kc < tiles_k; ++kc, ++it) {
        const int s = stage_of(it);
        if (it >= kStages) sm90::mbar_wait(&empty[s], phase_of(it) ^ 1);
        sm90::mbar_arrive_expect_tx(&full[s], kStageBytes);
        sm90::bulk_copy(piece(s), x_src + kc * kPieceBytes, kPieceBytes, &full[s]);
        for (int i = 0; i < kTiles; ++i) {
          const int64_t tile = std::min(wb * kTiles + i, row_tiles - 1) * tiles_k + kc;  // rows past N: never stored
          sm90::bulk_copy(wtiles(s) + i * kTileBytes, weight + tile * kTileBytes, kTileBytes, &full[s]);
          sm90::bulk_copy(stiles(s) + i * kTileScaleBytes, scale + tile * kTileScaleBytes, kTileScaleBytes,
                          &full[s]);
        }
      }
    }
    return;
  }
  sm90::regs_alloc<232>();

  // A k-tile's 8 k16 steps go out in 2 groups of kGroup. While one group
  // runs, the next one's A fragments are decoded into the other register
  // buffer; then the warpgroup waits for the running group. Waiting for
  // every group keeps the decode out of any in-flight group's pipeline stage
  // (ptxas serializes the wgmmas otherwise, and a buffer must not change
  // while a wgmma reads it); the other consumer warpgroup keeps the tensor
  // cores busy meanwhile. Measured (docs/PERF.md): 4-step groups beat 2-step
  // ones by 10-15%, 256 tokens per tile beat 128 by 20-30%.
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  uint4 w[2], sc;  // this warp's W tile words (k16 steps 0-3, 4-7) and scale words
  auto load_words = [&](int s) {
    const int tile = wg * 4 + warp;
    const uint4* wt = reinterpret_cast<const uint4*>(wtiles(s) + tile * kTileBytes);
    w[0] = wt[lane];
    w[1] = wt[32 + lane];
    sc = reinterpret_cast<const uint4*>(stiles(s) + tile * kTileScaleBytes)[lane / 4];
  };
  uint32_t a[2][kGroup][4];
  auto decode_group = [&](int q, uint32_t (&frag)[kGroup][4]) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int kt = q * kGroup + j;
      mma::decode_fragment<T>(reinterpret_cast<const uint32_t*>(w)[kt], reinterpret_cast<const uint32_t*>(&sc)[kt / 2],
                              kt, frag[j]);
    }
  };
  const float g = __ldg(global_scale) * kDecodeUnscale;
  float acc[kTokens / 2];
  int64_t it = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int64_t wb, tb;
    coords(t, wb, tb);
#pragma unroll
    for (int i = 0; i < kTokens / 2; ++i) acc[i] = 0.f;
    sm90::mbar_wait(&full[stage_of(it)], phase_of(it));
    load_words(stage_of(it));
    decode_group(0, a[0]);
    for (int64_t kc = 0; kc < tiles_k; ++kc, ++it) {
      const int s = stage_of(it);
      const uint32_t x_addr = sm90::smem_addr(piece(s));
#pragma unroll
      for (int q = 0; q < 8 / kGroup; ++q) {
        sm90::wgmma_fence();
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          const int kt = q * kGroup + j;
          sm90::Wgmma<T>::m64n256k16(acc, a[q % 2][j],
                                     sm90::desc_k_major_sw128(x_addr + (kt / 4) * kHalfBytes + (kt % 4) * 32));
        }
        sm90::wgmma_commit();
        if (q + 1 < 8 / kGroup) {
          decode_group(q + 1, a[(q + 1) % 2]);
        } else if (kc + 1 < tiles_k) {  // the next k-tile's first group
          sm90::mbar_wait(&full[stage_of(it + 1)], phase_of(it + 1));
          load_words(stage_of(it + 1));
          decode_group(0, a[0]);
        }
        sm90::wgmma_wait<0>();
      }
      if (lane == 0) sm90::mbar_arrive(&empty[s]);  // every MMA that read stage s has completed
    }
#pragma unroll
    for (int i = 0; i < kTokens / 2; ++i) sm90::fence_operand(acc[i]);

    // acc[4j + 2h + e]: W row 16 warp + lane / 4 + 8h of the warpgroup, token
    // 8j + 2 (lane % 4) + e. Lanes g and g ^ 1 swap one value so that each
    // stores two adjacent W rows of one token: even g rows (o, o + 1) of
    // token e = 0, odd g rows (o - 1, o) of token e = 1.
    const bool odd = (lane / 4) % 2;
    const int64_t token0 = tb * kTokens + 2 * (lane % 4) + odd;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t o = wb * kRows + wg * 64 + warp * 16 + lane / 4 + 8 * h - odd;
      const bool row_ok = o < n;  // o even and n a multiple of 16: o + 1 < n too
      float b0 = 0.f, b1 = 0.f;
      if (bias && row_ok) {
        b0 = cuda::to_float(bias[o]);
        b1 = cuda::to_float(bias[o + 1]);
      }
#pragma unroll
      for (int j = 0; j < kTokens / 8; ++j) {
        const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        const float lo = odd ? other : v0, hi = odd ? v1 : other;
        const int64_t token = token0 + 8 * j;
        if (row_ok && token < m) {
          T pair[2] = {cuda::from_float<T>(lo * g + b0), cuda::from_float<T>(hi * g + b1)};
          *reinterpret_cast<uint32_t*>(out + token * n + o) = *reinterpret_cast<const uint32_t*>(pair);
        }
      }
    }
  }
}

template <typename T>
cudaError_t launch(const LinearArgs& a, cudaStream_t stream) {
  const int64_t tiles_k = padded_k(a.k) / kTileK, token_tiles = cuda::ceil_div(a.m, kTokens);
  auto* image = static_cast<uint8_t*>(a.workspace);
  const int64_t threads = token_tiles * kTokens * tiles_k * (kTileK / 16);
  x_image_kernel<T><<<unsigned(cuda::ceil_div(threads, 256)), 256, 0, stream>>>(
      static_cast<const T*>(a.x), a.m, a.k, tiles_k, token_tiles * kTokens, image);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(linear_wgmma_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t ctas = std::min<int64_t>(linear_wgmma_tiles(a.m, a.n), cuda::num_sms());
  linear_wgmma_kernel<T><<<unsigned(ctas), kWgThreads, kSmemBytes, stream>>>(
      image, a.weight, a.scale, a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.m, a.n,
      a.k);
  return cudaGetLastError();
}

}  // namespace

int64_t linear_wgmma_tiles(int64_t m, int64_t n) { return cuda::ceil_div(n, kRows) * cuda::ceil_div(m, kTokens); }

int64_t linear_wgmma_workspace_bytes(int64_t m, int64_t k) {
  return cuda::ceil_div(m, kTokens) * (padded_k(k) / kTileK) * kPieceBytes;
}

cudaError_t linear_wgmma_cuda(const LinearArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16) return launch<__nv_bfloat16>(a, stream);
  if (a.dtype == DType::kFloat16) return launch<__half>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4::gemm
