// The Linear's plan strings (sm90_linear_plan.h, "Overrides"): parsed on the
// host in every build, so that the CPU and Meta kernels of
// lowbit::_nvfp4_linear_with_plan reject what the CUDA kernel would.
#include <cstdint>
#include <string>

#include "lowbit/linear/sm90_linear_plan.h"
#include "lowbit/plan_string.h"

namespace lowbit::nvfp4::gemm {
namespace {

constexpr const char* kKeys =
    "path, stream_warps, stream_ctas_per_sm, stream_k, stream_tiles, stream_stages, stream_splits, panel_splits, "
    "wide_wgmma, wgmma_pair";
constexpr LinearPath kPaths[] = {LinearPath::kStream, LinearPath::kNarrow, LinearPath::kPanel,
                                 LinearPath::kWide,   LinearPath::kWgmma,  LinearPath::kUnpack};

}  // namespace

const char* linear_path_name(LinearPath path) {
  switch (path) {
    case LinearPath::kStream: return "stream";
    case LinearPath::kNarrow: return "narrow";
    case LinearPath::kWide: return "wide";
    case LinearPath::kWgmma: return "wgmma";
    case LinearPath::kUnpack: return "unpack";
    case LinearPath::kPanel: return "panel";
  }
  return "unknown";
}

LinearPlanOverrides parse_linear_plan_string(const std::string& plan) {
  namespace ps = plan_string;
  LinearPlanOverrides o;
  for (const ps::Item& it : ps::split(plan)) {
    const std::string& key = it.key;
    // Counts up to what a grid or a K split can hold; the plan bounds them further.
    auto count = [&] { return static_cast<int>(ps::integer(plan, it, 1, 65535, "an integer of 1 to 65535")); };
    if (key == "path") {
      for (LinearPath p : kPaths)
        if (it.value == linear_path_name(p)) o.path = p;
      if (!o.path) ps::bad_value(plan, it, "stream, narrow, panel, wide, wgmma or unpack");
    } else if (key == "stream_warps") {
      o.stream_warps = ps::one_of(plan, it, {1, 2, 4, 8});
    } else if (key == "stream_ctas_per_sm") {
      o.stream_ctas_per_sm = count();
    } else if (key == "stream_k") {
      o.stream_k = ps::flag(plan, it);
    } else if (key == "stream_tiles") {
      o.stream_tiles = ps::one_of(plan, it, {1, 2});
    } else if (key == "stream_stages") {
      o.stream_stages = ps::one_of(plan, it, {2, 3});
    } else if (key == "stream_splits") {
      o.stream_splits = count();
    } else if (key == "panel_splits") {
      o.panel_splits = count();
    } else if (key == "wide_wgmma") {
      o.wide_wgmma = ps::flag(plan, it);
    } else if (key == "wgmma_pair") {
      o.wgmma_pair = ps::flag(plan, it);
    } else {
      ps::unknown_key(plan, it, kKeys);
    }
  }
  return o;
}

std::string to_plan_string(const LinearPlanOverrides& o) {
  std::string s;
  auto add = [&](const char* key, const std::string& value) {
    s += (s.empty() ? "" : ",") + std::string(key) + "=" + value;
  };
  if (o.path) add("path", linear_path_name(*o.path));
  if (o.stream_warps) add("stream_warps", std::to_string(*o.stream_warps));
  if (o.stream_ctas_per_sm) add("stream_ctas_per_sm", std::to_string(*o.stream_ctas_per_sm));
  if (o.stream_k) add("stream_k", *o.stream_k ? "1" : "0");
  if (o.stream_tiles) add("stream_tiles", std::to_string(*o.stream_tiles));
  if (o.stream_stages) add("stream_stages", std::to_string(*o.stream_stages));
  if (o.stream_splits) add("stream_splits", std::to_string(*o.stream_splits));
  if (o.panel_splits) add("panel_splits", std::to_string(*o.panel_splits));
  if (o.wide_wgmma) add("wide_wgmma", *o.wide_wgmma ? "1" : "0");
  if (o.wgmma_pair) add("wgmma_pair", *o.wgmma_pair ? "1" : "0");
  return s;
}

}  // namespace lowbit::nvfp4::gemm
