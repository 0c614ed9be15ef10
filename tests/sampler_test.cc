#include "engine/serving/sampler.h"

#include <gtest/gtest.h>

#include <cmath>

namespace llava {
namespace {

TEST(Sampler, GreedyTakesArgmax) {
  SamplingParams p;
  Sampler s(p);
  std::vector<float> logits = {0.1f, 2.5f, -1.f, 2.4f};
  EXPECT_EQ(s.Sample(logits.data(), 4, {}), 1);
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  Sampler s(p);
  std::vector<float> logits = {2.0f, 1.9f, -1.0f};
  EXPECT_EQ(s.Sample(logits.data(), 3, {0, 0, 2}), 1);  // 2.0 / 1.5 = 1.33 < 1.9
  EXPECT_FLOAT_EQ(logits[0], 2.0f / 1.5f);
  EXPECT_FLOAT_EQ(logits[2], -1.5f);
}

TEST(Sampler, SameSeedSameTokens) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  Sampler a(p), b(p);
  for (int i = 0; i < 50; ++i) {
    std::vector<float> la = {0.f, 0.1f, 0.2f, 0.3f, 0.4f}, lb = la;
    EXPECT_EQ(a.Sample(la.data(), 5, {}), b.Sample(lb.data(), 5, {}));
  }
}

TEST(Sampler, MatchesSoftmaxDistribution) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 7;
  Sampler s(p);
  const std::vector<float> base = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  std::vector<int> counts(3);
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = base;
    ++counts[s.Sample(l.data(), 3, {})];
  }
  EXPECT_NEAR(counts[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(counts[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(counts[2] / double(n), 0.2, 0.02);
}

TEST(Sampler, TopKAndTopPCutTheTail) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  Sampler k2(p);
  p.top_k = 0;
  p.top_p = 0.55f;  // 0.5 alone is below 0.55, so the top two survive
  Sampler nucleus(p);
  const std::vector<float> base = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  for (int i = 0; i < 2000; ++i) {
    std::vector<float> a = base, b = base;
    EXPECT_NE(k2.Sample(a.data(), 3, {}), 2);
    EXPECT_NE(nucleus.Sample(b.data(), 3, {}), 2);
  }
  p.top_p = 0.4f;
  Sampler top1(p);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> a = base;
    EXPECT_EQ(top1.Sample(a.data(), 3, {}), 0);
  }
}

TEST(Sampler, ValidationNamesTheField) {
  struct Case {
    SamplingParams p;
    const char* field;
  };
  std::vector<Case> cases(6);
  cases[0].p.max_tokens = 0, cases[0].field = "sampling.max_tokens";
  cases[1].p.temperature = std::nanf(""), cases[1].field = "sampling.temperature";
  cases[2].p.temperature = -1, cases[2].field = "sampling.temperature";
  cases[3].p.top_p = 0, cases[3].field = "sampling.top_p";
  cases[4].p.top_k = -3, cases[4].field = "sampling.top_k";
  cases[5].p.stop = {""}, cases[5].field = "sampling.stop";
  for (const auto& c : cases) {
    Status s = ValidateSamplingParams(c.p, 1000);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s.message();
  }
  SamplingParams too_many;
  too_many.max_tokens = 101;
  EXPECT_FALSE(ValidateSamplingParams(too_many, 100).ok());
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams(), 300).ok());
}

}  // namespace
}  // namespace llava
