// llava-train's learning-rate schedule (train/lr_schedule.h): warm-up, cosine over the steps,
// and the cosine ended by a time budget when that runs out first.
#include "train/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>

namespace llava::train {
namespace {

LrSchedule Schedule(double budget_s) {
  LrSchedule s;
  s.peak = 1e-3;
  s.floor_ratio = 0.1;
  s.warmup_steps = 10;
  s.steps = 110;
  s.budget_s = budget_s;
  return s;
}

TEST(LrSchedule, WarmsUpLinearlyThenFollowsTheCosineOverTheSteps) {
  const LrSchedule s = Schedule(0);
  EXPECT_DOUBLE_EQ(s.Rate(0, 0, 0), 1e-4);  // (0 + 1) / 10 of the peak
  EXPECT_DOUBLE_EQ(s.Rate(4, 0, 0), 5e-4);
  EXPECT_DOUBLE_EQ(s.Rate(10, 1e9, 0), 1e-3);  // no budget: time plays no part
  // Half way down (step 60 of the 100 after the warm-up): floor + half the span.
  EXPECT_NEAR(s.Rate(60, 0, 0), 1e-4 + 0.9e-3 * 0.5, 1e-15);
  EXPECT_NEAR(s.Rate(35, 0, 0), 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_DOUBLE_EQ(s.Rate(110, 0, 0), 1e-4);
  EXPECT_DOUBLE_EQ(s.Rate(500, 0, 0), 1e-4);
}

TEST(LrSchedule, ATimeBudgetEndsTheCosineWhenItRunsOutFirst) {
  // 1,000 s in all, the warm-up ended at 100 s: 900 s of decay.
  const LrSchedule s = Schedule(1000);
  EXPECT_DOUBLE_EQ(s.Progress(5, 60, 0), 0);        // still warming up
  EXPECT_DOUBLE_EQ(s.Progress(20, 100, 100), 0.1);  // the steps are ahead of the clock
  EXPECT_DOUBLE_EQ(s.Progress(20, 550, 100), 0.5);  // the clock is ahead of the steps
  EXPECT_NEAR(s.Rate(20, 550, 100), 1e-4 + 0.9e-3 * 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(s.Rate(30, 1000, 100), 1e-4);  // the budget spent: the floor
  EXPECT_DOUBLE_EQ(s.Rate(30, 5000, 100), 1e-4);
  // A fast machine finishes its steps before the budget: the steps end the decay.
  EXPECT_DOUBLE_EQ(s.Progress(110, 300, 50), 1);
  // A warm-up that used the whole budget leaves nothing to decay over.
  EXPECT_DOUBLE_EQ(s.Progress(10, 1000, 1000), 1);
}

}  // namespace
}  // namespace llava::train
