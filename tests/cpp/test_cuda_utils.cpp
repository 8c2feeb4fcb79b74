// Host-side CUDA helpers that need no GPU to check: the shared-memory
// padding that caps resident CTAs per SM (without a device the helpers use
// the H100's attributes).
#include <gtest/gtest.h>

#if defined(LOWBIT_WITH_CUDA)
namespace lowbit::cuda {
// From lowbit/cuda_utils.cuh, which also holds device code a host compiler
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
