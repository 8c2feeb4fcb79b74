// The NVFP4 Linear's small-M dispatch (gemm::linear_plan), decided on the
// host from the shape, the SM count and shared memory per SM, which without
// a device are the H100's (132 SMs, 228 KB). Two kinds of checks:
//   * invariants every plan must keep, whatever the heuristic picks (the
//     kernels' limits: rows a form takes, K splits that each get k-tiles,
//     grid sizes, CTAs per SM the kernels' footprints allow, workspaces),
//     swept over many shapes at M = 1..16;
//   * a few pinned choices, each saying what it guards: a hard limit that
//     sends a shape to another kernel, a form the plan must still pick
//     somewhere (else it runs only when forced), or a resource bound of a
//     kernel's footprint. Tuning choices themselves (warps, caps, split
//     counts measured in docs/perf/log/linear.md) are not pinned: a retuned
//     heuristic changes them, and the GPU tests (test_linear_kernels_cuda.py,
//     test_linear_plans_cuda.py: every M of 1..2048 against a reference)
//     check that whatever is picked computes the right answer.
// Also the plan strings' overrides (the plans the GPU tests force keep the
// invariants; what each key forces) and explain_linear_plan's text.
// Plans at more rows also depend on occupancy queries (panel, wide, wgmma)
// and are left to the GPU tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#if defined(LOWBIT_WITH_CUDA)
#include "lowbit/linear/nvfp4_linear.h"

namespace lowbit::cuda {
// From lowbit/arch/cuda_utils.cuh, which also holds device code a host compiler
// cannot take.
int num_sms();
int smem_per_sm();
}  // namespace lowbit::cuda

namespace {
namespace gemm = lowbit::nvfp4::gemm;
using gemm::LinearPath;

constexpr int64_t kTileRows = 16;

// The plans below are an H100's (or no device's, which reports the H100's
// attributes); another GPU gets other plans.
class LinearPlan : public ::testing::Test {
 protected:
  void SetUp() override {
    if (lowbit::cuda::num_sms() != 132 || lowbit::cuda::smem_per_sm() != 233472)
      GTEST_SKIP() << "plans pinned for 132 SMs with 228 KB of shared memory each";
  }
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What every plan of (m, n, k) must keep, whichever form and shape the
// heuristic picks.
void ExpectValidPlan(int64_t m, int64_t n, int64_t k, const gemm::LinearPlan& p) {
  SCOPED_TRACE(::testing::Message() << "m " << m << " n " << n << " k " << k << " path "
                                    << static_cast<int>(p.path));
  const int64_t tiles = n / kTileRows;
  const int64_t padded_k = CeilDiv(k, gemm::kTileK) * gemm::kTileK;
  const int64_t tiles_k = padded_k / gemm::kTileK;
  const int64_t sms = lowbit::cuda::num_sms();
  // The rows each form takes.
  switch (p.path) {
    case LinearPath::kStream:
      EXPECT_LE(m, p.stream_tiles == 2 ? gemm::kStreamTilesMaxM : gemm::kStreamMaxM);
      break;
    case LinearPath::kPanel:
      EXPECT_GE(m, gemm::kPanelMinM);
      EXPECT_LE(m, gemm::kPanelMaxM);
      break;
    case LinearPath::kNarrow:
      EXPECT_LE(m, gemm::kNarrowMaxM);
      break;
    case LinearPath::kWide:
      EXPECT_LE(m, gemm::kWideMaxM);
      break;
    case LinearPath::kWgmma:
      EXPECT_LE(m, gemm::kWgmmaMaxM);
      break;
    case LinearPath::kUnpack:
      EXPECT_GT(m, gemm::kWgmmaMaxM);
      break;
  }
  // K splits: at least one, each with k-tiles (no empty split).
  EXPECT_GE(p.splits, 1);
  if (p.path != LinearPath::kUnpack && tiles_k > 0) {
    EXPECT_LE(p.splits, tiles_k);
    EXPECT_EQ(CeilDiv(tiles_k, CeilDiv(tiles_k, p.splits)), p.splits);
  }
  // Splits added in a cluster: the wide kernel on wgmma and the panel
  // kernel only, at most 8 CTAs (the portable cluster size).
  if (p.splits_in_cluster) {
    EXPECT_TRUE((p.path == LinearPath::kWide && p.wide_wgmma) || p.path == LinearPath::kPanel);
    EXPECT_LE(p.splits, 8);
  }
  EXPECT_TRUE(!p.wide_wgmma || p.path == LinearPath::kWide);
  EXPECT_TRUE(!p.wgmma_pair || p.path == LinearPath::kWgmma);
  // The stream and narrow kernels put the W tiles on grid y.
  if (p.path == LinearPath::kStream || p.path == LinearPath::kNarrow) {
    EXPECT_LE(tiles, 65535);
    EXPECT_TRUE(p.warps == 1 || p.warps == 2 || p.warps == 4 || p.warps == 8) << p.warps;
  }
  if (p.path == LinearPath::kStream) {
    EXPECT_LE(padded_k, gemm::kStreamMaxPaddedK);  // its 32-bit counters
    EXPECT_TRUE(p.stream_tiles == 1 || p.stream_tiles == 2) << p.stream_tiles;
    if (p.stream_tiles == 2) {
      EXPECT_GE(m, gemm::kStreamTilesMinM);  // no pair build below
    }
    EXPECT_TRUE(p.stream_stages == 2 || p.stream_stages == gemm::kStreamRingSlots) << p.stream_stages;
    EXPECT_GE(p.ctas_per_sm, 0);
    EXPECT_LE(p.ctas_per_sm, gemm::stream_ctas_per_sm_max(p.warps, static_cast<int>(m), p.stream_tiles,
                                                          p.stream_stages));
    if (p.stream_k_ctas > 0) {
      // The stream-K form: one wave of CTAs on runs of k-tiles across the
      // tiles, each with a unit at least; a slot and a flag each.
      EXPECT_LE(m, gemm::kStreamMaxM);
      EXPECT_EQ(p.splits, 1);
      EXPECT_EQ(p.stream_tiles, 1);
      EXPECT_EQ(p.stream_stages, gemm::kStreamRingSlots);
      EXPECT_LE(p.stream_k_ctas, tiles * tiles_k);
      EXPECT_GT(p.ctas_per_sm, 0);
      EXPECT_LE(p.stream_k_ctas, p.ctas_per_sm * sms);
      EXPECT_GT(p.workspace_bytes, 0);
    }
  } else {
    EXPECT_EQ(p.stream_k_ctas, 0);
  }
  // The x rows a CTA covers: narrow one or two 8-row m-tiles for up to 16
  // rows; wide 16, 32 or 64 rows per CTA (more rows: more row blocks).
  if (p.path == LinearPath::kNarrow) {
    EXPECT_TRUE(p.mt == 1 || p.mt == 2) << p.mt;
    EXPECT_GE(8 * p.mt, m);
  }
  if (p.path == LinearPath::kWide) {
    EXPECT_TRUE(p.mt == 2 || p.mt == 4 || p.mt == 8) << p.mt;
    EXPECT_GE(8 * p.mt, std::min<int64_t>(m, 64));
  }
  // K split through FP32 partials: a [splits, M, N] workspace (the wide
  // wgmma kernel adds its x image to that).
  if (p.stream_k_ctas == 0 && p.path != LinearPath::kWgmma && p.path != LinearPath::kUnpack) {
    const int64_t partials = p.splits > 1 && !p.splits_in_cluster ? p.splits * m * n * int64_t{sizeof(float)} : 0;
    if (p.wide_wgmma) {
      EXPECT_GT(p.workspace_bytes, partials);
    } else {
      EXPECT_EQ(p.workspace_bytes, partials);
    }
  }
}

TEST_F(LinearPlan, EveryPlanIsValid) {
  // W tiles from one to past grid y's limit (few tiles: K split; uneven
  // waves; 65536: the wide kernel), K from one k-tile (and partial ones) to
  // long runs, every M of the small-M forms.
  const int64_t tile_counts[] = {1, 3, 16, 96, 256, 350, 448, 700, 1152, 1400, 2048, 3200, 65535, 65536};
  const int64_t ks[] = {16, 32, 400, 1168, 1536, 2064, 4096, 4112, 7168, 18432, 32768};
  for (const int64_t tiles : tile_counts) {
    for (const int64_t k : ks) {
      if (tiles >= 65535 && k > 32) continue;  // the grid limit is what these check; keep them small
      for (int64_t m = 1; m <= gemm::kNarrowMaxM; ++m) {
        ExpectValidPlan(m, tiles * kTileRows, k, gemm::linear_plan(m, tiles * kTileRows, k));
      }
    }
  }
}

TEST_F(LinearPlan, TheStreamFormsArePickedSomewhere) {
  // Guards that the plan still reaches each form of the stream kernel
  // without overrides (else it would run only in the forced GPU tests):
  // stream-K at M <= 8 where whole tiles sit unevenly on the SMs and K is
  // long (18432 x 7168, Linear v21); two W tiles per warp at 5..8 rows
  // (1536 x 24576, Linear v23) and at 9..16 (2048 x 7168), with 8-warp CTAs
  // over the whole K (8192 x 4096, Linear v27); rings of 2 slots on short
  // runs and of 3 on long ones (Linear v25). Which shapes take them is
  // tuning, so a retuned heuristic may move these examples.
  for (int64_t m = 1; m <= gemm::kStreamMaxM; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 7168, 18432);
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_GT(p.stream_k_ctas, 0) << m;
  }
  for (int64_t m = 5; m <= 8; ++m) EXPECT_EQ(gemm::linear_plan(m, 24576, 1536).stream_tiles, 2) << m;
  for (int64_t m = 9; m <= 11; ++m) EXPECT_EQ(gemm::linear_plan(m, 7168, 2048).stream_tiles, 2) << m;
  const gemm::LinearPlan eight = gemm::linear_plan(12, 4096, 8192);
  EXPECT_EQ(eight.path, LinearPath::kStream);
  EXPECT_EQ(eight.stream_tiles, 2);
  EXPECT_EQ(eight.warps, 8);
  EXPECT_EQ(gemm::linear_plan(1, 4096, 4096).stream_stages, 2);
  EXPECT_EQ(gemm::linear_plan(1, 4096, 8192).stream_stages, gemm::kStreamRingSlots);
}

TEST_F(LinearPlan, StreamCtasPerSm) {
  // Resource bounds of the stream kernel's footprint (registers, shared
  // memory for its rings and partial sums), not tuning: they change only
  // with the kernel. Shared memory bounds 8-warp CTAs (rings of 1, 2 and 4
  // x row pairs) at 4, 3 and 2 per SM; 4-warp CTAs at one row by registers,
  // 8.
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 1), 4);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 3), 3);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 8), 2);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(4, 1), 8);
  // Two tiles per warp: 16 warps at most (registers); the 20.3 KB rings of
  // 16 rows hold one 8-warp or two 4-warp CTAs, those of 8 rows four.
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 16, 2), 1);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(4, 16, 2), 2);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(4, 8, 2), 4);
  // Smaller rings fit more CTAs: 2-warp CTAs of two tiles at 16 rows, 5 a
  // SM with 3 slots, 6 or more with 2.
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(2, 16, 2, 3), 5);
  EXPECT_GE(gemm::stream_ctas_per_sm_max(2, 16, 2, 2), 6);
}

TEST_F(LinearPlan, KTooLongForTheStreamCountersRunsTheNarrowKernel) {
  // A hard limit: the stream kernel's 32-bit counters (Linear v19) hold
  // padded K up to kStreamMaxPaddedK; one k-tile more goes to the narrow
  // kernel.
  const int64_t longest = gemm::kStreamMaxPaddedK;
  EXPECT_EQ(longest % gemm::kTileK, 0);
  for (int64_t m : {1, 8}) {
    EXPECT_EQ(gemm::linear_plan(m, 16 * 4096, longest).path, LinearPath::kStream) << m;
    EXPECT_EQ(gemm::linear_plan(m, 16 * 4096, longest + 1).path, LinearPath::kNarrow) << m;
  }
}

// The plan strings of the GPU tests (test_linear_kernels_cuda.py,
// test_linear_plans_cuda.py, test_concurrency.py) and the rows they force:
// every plan they give keeps the invariants, so that each forced form can
// launch.
TEST_F(LinearPlan, EveryForcedPlanIsValid) {
  struct Forced {
    const char* plan;
    int64_t m_lo, m_hi;
  };
  const Forced forced[] = {
      {"path=stream,stream_tiles=1", 1, 8},
      {"path=stream,stream_tiles=1,stream_ctas_per_sm=3", 1, 8},
      {"path=stream,stream_tiles=2", 5, 16},
      {"path=stream,stream_tiles=2,stream_ctas_per_sm=1", 5, 16},
      {"path=stream,stream_tiles=2,stream_warps=8,stream_splits=1", 9, 16},
      {"path=stream,stream_tiles=1,stream_stages=2", 1, 8},
      {"path=stream,stream_tiles=2,stream_stages=3", 5, 16},
      {"stream_k=1", 1, 16},
      {"stream_k=1,stream_ctas_per_sm=1", 1, 16},
      {"stream_k=1,wide_wgmma=1,wgmma_pair=1", 1, 16},
      {"stream_tiles=2,stream_stages=3,wide_wgmma=0,wgmma_pair=0", 1, 16},
      {"path=narrow", 1, 16},
      {"path=wide", 1, 16},
      {"path=panel", gemm::kPanelMinM, 16},
      {"stream_warps=2,stream_splits=3", 1, 8},
  };
  const int64_t tile_counts[] = {1, 3, 16, 256, 350, 1152, 2707, 65536};
  const int64_t ks[] = {32, 400, 1168, 2176, 7168, 18432};
  for (const Forced& f : forced) {
    const gemm::LinearPlanOverrides o = gemm::parse_linear_plan_string(f.plan);
    for (const int64_t tiles : tile_counts)
      for (const int64_t k : ks) {
        if (tiles >= 65535 && k > 32) continue;
        for (int64_t m = f.m_lo; m <= f.m_hi; ++m) {
          SCOPED_TRACE(f.plan);
          const gemm::LinearPlan p = gemm::linear_plan(m, tiles * kTileRows, k, o);
          ExpectValidPlan(m, tiles * kTileRows, k, p);
          EXPECT_NE(p.rule, nullptr);
        }
      }
  }
}

TEST_F(LinearPlan, OverridesApplyWhereTheyCan) {
  // What each key forces, and the limits that still move a forced path.
  auto plan = [](int64_t m, int64_t n, int64_t k, const char* s) {
    return gemm::linear_plan(m, n, k, gemm::parse_linear_plan_string(s));
  };
  for (int64_t m = 1; m <= 8; ++m) {
    const gemm::LinearPlan p = plan(m, 4096, 1024, "stream_k=1");
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_GT(p.stream_k_ctas, 0) << m;
    EXPECT_EQ(plan(m, 7168, 18432, "stream_k=0").stream_k_ctas, 0) << m;
    EXPECT_EQ(plan(m, 4096, 1024, "path=narrow").path, LinearPath::kNarrow) << m;
  }
  for (int64_t m = 5; m <= 16; ++m) {
    const gemm::LinearPlan p = plan(m, 4096, 1024, "path=stream,stream_tiles=2,stream_stages=3");
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_EQ(p.stream_tiles, 2) << m;
    EXPECT_EQ(p.stream_stages, 3) << m;
  }
  // Above the stream kernel's rows, the narrow kernel; panel above 16 rows,
  // the wide kernel: each with the rule and the limit that moved it.
  const gemm::LinearPlan narrow = plan(12, 4096, 1024, "path=stream,stream_tiles=1");
  EXPECT_EQ(narrow.path, LinearPath::kNarrow);
  EXPECT_STREQ(narrow.rule, "the path the plan string names");
  EXPECT_NE(narrow.fallback, nullptr);
  EXPECT_EQ(plan(20, 4096, 1024, "path=panel").path, LinearPath::kWide);
  EXPECT_EQ(plan(3, 4096, 1024, "path=panel,panel_splits=2").splits, 2);
  EXPECT_EQ(plan(100, 4096, 1024, "path=wgmma").path, LinearPath::kWgmma);
  EXPECT_EQ(plan(100, 4096, 1024, "path=unpack").path, LinearPath::kUnpack);
  EXPECT_TRUE(plan(64, 4096, 1024, "path=wide,wide_wgmma=1").wide_wgmma);
  EXPECT_FALSE(plan(64, 4096, 16384, "wide_wgmma=0").wide_wgmma);
  // (Whether pairs can be forced on depends on the wgmma K splits, which
  // read the occupancy: left to the GPU tests.)
  EXPECT_FALSE(plan(1000, 16 * 769, 2176, "wgmma_pair=0").wgmma_pair);
  EXPECT_EQ(plan(1, 4096, 4096, "path=stream,stream_warps=2,stream_ctas_per_sm=1").warps, 2);
  EXPECT_EQ(plan(1, 4096, 4096, "path=stream,stream_warps=2,stream_ctas_per_sm=1").ctas_per_sm, 1);
}

TEST_F(LinearPlan, ExplainNamesTheFormAndTheRule) {
  const gemm::LinearPlan p = gemm::linear_plan(1, 4096, 4096);
  EXPECT_NE(p.rule, nullptr);
  EXPECT_EQ(p.fallback, nullptr);
  const std::string text = gemm::explain_linear_plan(1, 4096, 4096);
  EXPECT_NE(text.find("path: stream\nform: stream\nkernel: stream (sm90_linear_stream.cu): "), std::string::npos)
      << text;
  EXPECT_NE(text.find(std::string("why: ") + p.rule + "\n"), std::string::npos) << text;
  EXPECT_NE(text.find("plan: the shipped plan (no overrides)\n"), std::string::npos) << text;
  const std::string forced =
      gemm::explain_linear_plan(1, 4096, 4096, gemm::parse_linear_plan_string("stream_ctas_per_sm=1,stream_k=1"));
  EXPECT_NE(forced.find("form: stream-k\n"), std::string::npos) << forced;
  EXPECT_NE(forced.find("why: stream-K, as the plan string asks (stream_k=1)\n"), std::string::npos) << forced;
  EXPECT_NE(forced.find("plan: stream_ctas_per_sm=1,stream_k=1\n"), std::string::npos) << forced;
  const std::string moved = gemm::explain_linear_plan(1, 65536 * kTileRows, 32);
  EXPECT_NE(moved.find("path: wide\n"), std::string::npos) << moved;
  EXPECT_NE(moved.find("; then more than 65535 W tiles"), std::string::npos) << moved;
  EXPECT_NE(gemm::explain_linear_plan(4096, 4096, 4096).find("form: unpack\n"), std::string::npos);
}

TEST_F(LinearPlan, MoreTilesThanGridYHoldsRunTheWideKernel) {
  // A hard limit: the stream and narrow kernels put the W tiles on grid y
  // (at most 65535, a launch error beyond); test_cuda_more_w_tiles_than_grid_y_holds
  // runs the shape on the GPU.
  for (int64_t m : {1, 5}) {
    EXPECT_EQ(gemm::linear_plan(m, 65535 * kTileRows, 32).path, LinearPath::kStream) << m;
    EXPECT_EQ(gemm::linear_plan(m, 65536 * kTileRows, 32).path, LinearPath::kWide) << m;
  }
}
}  // namespace
#endif
