#include "engine/eval/eval_metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <stdexcept>

namespace llava {
namespace {

TEST(RougeTokens, LowercasesAndSplitsOnNonAlphanumerics) {
  EXPECT_EQ(RougeTokens("The RED circle, at top-left!"),
            (std::vector<std::string>{"the", "red", "circle", "at", "top", "left"}));
  EXPECT_EQ(RougeTokens("caf\xC3\xA9 42x"), (std::vector<std::string>{"caf", "42x"}));
  EXPECT_TRUE(RougeTokens("  ... ").empty());
}

TEST(RougeL, HandComputed) {
  // candidate: a b c d e, reference: a c e f -> LCS "a c e" = 3; P = 3/5, R = 3/4.
  const double p = 3.0 / 5, r = 3.0 / 4;
  EXPECT_DOUBLE_EQ(RougeL("a b c d e", "a c e f"), 2 * p * r / (p + r));
  EXPECT_DOUBLE_EQ(RougeL("same words here", "Same, words here."), 1.0);
  EXPECT_DOUBLE_EQ(RougeL("x y", "z"), 0.0);
  EXPECT_DOUBLE_EQ(RougeL("", ""), 1.0);
  EXPECT_DOUBLE_EQ(RougeL("", "a"), 0.0);
  // Order matters: reversed has LCS 1 of 3.
  EXPECT_NEAR(RougeL("c b a", "a b c"), 1.0 / 3, 1e-12);
}

TEST(ExactMatch, WholeWordPrefix) {
  EXPECT_TRUE(ExactMatch("Red.", "red"));
  EXPECT_TRUE(ExactMatch("Yes, there is a square.", "yes"));
  EXPECT_TRUE(ExactMatch("3", "3"));
  EXPECT_FALSE(ExactMatch("reddish", "red"));
  EXPECT_FALSE(ExactMatch("No.", "yes"));
  EXPECT_FALSE(ExactMatch("anything", ""));
}

ItemScore Short(bool correct, double nll = 1, int64_t tokens = 2) {
  return {true, correct ? 1.0 : 0.0, nll, tokens};
}
ItemScore Long(double rouge, double nll = 1, int64_t tokens = 2) {
  return {false, rouge, nll, tokens};
}

TEST(Measure, EachOverItsOwnItems) {
  const std::vector<ItemScore> items = {Short(true, 0.5, 1), Short(false, 1.5, 3),
                                        Long(0.5, 2.0, 4), Long(0.7, 1.0, 2)};
  const std::vector<int> all = {0, 1, 2, 3};
  EXPECT_DOUBLE_EQ(Measure(items, all, QualityMeasure::kAccuracy), 0.5);
  EXPECT_DOUBLE_EQ(Measure(items, all, QualityMeasure::kRougeRef), 0.6);
  // exp((0.5 + 1.5 + 2 + 1) / (1 + 3 + 4 + 2))
  EXPECT_DOUBLE_EQ(Measure(items, all, QualityMeasure::kReferencePpl), std::exp(0.5));
  // A draw counts an item as often as it was drawn.
  EXPECT_DOUBLE_EQ(Measure(items, {0, 0, 1}, QualityMeasure::kAccuracy), 2.0 / 3);
  EXPECT_TRUE(std::isnan(Measure(items, {2, 3}, QualityMeasure::kAccuracy)));
  EXPECT_TRUE(std::isnan(Measure(items, {0, 1}, QualityMeasure::kRougeRef)));
}

std::vector<ItemScore> FirstCorrect(int correct, int n) {
  std::vector<ItemScore> out;
  for (int i = 0; i < n; ++i) out.push_back(Short(i < correct));
  return out;
}

TEST(PairedBootstrap, EqualListsGiveAZeroInterval) {
  const auto a = FirstCorrect(30, 100);
  const PairedInterval d = PairedBootstrap(a, a, QualityMeasure::kAccuracy);
  EXPECT_EQ(d.diff, 0);
  EXPECT_EQ(d.lo, 0);
  EXPECT_EQ(d.hi, 0);
  EXPECT_FALSE(d.Excludes0());
}

TEST(PairedBootstrap, OneItemOfAHundredIsWithinTheInterval) {
  // a answers item 49 too: the difference is 0.01, but a third of the draws miss item 49.
  const PairedInterval d =
      PairedBootstrap(FirstCorrect(50, 100), FirstCorrect(49, 100), QualityMeasure::kAccuracy);
  EXPECT_NEAR(d.diff, 0.01, 1e-12);
  EXPECT_EQ(d.lo, 0);
  EXPECT_GE(d.hi, 0.01);
  EXPECT_LE(d.hi, 0.04);
  EXPECT_FALSE(d.Excludes0());
}

TEST(PairedBootstrap, ThirtyItemsOfAHundredExcludeZero) {
  // Paired differences: 30 ones and 70 zeros, standard error sqrt(0.3 * 0.7 / 100) = 0.046,
  // so the 95% interval is about 0.30 +- 0.09.
  const auto a = FirstCorrect(90, 100), b = FirstCorrect(60, 100);
  const PairedInterval d = PairedBootstrap(a, b, QualityMeasure::kAccuracy, 2000);
  EXPECT_NEAR(d.diff, 0.30, 1e-12);
  EXPECT_GT(d.lo, 0.19);
  EXPECT_LT(d.lo, 0.25);
  EXPECT_GT(d.hi, 0.35);
  EXPECT_LT(d.hi, 0.41);
  EXPECT_TRUE(d.Excludes0());
  // The other way round: the mirror interval.
  const PairedInterval r = PairedBootstrap(b, a, QualityMeasure::kAccuracy, 2000);
  EXPECT_NEAR(r.lo, -d.hi, 1e-12);
  EXPECT_NEAR(r.hi, -d.lo, 1e-12);
  // The same seed, the same draws; another seed, (almost surely) other ends.
  const PairedInterval again = PairedBootstrap(a, b, QualityMeasure::kAccuracy, 2000);
  EXPECT_EQ(again.lo, d.lo);
  EXPECT_EQ(again.hi, d.hi);
}

TEST(PairedBootstrap, PplAndRougeOverTheirItemsAndUnpairedListsRefused) {
  std::vector<ItemScore> a, b;
  for (int i = 0; i < 40; ++i) {
    a.push_back(Long(0.9, 1.0, 10));
    b.push_back(Long(0.5, 3.0, 10));
  }
  const PairedInterval rouge = PairedBootstrap(a, b, QualityMeasure::kRougeRef);
  EXPECT_NEAR(rouge.diff, 0.4, 1e-12);
  EXPECT_NEAR(rouge.lo, 0.4, 1e-12);  // every item differs by the same amount
  EXPECT_NEAR(rouge.hi, 0.4, 1e-12);
  const PairedInterval ppl = PairedBootstrap(a, b, QualityMeasure::kReferencePpl);
  EXPECT_NEAR(ppl.diff, std::exp(0.1) - std::exp(0.3), 1e-12);
  EXPECT_TRUE(ppl.Excludes0());
  EXPECT_TRUE(std::isnan(PairedBootstrap(a, b, QualityMeasure::kAccuracy).diff));
  b.pop_back();
  EXPECT_THROW(PairedBootstrap(a, b, QualityMeasure::kAccuracy), std::invalid_argument);
}

}  // namespace
}  // namespace llava
