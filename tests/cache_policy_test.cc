#include "engine/kv/cache_policy.h"

#include <gtest/gtest.h>

#include <random>

#include "engine/kv/elastic_policy.h"
#include "engine/kv/h2o_policy.h"
#include "engine/kv/kv_policy.h"
#include "engine/kv/snapkv_policy.h"
#include "engine/kv/streaming_policy.h"

namespace llava {
namespace {

CacheParams Elastic(double gamma, int sinks = -1, int recent = 25) {
  CacheParams p;
  p.policy = CachePolicy::kElastic;
  p.budget = gamma;
  p.sink_tokens = sinks;
  p.elastic = ElasticPreset(ElasticVariant::kPaper);
  p.elastic.recent_distance = recent;
  return p;
}

// T = 10, gamma = 0.5, one sink: K = 5 survivors, protected {0, 9}, anchors are the three
// most important of positions 1..8: 4 (0.9), 6 (0.8), 8 (0.7).
TEST(ElasticMerge, HandComputedTenTokens) {
  const std::vector<float> importance = {9, 0.1f, 0.5f, 0.3f, 0.9f, 0.2f, 0.8f, 0.05f, 0.7f, 5};
  MergePlan plan = PlanElasticMerge(importance, Elastic(0.5));
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 4, 6, 8, 9}));
  // 1, 2, 3 -> anchor 4; 5 is equidistant from 4 and 6 -> the earlier, 4;
  // 7 is equidistant from 6 and 8 -> 6.
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 1, 1, 1, 1, 1, 2, 2, 3, 4}));
  EXPECT_EQ(plan.merged, 5);
  EXPECT_EQ(plan.dropped, 0);
}

// The ablation keeps the same survivors as the merge above and drops the rest.
TEST(ElasticMerge, WithoutMergingDropsTheNonAnchors) {
  const std::vector<float> importance = {9, 0.1f, 0.5f, 0.3f, 0.9f, 0.2f, 0.8f, 0.05f, 0.7f, 5};
  CacheParams p = Elastic(0.5);
  p.elastic.merge = false;
  MergePlan plan = PlanElasticMerge(importance, p);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 4, 6, 8, 9}));
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, -1, -1, -1, 1, -1, 2, -1, 3, 4}));
  EXPECT_EQ(plan.merged, 0);
  EXPECT_EQ(plan.dropped, 5);
}

TEST(ElasticMerge, TiesInImportancePreferTheEarlierPosition) {
  const std::vector<float> importance(8, 1.0f);                 // all equal
  MergePlan plan = PlanElasticMerge(importance, Elastic(0.5));  // K = 4: {0, 7} + 2 anchors
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 1, 2, 7}));
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 1, 2, 2, 2, 2, 2, 3}));
}

TEST(ElasticMerge, NoAnchorsDropsTheUnprotected) {
  const std::vector<float> importance = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  MergePlan plan = PlanElasticMerge(importance, Elastic(0.1));  // ceil(1) < 2 protected
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 9}));
  EXPECT_EQ(plan.dropped, 8);
  EXPECT_EQ(plan.merged, 0);
}

TEST(ElasticMerge, FullBudgetKeepsEverything) {
  std::vector<float> importance = {3, 1, 2, 5, 4};
  MergePlan plan = PlanElasticMerge(importance, Elastic(1.0));
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(plan.merged, 0);
}

TEST(ElasticMerge, PropertiesOverRandomInputs) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t t = 1 + rng() % 80;
    const double gamma = 0.05 + 0.95 * (rng() % 1000) / 1000.0;
    const int sinks = rng() % 5;
    std::vector<float> imp(t);
    for (auto& x : imp) x = static_cast<float>(rng() % 50);
    const CacheParams p = Elastic(gamma, sinks);
    MergePlan plan = PlanElasticMerge(imp, p);
    const int64_t expected =
        std::min(t, std::max<int64_t>(std::min<int64_t>(t, sinks + 1), CeilBudget(gamma, t)));
    ASSERT_EQ(static_cast<int64_t>(plan.kept.size()), expected) << t << " " << gamma;
    ASSERT_TRUE(std::is_sorted(plan.kept.begin(), plan.kept.end()));
    for (int64_t i = 0; i < std::min<int64_t>(sinks, t); ++i) ASSERT_EQ(plan.kept[i], i);
    ASSERT_EQ(plan.kept.back(), t - 1);
    int64_t folded = 0;
    for (int64_t i = 0; i < t; ++i) {
      const int64_t b = plan.bucket[i];
      if (b < 0) continue;
      // Protected positions are alone in their bucket; others join an anchor.
      const int64_t anchor = plan.kept[b];
      if (anchor != i) {
        ++folded;
        ASSERT_GE(anchor, sinks);
        ASSERT_LT(anchor, t - 1);
        // Nearest anchor: no kept unprotected position is strictly closer.
        for (int64_t k : plan.kept) {
          if (k < sinks || k == t - 1) continue;
          ASSERT_GE(std::abs(k - i), std::abs(anchor - i));
          if (std::abs(k - i) == std::abs(anchor - i)) {
            ASSERT_LE(anchor, k);
          }
        }
      }
    }
    ASSERT_EQ(folded, plan.merged);
    ASSERT_EQ(plan.merged + plan.dropped + static_cast<int64_t>(plan.kept.size()), t);
  }
}

TEST(FixedPoint, Formula) {
  EXPECT_EQ(ElasticFixedPoint(5, Elastic(0.5)), 1);        // max(1, 5 - 25 + 1)
  EXPECT_EQ(ElasticFixedPoint(5, Elastic(0.5, 1, 3)), 3);  // 5 - 3 + 1
  EXPECT_EQ(ElasticFixedPoint(120, Elastic(0.2)), 96);     // 120 - 25 + 1
  EXPECT_EQ(ElasticFixedPoint(10, Elastic(0.2, /*sinks=*/4, 25)), 4);
}

TEST(EntryTarget, MatchesDefinition) {
  auto target = [](const CacheParams& p, int64_t n) { return ProjectedEntries(p, {}, n); };
  EXPECT_EQ(target(Elastic(0.2), 10), 2);
  EXPECT_EQ(target(Elastic(0.2), 11), 3);
  EXPECT_EQ(target(Elastic(0.1), 10), 2);  // protected: sink + newest
  EXPECT_EQ(target(Elastic(0.1), 1), 1);
  CacheParams full;
  full.policy = CachePolicy::kFull;
  full.budget = 0.1;
  EXPECT_EQ(target(full, 10), 10);
  EXPECT_EQ(EntryTarget(0.5, 10, 7), 7);  // protected entries above the budget
  EXPECT_EQ(EntryTarget(0.5, 5, 7), 5);   // never more than n
  EXPECT_EQ(CeilBudget(0.2, 10), 2);
  EXPECT_EQ(CeilBudget(0.3, 10), 3);
  EXPECT_EQ(CeilBudget(0.7, 10), 7);
  EXPECT_EQ(CeilBudget(0.21, 10), 3);
}

TEST(StreamingLLM, KeepsSinksAndRecent) {
  EXPECT_EQ(StreamingKeep(10, 6, 4), (std::vector<int64_t>{0, 1, 2, 3, 8, 9}));
  EXPECT_EQ(StreamingKeep(10, 4, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(StreamingKeep(3, 6, 4), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(StreamingKeep(10, 5, 0), (std::vector<int64_t>{5, 6, 7, 8, 9}));
}

TEST(H2O, HeavyHittersAndRecentWindow) {
  // target 5: recent 3 (7, 8, 9) + 2 heavy among 0..6: scores 0.9 at 2, 0.8 at 5.
  const std::vector<float> s = {0.1f, 0.3f, 0.9f, 0.2f, 0.1f, 0.8f, 0.4f, 0.f, 0.f, 0.f};
  EXPECT_EQ(H2OKeep(s, 5), (std::vector<int64_t>{2, 5, 7, 8, 9}));
  // Victim outside the 3 most recent: lowest score, earlier on ties (0 and 4 both 0.1).
  EXPECT_EQ(H2OVictim(s, 5), 0);
  EXPECT_EQ(H2OVictim({0.5f, 0.2f, 0.2f, 0.f}, 2), 1);
}

// `h2o+paper` (the Elastic Cache paper's code): no recent window but the newest entry, 1 sink.
TEST(H2O, PaperVariantHasNoRecentWindow) {
  const std::vector<float> s = {0.1f, 0.3f, 0.9f, 0.2f, 0.1f, 0.8f, 0.4f, 0.f, 0.f, 0.f};
  // target 5: the sink 0, the newest 9, and the three highest of 1..8: 2, 5, 6.
  EXPECT_EQ(H2OKeep(s, 5, 1, 1), (std::vector<int64_t>{0, 2, 5, 6, 9}));
  // Victim: the lowest of 1..8 (7 and 8 both 0: the earlier), never the sink nor the newest.
  EXPECT_EQ(H2OVictim(s, 5, 1, 1), 7);
  EXPECT_EQ(H2OVictim({0.f, 0.5f, 0.f}, 2, 1, 1), 1);
  EXPECT_EQ(H2OVictim({0.f, 0.5f}, 1, 1, 1), -1);  // only the sink and the newest are left
  const CacheParams p = ParseCacheSpec("h2o+paper").value();
  EXPECT_FALSE(p.h2o.recent_window);
  EXPECT_TRUE(p.h2o.shared_scores);
  EXPECT_EQ(p.sinks(), 1);
  EXPECT_EQ(ParseCacheSpec("h2o+paper+sinks=0").value().sinks(), 0);
  const CacheParams plain = ParseCacheSpec("h2o").value();
  EXPECT_TRUE(plain.h2o.recent_window);
  EXPECT_FALSE(plain.h2o.shared_scores);
  EXPECT_EQ(plain.sinks(), 0);
  auto bad = ParseCacheSpec("h2o+fast");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("kv_cache.h2o"), std::string::npos);
}

// Shared scores: every layer ranks by the sum over all layers, so every layer keeps and
// evicts the same positions although each layer's own scores would disagree.
TEST(H2O, SharedScoresKeepTheSamePositionsInEveryLayer) {
  CacheParams p = ParseCacheSpec("h2o+paper+sinks=0").value();
  p.budget = 0.5;
  std::unique_ptr<KvPolicy> policy = NewKvPolicy(p, {}, 2);
  // T = 6, target 3: the newest (5) and two heavy hitters of 0..4. Layer 0 alone would keep
  // {0, 1}, layer 1 alone {3, 4}; summed: 0: 1.0, 1: 0.9, 2: 1.2, 3: 0.7, 4: 0.8 -> {0, 2}.
  const float l0[6] = {0.9f, 0.8f, 0.6f, 0.1f, 0.1f, 0.f};
  const float l1[6] = {0.1f, 0.1f, 0.6f, 0.6f, 0.7f, 0.f};
  policy->AddScores(0, 0, l0, 6);
  policy->AddScores(1, 0, l1, 6);
  EXPECT_EQ(policy->PlanPrompt(0, 6).kept, (std::vector<int64_t>{0, 2, 5}));
  EXPECT_EQ(policy->PlanPrompt(1, 6).kept, (std::vector<int64_t>{0, 2, 5}));
  // A decode step appends entry 3 (position 6); its sums: layer 0 favours the first kept
  // entry, layer 1 the second; summed, position 5 (index 2) has the least.
  const float d0[4] = {0.5f, 0.f, 0.f, 0.5f};
  const float d1[4] = {0.f, 0.5f, 0.2f, 0.3f};
  for (int l = 0; l < 2; ++l) policy->OnAppend(l, 1);
  policy->AddScores(0, -1, d0, 4);
  policy->AddScores(1, -1, d1, 4);
  // target for n = 7: ceil(3.5) = 4 -> no eviction yet; at target 3 the victim of both layers
  // is the lowest of 0..2 by the summed scores: 0: 1.5, 2: 1.7, 5: 0.2 -> index 2.
  EXPECT_EQ(policy->Victim(0, 4, 3), 2);
  EXPECT_EQ(policy->Victim(1, 4, 3), 2);
}

TEST(CacheParams, ValidationNamesTheField) {
  CacheParams p;
  p.budget = 0;
  EXPECT_NE(ValidateCacheParams(p).message().find("kv_cache.budget"), std::string::npos);
  p.budget = 1.5;
  EXPECT_FALSE(ValidateCacheParams(p).ok());
  p.budget = std::nan("");
  EXPECT_FALSE(ValidateCacheParams(p).ok());
  p.budget = 0.5;
  p.elastic.recent_distance = 0;
  EXPECT_NE(ValidateCacheParams(p).message().find("kv_cache.recent_distance"), std::string::npos);
  p.elastic.recent_distance = 25;
  p.sink_tokens = -2;
  EXPECT_NE(ValidateCacheParams(p).message().find("kv_cache.sink_tokens"), std::string::npos);
  p.sink_tokens = 1;
  EXPECT_TRUE(ValidateCacheParams(p).ok());
  EXPECT_EQ(ParseCachePolicy("h2o").value(), CachePolicy::kH2O);
  EXPECT_NE(ParseCachePolicy("lru").status().message().find("kv_cache.policy"), std::string::npos);
  EXPECT_EQ(ParsePositionMode("compressed").value(), PositionMode::kCompressed);
}

}  // namespace
}  // namespace llava

namespace llava {
namespace {

// BOS, "USER:" at 1, an image at [2, 8), the instruction at [8, 12).
PromptSegments TwelveTokenPrompt() {
  PromptSegments s;
  s.images = {{2, 8}};
  s.instruction = {8, 12};
  return s;
}

CacheParams Product(double gamma) {
  CacheParams p;
  p.policy = CachePolicy::kElastic;
  p.budget = gamma;
  return p;
}

// The product with the instruction (and a question before the image) pinned: an option of the
// product, off by default. Without the product's pinned tail, so that only the spans are seen.
CacheParams Protecting(double gamma) {
  CacheParams p = Product(gamma);
  p.elastic.protect_instruction = true;
  p.elastic.protect_tail = 0;
  return p;
}

TEST(PromptSegments, EachImageAndTextRunIsASegment) {
  PromptSegments s;
  s.images = {{2, 4}, {5, 7}};
  EXPECT_EQ(s.SegmentIds(9), (std::vector<int>{0, 0, 1, 1, 2, 3, 3, 4, 4}));
  EXPECT_EQ(PromptSegments().SegmentIds(3), (std::vector<int>{0, 0, 0}));
}

TEST(ElasticPinned, SinksAndTheProtectedSpans) {
  PromptSegments s = TwelveTokenPrompt();
  s.system = {1, 2};
  EXPECT_EQ(ElasticPinned(Elastic(0.5), s, 12), (std::vector<int64_t>{0}));  // paper: sinks
  // Budget 1: 12 entries, half of them (6) for the sink and the spans: the instruction, not the
  // system prompt unless asked for.
  CacheParams p = Protecting(1.0);
  EXPECT_FALSE(p.elastic.protect_system);
  EXPECT_EQ(ElasticPinned(p, s, 12), (std::vector<int64_t>{0, 8, 9, 10, 11}));
  p.elastic.protect_system = true;
  EXPECT_EQ(ElasticPinned(p, s, 12), (std::vector<int64_t>{0, 1, 8, 9, 10, 11}));
  // Budget 0.5: 6 entries, 3 pinned at most: the sink and the instruction's last two.
  p.budget = 0.5;
  EXPECT_EQ(ElasticPinned(p, s, 12), (std::vector<int64_t>{0, 10, 11}));

  // The paper's layout: a question before the image is kept after the instruction, then the
  // system prompt when asked for, each from its end, within half of the budget.
  PromptSegments paper;
  paper.system = {1, 3};
  paper.question = {3, 6};
  paper.images = {{6, 20}};
  paper.instruction = {20, 24};
  EXPECT_EQ(ElasticPinned(Protecting(1.0), paper, 24),
            (std::vector<int64_t>{0, 3, 4, 5, 20, 21, 22, 23}));
  CacheParams with_system = Protecting(1.0);
  with_system.elastic.protect_system = true;
  EXPECT_EQ(ElasticPinned(with_system, paper, 24),
            (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 20, 21, 22, 23}));
  // 0.75: 18 entries, 9 pinned: the instruction, the question, the system prompt's end.
  with_system.budget = 0.75;
  EXPECT_EQ(ElasticPinned(with_system, paper, 24),
            (std::vector<int64_t>{0, 2, 3, 4, 5, 20, 21, 22, 23}));
  // 0.5: 12 entries, 6 pinned: the instruction and the question's last token.
  with_system.budget = 0.5;
  EXPECT_EQ(ElasticPinned(with_system, paper, 24), (std::vector<int64_t>{0, 5, 20, 21, 22, 23}));
  EXPECT_EQ(ElasticPinned(Protecting(0.5), paper, 24),
            (std::vector<int64_t>{0, 5, 20, 21, 22, 23}));
  EXPECT_EQ(ElasticPinned(Elastic(0.5), paper, 24), (std::vector<int64_t>{0}));
}

// protect_tail pins the prompt's last N positions, outside the spans' half of the budget: at
// 0.25 of 12 (3 entries) a tail of 3 is pinned whole, beside the sink; a tail longer than the
// prompt pins all of it; the merge keeps each pinned position in a bucket of its own.
TEST(ElasticPinned, TheTailIsPinnedWhole) {
  const PromptSegments s = TwelveTokenPrompt();
  CacheParams p = Elastic(0.25);
  p.elastic.protect_tail = 3;
  EXPECT_EQ(ElasticPinned(p, s, 12), (std::vector<int64_t>{0, 9, 10, 11}));
  p.elastic.protect_tail = 20;
  EXPECT_EQ(ElasticPinned(p, s, 5), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // Budget 0.5: 6 entries, the 4 pinned and 2 anchors, the most important free positions 1 and
  // 3; positions 2, 4-8 join the nearest anchor (2 ties and goes to the earlier), none joins a
  // pinned entry.
  p.budget = 0.5;
  p.elastic.protect_tail = 3;
  const std::vector<float> importance = {0, 9, 1, 8, 1, 1, 1, 1, 1, 7, 1, 1};
  MergePlan plan = PlanElasticMerge(importance, p, s);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 1, 3, 9, 10, 11}));
  EXPECT_EQ(plan.pinned, (std::vector<bool>{true, false, false, true, true, true}));
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 1, 1, 2, 2, 2, 2, 2, 2, 3, 4, 5}));
  p.elastic.protect_tail = -1;
  EXPECT_FALSE(ValidateCacheParams(p).ok());
  p.elastic.protect_tail = 4097;
  EXPECT_FALSE(ValidateCacheParams(p).ok());
  EXPECT_EQ(ParseCacheSpec("elastic+tail=6").value().elastic.protect_tail, 6);
  EXPECT_FALSE(ParseCacheSpec("elastic+tail=x").ok());
}

// Column sums [T = 6] of every prompt query and of the instruction's (rows 4 and 5).
TEST(ElasticImportance, EachModeDividesByTheQueriesThatWereSummed) {
  const std::vector<float> sums = {6, 5, 4, 3, 2, 1};
  const std::vector<float> instruction = {4, 3, 2, 1, 1, 0.5f};
  EXPECT_EQ(ElasticImportance(sums, instruction, ImportanceMode::kSum, 4), sums);
  // mean: position j is seen by 6 - j queries -> every value is 1.
  EXPECT_EQ(ElasticImportance(sums, instruction, ImportanceMode::kMean, 4),
            std::vector<float>(6, 1.f));
  // instruction: positions up to 4 are seen by both instruction queries, 5 by one.
  EXPECT_EQ(ElasticImportance(sums, instruction, ImportanceMode::kInstruction, 4),
            (std::vector<float>{2, 1.5f, 1, 0.5f, 0.5f, 0.5f}));
  EXPECT_EQ(ElasticImportance(sums, instruction, ImportanceMode::kHybrid, 4),
            (std::vector<float>{3, 2.5f, 2, 1.5f, 1.5f, 1.5f}));
}

// K = 6 of 12 (image rows 2-7, text 8-11, the instruction 10-11): pinned {0, 10, 11} leave three
// anchors, the most important unpinned positions (5, 8, 6). Segment scope merges image rows
// into image anchors and drops "USER:" (1), whose text run has no anchor; the paper's nearest
// scope would have merged it into the image.
TEST(ElasticMerge, ProtectedInstructionAndMergesWithinTheImage) {
  const std::vector<float> imp = {9, 0.05f, 0.1f, 0.2f, 0.3f, 0.9f, 0.4f, 0.1f, 0.6f, 0.05f, 0, 0};
  PromptSegments s;
  s.images = {{2, 8}};
  s.instruction = {10, 12};
  CacheParams p = Protecting(0.5);
  p.elastic.weighted_merge = false;
  MergePlan plan = PlanElasticMerge(imp, p, s);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 5, 6, 8, 10, 11}));
  EXPECT_EQ(plan.pinned, (std::vector<bool>{true, false, false, false, true, true}));
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, -1, 1, 1, 1, 1, 2, 2, 3, 3, 4, 5}));
  EXPECT_EQ(plan.merged, 5);
  EXPECT_EQ(plan.dropped, 1);
  EXPECT_TRUE(plan.weight.empty());

  p.elastic.merge_scope = MergeScope::kNearest;
  plan = PlanElasticMerge(imp, p, s);
  EXPECT_EQ(plan.bucket[1], 1);  // "USER:" joins the image anchor
  EXPECT_EQ(plan.merged, 6);
  EXPECT_EQ(plan.dropped, 0);

  p.elastic.weighted_merge = true;
  plan = PlanElasticMerge(imp, p, s);
  ASSERT_EQ(plan.weight.size(), 12u);
  EXPECT_FLOAT_EQ(plan.weight[5], 0.9f + 1e-6f);
  EXPECT_FLOAT_EQ(plan.weight[2], 0.1f + 1e-6f);
}

// The protected spans get half of the budget: at 0.2 (ceil(2.4) = 3 entries) only the sink is
// pinned, and the plan keeps exactly the budget.
TEST(ElasticMerge, ProtectedSpansNeverTakeTheWholeBudget) {
  const std::vector<float> imp = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2};
  MergePlan plan = PlanElasticMerge(imp, Protecting(0.2), TwelveTokenPrompt());
  EXPECT_EQ(plan.kept.size(), 3u);
  EXPECT_EQ(std::count(plan.pinned.begin(), plan.pinned.end(), true), 1);
  EXPECT_EQ(plan.kept.front(), 0);
  // At 0.8 (10 entries, 5 pinned) the sink and the whole 4-token instruction are.
  plan = PlanElasticMerge(imp, Protecting(0.8), TwelveTokenPrompt());
  EXPECT_EQ(plan.kept.size(), 10u);
  EXPECT_EQ(std::vector<int64_t>(plan.kept.end() - 4, plan.kept.end()),
            (std::vector<int64_t>{8, 9, 10, 11}));
  EXPECT_EQ(std::count(plan.pinned.begin(), plan.pinned.end(), true), 5);
}

// LOOK-M's text prior, T = 10: the sink 0, text 1, the image 2-7, text 8-9. gamma 0.5: K = 5,
// kept {0, 9} and three anchors: the text entries 1 and 8 first (whatever their importance),
// then the image's most important, 3 (0.9). Merges fall back to the nearest anchor by position
// (the cache re-assigns them by key similarity, AssignMergesByKey): 2 is 1 from 1 and 3 -> the
// earlier; 4, 5 -> 3; 6 is 3 from 3 and 2 from 8 -> 8; 7 -> 8.
TEST(ElasticMerge, TextPriorKeepsEveryTextEntryFirst) {
  const std::vector<float> imp = {9, 0.1f, 0.5f, 0.9f, 0.3f, 0.8f, 0.2f, 0.4f, 0.05f, 0};
  PromptSegments s;
  s.images = {{2, 8}};
  s.instruction = {8, 10};
  CacheParams p = ParseCacheSpec("lookm+sinks=1").value();
  p.budget = 0.5;
  MergePlan plan = PlanElasticMerge(imp, p, s);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 1, 3, 8, 9}));
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 1, 1, 2, 2, 2, 3, 3, 3, 4}));
  EXPECT_EQ(plan.merged, 5);
  EXPECT_TRUE(plan.merge_by_key);
  EXPECT_TRUE(plan.merge_keys);      // averaged merging: keys and values
  EXPECT_TRUE(plan.weight.empty());  // plain means
  // Without the prior the image's three most important are the anchors.
  p.elastic.text_prior = false;
  plan = PlanElasticMerge(imp, p, s);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 2, 3, 5, 9}));
  // More text than anchors: the text entries by importance (1 before 8), no image entry.
  p.elastic.text_prior = true;
  p.budget = 0.4;  // K = 4: two anchors
  plan = PlanElasticMerge(imp, p, s);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 1, 8, 9}));
}

TEST(ElasticVictim, SkipsPinnedEntriesAndTheNewest) {
  //                    0     1      2      3     4      5
  const std::vector<bool> pinned = {true, false, false, true, true, false};
  EXPECT_EQ(ElasticVictim(pinned, 1), 1);
  EXPECT_EQ(ElasticVictim(pinned, 3), 2);  // 3, 4 pinned, 5 newest: the last one before
  EXPECT_EQ(ElasticVictim({true, false}, 1), -1);
  EXPECT_EQ(ElasticVictim({true, true, false, false}, 1), 2);
}

TEST(ElasticVictim, ScoredTakesTheLeastAttendedUnpinnedEntry) {
  //                                0     1      2      3     4      5
  const std::vector<bool> pinned = {true, false, false, true, false, false};
  EXPECT_EQ(ScoredVictim(pinned, {0.f, 0.5f, 0.2f, 0.f, 0.2f, 0.f}), 2);  // ties: earlier
  EXPECT_EQ(ScoredVictim(pinned, {0.f, 0.1f, 0.2f, 0.f, 0.3f, 0.f}), 1);  // 5 is the newest
  EXPECT_EQ(ScoredVictim({true, true, false}, {0.f, 0.f, 0.f}), -1);
  // Ranked by score / age^exponent: 0.21 / 30^0.1 = 0.149 is below the fresh entry's 0.2.
  const std::vector<bool> none(4, false);
  const std::vector<float> scores = {0.9f, 0.21f, 0.2f, 0.f};
  const std::vector<int64_t> ages = {40, 30, 1, 0};
  EXPECT_EQ(ScoredVictim(none, scores, ages, 0.f), 2);
  EXPECT_EQ(ScoredVictim(none, scores, ages, 0.1f), 1);
  EXPECT_EQ(ScoredVictim(none, {0.9f, 0.5f, 0.2f, 0.f}, ages, 1.f), 1);  // 0.0167 < 0.2
}

// The policy counts each entry's age from the decode step it arrived in, and keeps the ages
// aligned when an entry leaves. Entries after three steps (e0 the pinned sink, e4 the newest):
//   e1 (age 3) 0.2 + 0.2 + 0.2 = 0.6, mean 0.2;  e2 (age 3) 0.8 + 0.3 + 0.3 = 1.4, mean 0.47;
//   e3 (age 2) 0.25 + 0.25 = 0.5, mean 0.25.
TEST(ElasticVictim, ScoredEvictionWeighsAgeFromArrival) {
  for (float exponent : {0.f, 1.f}) {
    CacheParams p;
    p.budget = 0.5;
    p.sink_tokens = 1;
    p.elastic = ElasticPreset(ElasticVariant::kPaper);
    p.elastic.eviction = DecodeEviction::kScored;
    p.elastic.evict_age_exponent = exponent;
    std::unique_ptr<KvPolicy> policy = NewElasticPolicy(p, PromptSegments{}, 1);
    ASSERT_EQ(policy->PlanPrompt(0, 2).kept, (std::vector<int64_t>{0, 1}));
    const std::vector<std::vector<float>> steps = {
        {0.f, 0.2f, 0.8f}, {0.f, 0.2f, 0.3f, 0.25f}, {0.f, 0.2f, 0.3f, 0.25f, 0.25f}};
    for (const std::vector<float>& col : steps) {
      policy->OnAppend(0, 1);
      policy->AddScores(0, -1, col.data(), static_cast<int64_t>(col.size()));
    }
    const int64_t first = policy->Victim(0, 5, 3);
    EXPECT_EQ(first, exponent == 0.f ? 3 : 1) << exponent;  // e3 by sum, e1 by mean
    policy->OnEvict(0, first);
    // Then e1 by sum (0.6 < 1.4); by mean e3 (0.25 < 0.47), now at index 2.
    EXPECT_EQ(policy->Victim(0, 4, 3), exponent == 0.f ? 1 : 2) << exponent;
  }
}

// evict_answer_first, by hand: the prompt keeps e0 (the pinned sink) and e1 (an image entry);
// three decode steps append e2, e3, e4 and give e1 0.1 x 3 = 0.3, e2 0.5 x 3 = 1.5, e3 0.3 + 0.3
// = 0.6, e4 0.2 (age exponent 0: plain sums). Every unpinned entry competing, e1 goes; with N = 1
// the answer's e3 (e4 is its newest); with N = 2 e2 (e3 and e4 spared); with N = 3 no answer
// entry is left to take and e1 goes after all. When e1 is prompt text, not image, it competes
// with the answer's entries even with N = 1.
TEST(ElasticVictim, AnswerFirstTakesTheAnswersEntriesBeforeTheImages) {
  for (bool image : {true, false}) {
    for (int n : {0, 1, 2, 3}) {
      CacheParams p;
      p.budget = 0.5;
      p.sink_tokens = 1;
      p.elastic = ElasticPreset(ElasticVariant::kPaper);
      p.elastic.eviction = DecodeEviction::kScored;
      p.elastic.evict_answer_first = n;
      PromptSegments segments;
      if (image) segments.images = {{1, 2}};
      std::unique_ptr<KvPolicy> policy = NewElasticPolicy(p, segments, 1);
      ASSERT_EQ(policy->PlanPrompt(0, 2).kept, (std::vector<int64_t>{0, 1}));
      const std::vector<std::vector<float>> steps = {
          {0.f, 0.1f, 0.5f}, {0.f, 0.1f, 0.5f, 0.3f}, {0.f, 0.1f, 0.5f, 0.3f, 0.2f}};
      for (const std::vector<float>& col : steps) {
        policy->OnAppend(0, 1);
        policy->AddScores(0, -1, col.data(), static_cast<int64_t>(col.size()));
      }
      const int64_t expected[] = {1, 3, 2, 1};
      const int64_t victim = policy->Victim(0, 5, 3);
      EXPECT_EQ(victim, image ? expected[n] : 1) << "N = " << n << ", image " << image;
      if (image && n == 1) {  // then e2, now the only answer entry but the newest
        policy->OnEvict(0, victim);
        EXPECT_EQ(policy->Victim(0, 4, 3), 2);
        policy->OnEvict(0, 2);
        EXPECT_EQ(policy->Victim(0, 3, 2), 1);  // e0, e1, e4: only the image's e1 is left
      }
    }
  }
  CacheParams bad;
  bad.elastic.evict_answer_first = -1;
  EXPECT_FALSE(ValidateCacheParams(bad).ok());
}

TEST(ParseCacheSpec, PresetsAndOptions) {
  auto p = ParseCacheSpec("elastic");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->elastic_variant, ElasticVariant::kProduct);
  EXPECT_FALSE(p->elastic.protect_instruction);
  EXPECT_EQ(p->elastic.importance, ImportanceMode::kHybrid);
  EXPECT_EQ(p->elastic.merge_scope, MergeScope::kSegment);
  EXPECT_FALSE(p->elastic.text_prior);
  EXPECT_FALSE(p->elastic.protect_system);
  EXPECT_FALSE(p->elastic.merge_keys);
  EXPECT_EQ(p->elastic.eviction, DecodeEviction::kScored);
  EXPECT_FLOAT_EQ(p->elastic.evict_age_exponent, 0.1f);
  EXPECT_EQ(p->elastic.evict_answer_first, 4);
  EXPECT_TRUE(p->elastic.decode_merge);
  EXPECT_EQ(p->elastic.protect_tail, 4);
  EXPECT_EQ(ParseCacheSpec("elastic+paper").value().elastic.protect_tail, 0);
  EXPECT_EQ(ParseCacheSpec("lookm").value().elastic.protect_tail, 0);
  p = ParseCacheSpec("elastic+answer_first=0+decode_merge=0");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->elastic.evict_answer_first, 0);
  EXPECT_FALSE(p->elastic.decode_merge);
  p = ParseCacheSpec("elastic+paper");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->elastic.evict_answer_first, 0);  // the paper drops what it evicts
  EXPECT_FALSE(p->elastic.decode_merge);
  p = ParseCacheSpec("lookm");  // LOOK-M: a preset of Elastic's knobs
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->policy, CachePolicy::kElastic);
  EXPECT_EQ(p->elastic_variant, ElasticVariant::kLookM);
  EXPECT_TRUE(p->elastic.text_prior);
  EXPECT_EQ(p->elastic.merge_scope, MergeScope::kKey);
  EXPECT_EQ(p->elastic.importance, ImportanceMode::kSum);
  EXPECT_FALSE(p->elastic.protect_instruction);
  EXPECT_EQ(p->elastic.eviction, DecodeEviction::kScored);
  EXPECT_EQ(p->elastic.evict_answer_first, 0);
  EXPECT_FALSE(p->elastic.decode_merge);
  EXPECT_FLOAT_EQ(p->elastic.evict_age_exponent, 0.f);
  EXPECT_EQ(ParseCacheSpec("elastic+lookm").value().elastic_variant, ElasticVariant::kLookM);
  p = ParseCacheSpec("lookm+text_prior=0+merge_scope=nearest");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_FALSE(p->elastic.text_prior);
  EXPECT_EQ(p->elastic.merge_scope, MergeScope::kNearest);
  EXPECT_FALSE(ParseCacheSpec("lookmx").ok());
  EXPECT_EQ(ParseCacheSpec("lookm").value().elastic.key_merge, KeyMerge::kAveraged);
  EXPECT_EQ(ParseCacheSpec("lookm+key_merge=pivotal").value().elastic.key_merge,
            KeyMerge::kPivotal);
  EXPECT_EQ(ParseCacheSpec("lookm+key_merge=weighted").value().elastic.key_merge,
            KeyMerge::kWeighted);
  p = ParseCacheSpec("lookm+key_merge=median");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("kv_cache.elastic.key_merge 'median' is unknown"),
            std::string::npos)
      << p.status().message();
  p = ParseCacheSpec("elastic+age_exp=0.5");
  ASSERT_TRUE(p.ok());
  EXPECT_FLOAT_EQ(p->elastic.evict_age_exponent, 0.5f);
  for (const char* bad : {"elastic+age_exp=2.5", "elastic+age_exp=-1", "elastic+age_exp=x",
                          "elastic+age_exp=nan", "elastic+age_exp="}) {
    auto q = ParseCacheSpec(bad);
    ASSERT_FALSE(q.ok()) << bad;
    EXPECT_NE(q.status().message().find("age_exp"), std::string::npos) << q.status().message();
  }
  p = ParseCacheSpec("elastic+merge_keys=1");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->elastic.merge_keys);
  EXPECT_FALSE(ParseCacheSpec("elastic+merge_keys=2").ok());
  p = ParseCacheSpec("elastic+paper+importance=mean+recent=7+weighted=1");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->elastic_variant, ElasticVariant::kPaper);
  EXPECT_FALSE(p->elastic.protect_instruction);
  EXPECT_EQ(p->elastic.importance, ImportanceMode::kMean);
  EXPECT_EQ(p->elastic.merge_scope, MergeScope::kNearest);
  EXPECT_TRUE(p->elastic.weighted_merge);
  EXPECT_TRUE(p->elastic.merge_keys);  // the paper averages keys too
  EXPECT_EQ(p->elastic.recent_distance, 7);
  EXPECT_EQ(p->elastic.eviction, DecodeEviction::kFixedPoint);
  p = ParseCacheSpec("elastic_drop");
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->elastic.merge);
  EXPECT_EQ(p->elastic.importance, ImportanceMode::kSum);
  CacheParams base;
  base.budget = 0.3;
  p = ParseCacheSpec("streaming", base);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->policy, CachePolicy::kStreamingLLM);
  EXPECT_EQ(p->budget, 0.3);
  EXPECT_NE(ParseCacheSpec("elastic+importance=max")
                .status()
                .message()
                .find("kv_cache.elastic.importance"),
            std::string::npos);
  EXPECT_NE(ParseCacheSpec("elastic+color=1").status().message().find("color"), std::string::npos);
  EXPECT_NE(ParseCacheSpec("elastic+recent=0").status().message().find("recent_distance"),
            std::string::npos);
  EXPECT_NE(ParseCacheSpec("lru").status().message().find("kv_cache.policy"), std::string::npos);
  // SnapKV's presets and knobs.
  auto snap = ParseCacheSpec("snapkv");
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->snapkv.window, 32);
  EXPECT_EQ(snap->snapkv.kernel, 7);
  snap = ParseCacheSpec("snapkv+kvpress");
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->snapkv.window, 64);
  EXPECT_EQ(snap->snapkv.kernel, 5);
  snap = ParseCacheSpec("snapkv+window=16+kernel=9");
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->snapkv.window, 16);
  EXPECT_EQ(snap->snapkv.kernel, 9);
  EXPECT_NE(ParseCacheSpec("snapkv+kernel=4").status().message().find("kv_cache.snapkv.kernel"),
            std::string::npos);
  EXPECT_NE(ParseCacheSpec("snapkv+window=0").status().message().find("kv_cache.snapkv.window"),
            std::string::npos);
  EXPECT_NE(ParseCacheSpec("snapkv+product").status().message().find("preset 'product'"),
            std::string::npos);
}

// SnapKV by hand. Votes of a prefix [0, 3, 0, 0, 6, 0] pooled over 3 neighbours (zero padding,
// divided by 3): [1, 1, 1, 2, 2, 2]. With a window of 2 and a target of 4 of 8 entries, the
// window (6, 7) stays and the two best pooled prefix entries join it: 3 and 4 (ties: earlier),
// where the raw votes (kernel 1) pick the isolated 1 and the peak 4.
TEST(SnapKv, PooledVotesKeepTheNeighboursOfWhatTheWindowReads) {
  EXPECT_EQ(SnapKvPool({0, 3, 0, 0, 6, 0}, 3), (std::vector<float>{1, 1, 1, 2, 2, 2}));
  EXPECT_EQ(SnapKvPool({0, 3, 0, 0, 6, 0}, 1), (std::vector<float>{0, 3, 0, 0, 6, 0}));
  const std::vector<float> votes = {0, 3, 0, 0, 6, 0, 9, 9};  // the window's own votes: unused
  EXPECT_EQ(SnapKvKeep(votes, 2, 3, 4), (std::vector<int64_t>{3, 4, 6, 7}));
  EXPECT_EQ(SnapKvKeep(votes, 2, 1, 4), (std::vector<int64_t>{1, 4, 6, 7}));
  EXPECT_EQ(SnapKvKeep(votes, 2, 3, 8).size(), 8u) << "a target of all keeps all";
  EXPECT_EQ(SnapKvKeep(votes, 8, 3, 4).size(), 8u) << "the window is never cut";
  // Decoding: the lowest score outside the 2 most recent entries (ties: the earlier).
  EXPECT_EQ(SnapKvVictim({5, 1, 1, 9, 0, 0}, 2), 1);
  EXPECT_EQ(SnapKvVictim({5, 1, 1, 9, 0, 0}, 5), 0);
}

// Through the policy object: with the prompt's layout known, only the window's rows vote
// (the cache skips the others' column sums), the plan keeps what SnapKvKeep says, and decode
// attention decides the victims from then on.
TEST(SnapKv, OnlyTheWindowVotesAndTheBudgetCoversTheAnswer) {
  CacheParams params;
  params.policy = CachePolicy::kSnapKV;
  params.budget = 0.5;
  params.snapkv = SnapKvParams{2, 3};
  PromptSegments segments;
  segments.images = {{1, 5}};
  segments.instruction = {5, 8};  // the prompt is 8 rows; the window is rows 6 and 7
  auto policy = NewKvPolicy(params, segments, /*num_layers=*/1);
  EXPECT_EQ(policy->ScoreSplitRow(), 6);
  EXPECT_FALSE(policy->ScoresBeforeSplit());
  EXPECT_EQ(policy->Target(8), 4);
  EXPECT_EQ(policy->Target(3), 2) << "the window is protected";
  const float window_sums[8] = {0, 3, 0, 0, 6, 0, 1, 1};
  policy->AddScores(0, /*first_row=*/6, window_sums, 8);
  const MergePlan plan = policy->PlanPrompt(0, 8);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{3, 4, 6, 7}));
  EXPECT_EQ(plan.dropped, 4);
  // Kept scores (raw votes) 0, 6, 1, 1; one decode row attends [2, 0, 0, 0, 5] after an append.
  policy->OnAppend(0, 1);
  const float decode[5] = {2, 0, 0, 0, 5};
  policy->AddScores(0, /*first_row=*/-1, decode, 5);
  EXPECT_EQ(policy->Target(9), 5);
  policy->OnAppend(0, 1);  // 6 entries, target 5 at n = 10
  ASSERT_EQ(policy->Target(10), 5);
  // Scores 2, 6, 1, 1, 5, 0: outside the 2 newest, entry 2 (score 1, the earlier of two) goes.
  EXPECT_EQ(policy->Victim(0, 6, 5), 2);
}

TEST(KvPolicyRegistry, EveryPolicyHasOneRowFoundByName) {
  for (CachePolicy id : {CachePolicy::kFull, CachePolicy::kElastic, CachePolicy::kH2O,
                         CachePolicy::kStreamingLLM, CachePolicy::kSnapKV}) {
    const KvPolicyInfo& info = KvPolicyInfoOf(id);
    EXPECT_EQ(info.id, id);
    auto parsed = ParseCachePolicy(info.name);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, id);
  }
  EXPECT_EQ(KvPolicyNames(), "full | elastic | h2o | streaming_llm | snapkv");
}

}  // namespace
}  // namespace llava
