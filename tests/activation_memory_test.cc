// The CPU allocator of the forward pass's tensors (engine/kernels/activation_memory.h).
// Installing it is for the whole process: each test installs it (the first call wins) and
// reads differences of its counters.
#include "engine/kernels/activation_memory.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace llava {
namespace {

using testing::RssAnonBytes;

constexpr int64_t kMiB = int64_t{1} << 20;

void Install() {
  InstallActivationAllocator();
  ASSERT_TRUE(ActivationAllocatorInstalled());
}

// One "layer" of a pass: tensors of a few sizes, each freed before the next is made, as the
// forward pass's temporaries are.
void Layer(const std::vector<int64_t>& bytes) {
  for (int64_t b : bytes) {
    at::Tensor t = at::empty({b / 4}, at::kFloat);
    t.fill_(1.0f);  // touched, as an activation is
  }
}

TEST(ActivationMemory, LaterPassesReuseTheBlocksOfTheFirst) {
  Install();
  ReleaseActivationCache();
  const std::vector<int64_t> sizes = {3 * kMiB, 12 * kMiB + 4096, 700 << 10};
  Layer(sizes);  // the first pass maps its blocks
  const ActivationMemoryStats first = ActivationMemory();
  for (int pass = 0; pass < 4; ++pass) {
    for (int layer = 0; layer < 8; ++layer) Layer(sizes);
  }
  const ActivationMemoryStats after = ActivationMemory();
  EXPECT_EQ(after.maps, first.maps) << "a later pass mapped a new block";
  EXPECT_EQ(after.reuses - first.reuses, 4 * 8 * 3);
  EXPECT_EQ(after.live_bytes, first.live_bytes);
}

TEST(ActivationMemory, WhatIsKeptFollowsTheRecentPeakNotTheHistory) {
  Install();
  ReleaseActivationCache();
  {  // a heavy pass: 48 MiB live at once
    std::vector<at::Tensor> live;
    for (int i = 0; i < 6; ++i) live.push_back(at::empty({2 * kMiB}, at::kFloat));
  }
  const ActivationMemoryStats heavy = ActivationMemory();
  EXPECT_GE(heavy.cached_bytes, 48 * kMiB) << "the heavy pass's blocks are kept for the next";
  StartActivationWindow();  // the heavy window ends: what it needed stays
  EXPECT_GE(ActivationMemory().cached_bytes, 48 * kMiB);
  for (int pass = 0; pass < 3; ++pass) Layer({2 * kMiB, 1 * kMiB});  // light passes
  StartActivationWindow();  // the light window ends: what it did not need goes
  const ActivationMemoryStats light = ActivationMemory();
  // The light passes never had more than 2 MiB in blocks at once: within the 1.25 slack and a
  // range's 64 KiB grain.
  EXPECT_LE(light.mapped_bytes, static_cast<int64_t>(1.25 * 2 * kMiB) + (64 << 10));
  EXPECT_GT(light.unmaps, heavy.unmaps);
  for (int pass = 0; pass < 3; ++pass) Layer({2 * kMiB, 1 * kMiB});  // and they still fit
  EXPECT_EQ(ActivationMemory().maps, light.maps);
}

TEST(ActivationMemory, ReleasedBlocksLeaveTheResidentMemory) {
  Install();
  ReleaseActivationCache();
  const int64_t before = RssAnonBytes();
  {
    at::Tensor t = at::empty({64 * kMiB / 4}, at::kFloat);
    t.fill_(2.0f);
  }
  const int64_t kept = RssAnonBytes();
  EXPECT_GE(kept - before, 60 * kMiB) << "a freed block stays mapped for the next pass";
  EXPECT_GE(ReleaseActivationCache(), 64 * kMiB);
  const int64_t released = RssAnonBytes();
  EXPECT_LE(released - before, 4 * kMiB) << "released blocks are given back to the system";
}

TEST(ActivationMemory, TensorsKeepTheirValuesAndTheRawInterfaceWorks) {
  const at::Tensor a = at::randn({300, 400}), b = at::randn({400, 500});
  const at::Tensor expected = at::matmul(a, b);  // may come from c10's allocator
  Install();
  const int64_t live = ActivationMemory().live_bytes;
  {
    const at::Tensor a2 = a.clone(), b2 = b.clone();  // ours: 480 KB, 800 KB
    const at::Tensor y = at::matmul(a2, b2);
    EXPECT_TRUE(at::equal(y, expected));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(y.data_ptr()) % 64, 0u);
    const at::Tensor small = at::full({10}, 3.0f);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data_ptr()) % 64, 0u);
    EXPECT_EQ(small.sum().item<float>(), 30.0f);
    EXPECT_GE(ActivationMemory().live_bytes - live, (300 * 400 + 400 * 500 + 300 * 500 + 10) * 4);
  }
  EXPECT_EQ(ActivationMemory().live_bytes, live);
  c10::Allocator* cpu = c10::GetCPUAllocator();
  for (size_t n : {size_t{100}, size_t{1} << 20}) {
    void* p = cpu->raw_allocate(n);
    ASSERT_NE(p, nullptr);
    static_cast<char*>(p)[n - 1] = 7;
    cpu->raw_deallocate(p);
  }
  EXPECT_EQ(ActivationMemory().live_bytes, live);
}

}  // namespace
}  // namespace llava
