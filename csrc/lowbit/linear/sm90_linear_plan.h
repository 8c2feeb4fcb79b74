// The NVFP4 Linear's plan on Hopper: which kernel form runs y = x W^T for a
// problem (M rows of x, N rows of W, K), and its shape. linear_plan
// (sm90_linear_plan.cu) decides on the host from the shape and the device
// (SM count, shared memory, the kernels' occupancy); linear_fused_cuda
// (nvfp4_linear.h) runs the plan. This is the one description of the
// dispatch; the rules' measurements are in sm90_linear_plan.cu's comments
// and docs/perf/log/linear.md.
//
// Rules in the order linear_plan applies them (a 16-row W tile is kTileN
// rows of W; a k-tile kTileK columns of K):
//
//   form (file)            M          where                     what and why
//   ---------------------  ---------  ------------------------  -------------------------------------
//   stream                 1..8       5..8 rows; 1..4 where the 1-8 warps per W tile, each streaming
//   (sm90_linear_stream)              narrow kernel needs       its k-tiles (W and x) through a
//                                     several waves (more than  cp.async ring in shared memory (2
//                                     4 W tiles per SM, no      slots for runs of 6 k-tiles or
//                                     one-wave shape), or where fewer, else 3); K split as the
//                                     a grid capped at 16 warps narrow kernel's; grids of at most
//                                     per SM brings 10 or more  1.5 waves at 16 warps per SM held to
//                                     (stream_shape)            that: twice the narrow kernel's warps
//                                                               per SM, x fragments cheaper
//   stream, two W tiles    5..16      where stream_tiles_pay:   x read once for both tiles (rings of
//   per warp                          at 9..16 8-warp CTAs      2 slots at 9..16 rows): half the x
//                                     over the whole K where    traffic per W byte, twice a warp's W
//                                     eight_warp_pairs, else    bytes in flight
//                                     CTAs of at most 4 warps
//                                     in one wave, K split in
//                                     2 at most; at 5..8 where
//                                     the one-tile plan runs
//                                     one warp per tile, unsplit
//   stream-K               1..8       whole tiles would sit     one wave of CTAs on equal runs of
//   (sm90_linear_stream_k)            unevenly on the SMs and   k-tiles that cross tiles, a tile's
//                                     K is long, or at 5..8     pieces added in the kernel in k order
//                                     rows CTAs of 4-8 warps
//                                     take more than a wave
//                                     (stream_k_ctas)
//   panel                  12..16     its grid runs in one      8 warps on 128 W rows over one K
//   (sm90_linear_panel)               wave (panel_shape) and K  chunk whose x rows sit in shared
//                                     fits its chunks           memory: x crosses L2 once per 128 W
//                                                               rows; K splits added in a cluster (2)
//                                                               or through partials (more)
//   narrow                 1..16      the rest up to 16 rows,   1-8 warps per W tile through register
//   (sm90_linear_stream)              unless at 9..16 the wide  stages (16 warps per SM); the fewest
//                                     kernel's unsplit CTAs     warps that give every SM 10-16 warps
//                                     fill 40% of the SMs       in one wave, else 8 and K split when
//                                                               the W tiles do not fill the SMs
//   wide                   9..128     above 16 rows, and 9..16  128 W rows x 16, 32 or 64 x rows per
//   (sm90_linear_wide)                on many W tiles (x shared CTA, x in shared memory, K split to
//                                     by 8 W tiles)             fill the SMs; MMAs on wgmma after an
//                                                               x image pass (wide_uses_wgmma), or on
//                                                               mma.sync where the GEMM is too short
//                                                               to repay the extra launch
//   wgmma                  129..2048                            128 W rows x 128 or 256 tokens per
//   (sm90_linear_wgmma)                                         CTA, W decoded into shared memory by
//                                                               warps of its own, x by TMA, K split
//                                                               over a cluster when the tiles are
//                                                               few, CTA pairs sharing the decode
//                                                               (linear_wgmma_pairs)
//   kUnpack (the caller)   > 2048                               unpack the weight + cuBLAS in the
//                                                               binding: above 2048 rows the unpack
//                                                               costs less than the wgmma kernel's
//                                                               distance to cuBLAS (Linear v8)
//
// Limits that move a problem to another form: the stream and narrow kernels
// hold at most 65535 W tiles (N <= 1048560), above that the wide kernel
// takes their rows; the stream kernel counts in 32 bits (kStreamMaxPaddedK),
// above that the narrow kernel; the panel kernel's chunk bounds K, above it
// the wide kernel. K splits always add in a fixed order (deterministic).
//
// Overrides (LinearPlanOverrides): a plan string (lowbit/plan_string.h)
// forces choices of one call, for tests and probes; the shipped op passes
// none. Keys, each applied where the rule it overrides sits:
//   path=stream|narrow|panel|wide|wgmma|unpack  the path for every M (the
//     limits above still apply: stream above its rows or K takes narrow;
//     panel above 16 rows or K too long for its chunks takes wide).
//   stream_warps=1|2|4|8  warps per stream CTA where stream_warps_per_tile
//     would pick them.
//   stream_ctas_per_sm=c  caps every stream plan at c CTAs per SM (Linear v18).
//   stream_k=0|1  the stream-K form off, or on at M <= 8 wherever it can run
//     (Linear v21).
//   stream_tiles=1|2  two W tiles per warp off, or on at 5..16 rows wherever
//     the stream kernel can run (Linear v23).
//   stream_stages=2|3  the stream kernel's ring slots (Linear v25).
//   stream_splits=s  the stream kernel's K splits (at most its k-tiles).
//   panel_splits=s  the panel kernel's K splits (among the counts its chunks
//     allow).
//   wide_wgmma=0|1  the wide kernel on mma.sync or wgmma.
//   wgmma_pair=0|1  wgmma CTA pairs off or on (256-token tiles, K not split).
// explain_linear_plan tells which form runs a problem and the rule that
// picked it (lowbit.explain_plan).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "lowbit/linear/nvfp4_linear_layout.h"

namespace lowbit::nvfp4::gemm {

enum class LinearPath { kStream, kNarrow, kWide, kWgmma, kUnpack, kPanel };
const char* linear_path_name(LinearPath path);  // "stream", "narrow", ...

// Choices a plan string forces (the keys above); each unset one is the plan's.
struct LinearPlanOverrides {
  std::optional<LinearPath> path;
  std::optional<int> stream_warps;        // 1, 2, 4 or 8
  std::optional<int> stream_ctas_per_sm;  // >= 1
  std::optional<bool> stream_k;
  std::optional<int> stream_tiles;        // 1 or 2
  std::optional<int> stream_stages;       // 2 or 3
  std::optional<int> stream_splits;       // >= 1
  std::optional<int> panel_splits;        // >= 1
  std::optional<bool> wide_wgmma;
  std::optional<bool> wgmma_pair;
};
// Throws std::invalid_argument naming the key of a bad item
// (lowbit/plan_string.h). Host code; built without CUDA too, so that every
// device checks a plan string alike.
LinearPlanOverrides parse_linear_plan_string(const std::string& plan);
// The overrides as a plan string in key order ("" when none is set).
std::string to_plan_string(const LinearPlanOverrides& overrides);

}  // namespace lowbit::nvfp4::gemm

#if defined(LOWBIT_WITH_CUDA)
namespace lowbit::nvfp4::gemm {

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
  const char* rule;          // the rule that picked the path (explain_linear_plan)
  const char* fallback;      // a limit that then moved it to another path, or null
};
LinearPlan linear_plan(int64_t m, int64_t n, int64_t k, const LinearPlanOverrides& overrides = {});
// Which form runs (M, N, K) on the current device and why: the plan as
// "key: value" lines (path, form, kernel, why, workspace, device, plan),
// for lowbit.explain_plan.
std::string explain_linear_plan(int64_t m, int64_t n, int64_t k, const LinearPlanOverrides& overrides = {});

// Building blocks of the plan that the MoE uses too.
// Warps per 16-row W tile for a narrow kernel of `tiles` W tiles (CTAs of
// one tile): the fewest of 1, 2, 4 that give every SM 10 to 16 warps in one
// wave, or 0 if none does (docs/perf/log/linear.md, Linear v7).
int one_wave_warps_per_tile(int64_t tiles);
// Warps per W tile for streaming warps (nvfp4_mainloops.cuh stream_mainloop) on
// `tiles` W tiles of tiles_k k-tiles and `rows` rows of x: the most of 8, 4,
// 2 that leave every warp 4 k-tiles or more and fit in 3 waves (registers
// and shared memory), else 1 (docs/perf/log/linear.md, Linear v9).
// tiles_per_warp 2: `tiles` counts tile pairs, each warp takes both of a
// pair (at 9..16 rows the plan then takes 8 warps or at most 4: Linear v27).
int stream_warps_per_tile(int64_t tiles, int64_t tiles_k, int rows, int tiles_per_warp = 1);
// The most stream CTAs of `warps` warps one SM holds at `rows` rows of x,
// `tiles_per_warp` W tiles per warp and rings of `stages` slots: registers
// (32 warps; 16 with two tiles) and shared memory (rings, partial sums).
constexpr int kStreamRingSlots = 3;
int stream_ctas_per_sm_max(int warps, int rows, int tiles_per_warp = 1, int stages = kStreamRingSlots);

// The wgmma kernel's shape (also the grouped Linear's): tokens per tile
// (128 or 256), K splits, whether CTAs pair up to share the decode.
int linear_wgmma_tokens(int64_t m);
int64_t linear_wgmma_splits(int64_t m, int64_t n, int64_t k);
// `forced` (wgmma_pair) turns pairs on or off where the tiles are 256 tokens
// and K is not split.
bool linear_wgmma_pairs(int64_t m, int64_t splits, std::optional<bool> forced = std::nullopt);

}  // namespace lowbit::nvfp4::gemm
#endif
