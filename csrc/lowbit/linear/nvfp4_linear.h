// NVFP4 Linear (W4A16): y = x W^T * global (+ bias), with W in the prepacked
// layout of nvfp4_linear_layout.h. Argument structs and the CPU / CUDA entry
// points; arguments are validated by the caller (csrc/torch).
#pragma once

#include "lowbit/common.h"
#include "lowbit/linear/nvfp4_linear_layout.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::nvfp4::gemm {

// Checkpoint layout -> prepacked layout.
struct PrepackArgs {
  const uint8_t* codes;        // [N, K/2]
  const uint8_t* block_scale;  // [N, K/16] E4M3 codes
  int64_t n, k;                // n % 16 == 0, k % 16 == 0
  uint8_t* weight;             // [N, Kp/2]
  uint8_t* scale;              // [N, Kp/16] written (the tensor's trailing bytes are the binding's)
};

// Prepacked layout -> dequantized [N, K] (e2m1 * block scale * global).
struct UnpackArgs {
  const uint8_t* weight;       // [N, Kp/2]
  const uint8_t* scale;        // [N, Kp/16]
  const float* global_scale;   // [] (device pointer on CUDA)
  int64_t n, k;
  void* out;                   // [N, K] out_dtype
  DType out_dtype;
};

// Prepacked layout -> checkpoint layout, the inverse of prepack (host
// only: a save-time conversion). Exact for positive finite block scales, all
// a quantizer writes; the prepacked form has already folded the others into
// its codes, which come back as the same values: a zero scale as scale 1.0
// with zero codes, a negative one as its magnitude with the codes' signs
// flipped, a NaN one (sign dropped) as E4M3 NaN 0x7F.
struct UnprepackArgs {
  const uint8_t* weight;       // [N, Kp/2]
  const uint8_t* scale;        // [N, Kp/16]
  int64_t n, k;
  uint8_t* codes;              // [N, K/2]
  uint8_t* block_scale;        // [N, K/16] E4M3 codes
};

// Fused GEMMs (CUDA only): out [M, N] = x [M, K] W^T * global + bias.
struct LinearArgs {
  const void* x;               // [M, K] contiguous, 16-byte aligned, dtype
  DType dtype;                 // kBFloat16 or kFloat16
  const uint8_t* weight;       // prepacked [N, Kp/2], 16-byte aligned
  const uint8_t* scale;        // prepacked [N, Kp/16], 16-byte aligned
  const float* global_scale;   // []
  const void* bias;            // [N] dtype, or null
  void* out;                   // [M, N] dtype
  int64_t m, n, k;
  void* workspace;             // LinearPlan::workspace_bytes, 256-byte aligned (null when 0)
};

// The FP8 mode of the Linear (W4A8 on FP8 tensor cores; nvfp4_linear_fp8.cu):
// W and x rounded to E4M3 with one FP32 scale per row, then an FP8 GEMM with
// FP32 sums (the caller's: cuBLASLt through at::_scaled_mm). Per row of
// values v (a W row: e2m1 * block scale, exact in FP32, the global scale left
// out; an x row: x), in FP32 with one rounding per operation:
//   amax = max |v|, r = 448 / amax (0 when amax is 0),
//   code = e4m3(v * r), rounded to nearest even (|v * r| <= 448),
//   row scale = amax * global / 448 for W, amax / 448 for x;
// y = (sum of code products) * x row scale * W row scale (+ bias), rounded
// once to x's dtype. The CPU kernel is this rule's reference.
constexpr float kE4m3Max = 448.f;  // the largest finite E4M3 value
struct Fp8WeightArgs {
  const uint8_t* weight;       // prepacked [N, Kp/2]
  const uint8_t* scale;        // prepacked [N, Kp/16]
  const float* global_scale;   // [] (device pointer)
  int64_t n, k;
  uint8_t* out;                // [N, K] E4M3
  float* row_scale;            // [N]
  float* row_amax;             // [N] scratch (CUDA)
};
struct Fp8RowsArgs {
  const void* x;               // [M, K] contiguous, 16-byte aligned, dtype
  DType dtype;                 // kBFloat16 or kFloat16
  int64_t m, k;                // k % 16 == 0
  uint8_t* out;                // [M, K] E4M3
  float* row_scale;            // [M]
};

void prepack_cpu(const PrepackArgs& args);
void unpack_cpu(const UnpackArgs& args);
void unprepack_cpu(const UnprepackArgs& args);

#if defined(LOWBIT_WITH_CUDA)
cudaError_t prepack_cuda(const PrepackArgs& args, cudaStream_t stream);
cudaError_t unpack_cuda(const UnpackArgs& args, cudaStream_t stream);
cudaError_t fp8_weight_cuda(const Fp8WeightArgs& args, cudaStream_t stream);
cudaError_t fp8_rows_cuda(const Fp8RowsArgs& args, cudaStream_t stream);

// How the fused GEMM runs a problem, chosen on the host from the shape and
// the device (nvfp4_linear.cu and nvfp4_linear_wgmma.cu describe the kernels):
//   M <= kStreamMaxM  stream kernel: 1-8 warps per 16-row W tile, each
//                     streaming its k-tiles (W and x) through a cp.async
//                     ring in shared memory (2 slots for runs of 6 k-tiles
//                     or fewer, else 3); split-K as the narrow kernel;
//                     grids of at most 1.5 waves at 16 warps per SM held
//                     to that (M <= 4: only where the narrow kernel needs
//                     several waves, or where such a capped grid brings 10
//                     warps or more per SM). Where whole tiles would sit
//                     unevenly on the SMs and K is long, or at 5..8 rows
//                     where CTAs of 4-8 warps take more than a wave, the
//                     stream-K form: one wave of CTAs on equal runs of
//                     k-tiles that cross tiles, the pieces of a tile added
//                     in the kernel
//   5 <= M <= 16      before the kernels below: the stream kernel with two
//                     W tiles per warp (x read once for both; rings of 2
//                     slots) at 9..16 rows: 8-warp CTAs over the whole K
//                     where they pay (eight_warp_pairs), else CTAs of at
//                     most 4 warps where they run in one wave with K split
//                     in 2 at most; at 5..8 where the one-tile plan runs
//                     one warp per tile, unsplit: stream_tiles_pay in
//                     nvfp4_linear.cu
//   kPanelMinM <= M <= kPanelMaxM
//                     panel kernel, where its grid runs in one wave: 8 warps
//                     on 128 W rows over one K chunk whose x rows sit in
//                     shared memory, each warp streaming its W tile through
//                     a cp.async ring; K splits added in a cluster (2) or
//                     through partials (more)
//   M <= kNarrowMaxM  narrow kernel: 1-8 warps per 16-row W tile, split-K
//                     when the W tiles alone do not fill the SMs (M 9..16
//                     with many W tiles, where the panel kernel does not
//                     run: the wide kernel)
//   M <= kWideMaxM    wide kernel: 128 W rows x 16, 32 or 64 x rows per CTA,
//                     x in shared memory, split-K to fill the SMs; its MMAs
//                     on wgmma after an x image pass, or on mma.sync where
//                     the GEMM is too short to repay the extra launch
//   M <= kWgmmaMaxM   wgmma kernel: 128 W rows x 256 tokens per CTA, W
//                     decoded into shared memory by warps of its own, x by
//                     TMA, K split over a cluster when the tiles are few
//   otherwise         kUnpack: left to the caller (unpack the weight + cuBLAS
//                     in the binding): above 2048 rows the unpack costs less
//                     than the wgmma kernel's distance to cuBLAS
//                     (docs/perf/log/linear.md, Linear v8)
// The stream and narrow kernels hold at most 65535 W tiles (N <= 1048560);
// above that the wide kernel takes their rows.
// LOWBIT_LINEAR_PATH=stream|narrow|panel|wide|wgmma|unpack in the
// environment (read once) forces a path for every M, for benchmarks (panel:
// M <= 16 and K short enough for its chunks, else the wide kernel).
constexpr int64_t kStreamMaxM = 8;
// The stream kernel with two W tiles per warp (LinearPlan::stream_tiles):
// 5..16 rows (Linear v23).
constexpr int64_t kStreamTilesMinM = 5;
constexpr int64_t kStreamTilesMaxM = 16;
// The stream kernel counts k-tiles and columns in 32 bits (Linear v19): a
// longer K (padded, plus the 32 k-tiles its copies run ahead) takes the
// narrow kernel.
constexpr int64_t kStreamMaxPaddedK = (int64_t{1} << 31) - 32 * kTileK;
constexpr int64_t kPanelMinM = 12;
constexpr int64_t kPanelMaxM = 16;
constexpr int64_t kNarrowMaxM = 16;
constexpr int64_t kWideMaxM = 128;
constexpr int64_t kWgmmaMaxM = 2048;
constexpr int64_t kWgmmaBlockRows = 128;  // W rows of a wgmma CTA (nvfp4_wgmma.cuh kBN)
// The grouped Linear runs the wgmma kernel up to this many tokens, the
// weight unpacked + a batched matmul above: on DeepSeek-V4-Flash's o_a_proj
// (8 x 4096 -> 1024, H100) the kernel ran at 0.80-0.98x the BF16 bmm's
// speed up to 512 tokens, where the unpacked form ran at 0.44-0.59x, and at
// 0.82x against 0.85x at 2048 (docs/perf/log/grouped.md, Nvfp4GroupedLinear v3).
constexpr int64_t kGroupedWgmmaMaxM = 1024;
enum class LinearPath { kStream, kNarrow, kWide, kWgmma, kUnpack, kPanel };
struct LinearPlan {
  LinearPath path;
  int mt;                    // narrow / wide: 8-row m-tiles per warp; wgmma: tokens per tile
  int warps;                 // stream / narrow: warps per CTA, all on one 16-row W tile
  int ctas_per_sm;           // stream: CTAs per SM the launch allows (0: as many as fit)
  int64_t stream_k_ctas;     // stream: CTAs of the stream-K kernel (runs of k-tiles across
                             // tiles), or 0: a CTA per W tile and K split
  int stream_tiles;          // stream (not stream-K): W tiles per warp, 1 or 2 (a CTA per tile pair)
  int stream_stages;         // stream: slots of a warp's ring, 2 or kStreamRingSlots (stream-K: always that)
  int64_t splits;            // K splits (stream / narrow / wide: FP32 partials added in split order;
                             // wgmma: cluster size)
  int64_t workspace_bytes;   // device workspace the launch needs
  bool wide_wgmma;           // wide: wgmma after an x image pass, not mma.sync
  bool splits_in_cluster;    // wide on wgmma, panel: K splits added in a cluster, not through partials
  bool wgmma_pair;           // wgmma: CTAs in pairs that share the decode (nvfp4_wgmma.cuh)
};
LinearPlan linear_plan(int64_t m, int64_t n, int64_t k);
// Warps per 16-row W tile for a narrow kernel of `tiles` W tiles (CTAs of
// one tile): the fewest of 1, 2, 4 that give every SM 10 to 16 warps in one
// wave, or 0 if none does (docs/perf/log/linear.md, Linear v7). The MoE uses it too.
int one_wave_warps_per_tile(int64_t tiles);
// Warps per W tile for streaming warps (nvfp4_mma.cuh stream_mainloop) on
// `tiles` W tiles of tiles_k k-tiles and `rows` rows of x: the most of 8, 4,
// 2 that leave every warp 4 k-tiles or more and fit in 3 waves (registers
// and shared memory), else 1 (docs/perf/log/linear.md, Linear v9). The MoE uses it too.
// tiles_per_warp 2: `tiles` counts tile pairs, each warp takes both of a
// pair (at 9..16 rows the plan then takes 8 warps or at most 4: Linear v27).
// LOWBIT_STREAM_WARPS=1|2|4|8 (read once) forces it, for benchmarks.
int stream_warps_per_tile(int64_t tiles, int64_t tiles_k, int rows, int tiles_per_warp = 1);
// The most stream CTAs of `warps` warps one SM holds at `rows` rows of x,
// `tiles_per_warp` W tiles per warp and rings of `stages` slots: registers
// (32 warps; 16 with two tiles) and shared memory (rings, partial sums).
constexpr int kStreamRingSlots = 3;
int stream_ctas_per_sm_max(int warps, int rows, int tiles_per_warp = 1, int stages = kStreamRingSlots);
// LOWBIT_STREAM_CTAS_PER_SM=c (read once) caps every stream plan at c CTAs
// per SM, for probes (Linear v18 in docs/perf/log/linear.md). LOWBIT_STREAM_K=0|1 (read
// once) turns the stream-K form off, or on at M <= 8 wherever it can run
// (Linear v21). LOWBIT_STREAM_TILES=1|2 (read once) turns two W tiles per
// warp off, or on at 5..16 rows wherever the stream kernel can run
// (Linear v23, stream_tiles_pay in nvfp4_linear.cu). LOWBIT_STREAM_STAGES=2|3
// (read once) sets the stream kernel's ring slots (Linear v25,
// stream_stages in nvfp4_linear.cu). LOWBIT_STREAM_SPLITS=s (read once) sets
// its K splits (at most its k-tiles), for probes and tests.
cudaError_t linear_fused_cuda(const LinearArgs& args, const LinearPlan& plan, cudaStream_t stream);

// The wgmma kernel (nvfp4_linear_wgmma.cu): tokens per tile (128 or 256), K
// splits, whether CTAs pair up to share the decode, launch.
int linear_wgmma_tokens(int64_t m);
int64_t linear_wgmma_splits(int64_t m, int64_t n, int64_t k);
bool linear_wgmma_pairs(int64_t m, int64_t splits);
cudaError_t linear_wgmma_cuda(const LinearArgs& args, const LinearPlan& plan, cudaStream_t stream);
// The grouped (block-diagonal) Linear on the wgmma kernel: x [M, G, K]
// (args.x, row stride G K), W [G group_n, K] prepacked (args.n = G group_n),
// out [M, G, group_n]: out[m, g] = x[m, g] W_g^T * global (+ bias), W_g rows
// [g group_n, (g + 1) group_n). group_n a multiple of kWgmmaBlockRows and K of 128
// (else cudaErrorInvalidValue): a W block lies in one group and a group's
// columns of x end on a k-tile.
cudaError_t grouped_linear_wgmma_cuda(const LinearArgs& args, int64_t group_n, cudaStream_t stream);
#endif

}  // namespace lowbit::nvfp4::gemm
