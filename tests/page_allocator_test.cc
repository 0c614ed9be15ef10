// The KV pool's free list: all-or-nothing allocation, lowest pages first, a freed page handed
// out next, and a page freed twice stopping the process.
#include "engine/kv/page_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace llava {
namespace {

TEST(PageAllocator, HandsOutTheLowestPagesAndReusesFreedOnesFirst) {
  PageAllocator a(6);
  std::vector<int32_t> x, y;
  ASSERT_TRUE(a.Allocate(2, &x));
  ASSERT_TRUE(a.Allocate(3, &y));
  EXPECT_EQ(x, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(y, (std::vector<int32_t>{2, 3, 4}));
  EXPECT_EQ(a.used_pages(), 5);
  EXPECT_EQ(a.free_pages(), 1);
  a.Free(x.data(), 2);
  EXPECT_FALSE(a.InUse(0));
  EXPECT_TRUE(a.InUse(2));
  std::vector<int32_t> z;
  ASSERT_TRUE(a.Allocate(2, &z));
  EXPECT_EQ(z, (std::vector<int32_t>{0, 1})) << "the freed pages, not the untouched page 5";
  EXPECT_EQ(a.high_water(), 5);
}

TEST(PageAllocator, AllOrNothing) {
  PageAllocator a(4);
  std::vector<int32_t> x = {99};
  ASSERT_TRUE(a.Allocate(3, &x));
  EXPECT_EQ(x, (std::vector<int32_t>{99, 0, 1, 2})) << "appends";
  std::vector<int32_t> y;
  EXPECT_FALSE(a.Allocate(2, &y));
  EXPECT_TRUE(y.empty());
  EXPECT_EQ(a.free_pages(), 1);
  EXPECT_FALSE(a.Allocate(-1, &y));
  EXPECT_TRUE(a.Allocate(0, &y));
  PageAllocator none(0);
  EXPECT_FALSE(none.Allocate(1, &y));
}

// Many owners allocating and freeing at random: every page is owned by exactly one of them or
// free, and the pages ever handed out are the lowest ids up to the most held at once.
TEST(PageAllocator, EveryPageHasOneOwnerOrIsFree) {
  PageAllocator a(64);
  std::vector<std::vector<int32_t>> owners(7);
  std::mt19937 rng(5);
  int32_t highest = -1;
  for (int step = 0; step < 2000; ++step) {
    auto& o = owners[rng() % owners.size()];
    if (rng() % 2 == 0) {
      const int64_t n = rng() % 6, free_before = a.free_pages();
      EXPECT_EQ(a.Allocate(n, &o), n <= free_before);
    } else if (!o.empty()) {
      const int64_t n = 1 + rng() % o.size();
      a.Free(o.data() + o.size() - n, n);
      o.resize(o.size() - n);
    }
    std::vector<int> count(64, 0);
    int64_t held = 0;
    for (const auto& owner : owners) {
      for (int32_t p : owner) {
        ++count[p];
        highest = std::max(highest, p);
      }
      held += static_cast<int64_t>(owner.size());
    }
    for (int32_t p = 0; p < 64; ++p) {
      ASSERT_LE(count[p], 1) << "page " << p << " has two owners";
      ASSERT_EQ(count[p] == 1, a.InUse(p)) << "page " << p;
    }
    ASSERT_EQ(held, a.used_pages());
    ASSERT_EQ(highest + 1, a.high_water()) << "a page above the high-water mark was touched";
  }
}

TEST(PageAllocatorDeathTest, FreeingAFreePageAborts) {
  PageAllocator a(2);
  std::vector<int32_t> x;
  ASSERT_TRUE(a.Allocate(1, &x));
  a.Free(x.data(), 1);
  EXPECT_DEATH(a.Free(x.data(), 1), "not in use");
  const int32_t outside = 7;
  EXPECT_DEATH(a.Free(&outside, 1), "not in use");
}

}  // namespace
}  // namespace llava
