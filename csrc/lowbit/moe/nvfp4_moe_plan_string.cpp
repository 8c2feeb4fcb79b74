// The MoE's plan strings (nvfp4_moe.h, MoePlanOverrides): parsed on the host
// in every build, so that the CPU and Meta kernels of
// lowbit::_nvfp4_moe_with_plan reject what the CUDA kernel would.
#include <string>

#include "lowbit/moe/nvfp4_moe.h"
#include "lowbit/plan_string.h"

namespace lowbit::nvfp4::moe {

MoePlanOverrides parse_moe_plan_string(const std::string& plan) {
  namespace ps = plan_string;
  MoePlanOverrides o;
  for (const ps::Item& it : ps::split(plan)) {
    if (it.key == "stream")
      o.stream = ps::flag(plan, it);
    else if (it.key == "hot")
      o.hot = ps::flag(plan, it);
    else if (it.key == "stream_warps")
      o.stream_warps = ps::one_of(plan, it, {1, 2, 4, 8});
    else
      ps::unknown_key(plan, it, "stream, hot, stream_warps");
  }
  return o;
}

}  // namespace lowbit::nvfp4::moe
