// The Linear's plan: which kernel form runs a problem (M, N, K) on this
// device, and its shape (warps, K splits, clusters, CTAs per SM, tile
// pairs). sm90_linear_plan.h describes the dispatch; the reasons and the
// measurements behind each rule are in the comments below and in
// docs/perf/log/linear.md. Host code: the cost models read the SM count,
// shared memory per SM and the kernels' occupancy (sm90_linear_forms.cuh),
// which is why this file is compiled with the CUDA sources.
#include "lowbit/linear/sm90_linear_plan.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"
#include "lowbit/linear/nvfp4_wgmma.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {
using mma::kWarps;
}  // namespace

// ---- building blocks the MoE shares -----------------------------------------
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

int stream_warps_per_tile(int64_t tiles, int64_t tiles_k, int rows, int tiles_per_warp) {
  const int64_t sms = cuda::num_sms();
  for (int w : {8, 4, 2}) {
    const int64_t warps_per_wave = int64_t{stream_ctas_per_sm_max(w, rows, tiles_per_warp)} * w * sms;
    if (tiles_k >= 4 * w && tiles * w <= 3 * warps_per_wave) return w;
  }
  return 1;
}

namespace {

// ---- the wide kernel --------------------------------------------------------
// The wide kernel's MMAs: wgmma (x image pass + bulk copies; fewer
// instructions per k-tile) or mma.sync (no extra pass). The extra launch
// pays off on long GEMMs and with many rows of x; measured on an H100
// (docs/perf/log/linear.md, Linear v11). The override wide_wgmma forces either.
bool wide_uses_wgmma(int64_t m, int64_t n, int64_t k, int mt, std::optional<bool> forced) {
  if (forced) return *forced;
  const int64_t weights = n * k;
  if (mt == 2) return weights >= (int64_t{1} << 25);  // Linear v14b: 1024 x 32768, 1536 x 24576
  if (mt == 4) return n >= 7168 || k >= 7168;
  return m > 64 || weights > (int64_t{1} << 23);
}

// ---- the stream kernel ------------------------------------------------------
// Ring slots per stream warp for runs of `run` k-tiles: 2 (one copy in
// flight while one k-tile is computed) for runs of 6 or fewer, else 3.
// Measured in docs/perf/log/linear.md, Linear v25: with 2, 4096 x 4096 at M = 1-8
// (runs of 4) 4-9% faster (M = 8: 5.6 -> 5.1-5.2 us) and 2048 x 7168 (4)
// 0-6%, but 8192 x 4096 at M = 4-8 (8) and 7168 x 18432 at M = 4 (7) 4%
// slower. Fewer slots also let more two-tile CTAs fit (1536 x 24576 at
// M = 16, runs of 6: 12.5 -> 10.9 us). Two tiles per warp above 8 rows
// (`wide_pairs`) always take 2: their 16 x rows make a slot 6.9 KB, and 2
// slots let 4-warp CTAs sit 4 a SM (Linear v26). The override stream_stages
// forces it.
int stream_stages(int64_t run, bool wide_pairs, std::optional<int> forced) {
  if (forced) return *forced;
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
// the tile pairs. The overrides stream_warps, stream_splits and
// stream_stages apply here.
LinearPlan stream_shape(int64_t m, int64_t ntiles, int64_t tiles_k, const LinearPlanOverrides& o,
                        int tiles_per_warp = 1) {
  constexpr int kSpreadWarpsPerSm = 16;
  const int64_t sms = cuda::num_sms();
  const int64_t units = cuda::ceil_div(ntiles, tiles_per_warp);  // a CTA's W tiles (per K split)
  LinearPlan p{};
  p.path = LinearPath::kStream;
  p.mt = 1;
  p.stream_tiles = tiles_per_warp;
  const int forced_warps = o.stream_warps.value_or(0);
  p.warps = units >= 10 * sms && 2 * units <= 3 * kSpreadWarpsPerSm * sms ? 1
            : forced_warps > 0 ? forced_warps
                               : stream_warps_per_tile(units, tiles_k, static_cast<int>(m), tiles_per_warp);
  // Two tiles per warp above 8 rows: 8-warp CTAs over the whole K where
  // they pay, else CTAs of at most 4 warps (8-warp CTAs ran 10-20% slower
  // at 14..16 rows where two sit on an SM, Linear v26).
  const bool wide_pairs = tiles_per_warp == 2 && m > kStreamMaxM;
  const bool eight_whole = wide_pairs && forced_warps == 0 && eight_warp_pairs(m, units, tiles_k);
  if (wide_pairs && forced_warps == 0) p.warps = eight_whole ? 8 : std::min(p.warps, 4);
  const int forced_splits = o.stream_splits.value_or(0);
  const int64_t splits =
      forced_splits > 0 ? std::min<int64_t>(forced_splits, tiles_k)
      : units >= sms || eight_whole
          ? 1
          : std::min(cuda::ceil_div(sms, units), std::max<int64_t>(1, tiles_k / p.warps));
  p.splits = cuda::ceil_div(tiles_k, cuda::ceil_div(tiles_k, splits));
  p.stream_stages =
      stream_stages(cuda::ceil_div(cuda::ceil_div(tiles_k, p.splits), p.warps), wide_pairs, o.stream_stages);
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

// ---- the panel kernel -------------------------------------------------------
// The panel kernel's shape at M <= 16: its K splits and how they are added.
// A CTA holds its chunk of x in shared memory, so a split has at most
// kPanelMaxChunk k-tiles; among the split counts that allow, the one
// minimizing waves x (k-tiles per split + 4), the 4 standing for a CTA's
// fill and the sum. Two splits add up in a cluster (distributed shared
// memory); more write FP32 partials for split_reduce_kernel, as clusters of
// 4-8 of these CTAs are placed badly (docs/perf/log/linear.md, Linear v15).
// The override panel_splits forces the count (among those the chunk
// allows). splits 0: K is too long for the chunk.
struct PanelShape {
  int64_t splits = 0;
  bool cluster = false;
  bool one_wave = false;
};
PanelShape panel_shape(int64_t m, int64_t ntiles, int64_t tiles_k, std::optional<int> forced_splits) {
  const int forced = forced_splits.value_or(0);
  const int64_t ctas = cuda::ceil_div(ntiles, mma::kPanelWarps) * cuda::ceil_div(m, 8 * kPanelMt);
  PanelShape best;
  int64_t best_cost = INT64_MAX;
  for (int64_t s = 1; s <= kWideMaxSplits && s <= tiles_k; ++s) {
    const int64_t per = cuda::ceil_div(tiles_k, s);
    if (cuda::ceil_div(tiles_k, per) != s || per > mma::kPanelMaxChunk) continue;  // no empty split; x fits
    if (forced > 0 && s != forced) continue;
    const int cluster = s == 2 ? 2 : 1;
    const int smem = cuda::smem_for_ctas_per_sm(mma::panel_smem_bytes(kPanelMt, per), kPanelCtasPerSm);
    const int64_t resident = panel_resident_ctas(smem, cluster);
    const int64_t waves = cuda::ceil_div(ctas * s, std::max<int64_t>(1, resident)), cost = waves * (per + 4);
    if (cost < best_cost) {
      best = {s, cluster > 1, waves == 1};
      best_cost = cost;
    }
  }
  return best;
}

// ---- the stream kernel: stream-K, two W tiles per warp ----------------------
// The stream-K kernel's CTAs (0: the stream kernel's whole tiles), W warps
// each, one wave of 16 warps per SM (or fewer: stream_ctas_per_sm).
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
//     3-5% faster in three runs; six other such shapes -3% to +8%,
//     +2% on average; with CTAs of 1-2 warps, 7168 x 65536, 6-7% slower).
// The override stream_k turns it off, or on wherever it can run. *rule:
// the rule that picked it.
int64_t stream_k_ctas(int64_t m, int64_t ntiles, int64_t tiles_k, const LinearPlan& one, const LinearPlanOverrides& o,
                      const char** rule) {
  const int forced = o.stream_k ? int{*o.stream_k} : -1;
  const int forced_cap = o.stream_ctas_per_sm.value_or(0);
  const int warps = one.warps;
  const int64_t units = ntiles * tiles_k, sms = cuda::num_sms();
  if (forced == 0 || m < 1 || m > kStreamMaxM || warps > tiles_k || units > (int64_t{1} << 30)) return 0;
  const int most = std::min(stream_ctas_per_sm_max(warps, static_cast<int>(m)), kStreamKWarpsPerSm / warps);
  const int per_sm = forced_cap > 0 ? std::min(most, forced_cap) : most;
  const int64_t ctas = std::min(units, int64_t{per_sm} * sms);
  const bool uneven = 10 * cuda::ceil_div(ntiles, sms) * sms >= 11 * ntiles;
  const bool past_a_wave = m > 4 && warps >= 4 && one.splits == 1 && one.ctas_per_sm == 0 &&
                           ntiles > int64_t{stream_ctas_per_sm_max(warps, static_cast<int>(m))} * sms;
  if (forced == 1)
    *rule = "stream-K, as the plan string asks (stream_k=1)";
  else if (uneven && units >= 128 * ctas)
    *rule = "1..8 rows: whole W tiles would sit 10% or more unevenly on the SMs, and each CTA gets a run of 128 "
            "(W tile, k-tile) units or more: stream-K (stream_k_ctas, Linear v21)";
  else if (past_a_wave && units >= 96 * ctas)
    *rule = "5..8 rows: the stream kernel's CTAs of 4-8 warps would take more than a wave, and each CTA gets a run "
            "of 96 units or more: stream-K (stream_k_ctas, Linear v24)";
  else
    return 0;
  return ctas;
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
// the other stream plans (0-40%). The override stream_tiles turns them
// off, or on at 5..16 rows wherever the stream kernel can run. one / two:
// stream_shape's plans with one and two tiles per warp (one: M <= 8 only).
// Returns the rule that picked them, or null where they do not pay.
const char* stream_tiles_pay(int64_t m, int64_t ntiles, int64_t tiles_k, const LinearPlan& one,
                             const LinearPlan& two, const LinearPlanOverrides& o) {
  const int forced = o.stream_tiles.value_or(0);
  if (m < kStreamTilesMinM || m > kStreamTilesMaxM || forced == 1) return nullptr;
  if (forced == 2) return "two W tiles per warp, as the plan string asks (stream_tiles=2)";
  if (m <= kStreamMaxM)
    return one.warps == 1 && one.splits == 1 && one.ctas_per_sm > 0
               ? "5..8 rows where the one-tile stream plan runs one warp per W tile, unsplit: two W tiles per warp "
                 "read x once for both (stream_tiles_pay, Linear v26)"
               : nullptr;
  const int64_t pairs = cuda::ceil_div(ntiles, 2);
  if (eight_warp_pairs(m, pairs, tiles_k))  // stream_shape's 8-warp CTAs, whole K
    return "9..16 rows: two W tiles per warp in 8-warp CTAs over the whole K pay on this many W tiles "
           "(eight_warp_pairs, Linear v27)";
  // One wave at what the rings hold: stream_shape's cap then covers the grid.
  return two.splits <= 2 && two.ctas_per_sm > 0 && pairs * two.splits <= two.ctas_per_sm * cuda::num_sms()
             ? "9..16 rows: two W tiles per warp in CTAs of at most 4 warps run in one wave with at most 2 K "
               "splits, which beats the panel and wide kernels (stream_tiles_pay, Linear v26)"
             : nullptr;
}

}  // namespace

// ---- the plan ---------------------------------------------------------------
LinearPlan linear_plan(int64_t m, int64_t n, int64_t k, const LinearPlanOverrides& o) {
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
  // Each rule that picks the stream kernel names itself (stream_rule).
  const LinearPlan stream_one = m <= kStreamMaxM ? stream_shape(m, ntiles, tiles_k, o) : LinearPlan{};
  const LinearPlan stream_two =
      m >= kStreamTilesMinM && m <= kStreamTilesMaxM ? stream_shape(m, ntiles, tiles_k, o, 2) : LinearPlan{};
  const char* const tiles_rule = stream_tiles_pay(m, ntiles, tiles_k, stream_one, stream_two, o);
  const bool stream_tiles = tiles_rule != nullptr;
  const LinearPlan& stream_plan = stream_tiles ? stream_two : stream_one;
  const bool stream_spread =
      stream_plan.ctas_per_sm > 0 && ntiles * stream_plan.splits * stream_plan.warps >= 10 * sms;
  const char* stream_k_rule = nullptr;
  const int64_t stream_k =
      m <= kStreamMaxM && !stream_tiles ? stream_k_ctas(m, ntiles, tiles_k, stream_plan, o, &stream_k_rule) : 0;
  const char* const stream_rule =
      stream_tiles        ? tiles_rule
      : m > kStreamMaxM   ? nullptr
      : stream_k > 0      ? stream_k_rule
      : m > 4             ? "5..8 rows: the stream kernel, twice the narrow kernel's warps per SM, where the narrow "
                            "kernel's x fragments cost it most (Linear v9)"
      : stream_spread     ? "1..4 rows: the stream kernel's CTAs, capped at 16 warps per SM, bring 10 warps or more "
                            "to every SM (stream_shape, Linear v13)"
      : one_wave_warps_per_tile(ntiles) == 0 && ntiles > 4 * sms
          ? "1..4 rows: the narrow kernel has no one-wave shape and more than 4 W tiles per SM (Linear v9)"
          : nullptr;
  const bool stream = stream_rule != nullptr;
  // M 12..16: the panel kernel where its grid runs in one wave (Linear v15):
  // x crosses L2 once per 128 W rows and K chunk, not once per 16 W rows.
  // Longer K or more W tiles (the 71 MB shapes) stay on the wide kernel.
  // Below 12 rows the narrow kernel's x traffic (distinct rows only) is
  // small enough that it matches or beats the panel kernel's fixed cost.
  const bool panel_asked = m <= kPanelMaxM && (m >= kPanelMinM || o.path == LinearPath::kPanel);
  const PanelShape panel = panel_asked ? panel_shape(m, ntiles, tiles_k, o.panel_splits) : PanelShape{};
  LinearPath path;
  const char* rule;  // explain_linear_plan's "why"
  if (stream) {
    path = LinearPath::kStream;
    rule = stream_rule;
  } else if (m >= kPanelMinM && panel.one_wave) {
    path = LinearPath::kPanel;
    rule = "12..16 rows: the panel kernel's grid runs in one wave and K fits its chunks (panel_shape, Linear v15)";
  } else if (m <= kNarrowMaxM && !wide_small_m) {
    path = LinearPath::kNarrow;
    rule = m <= kStreamMaxM ? "1..4 rows that no stream rule takes: the narrow kernel (Linear v7)"
                            : "9..16 rows that neither two W tiles per warp nor a one-wave panel grid take, on too few "
                              "W tiles for the wide kernel's unsplit CTAs to fill 40% of the SMs: the narrow kernel";
  } else if (m <= kWideMaxM) {
    path = LinearPath::kWide;
    rule = m <= kNarrowMaxM ? "9..16 rows on many W tiles (the wide kernel's unsplit CTAs fill 40% of the SMs or "
                              "more): the wide kernel, x shared by 8 W tiles through shared memory"
                            : "17..128 rows: the wide kernel";
  } else if (m <= kWgmmaMaxM) {
    path = LinearPath::kWgmma;
    rule = "129..2048 rows: the wgmma kernel";
  } else {
    path = LinearPath::kUnpack;
    rule = "more than 2048 rows: the weight unpacked, then cuBLAS, which there costs less than the wgmma kernel's "
           "distance to cuBLAS (Linear v8)";
  }
  if (o.path) {
    path = *o.path;
    rule = "the path the plan string names";
  }
  const char* fallback = nullptr;
  if (path == LinearPath::kStream && m > (stream_tiles ? kStreamTilesMaxM : kStreamMaxM)) {
    path = LinearPath::kNarrow;
    fallback = "more rows than the stream kernel takes: the narrow kernel instead";
  } else if (path == LinearPath::kStream && padded_k(k) > kStreamMaxPaddedK) {
    path = LinearPath::kNarrow;
    fallback = "K past the stream kernel's 32-bit counts: the narrow kernel instead";
  }
  if (path == LinearPath::kPanel && panel.splits == 0) {
    path = LinearPath::kWide;
    fallback = "more than 16 rows, or K too long for the panel kernel's chunks: the wide kernel instead";
  }
  // The stream and narrow kernels put the 16-row W tiles on grid y, at most
  // 65535 of them (N <= 1048560); the wide kernel's 128-row blocks are on x.
  if ((path == LinearPath::kStream || path == LinearPath::kNarrow) && ntiles > cuda::kMaxGridDimYZ) {
    path = LinearPath::kWide;
    fallback = "more than 65535 W tiles, the stream and narrow kernels' grid y: the wide kernel instead";
  }
  p.path = path;
  p.rule = rule;
  p.fallback = fallback;
  if (path == LinearPath::kStream) {
    p = stream_plan;
    p.rule = rule;
    p.fallback = fallback;
    if (stream_k > 0) {
      p.splits = 1;
      p.stream_stages = mma::kStreamStages;  // its kernel's rings (runs of 96 units or more)
      p.ctas_per_sm = static_cast<int>(cuda::ceil_div(stream_k, sms));
      p.stream_k_ctas = stream_k;
      p.workspace_bytes = stream_k_workspace_bytes(stream_k);
      return p;
    }
    const int forced_cap = o.stream_ctas_per_sm.value_or(0);
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
    p.wide_wgmma = wide_uses_wgmma(m, n, k, p.mt, o.wide_wgmma);
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
    p.wgmma_pair = linear_wgmma_pairs(m, p.splits, o.wgmma_pair);
    return p;
  } else {
    p.splits = 1;
    return p;
  }
  p.workspace_bytes = p.splits > 1 && !p.splits_in_cluster ? p.splits * m * n * int64_t{sizeof(float)} : 0;
  if (p.wide_wgmma) p.workspace_bytes += wide_image_bytes(m, k, p.mt);  // the image, then any partials
  return p;
}

// ---- the wgmma kernel -------------------------------------------------------
int linear_wgmma_tokens(int64_t m) { return m <= 128 ? 128 : 256; }

bool linear_wgmma_pairs(int64_t m, int64_t splits, std::optional<bool> forced) {
  // Pairs halve each CTA's decode but tie two CTAs together. Measured
  // (docs/perf/log/linear.md, Linear v14): from 4 token tiles of 256 (M 1024-2048)
  // mostly 2-8% faster; with one (M = 256) 2x slower, as a pair's second
  // CTA has no tokens; 2 and 3 tiles not measured, left unpaired.
  // `forced` turns them off or on (where the tiles are 256 tokens and K is
  // not split).
  if (linear_wgmma_tokens(m) != 256 || splits != 1) return false;
  return forced ? *forced : m > 3 * 256;
}

int64_t linear_wgmma_splits(int64_t m, int64_t n, int64_t k) {
  // Tiles of 128 W rows x NT tokens, one CTA each (one per SM: shared
  // memory). K is split (a cluster of up to 8 CTAs per tile) when that
  // lowers waves x (k-tiles per split + 2, + 3 more for a split tile), the
  // 2 standing for a CTA's pipeline fill and epilogue, the 3 for the
  // cluster's reduction; a wave is as many clusters as the device runs at
  // once (resident_clusters); no split is empty.
  const int nt = linear_wgmma_tokens(m);
  const int64_t tiles = cuda::ceil_div(m, nt) * cuda::ceil_div(n, kWgmmaBlockRows), tiles_k = padded_k(k) / kTileK;
  int64_t best = 1, best_cost = INT64_MAX;
  for (int s = 1; s <= wgmma::kMaxSplits && s <= tiles_k; ++s) {
    const int64_t per = cuda::ceil_div(tiles_k, s);
    if (cuda::ceil_div(tiles_k, per) != s) continue;
    const int64_t resident = linear_wgmma_resident_clusters(nt, s);
    const int64_t cost = cuda::ceil_div(tiles, resident) * (per + 2 + (s > 1 ? 3 : 0));
    if (cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

// ---- the plan in words -------------------------------------------------------
// Built with std::string and std::to_string: plain strings, no stream state.
// (With a host compiler that instantiated ostream's code into the library,
// the stream version crashed; the build now rules such a compiler out:
// docs/ARCHITECTURE.md, "Toolchain".)
namespace {

std::string num(int64_t n) { return std::to_string(n); }
// "1 warp", "8 warps".
std::string count(int64_t n, const char* one, const char* many) { return num(n) + " " + (n == 1 ? one : many); }
// "K unsplit" or "K in 3 splits".
std::string k_splits(int64_t splits) { return splits == 1 ? "K unsplit" : "K in " + count(splits, "split", "splits"); }

// The kernel form and its shape, from the plan alone.
std::string describe_kernel(const LinearPlan& p) {
  std::string s;
  switch (p.path) {
    case LinearPath::kStream:
      if (p.stream_k_ctas > 0 && p.stream_tiles != 2)  // as linear_fused_cuda launches it
        return "stream-K (sm90_linear_stream_k.cu): " + num(p.stream_k_ctas) + " CTAs of " +
               count(p.warps, "warp", "warps") +
               " in one wave, each on an equal run of (W tile, k-tile) units across W tiles, a tile's pieces "
               "added in k order";
      s = "stream (sm90_linear_stream.cu): " + count(p.warps, "warp", "warps") + " per CTA, " +
          count(p.stream_tiles, "W tile", "W tiles") + " per warp, rings of " + num(p.stream_stages) + " slots, " +
          k_splits(p.splits);
      if (p.ctas_per_sm > 0) s += ", at most " + count(p.ctas_per_sm, "CTA", "CTAs") + " per SM";
      return s;
    case LinearPath::kNarrow:
      return "narrow (sm90_linear_stream.cu): " + count(p.warps, "warp", "warps") + " per 16-row W tile, " +
             count(p.mt, "m-tile", "m-tiles") + " of 8 rows per warp, " + k_splits(p.splits);
    case LinearPath::kPanel:
      s = "panel (sm90_linear_panel.cu): " + num(mma::kPanelWarps) + " warps on " + num(16 * mma::kPanelWarps) +
          " W rows, " + k_splits(p.splits);
      break;
    case LinearPath::kWide:
      s = std::string("wide (sm90_linear_wide.cu) on ") +
          (p.wide_wgmma ? "wgmma after an x image pass" : "mma.sync") + ": 128 W rows x " + num(8 * p.mt) +
          " rows of x per CTA, " + k_splits(p.splits);
      break;
    case LinearPath::kWgmma:
      return "wgmma (sm90_linear_wgmma.cu): 128 W rows x " + num(p.mt) +
             " tokens per CTA, W decoded into shared memory, " + k_splits(p.splits) +
             (p.splits > 1 ? " (a cluster)" : "") + (p.wgmma_pair ? ", CTAs in pairs that share the decode" : "");
    case LinearPath::kUnpack:
      return "unpack + cuBLAS (the binding): the weight unpacked to x's dtype, then at::linear";
  }
  if (p.splits > 1) s += p.splits_in_cluster ? " added in a cluster" : " added through FP32 partials";
  return s;
}

}  // namespace

std::string explain_linear_plan(int64_t m, int64_t n, int64_t k, const LinearPlanOverrides& overrides) {
  const LinearPlan p = linear_plan(m, n, k, overrides);
  const bool stream_k = p.path == LinearPath::kStream && p.stream_k_ctas > 0 && p.stream_tiles != 2;
  std::string s;
  s += std::string("path: ") + linear_path_name(p.path) + "\n";
  s += std::string("form: ") + (stream_k ? "stream-k" : linear_path_name(p.path)) + "\n";
  s += "kernel: " + describe_kernel(p) + "\n";
  s += std::string("why: ") + p.rule + (p.fallback ? "; then " : "") + (p.fallback ? p.fallback : "") + "\n";
  s += "workspace: " + num(p.workspace_bytes) + " bytes";
  if (stream_k)
    s += " (the pieces' partial sums and flags)";
  else if (p.wide_wgmma)
    s += std::string(" (the x image") + (p.workspace_bytes > wide_image_bytes(m, k, p.mt) ? ", then FP32 partials)" : ")");
  else if (p.workspace_bytes > 0)
    s += " (FP32 partials of the K splits)";
  s += "\n";
  s += "device: " + num(cuda::num_sms()) + " SMs, " + num(cuda::smem_per_sm() / 1024) + " KB of shared memory per SM\n";
  const std::string forced = to_plan_string(overrides);
  s += "plan: " + (forced.empty() ? std::string("the shipped plan (no overrides)") : forced) + "\n";
  return s;
}

}  // namespace lowbit::nvfp4::gemm
