// Plan strings (lowbit/plan_string.h): the Linear's and the MoE's parsers
// take every key with its values and reject anything else with an error
// that names the key. Host code, in every build.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "lowbit/linear/sm90_linear_plan.h"
#include "lowbit/moe/nvfp4_moe.h"

namespace {
namespace gemm = lowbit::nvfp4::gemm;
namespace moe = lowbit::nvfp4::moe;

// The message of the std::invalid_argument that `parse(plan)` throws.
template <typename Parse>
std::string ErrorOf(Parse parse, const std::string& plan) {
  try {
    parse(plan);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PlanStrings, LinearKeys) {
  const gemm::LinearPlanOverrides none = gemm::parse_linear_plan_string(" ");
  EXPECT_FALSE(none.path || none.stream_warps || none.stream_ctas_per_sm || none.stream_k || none.stream_tiles ||
               none.stream_stages || none.stream_splits || none.panel_splits || none.wide_wgmma || none.wgmma_pair);
  const gemm::LinearPlanOverrides o = gemm::parse_linear_plan_string(
      "path=panel, stream_warps=4,stream_ctas_per_sm=3,stream_k=0,stream_tiles=2,stream_stages=3,stream_splits=5,"
      "panel_splits=2,wide_wgmma=1,wgmma_pair=0");
  EXPECT_EQ(o.path, gemm::LinearPath::kPanel);
  EXPECT_EQ(o.stream_warps, 4);
  EXPECT_EQ(o.stream_ctas_per_sm, 3);
  EXPECT_EQ(o.stream_k, false);
  EXPECT_EQ(o.stream_tiles, 2);
  EXPECT_EQ(o.stream_stages, 3);
  EXPECT_EQ(o.stream_splits, 5);
  EXPECT_EQ(o.panel_splits, 2);
  EXPECT_EQ(o.wide_wgmma, true);
  EXPECT_EQ(o.wgmma_pair, false);
  // The canonical form, key order, parses back to the same.
  const std::string canonical = gemm::to_plan_string(o);
  EXPECT_EQ(canonical,
            "path=panel,stream_warps=4,stream_ctas_per_sm=3,stream_k=0,stream_tiles=2,stream_stages=3,"
            "stream_splits=5,panel_splits=2,wide_wgmma=1,wgmma_pair=0");
  EXPECT_EQ(gemm::to_plan_string(gemm::parse_linear_plan_string(canonical)), canonical);
  EXPECT_EQ(gemm::to_plan_string(none), "");
  for (const char* path : {"stream", "narrow", "panel", "wide", "wgmma", "unpack"})
    EXPECT_STREQ(gemm::linear_path_name(*gemm::parse_linear_plan_string(std::string("path=") + path).path), path);
}

TEST(PlanStrings, LinearErrorsNameTheKey) {
  auto parse = [](const std::string& s) { return gemm::parse_linear_plan_string(s); };
  EXPECT_EQ(ErrorOf(parse, "strem_k=1"),
            "plan \"strem_k=1\": unknown key \"strem_k\" (keys: path, stream_warps, stream_ctas_per_sm, stream_k, "
            "stream_tiles, stream_stages, stream_splits, panel_splits, wide_wgmma, wgmma_pair)");
  EXPECT_EQ(ErrorOf(parse, "path=fastest"),
            "plan \"path=fastest\": key \"path\" takes stream, narrow, panel, wide, wgmma or unpack, got \"fastest\"");
  EXPECT_EQ(ErrorOf(parse, "stream_warps=16"), "plan \"stream_warps=16\": key \"stream_warps\" takes 1, 2, 4 or 8, "
                                               "got \"16\"");
  EXPECT_EQ(ErrorOf(parse, "stream_k=on"), "plan \"stream_k=on\": key \"stream_k\" takes 0 or 1, got \"on\"");
  EXPECT_EQ(ErrorOf(parse, "stream_splits=65536"),
            "plan \"stream_splits=65536\": key \"stream_splits\" takes an integer of 1 to 65535, got \"65536\"");
  EXPECT_EQ(ErrorOf(parse, "panel_splits=99999999999999999999"),
            "plan \"panel_splits=99999999999999999999\": key \"panel_splits\" takes an integer of 1 to 65535, got "
            "\"99999999999999999999\"");
  EXPECT_EQ(ErrorOf(parse, "stream_k=1;path=wide"),
            "plan \"stream_k=1;path=wide\": key \"stream_k\" takes 0 or 1, got \"1;path=wide\"");
  EXPECT_EQ(ErrorOf(parse, "wide_wgmma"), "plan \"wide_wgmma\": item \"wide_wgmma\" is not key=value");
  EXPECT_EQ(ErrorOf(parse, "wide_wgmma=1,"), "plan \"wide_wgmma=1,\": item \"\" is not key=value");
  EXPECT_EQ(ErrorOf(parse, "wgmma_pair=1,wgmma_pair=1"),
            "plan \"wgmma_pair=1,wgmma_pair=1\": key \"wgmma_pair\" given twice");
}

TEST(PlanStrings, MoeKeys) {
  const moe::MoePlanOverrides none = moe::parse_moe_plan_string("");
  EXPECT_FALSE(none.stream || none.hot || none.stream_warps);
  const moe::MoePlanOverrides o = moe::parse_moe_plan_string("stream=0,hot=1,stream_warps=2");
  EXPECT_EQ(o.stream, false);
  EXPECT_EQ(o.hot, true);
  EXPECT_EQ(o.stream_warps, 2);
  auto parse = [](const std::string& s) { return moe::parse_moe_plan_string(s); };
  EXPECT_EQ(ErrorOf(parse, "path=wide"),
            "plan \"path=wide\": unknown key \"path\" (keys: stream, hot, stream_warps)");
  EXPECT_EQ(ErrorOf(parse, "hot=2"), "plan \"hot=2\": key \"hot\" takes 0 or 1, got \"2\"");
}

}  // namespace
