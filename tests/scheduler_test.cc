#include "engine/serving/scheduler.h"

#include <gtest/gtest.h>

namespace llava {
namespace {

CacheParams Kv(CachePolicy p, double gamma) {
  CacheParams c;
  c.policy = p;
  c.budget = gamma;
  return c;
}

// 2 layers x 100 bytes per entry; budget 100 000 bytes = 500 entries per layer.
SchedulerConfig Config(int max_batch = 8, int max_queue = 4) {
  SchedulerConfig c;
  c.kv_budget_bytes = 100000;
  c.bytes_per_entry = 100;
  c.num_layers = 2;
  c.max_batch = max_batch;
  c.max_queue = max_queue;
  return c;
}

TEST(SteadyEntries, FullAndCompressed) {
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kFull, 0.2)), 800);
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kElastic, 1.0)), 800);
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kElastic, 0.2)), 160);  // ceil(0.2 * 800)
  EXPECT_EQ(SteadyEntries(400, 1000, Kv(CachePolicy::kH2O, 0.5)), 700);
}

// The product Elastic never drops its instruction: a 30-token instruction plus BOS and the
// newest entry outweigh a 2% budget, and admission counts them.
TEST(SteadyEntries, CountsTheProtectedInstruction) {
  PromptSegments segments;
  segments.images = {{5, 570}};
  segments.instruction = {570, 600};
  // 0.02: the pins get half of ceil(0.02 * 600) = 12, so they never exceed the budget.
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kElastic, 0.02), segments), 16);
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kElastic, 0.2), segments), 160);
  // Sinks beyond the budget do: 40 sinks at ceil(0.02 * 800) = 16.
  CacheParams sinks = Kv(CachePolicy::kElastic, 0.02);
  sinks.sink_tokens = 40;
  EXPECT_EQ(SteadyEntries(600, 200, sinks, segments), 41);  // + the newest entry
  CacheParams paper = Kv(CachePolicy::kElastic, 0.02);
  paper.elastic = ElasticPreset(ElasticVariant::kPaper);
  EXPECT_EQ(SteadyEntries(600, 200, paper, segments), 16);  // ceil(0.02 * 800)
}

TEST(Scheduler, AdmitsFifoWhileBytesFit) {
  Scheduler s(Config());
  // Full, 200 + 100 tokens -> 300 entries x 2 layers x 100 B = 60 000 B.
  ASSERT_TRUE(s.Enqueue({1, 200, 100, Kv(CachePolicy::kFull, 1)}).ok());
  ASSERT_TRUE(s.Enqueue({2, 200, 100, Kv(CachePolicy::kFull, 1)}).ok());
  // Elastic 0.2 of the same: 60 entries once merged + the one a decode step appends before it
  // evicts (12 200 B), 200 while prefilling (40 000 B).
  ASSERT_TRUE(s.Enqueue({3, 200, 100, Kv(CachePolicy::kElastic, 0.2)}).ok());
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{1}));  // 2 would make 120 000 > 100 000
  EXPECT_EQ(s.reserved_bytes(), 60000);
  EXPECT_EQ(s.waiting(), 2);
  EXPECT_TRUE(s.Admit().empty()) << "FIFO: 3 would fit but may not overtake 2";
  EXPECT_TRUE(s.Remove(1));
  // Together: 60 000 + 12 200 once running; 40 000 + 40 000 while both prompts prefill.
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(s.reserved_bytes(), 100000) << "3 holds its whole prompt until it is merged";
  s.PrefillDone(2);
  s.PrefillDone(3);
  EXPECT_EQ(s.reserved_bytes(), 72200);
  EXPECT_EQ(s.running(), 2);
}

// A budget that holds 4 Full requests of a 600-token prompt + 100 answer tokens holds 5x as
// many at Elastic 0.2 once their prompts are merged (admitted a round at a time, since each
// round's prompts sit whole in the cache while they prefill).
TEST(Scheduler, CompressionAdmitsMoreRequests) {
  SchedulerConfig c = Config(64, 64);
  c.kv_budget_bytes = 4 * 700 * 2 * 100;  // 2800 entries per layer
  Scheduler full(c), elastic(c);
  for (uint64_t i = 0; i < 40; ++i) {
    ASSERT_TRUE(full.Enqueue({i, 600, 100, Kv(CachePolicy::kFull, 1)}).ok());
    ASSERT_TRUE(elastic.Enqueue({i, 600, 100, Kv(CachePolicy::kElastic, 0.2)}).ok());
  }
  EXPECT_EQ(full.Admit().size(), 4u);
  EXPECT_TRUE(full.Admit().empty());
  size_t admitted = 0;
  for (int round = 0; round < 40; ++round) {
    for (uint64_t id : elastic.Admit()) {
      elastic.PrefillDone(id);  // as the engine does once the prompt is fed and merged
      ++admitted;
    }
  }
  // Steady 140 entries each: 20 x 140 = 2800; the last rounds are limited by the 600-token
  // transient of the prefill.
  EXPECT_GE(admitted, 16u);
  EXPECT_LE(elastic.reserved_bytes(), c.kv_budget_bytes);
}

// With chunked prefill a request keeps its whole prompt for several turns: its reservation
// stays at the prompt size until PrefillDone, and later rounds see it.
TEST(Scheduler, PromptTransientIsHeldUntilPrefillDone) {
  SchedulerConfig c = Config(64, 64);
  c.kv_budget_bytes = 1000 * 2 * 100;  // 1000 entries per layer
  Scheduler s(c);
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(s.Enqueue({i, 600, 100, Kv(CachePolicy::kElastic, 0.2)}).ok());  // steady 140 + 1
  }
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{0}));  // two prompts of 600 would not fit
  EXPECT_EQ(s.reserved_bytes(), 600 * 200);
  EXPECT_TRUE(s.Admit().empty()) << "request 0 still holds its whole prompt";
  s.PrefillDone(0);
  s.PrefillDone(0);  // repeated: ignored
  s.PrefillDone(7);  // unknown: ignored
  EXPECT_EQ(s.reserved_bytes(), 141 * 200);
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{1}));  // 141 + 600 fits, 141 + 1200 does not
  EXPECT_TRUE(s.Remove(1));                          // cancelled while prefilling
  EXPECT_EQ(s.reserved_bytes(), 141 * 200);
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{2}));
}

TEST(Scheduler, RefusesWhatCanNeverFitAndBoundsTheQueue) {
  Scheduler s(Config(8, 2));
  Status too_big = s.Enqueue({1, 400, 200, Kv(CachePolicy::kFull, 1)});  // 600 > 500 entries
  EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.message().find("KV cache"), std::string::npos);
  ASSERT_TRUE(s.Enqueue({2, 10, 10, Kv(CachePolicy::kFull, 1)}).ok());
  ASSERT_TRUE(s.Enqueue({3, 10, 10, Kv(CachePolicy::kFull, 1)}).ok());
  EXPECT_EQ(s.Enqueue({4, 10, 10, Kv(CachePolicy::kFull, 1)}).code(),
            StatusCode::kResourceExhausted);
  EXPECT_TRUE(s.Remove(3));  // a waiting request can be cancelled
  EXPECT_FALSE(s.Remove(3));
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{2}));
}

// With pages of 16 slots a reservation is whole pages: Full 200 + 100 -> 300 entries -> 19
// pages (304 slots); Elastic 0.2 -> 60 + 1 -> 4 pages (64); a 200-token prompt -> 13 (208).
TEST(Scheduler, ReservesWholePages) {
  SchedulerConfig c = Config();
  c.page_entries = 16;
  Scheduler s(c);
  EXPECT_EQ(s.SteadyBytes({1, 200, 100, Kv(CachePolicy::kFull, 1)}), 304 * 200);
  EXPECT_EQ(s.SteadyBytes({2, 200, 100, Kv(CachePolicy::kElastic, 0.2)}), 64 * 200);
  EXPECT_EQ(s.PrefillBytes({2, 200, 100, Kv(CachePolicy::kElastic, 0.2)}), 208 * 200);
  EXPECT_EQ(s.PageBytes(0), 0);
  EXPECT_EQ(s.PageBytes(16), 16 * 200);
  EXPECT_EQ(s.PageBytes(17), 32 * 200);
}

TEST(Scheduler, BatchLimit) {
  Scheduler s(Config(2, 8));
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_TRUE(s.Enqueue({i, 10, 10, Kv(CachePolicy::kFull, 1)}).ok());
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{0, 1}));
  EXPECT_TRUE(s.Remove(0));
  EXPECT_EQ(s.Admit(), (std::vector<uint64_t>{2}));
}

}  // namespace
}  // namespace llava
