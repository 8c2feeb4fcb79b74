// Host-side CUDA helpers that need no GPU to check: which GPUs the built
// kernels run on, and the shared-memory padding that caps resident CTAs per
// SM (without a device the helpers use the H100's attributes).
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "lowbit/common.h"

namespace {

// The kernels are built for sm_90a, whose arch-specific instructions
// (wgmma, setmaxnreg) run on compute capability 9.0 only: not on earlier
// GPUs, and not on Blackwell (10.x, 12.x) or anything later.
TEST(CudaUtils, OnlyComputeCapability90RunsTheKernels) {
  EXPECT_TRUE(lowbit::gpu_arch_supported(9, 0));
  const std::pair<int, int> others[] = {{7, 0}, {7, 5}, {8, 0}, {8, 6}, {8, 9}, {9, 1}, {10, 0},
                                       {10, 1}, {10, 3}, {11, 0}, {12, 0}, {12, 1}, {13, 0}};
  for (auto [major, minor] : others) {
    EXPECT_FALSE(lowbit::gpu_arch_supported(major, minor)) << major << "." << minor;
  }
  EXPECT_EQ(std::string(lowbit::kCudaArchBuilt), "sm_90a");
}

}  // namespace

#if defined(LOWBIT_WITH_CUDA)
namespace lowbit::cuda {
// From lowbit/arch/cuda_utils.cuh, which also holds device code a host compiler
// cannot take.
int smem_per_sm();
int smem_for_ctas_per_sm(int bytes, int ctas);
}  // namespace lowbit::cuda

namespace {
constexpr int kReservedPerCta = 1024;

TEST(CudaUtils, SmemPaddingCapsCtasPerSm) {
  const int per_sm = lowbit::cuda::smem_per_sm();
  for (int ctas = 1; ctas <= 32; ++ctas) {
    for (int bytes : {0, 1000, 5184, 41472}) {
      const int padded = lowbit::cuda::smem_for_ctas_per_sm(bytes, ctas);
      EXPECT_GE(padded, bytes);
      if (padded > bytes) {
        EXPECT_EQ(padded % 128, 0) << ctas;  // whole allocation units
      }
      // One more CTA never fits, and `ctas` of them do unless the CTA's
      // own bytes already allow fewer.
      EXPECT_GT((ctas + 1) * (padded + kReservedPerCta), per_sm) << ctas << " " << bytes;
      if (ctas * (bytes + kReservedPerCta) <= per_sm) {
        EXPECT_LE(ctas * (padded + kReservedPerCta), per_sm) << ctas << " " << bytes;
      }
    }
  }
  EXPECT_EQ(lowbit::cuda::smem_for_ctas_per_sm(41472, 0), 41472);  // no cap: as is
  EXPECT_EQ(lowbit::cuda::smem_for_ctas_per_sm(200000, 2), 200000);  // already one per SM
}
}  // namespace
#endif
