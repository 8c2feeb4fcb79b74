// The NVFP4 Linear's small-M dispatch (gemm::linear_plan): decisions that
// depend only on the SM count and shared memory per SM, which without a
// device are the H100's (132 SMs, 228 KB), so CI pins the plans that
// docs/perf/log/linear.md measured and the GPU tests' comments describe. Plans that
// also depend on occupancy queries (panel, wide, wgmma) need the device and
// are left to the GPU tests.
#include <gtest/gtest.h>

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

TEST_F(LinearPlan, StreamKernelShapesOfTheSmallMTest) {
  // test_cuda_small_m_kernel_shapes (K = 1168: 10 k-tiles), M = 1: one warp
  // per tile on 2048 and 1400 tiles, at most 16 and 11 CTAs per SM; two on
  // 1152 and 700 tiles, at most 8 and 6; two on 3200, uncapped.
  struct Case {
    int64_t tiles;
    int warps, ctas_per_sm;
  };
  for (const Case c : {Case{2048, 1, 16}, Case{1400, 1, 11}, Case{1152, 2, 8}, Case{700, 2, 6}, Case{3200, 2, 0}}) {
    const gemm::LinearPlan p = gemm::linear_plan(1, c.tiles * kTileRows, 1168);
    EXPECT_EQ(p.path, LinearPath::kStream) << c.tiles;
    EXPECT_EQ(p.warps, c.warps) << c.tiles;
    EXPECT_EQ(p.ctas_per_sm, c.ctas_per_sm) << c.tiles;
    EXPECT_EQ(p.splits, 1) << c.tiles;
  }
  // 350 tiles: M 1..4 on the narrow kernel (4 warps per tile), 5..8 stream.
  for (int64_t m = 1; m <= 8; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 350 * kTileRows, 1168);
    EXPECT_EQ(p.path, m <= 4 ? LinearPath::kNarrow : LinearPath::kStream) << m;
    if (m <= 4) {
      EXPECT_EQ(p.warps, 4) << m;
    }
  }
  // K = 2064 (17 k-tiles) on 1400 tiles: one warp per tile, 11 per SM, at
  // M 1..4; at 5..8, where such SMs are short of 16 warps, two tiles per
  // warp (Linear v23).
  for (int64_t m = 1; m <= 8; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 1400 * kTileRows, 2064);
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_EQ(p.stream_tiles, m <= 4 ? 1 : 2) << m;
    if (m <= 4) {
      EXPECT_EQ(p.warps, 1) << m;
      EXPECT_EQ(p.ctas_per_sm, 11) << m;
    }
  }
  // K = 4112 on 700 tiles: 8 stream warps per tile are too many for the
  // cap, so M 1..4 run the narrow kernel, 2 warps per tile.
  for (int64_t m = 1; m <= 4; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 700 * kTileRows, 4112);
    EXPECT_EQ(p.path, LinearPath::kNarrow) << m;
    EXPECT_EQ(p.warps, 2) << m;
  }
}

TEST_F(LinearPlan, BenchShapesAtOneRow) {
  // docs/perf/log/linear.md, Linear v16: 1536 x 24576 (1536 tiles) one warp per tile at
  // 12 CTAs per SM.
  gemm::LinearPlan p = gemm::linear_plan(1, 24576, 1536);
  EXPECT_EQ(p.path, LinearPath::kStream);
  EXPECT_EQ(p.warps, 1);
  EXPECT_EQ(p.ctas_per_sm, 12);
  EXPECT_EQ(p.stream_k_ctas, 0);
  // 7168 x 18432 (1152 tiles, 56 k-tiles): 8 warps per tile, uncapped
  // (4 CTAs per SM at one row, 3 at three; Linear v17; v18's fuller waves
  // at 3 per SM gained under 1% and were dropped).
  for (int64_t m : {1, 3}) {
    p = gemm::linear_plan(m, 18432, 7168);
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_EQ(p.warps, 8) << m;
    EXPECT_EQ(p.splits, 1) << m;
    EXPECT_EQ(p.ctas_per_sm, 0) << m;
  }
  // Few tiles: K split so that the CTAs cover the SMs (4096 x 1536: 96
  // tiles), with a workspace for the partials.
  p = gemm::linear_plan(1, 1536, 4096);
  EXPECT_GT(p.splits, 1);
  EXPECT_EQ(p.workspace_bytes, p.splits * 1 * 1536 * int64_t{sizeof(float)});
}

TEST_F(LinearPlan, StreamKWhereWholeTilesSitUnevenly) {
  // Linear v21: 18432 x 7168 (448 tiles of 144 k-tiles: 3.4 a SM on
  // average, 4 on the busiest) runs stream-K at every M <= 8: 264 CTAs of 8
  // warps, 244 units each, a slot and a flag per CTA in the workspace.
  for (int64_t m = 1; m <= 8; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 7168, 18432);
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_EQ(p.warps, 8) << m;
    EXPECT_EQ(p.stream_k_ctas, 264) << m;
    EXPECT_EQ(p.ctas_per_sm, 2) << m;
    EXPECT_EQ(p.splits, 1) << m;
    EXPECT_EQ(p.workspace_bytes, 264 * (16 * 8 * int64_t{sizeof(float)} + 8)) << m;
  }
  // Not on short runs (2048 x 7168: uneven, but 27 units a CTA), nor past
  // M = 8.
  for (int64_t m : {1, 4, 8}) EXPECT_EQ(gemm::linear_plan(m, 7168, 2048).stream_k_ctas, 0) << m;
  EXPECT_EQ(gemm::linear_plan(9, 7168, 18432).stream_k_ctas, 0);
}

TEST_F(LinearPlan, StreamKWhereTheOneTileGridSpansMoreThanAWave) {
  // Linear v24: 7168 x 18432 (1152 tiles of 56 k-tiles) sits evenly (8.7 a
  // SM, 9 on the busiest). At M 1..4 its 8-warp CTAs run uncapped up to 32
  // warps a SM, whole tiles. At 7..8 rows, 4-warp CTAs of 10 KB rings a warp
  // hold 5 a SM: 1.75 waves, so stream-K (4 a SM, 122 units each); at 5..6,
  // 8-warp CTAs, 264 of 244 units.
  for (int64_t m = 1; m <= 8; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 18432, 7168);
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_EQ(p.splits, 1) << m;
    if (m <= 4) {
      EXPECT_EQ(p.stream_k_ctas, 0) << m;
      EXPECT_EQ(p.ctas_per_sm, 0) << m;
    } else {
      EXPECT_EQ(p.warps, m <= 6 ? 8 : 4) << m;
      EXPECT_EQ(p.stream_k_ctas, m <= 6 ? 264 : 528) << m;
    }
  }
  // Not where the one-tile grid fits a wave (8192 x 4096: 256 CTAs of 8
  // warps, 2 a SM), nor on CTAs of 1-2 warps (7168 x 65536, which lost
  // 6-7%), nor on runs under 96 units (4096 x 14336 at 7..8 rows: 4-warp
  // CTAs in 1.4 waves, 54 units a run).
  for (int64_t m = 5; m <= 8; ++m) {
    EXPECT_EQ(gemm::linear_plan(m, 4096, 8192).stream_k_ctas, 0) << m;
    EXPECT_EQ(gemm::linear_plan(m, 65536, 7168).stream_k_ctas, 0) << m;
  }
  for (int64_t m = 7; m <= 8; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 14336, 4096);
    EXPECT_EQ(p.warps, 4) << m;
    EXPECT_EQ(p.ctas_per_sm, 0) << m;
    EXPECT_EQ(p.stream_k_ctas, 0) << m;
  }
}

TEST_F(LinearPlan, TwoTilesPerWarpWhereThePairsPay) {
  // Linear v23: 2048 x 7168 (224 tile pairs of 16 k-tiles) at 9..11 rows:
  // one wave of 4-warp CTAs (the rings hold 3 a SM), K unsplit.
  for (int64_t m = 9; m <= 11; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 7168, 2048);
    EXPECT_EQ(p.path, LinearPath::kStream) << m;
    EXPECT_EQ(p.stream_tiles, 2) << m;
    EXPECT_EQ(p.warps, 4) << m;
    EXPECT_EQ(p.splits, 1) << m;
    EXPECT_EQ(p.workspace_bytes, 0) << m;
  }
  // At 5..8 rows where one warp per tile runs unsplit: 1536 x 24576 (12
  // one-warp CTAs a SM; the 768 pairs on 2-warp CTAs, 6 a SM) and, since
  // v26, 1024 x 32768 (16 a SM; 1024 pairs, 8 a SM), with 2-slot rings.
  struct Pairs {
    int64_t n, k;
    int ctas_per_sm;
  };
  for (const Pairs& s : {Pairs{24576, 1536, 6}, Pairs{32768, 1024, 8}}) {
    for (int64_t m = 5; m <= 8; ++m) {
      const gemm::LinearPlan p = gemm::linear_plan(m, s.n, s.k);
      EXPECT_EQ(p.stream_tiles, 2) << s.n << " " << m;
      EXPECT_EQ(p.warps, 2) << s.n << " " << m;
      EXPECT_EQ(p.ctas_per_sm, s.ctas_per_sm) << s.n << " " << m;
      EXPECT_EQ(p.stream_stages, 2) << s.n << " " << m;
      EXPECT_EQ(gemm::linear_plan(m - 4, s.n, s.k).stream_tiles, 1) << s.n << " " << m;  // no pair build below 5 rows
    }
  }
  // Linear v26: at 9..16 rows rings of 2 slots and CTAs of at most 4
  // warps, unsplit or K split in 2 (2048 x 7168 above; 18432 x 7168 at 16
  // rows: 224 pairs, 8 warps before the cap). Linear v27: 8-warp CTAs over
  // the whole K where the pairs give 90-100% of the SMs one CTA each
  // (8192 x 4096: 128 pairs, which v26 split in 2 on 4-warp CTAs), and
  // where they are more than the SMs, with runs of 4+ k-tiles and at most
  // 12 rows (two CTAs a SM leave L1 its 60 KB): 18432 x 7168 and 7168 x
  // 18432 (576 pairs, over two waves) at 9..12 rows.
  for (int64_t m : {9, 12, 16}) {
    const gemm::LinearPlan one_each = gemm::linear_plan(m, 4096, 8192);
    EXPECT_EQ(one_each.path, LinearPath::kStream) << m;
    EXPECT_EQ(one_each.stream_tiles, 2) << m;
    EXPECT_EQ(one_each.warps, 8) << m;
    EXPECT_EQ(one_each.splits, 1) << m;
    EXPECT_EQ(one_each.ctas_per_sm, 1) << m;
    EXPECT_EQ(one_each.stream_stages, 2) << m;
    EXPECT_EQ(one_each.workspace_bytes, 0) << m;
    const gemm::LinearPlan whole = gemm::linear_plan(m, 7168, 18432);
    EXPECT_EQ(whole.stream_tiles, 2) << m;
    EXPECT_EQ(whole.warps, m <= 12 ? 8 : 4) << m;
    EXPECT_EQ(whole.splits, 1) << m;
  }
  for (int64_t m = 9; m <= 16; ++m) {
    const gemm::LinearPlan p = gemm::linear_plan(m, 18432, 7168);
    EXPECT_EQ(p.path == LinearPath::kStream, m <= 12) << m;
    if (m <= 12) {
      EXPECT_EQ(p.stream_tiles, 2) << m;
      EXPECT_EQ(p.warps, 8) << m;
      EXPECT_EQ(p.splits, 1) << m;
    }
  }
  // Not where the pairs need 3 K splits (4096 x 1536: 48 pairs), nor at
  // M = 8 where the one-tile plan runs several warps per tile (2048 x 7168).
  EXPECT_EQ(gemm::linear_plan(8, 7168, 2048).stream_tiles, 1);
  EXPECT_NE(gemm::linear_plan(12, 1536, 4096).path, LinearPath::kStream);
}

TEST_F(LinearPlan, StreamCtasPerSm) {
  // Shared memory bounds 8-warp CTAs (rings of 1, 2 and 4 x row pairs) at
  // 4, 3 and 2 per SM; 4-warp CTAs at one row by registers, 8.
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 1), 4);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 3), 3);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 8), 2);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(4, 1), 8);
  // Two tiles per warp: 16 warps at most (registers); the 20.3 KB rings of
  // 16 rows hold one 8-warp or two 4-warp CTAs, those of 8 rows four.
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(8, 16, 2), 1);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(4, 16, 2), 2);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(4, 8, 2), 4);
}

TEST_F(LinearPlan, TwoRingSlotsWhereWarpRunsAreShort) {
  // Rings of 2 slots for runs of 6 k-tiles or fewer a warp, else 3 (Linear
  // v25): 4096 x 4096 and 2048 x 7168 (runs of 4) take 2, 8192 x 4096 (8)
  // 3; the stream-K form keeps 3 (7168 x 18432 at M = 8).
  for (int64_t m : {1, 8}) {
    EXPECT_EQ(gemm::linear_plan(m, 4096, 4096).stream_stages, 2) << m;
    EXPECT_EQ(gemm::linear_plan(m, 7168, 2048).stream_stages, 2) << m;
    EXPECT_EQ(gemm::linear_plan(m, 4096, 8192).stream_stages, 3) << m;
  }
  const gemm::LinearPlan k_plan = gemm::linear_plan(8, 18432, 7168);
  EXPECT_GT(k_plan.stream_k_ctas, 0);
  EXPECT_EQ(k_plan.stream_stages, 3);
  // Smaller rings fit more two-tile CTAs: 1536 x 24576 at M = 16 (768
  // pairs, runs of 6) now fits one wave at 6 two-warp CTAs a SM and takes
  // the stream kernel; with 3 slots, 5 a SM, it did not.
  const gemm::LinearPlan pairs = gemm::linear_plan(16, 24576, 1536);
  EXPECT_EQ(pairs.path, LinearPath::kStream);
  EXPECT_EQ(pairs.stream_tiles, 2);
  EXPECT_EQ(pairs.stream_stages, 2);
  EXPECT_EQ(gemm::stream_ctas_per_sm_max(2, 16, 2, 3), 5);
  EXPECT_GE(gemm::stream_ctas_per_sm_max(2, 16, 2, 2), 6);
}

TEST_F(LinearPlan, KTooLongForTheStreamCountersRunsTheNarrowKernel) {
  // The stream kernel's 32-bit counters (Linear v19) hold padded K up to
  // kStreamMaxPaddedK; one k-tile more goes to the narrow kernel.
  const int64_t longest = gemm::kStreamMaxPaddedK;
  EXPECT_EQ(longest % gemm::kTileK, 0);
  for (int64_t m : {1, 8}) {
    EXPECT_EQ(gemm::linear_plan(m, 16 * 4096, longest).path, LinearPath::kStream) << m;
    EXPECT_EQ(gemm::linear_plan(m, 16 * 4096, longest + 1).path, LinearPath::kNarrow) << m;
  }
}

TEST_F(LinearPlan, MoreTilesThanGridYHoldsRunTheWideKernel) {
  // The stream and narrow kernels put the W tiles on grid y (at most 65535).
  for (int64_t m : {1, 5}) {
    EXPECT_EQ(gemm::linear_plan(m, 65535 * kTileRows, 32).path, LinearPath::kStream) << m;
    EXPECT_EQ(gemm::linear_plan(m, 65536 * kTileRows, 32).path, LinearPath::kWide) << m;
  }
}
}  // namespace
#endif
