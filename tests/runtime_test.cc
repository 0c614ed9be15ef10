// Process-level settings (engine/kernels/runtime.h).
#include "engine/kernels/runtime.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "engine/kernels/cpu_features.h"
#include "tests/test_util.h"

namespace llava {
namespace {

using testing::RssAnonBytes;

TEST(ConfigureMalloc, BlocksUnderTheFixedThresholdComeFromTheHeap) {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_")) {
    GTEST_SKIP() << "the environment sets glibc's thresholds";
  }
  MallocSettings settings;
  settings.arena_max = 0;
  settings.mmap_threshold_bytes = int64_t{64} << 20;
  const std::string said = ConfigureMalloc(settings);
  EXPECT_NE(said.find("thresholds 64 MiB"), std::string::npos) << said;
  EXPECT_NE(said.find("glibc's arenas"), std::string::npos) << said;
  // 48 MiB is above glibc's largest sliding threshold (32 MiB): by default a fresh mapping,
  // whose pages fault in again on every use; with the fixed threshold it comes from the heap.
  const size_t mapped_before = mallinfo2().hblkhd;
  void* block = std::malloc(size_t{48} << 20);
  ASSERT_NE(block, nullptr);
  const size_t mapped_during = mallinfo2().hblkhd;
  std::free(block);
  EXPECT_EQ(mapped_during, mapped_before);
}

// Freed blocks between live ones stay resident on the heap (the top cannot be trimmed past a
// live block); TrimFreeHeap gives their pages back once more than the bound is free.
TEST(TrimFreeHeap, GivesFreeHeapPagesBackAboveTheBound) {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_")) {
    GTEST_SKIP() << "the environment sets glibc's thresholds";
  }
  MallocSettings settings;
  settings.arena_max = 0;
  settings.mmap_threshold_bytes = int64_t{64} << 20;  // 1 MiB blocks come from the heap
  ConfigureMalloc(settings);
  constexpr size_t kBlock = size_t{1} << 20;
  std::vector<char*> blocks;
  for (int i = 0; i < 48; ++i) {
    blocks.push_back(static_cast<char*>(std::malloc(kBlock)));
    ASSERT_NE(blocks.back(), nullptr);
    std::memset(blocks.back(), 1, kBlock);  // resident
  }
  for (int i = 0; i < 47; ++i) std::free(blocks[i]);  // the last one pins the heap's top
  const int64_t before = RssAnonBytes();
  EXPECT_EQ(TrimFreeHeap(int64_t{1} << 30), 0) << "under the bound: nothing to do";
  const int64_t freed = TrimFreeHeap(int64_t{8} << 20);
  EXPECT_GE(freed, int64_t{40} << 20);
  const int64_t after = RssAnonBytes();
  EXPECT_GE(before - after, int64_t{32} << 20) << "the free pages must leave the resident set";
  std::free(blocks.back());
}

TEST(ConfigureMalloc, TheEnvironmentWins) {
  ASSERT_EQ(setenv("MALLOC_ARENA_MAX", "3", 1), 0);
  const std::string said = ConfigureMalloc(MallocSettings{});
  unsetenv("MALLOC_ARENA_MAX");
  EXPECT_NE(said.find("MALLOC_ARENA_MAX=3"), std::string::npos) << said;
}

TEST(AutoThreadCount, OneForASmallModelOnePerCoreOtherwise) {
  std::string why;
  // The default model (5.12 M parameters) and the largest that counts as small: one thread.
  EXPECT_EQ(AutoThreadCount(0, 5'120'000, 16, &why), 1);
  EXPECT_NE(why.find("5120000 parameters"), std::string::npos) << why;
  EXPECT_EQ(AutoThreadCount(0, kAutoF32MaxParameters, 16), 1);
  // Larger or unknown (-1: the folder's headers could not be read): every core.
  EXPECT_EQ(AutoThreadCount(0, kAutoF32MaxParameters + 1, 16, &why), 16);
  EXPECT_NE(why.find("one per core"), std::string::npos) << why;
  EXPECT_EQ(AutoThreadCount(0, -1, 2), 2);
  EXPECT_EQ(AutoThreadCount(-3, 7'063'427'072, 0), 1);  // no core count known: still one
  // A count asked for wins, whatever the model.
  EXPECT_EQ(AutoThreadCount(3, 5'120'000, 16, &why), 3);
  EXPECT_NE(why.find("forced"), std::string::npos) << why;
}

TEST(AutoMaxBatch, WideWhereProductsGainFromRowsNarrowWhereTheyDoNot) {
  std::string why;
  EXPECT_EQ(AutoMaxBatch(0, false, CpuPath::kAvx512Bf16, DType::kBF16, &why), kAutoMaxBatchWide);
  EXPECT_NE(why.find("avx512bf16"), std::string::npos) << why;
  EXPECT_EQ(AutoMaxBatch(0, true, CpuPath::kGeneric, DType::kBF16), kAutoMaxBatchWide);
  // fp32 weights, or a path that widens bf16 in registers: the FMAs are the limit from 8 rows.
  EXPECT_EQ(AutoMaxBatch(0, false, CpuPath::kAvx512Bf16, DType::kF32, &why), kAutoMaxBatchNarrow);
  EXPECT_NE(why.find("f32"), std::string::npos) << why;
  EXPECT_EQ(AutoMaxBatch(0, false, CpuPath::kAvx2, DType::kBF16, &why), kAutoMaxBatchNarrow);
  EXPECT_NE(why.find("avx2"), std::string::npos) << why;
  EXPECT_EQ(AutoMaxBatch(0, false, CpuPath::kAvx512, DType::kBF16), kAutoMaxBatchNarrow);
  EXPECT_EQ(AutoMaxBatch(0, false, CpuPath::kGeneric, DType::kF32), kAutoMaxBatchNarrow);
  EXPECT_LT(kAutoMaxBatchNarrow, kAutoMaxBatchWide);
  // A cap asked for wins.
  EXPECT_EQ(AutoMaxBatch(3, true, CpuPath::kAvx512Bf16, DType::kBF16, &why), 3);
  EXPECT_NE(why.find("forced"), std::string::npos) << why;
}

// oneDNN's primitive cache is capped (where libtorch loads oneDNN and the environment says
// nothing): read back through oneDNN's own getter.
TEST(LimitOneDnnCache, CapsThePrimitiveCache) {
  if (std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") ||
      std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY")) {
    GTEST_SKIP() << "the environment sets the capacity";
  }
  using GetCapacity = int (*)(int*);
  auto get =
      reinterpret_cast<GetCapacity>(dlsym(RTLD_DEFAULT, "dnnl_get_primitive_cache_capacity"));
  const std::string said = LimitOneDnnCache(48);
  if (get == nullptr) {
    EXPECT_EQ(said, "no oneDNN");
    GTEST_SKIP() << "libtorch without oneDNN";
  }
  int capacity = -1;
  ASSERT_EQ(get(&capacity), 0);
  EXPECT_EQ(capacity, 48);
  EXPECT_NE(said.find("48 primitives"), std::string::npos) << said;
  LimitOneDnnCache();
  ASSERT_EQ(get(&capacity), 0);
  EXPECT_EQ(capacity, kOneDnnCacheCapacity);
}

}  // namespace
}  // namespace llava
