// Tests of the core CPU routing and top-k kernels (routing.h, topk.h): the
// selection and tie rules, group limiting, weights, the hash router's range
// reporting, and top-k ordering, each against expectations computed here
// independently (double precision, explicit sorts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "lowbit/routing/routing.h"
#include "lowbit/routing/topk.h"

using namespace lowbit;
using namespace lowbit::routing;

namespace {

struct Routed {
  std::vector<float> w;
  std::vector<int32_t> ids;
};

Routed run_route(const std::vector<float>& logits, const std::vector<float>* bias, int64_t M, int64_t E, int k,
                 ScoreFunc f, int n_group = 1, int topk_group = 1, bool renorm = true, float scale = 1.f) {
  Routed r{std::vector<float>(M * k), std::vector<int32_t>(M * k)};
  RouteArgs a{};
  a.logits = logits.data();
  a.logits_dtype = DType::kFloat32;
  a.bias = bias ? bias->data() : nullptr;
  a.tokens = M;
  a.experts = E;
  a.topk = k;
  a.score_func = f;
  a.n_group = n_group;
  a.topk_group = topk_group;
  a.renormalize = renorm;
  a.routed_scaling_factor = scale;
  a.weights = r.w.data();
  a.ids = r.ids.data();
  route_cpu(a);
  return r;
}

double score64(ScoreFunc f, double x) {
  return f == ScoreFunc::kSigmoid ? 1.0 / (1.0 + std::exp(-x)) : std::sqrt(std::log1p(std::exp(x)));
}

// Expected ids of one token: stable sort of experts by biased score.
std::vector<int32_t> expected_ids(const std::vector<double>& biased, int k) {
  std::vector<int32_t> order(biased.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return biased[a] > biased[b]; });
  order.resize(k);
  return order;
}

}  // namespace

TEST(RouteCpu, SqrtSoftplusWithBiasMatchesDouble) {
  const int64_t M = 20, E = 64;
  const int k = 6;
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> logits(M * E), bias(E);
  for (auto& v : logits) v = nd(gen);
  for (auto& v : bias) v = nd(gen) * 0.05f;
  auto r = run_route(logits, &bias, M, E, k, ScoreFunc::kSqrtSoftplus, 1, 1, true, 1.5f);
  for (int64_t m = 0; m < M; ++m) {
    std::vector<double> s(E), b(E);
    for (int64_t e = 0; e < E; ++e) {
      s[e] = score64(ScoreFunc::kSqrtSoftplus, logits[m * E + e]);
      b[e] = s[e] + bias[e];
    }
    auto ids = expected_ids(b, k);
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += s[ids[j]];
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(r.ids[m * k + j], ids[j]) << "token " << m << " pick " << j;
      EXPECT_NEAR(r.w[m * k + j], s[ids[j]] / sum * 1.5, 1e-6 * 1.5) << "token " << m;
    }
  }
}

TEST(RouteCpu, TiesGoToTheLowerIndex) {
  const int64_t E = 16;
  std::vector<float> logits(E, 0.5f);
  auto r = run_route(logits, nullptr, 1, E, 5, ScoreFunc::kSigmoid);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  for (float w : r.w) EXPECT_FLOAT_EQ(w, 0.2f);
  logits[9] = 0.75f;
  logits[3] = 0.75f;
  r = run_route(logits, nullptr, 1, E, 3, ScoreFunc::kSigmoid);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 9, 0}));
}

TEST(RouteCpu, GroupLimitUsesTopTwoSum) {
  // 4 groups of 4. Group 0 has the single best expert but a weak second;
  // groups 1 and 2 win on their top-2 sums, so expert 0 is never chosen.
  std::vector<float> logits = {5.f, -5.f, -5.f, -5.f,  2.f, 2.f, -5.f, -5.f,
                               1.9f, 1.9f, 1.9f, -5.f, -1.f, -1.f, -1.f, -1.f};
  auto r = run_route(logits, nullptr, 1, 16, 4, ScoreFunc::kSigmoid, 4, 2, false);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5, 8, 9}));
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(r.w[j], static_cast<float>(score64(ScoreFunc::kSigmoid, logits[r.ids[j]])));
  auto all = run_route(logits, nullptr, 1, 16, 1, ScoreFunc::kSigmoid, 4, 4);
  EXPECT_EQ(all.ids[0], 0);
}

TEST(RouteCpu, SoftmaxWithoutRenormalization) {
  std::vector<float> logits = {1.f, 3.f, 2.f, 0.f};
  auto r = run_route(logits, nullptr, 1, 4, 2, ScoreFunc::kSoftmax, 1, 1, false, 2.f);
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.w[0], 2 * std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(r.w[1], 2 * std::exp(2.0) / z, 1e-6);
}

TEST(RouteCpu, NanRanksBelowEveryNumber) {
  std::vector<float> logits = {std::nanf(""), -30.f, 1.f};
  auto r = run_route(logits, nullptr, 1, 3, 3, ScoreFunc::kSigmoid, 1, 1, false);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1, 0}));
}

TEST(HashRouteCpu, GathersScoresAndReportsBadTokens) {
  std::vector<int32_t> table = {0, 2, 1, 3, 3, 3};  // vocab 3, k 2
  std::vector<int64_t> tids = {1, 0};
  std::vector<float> logits = {0.f, 1.f, 2.f, 3.f, -1.f, 0.5f, 0.25f, 4.f};  // M 2, E 4
  std::vector<float> w(4);
  std::vector<int32_t> ids(4);
  HashRouteArgs a{};
  a.token_ids = tids.data();
  a.token_ids_64 = true;
  a.table = table.data();
  a.vocab = 3;
  a.logits = logits.data();
  a.logits_dtype = DType::kFloat32;
  a.tokens = 2;
  a.experts = 4;
  a.topk = 2;
  a.score_func = ScoreFunc::kSqrtSoftplus;
  a.weighting = HashWeighting::kGate;
  a.renormalize = true;
  a.routed_scaling_factor = 1.f;
  a.weights = w.data();
  a.ids = ids.data();
  EXPECT_EQ(hash_route_cpu(a), -1);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3, 0, 2}));
  const double s1 = score64(ScoreFunc::kSqrtSoftplus, 1.0), s3 = score64(ScoreFunc::kSqrtSoftplus, 3.0);
  EXPECT_NEAR(w[0], s1 / (s1 + s3), 1e-6);
  EXPECT_NEAR(w[1], s3 / (s1 + s3), 1e-6);
  tids[1] = 3;
  EXPECT_EQ(hash_route_cpu(a), 1);
  tids[1] = -1;
  EXPECT_EQ(hash_route_cpu(a), 1);
  tids = {2, 0};
  table[4] = 4;  // expert 4 with E = 4
  EXPECT_EQ(hash_route_cpu(a), 0);
}

TEST(TopkCpu, OrderTiesNanAndSignedZero) {
  std::vector<float> x = {1.f, -0.f, 3.f, std::nanf(""), 3.f, 0.f, -INFINITY, INFINITY};
  std::vector<float> v(6);
  std::vector<int32_t> idx(6);
  topk::TopkArgs a{};
  a.input = x.data();
  a.input_dtype = DType::kFloat32;
  a.rows = 1;
  a.cols = static_cast<int64_t>(x.size());
  a.k = 6;
  a.values = v.data();
  a.indices = idx.data();
  topk::topk_cpu(a);
  EXPECT_EQ(idx, (std::vector<int32_t>{3, 7, 2, 4, 0, 1}));
  EXPECT_TRUE(std::signbit(v[5]));  // -0.0 returned as stored, tied with +0.0 at index 5
}

TEST(TopkCpu, RandomRowsMatchStableSort) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> small(-20, 20);
  const int64_t rows = 4, cols = 3000;
  const int k = 100;
  std::vector<float> x(rows * cols);
  for (auto& e : x) e = small(gen) * 0.5f;  // many ties
  std::vector<float> v(rows * k);
  std::vector<int32_t> idx(rows * k);
  topk::TopkArgs a{x.data(), DType::kFloat32, rows, cols, k, v.data(), idx.data(), nullptr};
  topk::topk_cpu(a);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> row(x.begin() + r * cols, x.begin() + (r + 1) * cols);
    auto want = expected_ids(row, k);
    for (int j = 0; j < k; ++j) ASSERT_EQ(idx[r * k + j], want[j]) << "row " << r << " pick " << j;
  }
}

TEST(TopkKey, OrderKeyIsMonotone) {
  const float xs[] = {-INFINITY, -1e30f, -1.f, -1e-40f, 0.f, 1e-40f, 1.f, 1e30f, INFINITY};
  for (size_t i = 0; i + 1 < sizeof(xs) / sizeof(xs[0]); ++i) EXPECT_LT(topk::order_key(xs[i]), topk::order_key(xs[i + 1]));
  EXPECT_EQ(topk::order_key(-0.f), topk::order_key(0.f));
  EXPECT_GT(topk::order_key(std::nanf("")), topk::order_key(INFINITY));
  EXPECT_GT(topk::order_key(-INFINITY), 0u);
}
