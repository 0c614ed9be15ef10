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

}  // namespace
}  // namespace llava
