// PrepareGate (engine/serving/prepare_gate.h): turns and decode bytes shared by requests being
// prepared, with threads that hold their turn until told to go.
#include "engine/serving/prepare_gate.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace llava {
namespace {

using namespace std::chrono_literals;

// Starts a thread that takes a turn of `bytes`, sets `inside` while holding it, and leaves when
// `release` is set.
std::thread Holder(PrepareGate* gate, int64_t bytes, std::atomic<bool>* inside,
                   const std::atomic<bool>* release) {
  return std::thread([=] {
    PrepareGate::Turn turn(gate, bytes);
    *inside = true;
    while (!*release) std::this_thread::sleep_for(1ms);
  });
}

bool BecomesTrue(const std::atomic<bool>& flag, std::chrono::milliseconds within) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (!flag && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(1ms);
  return flag;
}

TEST(PrepareGate, SmallClaimsShareTheBudgetLargeOnesWait) {
  PrepareGate gate(/*max_turns=*/8, /*budget_bytes=*/100);
  std::atomic<bool> a{false}, b{false}, c{false}, release_ab{false}, release_c{false};
  std::thread ta = Holder(&gate, 40, &a, &release_ab);
  std::thread tb = Holder(&gate, 40, &b, &release_ab);
  ASSERT_TRUE(BecomesTrue(a, 2000ms));
  ASSERT_TRUE(BecomesTrue(b, 2000ms)) << "two claims within the budget run together";
  EXPECT_EQ(gate.bytes_in_use(), 80);
  std::thread tc = Holder(&gate, 40, &c, &release_c);
  EXPECT_FALSE(BecomesTrue(c, 100ms)) << "a third would pass the budget";
  release_ab = true;
  ta.join();
  tb.join();
  EXPECT_TRUE(BecomesTrue(c, 2000ms));
  release_c = true;
  tc.join();
  EXPECT_EQ(gate.bytes_in_use(), 0);
}

TEST(PrepareGate, AClaimOverTheBudgetRunsAloneAndTurnsAreCounted) {
  PrepareGate gate(/*max_turns=*/2, /*budget_bytes=*/100);
  std::atomic<bool> big{false}, small{false}, release_big{false}, release_small{false};
  std::thread tbig = Holder(&gate, 500, &big, &release_big);
  ASSERT_TRUE(BecomesTrue(big, 2000ms)) << "alone, a claim over the budget runs";
  std::thread tsmall = Holder(&gate, 1, &small, &release_small);
  EXPECT_FALSE(BecomesTrue(small, 100ms)) << "nothing runs beside it";
  release_big = true;
  tbig.join();
  EXPECT_TRUE(BecomesTrue(small, 2000ms));

  // Two turns: a third claim of no bytes waits for one.
  std::atomic<bool> second{false}, third{false}, release_rest{false};
  std::thread t2 = Holder(&gate, 0, &second, &release_rest);
  ASSERT_TRUE(BecomesTrue(second, 2000ms));
  std::thread t3 = Holder(&gate, 0, &third, &release_rest);
  EXPECT_FALSE(BecomesTrue(third, 100ms));
  release_small = true;
  tsmall.join();
  EXPECT_TRUE(BecomesTrue(third, 2000ms));
  release_rest = true;
  t2.join();
  t3.join();
}

// Waiting for the budget is bounded: with a large claim decoding and another waiting, a third
// large claim is refused at once instead of holding its thread, while a claim that fits beside
// the one decoding goes ahead of the waiting one.
TEST(PrepareGate, OnlyOneBudgetOfClaimsWaitsAndWhatFitsGoesAhead) {
  PrepareGate gate(/*max_turns=*/4, /*budget_bytes=*/100);
  std::atomic<bool> bomb1{false}, bomb2{false}, small{false}, release1{false}, release2{false},
      release_small{false};
  std::thread t1 = Holder(&gate, 90, &bomb1, &release1);
  ASSERT_TRUE(BecomesTrue(bomb1, 2000ms));
  std::thread t2 = Holder(&gate, 90, &bomb2, &release2);
  EXPECT_FALSE(BecomesTrue(bomb2, 100ms)) << "the second bomb waits for the budget";
  {
    PrepareGate::Turn third(&gate, 90);
    EXPECT_FALSE(third.admitted()) << "two bombs' claims do not fit one budget: refused";
  }
  std::thread ts = Holder(&gate, 10, &small, &release_small);
  EXPECT_TRUE(BecomesTrue(small, 2000ms)) << "a claim that fits beside the first goes ahead";
  {
    PrepareGate::Turn tiny(&gate, 0);
    EXPECT_TRUE(tiny.admitted()) << "what fits is never refused";
  }
  release_small = true;
  ts.join();
  release1 = true;
  t1.join();
  EXPECT_TRUE(BecomesTrue(bomb2, 2000ms)) << "the waiting bomb runs when the first has gone";
  // A claim of a budget and more waits when it is the only one waiting.
  std::atomic<bool> huge{false}, release_huge{false};
  std::thread th = Holder(&gate, 500, &huge, &release_huge);
  EXPECT_FALSE(BecomesTrue(huge, 100ms));
  release2 = true;
  t2.join();
  EXPECT_TRUE(BecomesTrue(huge, 2000ms)) << "alone, it runs";
  release_huge = true;
  th.join();
  EXPECT_EQ(gate.bytes_in_use(), 0);
}

}  // namespace
}  // namespace llava
