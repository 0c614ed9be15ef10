#include "engine/eval/eval_metrics.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace llava
