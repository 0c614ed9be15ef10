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

// A pool of 20 pages of 16 slots (320 entries per layer), 200 bytes a page.
// No share of the answers' growth in admission (growth ratio 0) unless a test sets one.
SchedulerConfig Config(int max_batch = 8, int max_queue = 4) {
  SchedulerConfig c;
  c.initial_growth_ratio = c.min_growth_ratio = 0;
  c.pool_pages = 20;
  c.page_entries = 16;
  c.page_bytes = 200;
  c.max_batch = max_batch;
  c.max_queue = max_queue;
  return c;
}

SchedRequest Req(uint64_t id, int64_t prompt, int64_t max_tokens, CacheParams kv) {
  SchedRequest r;
  r.id = id;
  r.prompt_tokens = prompt;
  r.max_tokens = max_tokens;
  r.kv = kv;
  return r;
}

TEST(SteadyEntries, FullAndCompressed) {
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kFull, 0.2)), 800);
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kElastic, 1.0)), 800);
  EXPECT_EQ(SteadyEntries(600, 200, Kv(CachePolicy::kElastic, 0.2)), 160);  // ceil(0.2 * 800)
  EXPECT_EQ(SteadyEntries(400, 1000, Kv(CachePolicy::kH2O, 0.5)), 700);
}

// Elastic with `protect_instruction` (off by default) pins a 30-token instruction, but the pins
// get at most half of the budget, so admission counts the budget; sinks beyond it are counted.
TEST(SteadyEntries, CountsTheProtectedInstruction) {
  PromptSegments segments;
  segments.images = {{5, 570}};
  segments.instruction = {570, 600};
  CacheParams pinned = Kv(CachePolicy::kElastic, 0.02);
  pinned.elastic.protect_instruction = true;
  pinned.elastic.protect_tail = 0;  // the spans alone (the tail: below)
  // 0.02: the pins get half of ceil(0.02 * 600) = 12, so they never exceed the budget.
  EXPECT_EQ(SteadyEntries(600, 200, pinned, segments), 16);
  pinned.budget = 0.2;
  EXPECT_EQ(SteadyEntries(600, 200, pinned, segments), 160);
  // Sinks beyond the budget do: 40 sinks at ceil(0.02 * 800) = 16.
  CacheParams sinks = Kv(CachePolicy::kElastic, 0.02);
  sinks.sink_tokens = 40;
  EXPECT_EQ(SteadyEntries(600, 200, sinks, segments), 44);  // + the product's tail of 4
  CacheParams paper = Kv(CachePolicy::kElastic, 0.02);
  paper.elastic = ElasticPreset(ElasticVariant::kPaper);
  EXPECT_EQ(SteadyEntries(600, 200, paper, segments), 16);  // ceil(0.02 * 800)
  // The product's pinned tail is not held to half of the budget: at 0.005 (4 entries) the sink
  // and the tail's 4 (the newest entry among them) are counted.
  CacheParams product = Kv(CachePolicy::kElastic, 0.005);
  ASSERT_EQ(product.elastic.protect_tail, 4);
  EXPECT_EQ(SteadyEntries(600, 200, product, segments), 5);
}

// Full 200 + 100 tokens holds at most 300 entries: 19 pages. Elastic 0.2 of the same: its
// whole prompt (13 pages) while it prefills, then ceil(0.2 x 300) + 1 = 61 entries (4 pages).
TEST(Scheduler, PeakPagesAreTheMostARequestHoldsAtOnce) {
  Scheduler s(Config());
  EXPECT_EQ(s.PeakPages(Req(1, 200, 100, Kv(CachePolicy::kFull, 1))), 19);
  EXPECT_EQ(s.PeakPages(Req(2, 200, 100, Kv(CachePolicy::kElastic, 0.2))), 13);
  EXPECT_EQ(s.PeakPages(Req(3, 20, 600, Kv(CachePolicy::kElastic, 0.2))), 8);  // 125 entries
  EXPECT_EQ(s.PromptPages(Req(2, 200, 100, Kv(CachePolicy::kElastic, 0.2))), 13);
  EXPECT_EQ(s.PagesFor(0), 0);
  EXPECT_EQ(s.PagesFor(16), 1);
  EXPECT_EQ(s.PagesFor(17), 2);
}

// Admission by the prompt's pages in what is free now, above a watermark of a page per
// running request; FIFO, no overtaking; nothing reserved for the answer.
TEST(Scheduler, AdmitsFifoWhilePromptsFit) {
  Scheduler s(Config());
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(s.Enqueue(Req(id, 100, 200, Kv(CachePolicy::kFull, 1))).ok());  // 7 pages each
  }
  // 1: 7 <= 20. 2: 7 + 7 + 1 (1's page to grow into) = 15 <= 20. 3: 14 + 7 + 2 = 23 > 20.
  EXPECT_EQ(s.Admit(20), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(s.running(), 2);
  EXPECT_EQ(s.waiting(), 1);
  // With the two holding 15 pages, 5 are free: 7 + 2 > 5.
  EXPECT_TRUE(s.Admit(5).empty());
  EXPECT_EQ(s.Admit(9), (std::vector<uint64_t>{3}));  // 7 + 2 <= 9
  // A large request at the head blocks a small one behind it.
  Scheduler f(Config());
  ASSERT_TRUE(f.Enqueue(Req(1, 250, 10, Kv(CachePolicy::kFull, 1))).ok());  // 16 pages
  ASSERT_TRUE(f.Enqueue(Req(2, 10, 10, Kv(CachePolicy::kFull, 1))).ok());   // 1 page
  EXPECT_TRUE(f.Admit(15).empty()) << "FIFO: 2 would fit but may not overtake 1";
  EXPECT_EQ(f.Admit(20), (std::vector<uint64_t>{1, 2}));
}

// Elastic's compression shows in admission through the pages actually free: a pool of 100
// pages, requests of a 160-token prompt (10 pages while it prefills). After its prefill a Full
// request holds its 10 pages, an Elastic 0.2 one 3 (32 + 1 entries); each round admits against
// what is free then.
TEST(Scheduler, CompressionAdmitsMoreRequestsThroughFreePages) {
  SchedulerConfig c = Config(64, 64);
  c.pool_pages = 100;
  Scheduler full(c), elastic(c);
  for (uint64_t i = 0; i < 40; ++i) {
    ASSERT_TRUE(full.Enqueue(Req(i, 160, 64, Kv(CachePolicy::kFull, 1))).ok());
    ASSERT_TRUE(elastic.Enqueue(Req(i, 160, 64, Kv(CachePolicy::kElastic, 0.2))).ok());
  }
  auto run = [](Scheduler* s, int64_t held_each) {
    int64_t held = 0;
    std::vector<size_t> rounds;
    for (int round = 0; round < 10; ++round) {
      const std::vector<uint64_t> ids = s->Admit(100 - held);
      if (ids.empty()) break;
      rounds.push_back(ids.size());
      held += held_each * static_cast<int64_t>(ids.size());
    }
    return rounds;
  };
  // The k-th request of a round needs 10 (k + 1) prompt pages + a watermark page per running
  // request within what is free: 9 in the first round (9 x 10 + 8 = 98 <= 100), then Full has
  // 10 free pages for 10 + 9; Elastic 73, 58, 46, 40, 37, 34 for 5, 4, 2, 1, 1, 1 more.
  EXPECT_EQ(run(&full, 10), (std::vector<size_t>{9}));
  EXPECT_EQ(run(&elastic, 3), (std::vector<size_t>{9, 5, 4, 2, 1, 1, 1}));
}

// A preempted request waits first in line with its prompt and answer so far as its prompt, and
// is re-admitted before anything that was waiting.
TEST(Scheduler, PreemptedRequestsComeBackFirst) {
  Scheduler s(Config());
  ASSERT_TRUE(s.Enqueue(Req(1, 50, 100, Kv(CachePolicy::kFull, 1))).ok());  // 4 pages
  ASSERT_TRUE(s.Enqueue(Req(2, 50, 100, Kv(CachePolicy::kFull, 1))).ok());
  EXPECT_EQ(s.Admit(20), (std::vector<uint64_t>{1, 2}));
  ASSERT_TRUE(s.Enqueue(Req(3, 10, 10, Kv(CachePolicy::kFull, 1))).ok());
  EXPECT_TRUE(s.Preempt(2, 50 + 40, 60));  // 40 tokens generated: 90 rows = 6 pages
  EXPECT_EQ(s.preemptions(), 1);
  EXPECT_EQ(s.running(), 1);
  EXPECT_EQ(s.waiting(), 2);
  EXPECT_TRUE(s.Admit(6).empty()) << "6 pages + a watermark of 1 > 6";
  EXPECT_EQ(s.Admit(8), (std::vector<uint64_t>{2}));
  EXPECT_FALSE(s.Preempt(9, 10, 10)) << "not running";
  EXPECT_FALSE(s.Preempt(1, 400, 10)) << "400 rows could never fit the 20 pages";
  EXPECT_EQ(s.running(), 2);
  EXPECT_TRUE(s.Remove(2));
  EXPECT_TRUE(s.Remove(3));  // waiting
  EXPECT_FALSE(s.Remove(3));
}

// The share of growth: Full 100 + 200 tokens holds 7 pages after its prompt and grows by 12
// more (19). At ratio 1 admission keeps room for every running request's whole answer. The
// ratio follows the answers that finish (here each weighs 0.5 in the average, floor 0.25):
// answers of 20 of 200 tokens bring it down and admission takes more; a preemption raises it
// by 0.2; an answer that used all its tokens raises it too.
TEST(Scheduler, GrowthShareLearnsFromFinishedAnswers) {
  SchedulerConfig c = Config(8, 8);
  c.pool_pages = 40;
  c.initial_growth_ratio = 1.0;
  c.min_growth_ratio = 0.25;
  c.growth_ratio_weight = 0.5;
  Scheduler s(c);
  const SchedRequest r = Req(1, 100, 200, Kv(CachePolicy::kFull, 1));
  EXPECT_EQ(s.SteadyPages(r), 19);
  EXPECT_EQ(s.GrowthPages(r), 12);
  EXPECT_EQ(s.GrowthPages(Req(2, 200, 100, Kv(CachePolicy::kElastic, 0.2))), 0);
  for (uint64_t id = 1; id <= 6; ++id) {
    ASSERT_TRUE(s.Enqueue(Req(id, 100, 200, Kv(CachePolicy::kFull, 1))).ok());
  }
  // Ratio 1: 1 needs 7 + 12 = 19 <= 40; 2: 14 + 1 + 24 = 39 <= 40; 3: 21 + 2 + 36 > 40.
  EXPECT_EQ(s.Admit(40), (std::vector<uint64_t>{1, 2}));
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 1.0) << "admitting teaches nothing";
  EXPECT_TRUE(s.Finish(1, 20));  // 0.5 x 1 + 0.5 x 0.1
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 0.55);
  EXPECT_TRUE(s.Finish(2, 20));  // 0.5 x 0.55 + 0.05 = 0.325
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 0.325);
  EXPECT_FALSE(s.Finish(2, 20)) << "no longer running";
  // An empty pool of 40: k-th request needs 7 (k + 1) + k + ceil(0.325 x 12 (k + 1)).
  EXPECT_EQ(s.Admit(40), (std::vector<uint64_t>{3, 4, 5}));  // 7+0+4, 14+1+8, 21+2+12 = 35
  ASSERT_TRUE(s.Preempt(5, 130, 170));
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 0.525);
  EXPECT_TRUE(s.Finish(3, 200));  // all of it: 0.5 x 0.525 + 0.5
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 0.7625);
  // 5 comes back first: 9 prompt pages + 1 + ceil(0.7625 x 10) = 18; then 6: 9 + 7 + 2 +
  // ceil(0.7625 x 22) = 35. A resumed request's answer counts from its first prompt: 30
  // generated before the preemption (prompt 100 -> 130) and 170 after make all of its 200.
  EXPECT_EQ(s.Admit(40), (std::vector<uint64_t>{5, 6}));
  EXPECT_TRUE(s.Finish(5, 200));
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 0.88125);
  for (int i = 0; i < 20; ++i) {  // short answers bring it to its floor
    ASSERT_TRUE(s.Enqueue(Req(100 + i, 10, 200, Kv(CachePolicy::kFull, 1))).ok());
    ASSERT_EQ(s.Admit(40).size(), 1u);
    ASSERT_TRUE(s.Finish(100 + i, 1));
  }
  EXPECT_DOUBLE_EQ(s.growth_ratio(), 0.25);
}

TEST(Scheduler, RefusesWhatCanNeverFitAndBoundsTheQueue) {
  Scheduler s(Config(8, 2));
  Status too_big = s.Enqueue(Req(1, 200, 200, Kv(CachePolicy::kFull, 1)));  // 25 > 20 pages
  EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.message().find("KV cache"), std::string::npos);
  EXPECT_NE(too_big.message().find("5000"), std::string::npos) << too_big.message();  // 25 x 200
  // The same at Elastic 0.2 fits: 13 pages of prompt, then 81 entries.
  ASSERT_TRUE(s.Enqueue(Req(2, 200, 200, Kv(CachePolicy::kElastic, 0.2))).ok());
  ASSERT_TRUE(s.Enqueue(Req(3, 10, 10, Kv(CachePolicy::kFull, 1))).ok());
  EXPECT_EQ(s.Enqueue(Req(4, 10, 10, Kv(CachePolicy::kFull, 1))).code(),
            StatusCode::kResourceExhausted);
  EXPECT_TRUE(s.Remove(3));  // a waiting request can be cancelled
  EXPECT_FALSE(s.Remove(3));
  EXPECT_EQ(s.Admit(20), (std::vector<uint64_t>{2}));
}

TEST(Scheduler, BatchLimit) {
  Scheduler s(Config(2, 8));
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_TRUE(s.Enqueue(Req(i, 10, 10, Kv(CachePolicy::kFull, 1))).ok());
  EXPECT_EQ(s.Admit(20), (std::vector<uint64_t>{0, 1}));
  EXPECT_TRUE(s.Remove(0));
  EXPECT_EQ(s.Admit(20), (std::vector<uint64_t>{2}));
}

}  // namespace
}  // namespace llava
