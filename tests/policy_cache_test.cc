// The policies' tensor side on the tiny checkpoint: merge values, eviction slots, lengths,
// accounting, and budget 1 == Full.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <random>

#include "engine/kernels/runtime.h"
#include "engine/kv/elastic_policy.h"
#include "engine/kv/kv_cache.h"
#include "engine/kv/kv_pool.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

CacheParams Params(CachePolicy policy, double gamma, int recent = 25, int sinks = -1) {
  CacheParams p;
  p.policy = policy;
  p.budget = gamma;
  p.elastic = ElasticPreset(ElasticVariant::kPaper);
  p.elastic.recent_distance = recent;
  p.sink_tokens = sinks;
  return p;
}

// Entries per layer after n tokens when the prompt layout is unknown (raw token ids).
int64_t Target(const CacheParams& p, int64_t n) { return ProjectedEntries(p, {}, n); }

TEST(MergeRows, AveragesEachBucket) {
  // The hand-computed plan of cache_policy_test (T = 10, gamma = 0.5): kept {0, 4, 6, 8, 9};
  // buckets 1,2,3,4,5 -> 4 and 6,7 -> 6. Row i holds the value i (head 0) and 10 i (head 1).
  MergePlan plan;
  plan.kept = {0, 4, 6, 8, 9};
  plan.bucket = {0, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  at::Tensor rows = at::arange(10, at::kFloat).view({1, 10, 1}).repeat({2, 1, 3});
  rows[1].mul_(10);
  at::Tensor merged = MergeRows(rows.to(at::kBFloat16), plan).to(at::kFloat);
  ASSERT_EQ(merged.sizes(), (std::vector<int64_t>{2, 5, 3}));
  const float expected[5] = {0, 3, 6.5f, 8, 9};  // mean(1..5) = 3, mean(6, 7) = 6.5
  for (int j = 0; j < 5; ++j) {
    EXPECT_FLOAT_EQ(merged[0][j][2].item<float>(), expected[j]);
    EXPECT_FLOAT_EQ(merged[1][j][0].item<float>(), 10 * expected[j]);
  }
  // Weighted: row i weighs i, so bucket {1..5} gives (1 + 4 + 9 + 16 + 25) / 15 = 11/3 and
  // {6, 7} gives (36 + 49) / 13.
  plan.weight = {1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  merged = MergeRows(rows, plan);
  EXPECT_FLOAT_EQ(merged[0][1][0].item<float>(), 55.f / 15);
  EXPECT_FLOAT_EQ(merged[0][2][0].item<float>(), 85.f / 13);
  EXPECT_FLOAT_EQ(merged[0][0][0].item<float>(), 0.f);
  // The CPU loop and the tensor-op version (used on other devices) agree, on a strided view.
  at::Tensor wide = at::randn({2, 16, 3});
  at::Tensor view = wide.narrow(1, 0, 10);
  for (bool weighted : {false, true}) {
    plan.weight.clear();
    if (weighted) plan.weight = {1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    EXPECT_TRUE(at::allclose(MergeRows(view, plan), MergeRowsReference(view, plan), 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(MergeRows(view.to(at::kBFloat16), plan).to(at::kFloat),
                             MergeRowsReference(view.to(at::kBFloat16), plan).to(at::kFloat), 1e-2,
                             1e-2));
  }
}

// LOOK-M's merge target: each merged entry joins the kept, unpinned entry whose key is the most
// similar, by cosine summed over the heads, whatever their positions.
TEST(AssignMergesByKey, EachMergedEntryJoinsTheMostSimilarKeptKey) {
  // Two heads, head dim 2. Kept {0 (pinned), 2, 4}; 1 and 3 are merged (their position
  // buckets: 1 -> 2, 3 -> 4). Keys by position (head 0 | head 1):
  //   0: (1, 0) | (1, 0)    pinned: never a target even though 1's key equals it
  //   1: (1, 0) | (0, 1)    cos to 2: 0 + 1 = 1; to 4: 1 + 0 = 1 -> tie: the earlier (2)
  //   2: (0, 1) | (0, 1)
  //   3: (-1, 0.1) | (0, 3) cos to 2: 0.0995 + 1 = 1.0995; to 4: -0.995 + 0 -> 2
  //   4: (2, 0) | (5, 0)
  at::Tensor keys = at::tensor({1.f, 0.f, 1.f, 0.f, 0.f, 1.f, -1.f, 0.1f, 2.f, 0.f,   // head 0
                                1.f, 0.f, 0.f, 1.f, 0.f, 1.f, 0.f,  3.f,  5.f, 0.f})  // head 1
                        .view({2, 5, 2});
  MergePlan plan;
  plan.kept = {0, 2, 4};
  plan.pinned = {true, false, false};
  plan.bucket = {0, 1, 1, 2, 2};
  plan.merged = 2;
  AssignMergesByKey(keys, &plan);
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 1, 1, 1, 2}));
  // Entry 1's head-1 key turned to (0.6, 0.8): to 2, 0 + 0.8; to 4, 1 + 0.6 -> 4.
  keys[1][1] = at::tensor({0.6f, 0.8f});
  plan.bucket = {0, 1, 1, 2, 2};
  AssignMergesByKey(keys, &plan);
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 2, 1, 1, 2}));
  // Nothing kept but the pinned: the position buckets stay.
  plan.kept = {0};
  plan.pinned = {true};
  plan.bucket = {0, 0, -1, 0, -1};
  AssignMergesByKey(keys, &plan);
  EXPECT_EQ(plan.bucket, (std::vector<int64_t>{0, 0, -1, 0, -1}));
}

// LOOK-M's pivotal and weighted merges, by hand. One head, head dim 2; kept {0, 2}; 1 and 3 are
// merged. Keys: 0 (1, 0); 1 (1, 1); 2 (0, 1); 3 (0.6, 0.8). Cosines to 0 | 2: entry 1 0.7071 |
// 0.7071 (tie: 0); entry 3 0.6 | 0.8 (-> 2). Values: the keys times 10.
TEST(AssignMergesByKey, PivotalAndWeightedMergesFollowLookM) {
  const at::Tensor keys = at::tensor({1.f, 0.f, 1.f, 1.f, 0.f, 1.f, 0.6f, 0.8f}).view({1, 4, 2});
  const at::Tensor values = keys * 10;
  auto plan_for = [](KeyMerge how) {
    MergePlan plan;
    plan.kept = {0, 2};
    plan.bucket = {0, 0, 1, 1};
    plan.merged = 2;
    plan.merge_by_key = true;
    plan.key_merge = how;
    return plan;
  };
  MergePlan averaged = plan_for(KeyMerge::kAveraged);
  AssignMergesByKey(keys, &averaged);
  EXPECT_TRUE(averaged.weight.empty());
  EXPECT_FALSE(averaged.divide_by_count);
  // Pivotal: each pivot has one merged entry, weights 1 + 1/2 and 1/2: value 0 is
  // (1.5 * (10, 0) + 0.5 * (10, 10)) / 2 = (10, 2.5); value 2 (1.5 * (0, 10) + 0.5 * (6, 8)) / 2
  // = (1.5, 9.5).
  MergePlan pivotal = plan_for(KeyMerge::kPivotal);
  AssignMergesByKey(keys, &pivotal);
  EXPECT_EQ(pivotal.bucket, (std::vector<int64_t>{0, 0, 1, 1}));
  ASSERT_EQ(pivotal.weight.size(), 4u);
  EXPECT_FLOAT_EQ(pivotal.weight[0], 1.5f);
  EXPECT_FLOAT_EQ(pivotal.weight[1], 0.5f);
  EXPECT_FLOAT_EQ(pivotal.weight[2], 1.5f);
  EXPECT_FLOAT_EQ(pivotal.weight[3], 0.5f);
  const at::Tensor want_pivotal = at::tensor({10.f, 2.5f, 1.5f, 9.5f}).view({1, 2, 2});
  EXPECT_TRUE(at::allclose(MergeRows(values, pivotal), want_pivotal, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(MergeRowsReference(values, pivotal), want_pivotal, 1e-5, 1e-5));
  // Weighted: merged entries weigh their cosine, the sum divided by 2 (not by 1 + cosine):
  // value 0 is ((10, 0) + 0.7071 * (10, 10)) / 2 = (8.5355, 3.5355); value 2 is
  // ((0, 10) + 0.8 * (6, 8)) / 2 = (2.4, 8.2).
  MergePlan weighted = plan_for(KeyMerge::kWeighted);
  AssignMergesByKey(keys, &weighted);
  EXPECT_TRUE(weighted.divide_by_count);
  ASSERT_EQ(weighted.weight.size(), 4u);
  EXPECT_NEAR(weighted.weight[1], 0.70711f, 1e-5);
  EXPECT_NEAR(weighted.weight[3], 0.8f, 1e-6);
  EXPECT_FLOAT_EQ(weighted.weight[0], 1.f);
  const at::Tensor want_weighted = at::tensor({8.5355f, 3.5355f, 2.4f, 8.2f}).view({1, 2, 2});
  EXPECT_TRUE(at::allclose(MergeRows(values, weighted), want_weighted, 1e-4, 1e-4));
  EXPECT_TRUE(at::allclose(MergeRowsReference(values, weighted), want_weighted, 1e-4, 1e-4));
  EXPECT_TRUE(at::allclose(MergeRows(values.to(at::kBFloat16), weighted).to(at::kFloat),
                           want_weighted, 5e-2, 5e-2));
}

// One layer, one head of width 2, fp32: for caches fed hand-made attention.
KvLayout OneLayerLayout() {
  KvLayout layout;
  layout.num_layers = 1;
  layout.kv_heads = 1;
  layout.head_dim = 2;
  layout.dtype = DType::kF32;
  return layout;
}

// The positions `cache` keeps in `layer`, in position order (the policies' order; the cache
// stores them in slot order).
std::vector<int64_t> Kept(const KvCache& cache, int layer) {
  std::vector<int64_t> pos = cache.Positions(layer);
  std::sort(pos.begin(), pos.end());
  return pos;
}

// Elastic's importance on a hand-made prefill: every query attends only to itself, so each
// position's column sum is 1 (ties: the plain sum keeps the earliest anchors) while its mean
// over the T - n queries that can see it grows toward the end of the prompt.
TEST(ElasticImportance, MeanRemovesTheEarlyPositionBias) {
  const int64_t t = 10;
  const KvLayout layout = OneLayerLayout();
  KvPool pool(layout, int64_t{1} << 20);
  for (bool mean : {false, true}) {
    CacheParams p = Params(CachePolicy::kElastic, 0.5, 25, 1);  // K = 5, protected {0, 9}
    p.elastic.importance = mean ? ImportanceMode::kMean : ImportanceMode::kSum;
    auto cache = NewPolicyKvCache(&pool, p);
    ASSERT_TRUE(cache->WantsAttentionProbs(0));
    ASSERT_TRUE(cache->Reserve(t));
    cache->Append(0, at::zeros({1, t, 2}), at::zeros({1, t, 2}));
    cache->ObserveAttention(0, at::eye(t).unsqueeze(0));  // [H = 1, t, t]
    cache->OnForwardDone(t);
    const std::vector<int64_t> expected =
        mean ? std::vector<int64_t>{0, 6, 7, 8, 9} : std::vector<int64_t>{0, 1, 2, 3, 9};
    EXPECT_EQ(Kept(*cache, 0), expected) << "mean importance: " << mean;
  }
}

// Instruction-only importance reads only the instruction's query rows, also when they arrive
// in separate blocks: rows 1..5 attend to position 1, the instruction's rows (6..9) to
// position 4. K = 3 (the instruction not pinned: BOS, one anchor and the last position) leaves
// one anchor, and it follows the rows that are counted.
TEST(ElasticImportance, InstructionModeCountsOnlyTheInstructionsRows) {
  const int64_t t = 10;
  const KvLayout layout = OneLayerLayout();
  KvPool pool(layout, int64_t{1} << 20);
  PromptSegments segments;
  segments.images = {{2, 6}};
  segments.instruction = {6, 10};
  for (ImportanceMode mode : {ImportanceMode::kSum, ImportanceMode::kInstruction}) {
    CacheParams p;
    p.policy = CachePolicy::kElastic;
    p.budget = 0.3;  // K = 3
    p.elastic.importance = mode;
    p.elastic.protect_instruction = false;
    p.elastic.protect_tail = 0;  // the instruction's last rows would be pinned otherwise
    auto cache = NewPolicyKvCache(&pool, p, segments);
    ASSERT_TRUE(cache->Reserve(t));
    cache->Append(0, at::zeros({1, t, 2}), at::zeros({1, t, 2}));
    at::Tensor probs = at::zeros({1, t, t});
    for (int64_t i = 0; i < t; ++i) probs[0][i][i < 6 ? std::min<int64_t>(i, 1) : 4] = 1;
    cache->ObserveAttention(0, probs.narrow(1, 0, 7));  // rows 0..6, then 7..9
    cache->ObserveAttention(0, probs.narrow(1, 7, 3));
    cache->OnForwardDone(t);
    const int64_t anchor = mode == ImportanceMode::kSum ? 1 : 4;
    EXPECT_EQ(Kept(*cache, 0), (std::vector<int64_t>{0, anchor, 9})) << ImportanceModeName(mode);
  }
}

// merge_keys: with every column sum equal, the anchors are the earliest free positions (1, 2,
// 3; K = 5 with {0, 9} protected) and 4..8 join anchor 3. Row i holds key (i, i) and value
// (i, -i): the bucket's mean is 5.5. The paper averages both; the product keeps the anchor's key.
TEST(ElasticMerge, KeysAreAveragedOnlyWhenAsked) {
  const int64_t t = 10;
  const at::Tensor rows = at::arange(t, at::kFloat).view({1, t, 1}).repeat({1, 1, 2});
  const at::Tensor values = rows * at::tensor({1.f, -1.f});
  for (bool merge_keys : {true, false}) {
    CacheParams p = Params(CachePolicy::kElastic, 0.5, 25, 1);
    p.elastic.merge_keys = merge_keys;
    KvPool pool(OneLayerLayout(), int64_t{1} << 20);
    auto cache = NewPolicyKvCache(&pool, p);
    ASSERT_TRUE(cache->Reserve(t));
    cache->Append(0, rows, values);
    cache->ObserveAttention(0, at::eye(t).unsqueeze(0));
    cache->OnForwardDone(t);
    ASSERT_EQ(cache->Positions(0), (std::vector<int64_t>{0, 1, 2, 3, 9}));
    const at::Tensor k = cache->Keys(0), v = cache->Values(0);  // [1, 5, 2]
    EXPECT_FLOAT_EQ(k[0][3][0].item<float>(), merge_keys ? 5.5f : 3.f) << merge_keys;
    EXPECT_FLOAT_EQ(k[0][3][1].item<float>(), merge_keys ? 5.5f : 3.f) << merge_keys;
    EXPECT_FLOAT_EQ(v[0][3][0].item<float>(), 5.5f);
    EXPECT_FLOAT_EQ(v[0][3][1].item<float>(), -5.5f);
    EXPECT_FLOAT_EQ(k[0][4][0].item<float>(), 9.f);  // the protected last position
  }
}

// Decode merge, by hand: the prompt keeps positions {0, 1, 5} of 6 (values 0, 1, 5), two decode
// steps append 6 and 7 and give e1 0.1 + 0.1, e5 0.6 + 0.2, e6 0.3 + 0.3 of attention. At n = 8
// the target is 4: e1 goes (the least attended; the sink is pinned, e7 the newest) and its value
// is averaged into its neighbour with more attention, e5: (0.2 x 1 + 0.8 x 5) / 1.0 = 4.2.
// With int8 entries the blend works on dequantized values and its result is quantized again:
// rows of two equal values are exact (+-127 steps), the blend within half a step (4.2 / 254).
TEST(ElasticDecodeMerge, TheVictimsValueGoesIntoItsMoreAttendedNeighbour) {
  for (const KvDtype entries : {KvDtype::kModel, KvDtype::kInt8})
    for (bool decode_merge : {false, true}) {
      SCOPED_TRACE(KvDtypeName(entries));
      CacheParams p = Params(CachePolicy::kElastic, 0.5, 25, 1);
      p.elastic.merge = false;  // the prompt's plan drops what it does not keep
      p.elastic.eviction = DecodeEviction::kScored;
      p.elastic.decode_merge = decode_merge;
      KvLayout layout = OneLayerLayout();
      layout.entries = entries;
      const double tol = entries == KvDtype::kInt8 ? 4.2 / 254 : 1e-5;
      KvPool pool(layout, int64_t{1} << 20);
      auto cache = NewPolicyKvCache(&pool, p);
      auto rows = [](int64_t first, int64_t n) {
        return at::arange(first, first + n, at::kFloat).view({1, n, 1}).repeat({1, 1, 2});
      };
      ASSERT_TRUE(cache->Reserve(6));
      cache->Append(0, rows(0, 6), rows(0, 6));
      cache->ObserveAttention(0, at::eye(6).unsqueeze(0));  // equal importance: earliest anchor
      cache->OnForwardDone(6);
      ASSERT_EQ(cache->Positions(0), (std::vector<int64_t>{0, 1, 5}));
      const std::vector<std::vector<float>> steps = {{0.f, 0.1f, 0.6f, 0.3f},
                                                     {0.f, 0.1f, 0.2f, 0.3f, 0.4f}};
      for (size_t i = 0; i < steps.size(); ++i) {
        ASSERT_TRUE(cache->Reserve(1));
        cache->Append(0, rows(6 + i, 1), rows(6 + i, 1));
        const auto n = static_cast<int64_t>(steps[i].size());
        cache->ObserveAttention(0, at::tensor(steps[i]).view({1, 1, n}));
        cache->OnForwardDone(1);
      }
      std::vector<int64_t> pos = cache->Positions(0);
      const at::Tensor v = cache->Values(0);  // [1, 4, 2], in storage order
      ASSERT_EQ(v.size(1), 4);
      std::sort(pos.begin(), pos.end());
      EXPECT_EQ(pos, (std::vector<int64_t>{0, 5, 6, 7}));
      for (int64_t slot = 0; slot < 4; ++slot) {
        const int64_t position = cache->Positions(0)[slot];
        const float expected = position == 5 && decode_merge ? 4.2f : static_cast<float>(position);
        EXPECT_NEAR(v[0][slot][0].item<float>(), expected, tol) << "position " << position;
        EXPECT_NEAR(cache->Keys(0)[0][slot][0].item<float>(), position, 1e-5);  // keys stay
      }
    }
}

class PolicyCacheTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    InitTorchThreads(2);
    ModelOptions o;
    o.dtype = DType::kF32;
    auto m = LlavaModel::Load(::llava::testing::TestData() + "/tiny-new", o);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(m).value().release();
    pool_ = new KvPool(model_->kv_layout(), int64_t{64} << 20);
  }
  static void TearDownTestSuite() {
    delete pool_;
    delete model_;
  }
  // One forward pass, each pooled cache's pages for it reserved first.
  static at::Tensor Feed(const std::vector<SequenceChunk>& chunks) { return Pass(*model_, chunks); }

  static at::Tensor Ids(int64_t n, int seed) {
    at::manual_seed(seed);
    return at::randint(3, model_->config().text.vocab_size, {n}, at::kLong);
  }
  // Prefill `prompt`, then feed `steps` tokens one by one; returns the logits of every step
  // and calls `check` after each forward pass.
  static at::Tensor Run(KvCache* cache, const at::Tensor& prompt, const at::Tensor& steps,
                        const std::function<void(int64_t)>& check = nullptr) {
    std::vector<at::Tensor> out = {Feed({{model_->Embed(prompt), 0, cache, false}})};
    if (check) check(prompt.size(0));
    for (int64_t i = 0; i < steps.size(0); ++i) {
      out.push_back(
          Feed({{model_->Embed(steps.narrow(0, i, 1)), cache->NextPosition(), cache, false}}));
      if (check) check(prompt.size(0) + i + 1);
    }
    return at::cat(out, 0);
  }
  static LlavaModel* model_;
  static KvPool* pool_;
};
LlavaModel* PolicyCacheTest::model_ = nullptr;
KvPool* PolicyCacheTest::pool_ = nullptr;

TEST_F(PolicyCacheTest, BudgetOneEqualsFullForEveryPolicy) {
  at::Tensor prompt = Ids(30, 1), steps = Ids(12, 2);
  auto full = NewFullKvCache(model_->kv_layout());
  at::Tensor ref = Run(full.get(), prompt, steps);
  for (CachePolicy p : {CachePolicy::kElastic, CachePolicy::kH2O, CachePolicy::kStreamingLLM,
                        CachePolicy::kSnapKV}) {
    auto cache = NewPolicyKvCache(pool_, Params(p, 1.0));
    at::Tensor got = Run(cache.get(), prompt, steps);
    EXPECT_TRUE(at::equal(got, ref)) << CachePolicyName(p);
    EXPECT_EQ(cache->Length(0), 42);
  }
}

// After the prompt, the rows a policy keeps are the prompt's own rows, moved into place in the
// layer's buffer: every kept key (Elastic's product keeps its anchors' keys) and, for the
// policies that drop rather than merge, every kept value equals Full's row at that position, in
// every layer and head.
TEST_F(PolicyCacheTest, KeptRowsAreThePromptRowsAtTheirPositions) {
  const at::Tensor prompt = Ids(37, 11);
  PromptSegments segments;
  segments.images = {{4, 29}};
  segments.instruction = {29, 37};
  auto full = NewFullKvCache(model_->kv_layout());
  Feed({{model_->Embed(prompt), 0, full.get(), false}});
  for (const char* spec : {"elastic", "h2o", "streaming_llm"}) {
    CacheParams base;
    base.budget = 0.4;
    auto params = ParseCacheSpec(spec, base);
    ASSERT_TRUE(params.ok()) << params.status().ToString();
    auto cache = NewKvCache(pool_, *params, segments);
    Feed({{model_->Embed(prompt), 0, cache.get(), false}});
    const bool merges = params->policy == CachePolicy::kElastic;
    ASSERT_FALSE(merges && params->elastic.merge_keys) << spec;
    for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
      const std::vector<int64_t>& pos = cache->Positions(l);
      ASSERT_LT(pos.size(), 37u) << spec;
      const at::Tensor index = at::tensor(pos, at::kLong);
      EXPECT_TRUE(at::equal(cache->Keys(l), full->Keys(l).index_select(1, index)))
          << spec << " layer " << l;
      if (!merges) {
        EXPECT_TRUE(at::equal(cache->Values(l), full->Values(l).index_select(1, index)))
            << spec << " layer " << l;
      }
    }
  }
}

// Chunked prefill: a prompt fed in pieces (one of them a single row, which takes the decode
// attention path) leaves every policy's cache with the same entries as one whole pass: the
// attention scores add up across chunks and compression waits for the last one.
TEST_F(PolicyCacheTest, ChunkedPrefillMatchesOnePass) {
  const at::Tensor prompt = Ids(37, 5), steps = Ids(6, 6);
  // The product Elastic also reads the instruction's rows (from 29: inside the 20-row chunk).
  PromptSegments segments;
  segments.images = {{3, 29}};
  segments.instruction = {29, 37};
  // SnapKV's window (the last 5 rows, from 32) also falls inside the 20-row chunk.
  // LOOK-M (k = 5) merges by key similarity, and `h2o+paper` (k = 6) sums scores over layers.
  for (int k = 0; k < 7; ++k) {
    const CachePolicy p = std::array<CachePolicy, 7>{
        CachePolicy::kElastic, CachePolicy::kH2O,    CachePolicy::kStreamingLLM,
        CachePolicy::kElastic, CachePolicy::kSnapKV, CachePolicy::kElastic,
        CachePolicy::kH2O}[k];
    CacheParams params = Params(p, 0.3, /*recent=*/4);
    if (k == 3) params.elastic = ElasticPreset(ElasticVariant::kProduct);
    if (k == 5) params.elastic = ElasticPreset(ElasticVariant::kLookM);
    if (k == 6) params.h2o = H2OParams{false, true};
    params.snapkv = SnapKvParams{5, 3};
    auto whole = NewKvCache(pool_, params, segments);
    std::vector<at::Tensor> ref = {Feed({{model_->Embed(prompt), 0, whole.get(), false}})};

    auto chunked = NewKvCache(pool_, params, segments);
    const at::Tensor embeds = model_->Embed(prompt);
    std::vector<at::Tensor> out;
    int64_t begin = 0;
    for (int64_t n : {10, 1, 20, 6}) {
      SequenceChunk c{embeds.narrow(0, begin, n), chunked->NextPosition(), chunked.get(), false};
      c.prompt_continues = begin + n < prompt.size(0);
      at::Tensor logits = Feed({c});
      begin += n;
      if (c.prompt_continues) {
        ASSERT_EQ(chunked->Length(0), begin) << "nothing is compressed before the last chunk";
      } else {
        out.push_back(logits);
      }
    }
    ASSERT_EQ(begin, prompt.size(0));
    for (int64_t i = 0; i <= steps.size(0); ++i) {
      for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
        ASSERT_EQ(chunked->Positions(l), whole->Positions(l))
            << CachePolicyName(p) << " layer " << l << " step " << i;
        ASSERT_TRUE(at::allclose(chunked->Keys(l), whole->Keys(l), 1e-5, 1e-5));
        ASSERT_TRUE(at::allclose(chunked->Values(l), whole->Values(l), 1e-5, 1e-5));
      }
      if (i == steps.size(0)) break;
      const at::Tensor x = model_->Embed(steps.narrow(0, i, 1));
      ref.push_back(Feed({{x, whole->NextPosition(), whole.get(), false}}));
      out.push_back(Feed({{x, chunked->NextPosition(), chunked.get(), false}}));
    }
    EXPECT_TRUE(at::allclose(at::cat(out, 0), at::cat(ref, 0), 1e-4, 1e-4)) << CachePolicyName(p);
    EXPECT_EQ(chunked->Stats().tokens_merged, whole->Stats().tokens_merged);
    EXPECT_EQ(chunked->Stats().tokens_evicted, whole->Stats().tokens_evicted);
  }
}

TEST_F(PolicyCacheTest, LengthAndBytesFollowTheBudgetEveryStep) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 18; ++trial) {
    // The last two: LOOK-M (Elastic's knobs) and `h2o+paper`.
    const CachePolicy policy = std::array<CachePolicy, 6>{
        CachePolicy::kElastic, CachePolicy::kH2O,     CachePolicy::kStreamingLLM,
        CachePolicy::kSnapKV,  CachePolicy::kElastic, CachePolicy::kH2O}[trial % 6];
    const double gamma = 0.1 + 0.8 * (rng() % 100) / 100.0;
    const int64_t t = 8 + rng() % 40, steps = 1 + rng() % 20;
    CacheParams params = Params(policy, gamma, 1 + rng() % 10, rng() % 3);
    if (trial % 6 == 4) params.elastic = ElasticPreset(ElasticVariant::kLookM);
    if (trial % 6 == 5) params.h2o = H2OParams{false, true};
    if (policy == CachePolicy::kSnapKV) {
      params.sink_tokens = -1;  // SnapKV keeps no sinks
      params.snapkv.window = 1 + static_cast<int>(rng() % 8);
    }
    auto cache = NewKvCache(pool_, params);
    Run(cache.get(), Ids(t, trial), Ids(steps, 100 + trial), [&](int64_t n) {
      const KvStats s = cache->Stats();
      for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
        ASSERT_EQ(cache->Length(l), Target(params, n))
            << CachePolicyName(policy) << " gamma " << gamma << " n " << n;
        ASSERT_EQ(static_cast<int64_t>(cache->Positions(l).size()), cache->Length(l));
        const std::vector<int64_t> kept = Kept(*cache, l);
        ASSERT_TRUE(std::adjacent_find(kept.begin(), kept.end()) == kept.end());
        for (int64_t i = 0; i < std::min<int64_t>(params.sinks(), n); ++i) {
          ASSERT_EQ(kept[i], i) << "sink " << i << " must survive";
        }
      }
      ASSERT_EQ(s.tokens_seen, n);
      ASSERT_EQ(s.bytes_kept, model_->kv_layout().num_layers * Target(params, n) *
                                  model_->kv_layout().bytes_per_entry());
      ASSERT_EQ(s.full_equivalent_bytes,
                model_->kv_layout().num_layers * n * model_->kv_layout().bytes_per_entry());
    });
  }
}

// The model only writes a pass's rows to their reserved slots and hands over its attention:
// what the policy decides (the prompt merge, each step's eviction) happens when the caller
// commits the pass, so a pass that fails and is never committed has changed no decision.
TEST_F(PolicyCacheTest, ThePolicyDecidesOnlyWhenThePassIsCommitted) {
  for (CachePolicy policy : {CachePolicy::kElastic, CachePolicy::kH2O}) {
    const CacheParams params = Params(policy, 0.4, /*recent=*/2);
    auto cache = NewKvCache(pool_, params);
    const int64_t t = 24;
    ASSERT_TRUE(cache->Reserve(t));
    (void)model_->Forward({{model_->Embed(Ids(t, 7)), 0, cache.get(), false}});
    for (int l = 0; l < model_->kv_layout().num_layers; ++l) ASSERT_EQ(cache->Length(l), t);
    EXPECT_EQ(cache->Stats().tokens_seen, 0);
    cache->Commit(t, /*prompt_continues=*/false);
    const int64_t target = Target(params, t);
    ASSERT_LT(target, t);
    for (int l = 0; l < model_->kv_layout().num_layers; ++l) ASSERT_EQ(cache->Length(l), target);
    // A decode step: its row is stored, nothing is evicted until the commit.
    ASSERT_TRUE(cache->Reserve(1));
    (void)model_->Forward({{model_->Embed(Ids(1, 8)), cache->NextPosition(), cache.get(), false}});
    for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
      ASSERT_EQ(cache->Length(l), target + 1) << CachePolicyName(policy);
    }
    cache->Commit(1, false);
    for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
      ASSERT_EQ(cache->Length(l), Target(params, t + 1)) << CachePolicyName(policy);
    }
    EXPECT_EQ(cache->Stats().tokens_seen, t + 1);
  }
}

// Elastic decoding evicts exactly the entry at N_tl, every time, in every layer; entries
// before N_tl never change after the merge.
TEST_F(PolicyCacheTest, ElasticEvictsAtTheFixedPoint) {
  const CacheParams params = Params(CachePolicy::kElastic, 0.3, /*recent=*/4);
  auto cache = NewKvCache(pool_, params);
  const int64_t t = 40;
  std::vector<std::vector<int64_t>> before;
  int64_t fixed_point = -1, evictions = 0;
  Run(cache.get(), Ids(t, 7), Ids(30, 8), [&](int64_t n) {
    const int layers = model_->kv_layout().num_layers;
    if (n == t) {
      fixed_point = ElasticFixedPoint(cache->Length(0), params);  // S0 - 4 + 1
      EXPECT_EQ(fixed_point, Target(params, t) - 3);
      for (int l = 0; l < layers; ++l) {
        EXPECT_EQ(Kept(*cache, l).front(), 0);     // BOS sink
        EXPECT_EQ(Kept(*cache, l).back(), t - 1);  // last prompt token
      }
    } else {
      for (int l = 0; l < layers; ++l) {
        std::vector<int64_t> expected = before[l];
        expected.push_back(n - 1);
        if (static_cast<int64_t>(expected.size()) > Target(params, n)) {
          expected.erase(expected.begin() + fixed_point);
          if (l == 0) ++evictions;
        }
        EXPECT_EQ(Kept(*cache, l), expected) << "layer " << l << " n " << n;
      }
    }
    before.clear();
    for (int l = 0; l < layers; ++l) before.push_back(Kept(*cache, l));
  });
  EXPECT_GT(evictions, 15);
  EXPECT_EQ(cache->Stats().tokens_evicted, evictions);
  EXPECT_EQ(cache->Stats().tokens_merged, t - Target(params, t));
}

// The product Elastic keeps the instruction verbatim through the merge and every decode step,
// and holds exactly its target in every layer; the image rows are merged within the image.
// `protect_instruction` (an option of the product, off by default): the instruction survives
// the prompt's plan and every decode step.
TEST_F(PolicyCacheTest, PinnedInstructionSurvivesEveryDecodeStep) {
  PromptSegments segments;
  segments.images = {{2, 34}};
  segments.instruction = {34, 40};
  for (double gamma : {0.4, 0.5}) {  // the pins get half of K = 16 / 20: room for all 6
    CacheParams params;
    params.policy = CachePolicy::kElastic;
    params.budget = gamma;
    params.elastic.protect_instruction = true;
    auto cache = NewKvCache(pool_, params, segments);
    Run(cache.get(), Ids(40, 21), Ids(40, 22), [&](int64_t n) {
      for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
        const std::vector<int64_t> pos = Kept(*cache, l);
        ASSERT_EQ(cache->Length(l), ProjectedEntries(params, segments, n)) << "n " << n;
        ASSERT_EQ(pos.front(), 0);
        for (int64_t i = 34; i < 40; ++i) {
          ASSERT_TRUE(std::binary_search(pos.begin(), pos.end(), i))
              << "instruction position " << i << " lost at n " << n << ", gamma " << gamma;
        }
        ASSERT_EQ(pos.back(), n - 1);
      }
    });
    // Positions 1..33 compete for K - 7 anchor slots; position 1 ("USER:") has no other
    // position in its text run, so unless it is an anchor itself it is dropped, never merged
    // into the image.
    const int64_t anchors = ProjectedEntries(params, segments, 40) - 7;
    std::unique_ptr<KvCache> fresh = NewKvCache(pool_, params, segments);
    Run(fresh.get(), Ids(40, 21), Ids(0, 22));
    const KvStats s = fresh->Stats();
    // (Both counts are per-layer means, each rounded down: their sum may lose one.)
    EXPECT_LE(s.tokens_merged + s.tokens_evicted, 33 - anchors);
    EXPECT_GE(s.tokens_merged + s.tokens_evicted, 33 - anchors - 1);
    EXPECT_LE(s.tokens_evicted, anchors > 0 ? 1 : 33) << "gamma " << gamma;
  }
}

TEST_F(PolicyCacheTest, StreamingKeepsSinksAndTheRecentWindow) {
  const CacheParams params = Params(CachePolicy::kStreamingLLM, 0.25);  // 4 sinks
  auto cache = NewKvCache(pool_, params);
  Run(cache.get(), Ids(40, 9), Ids(8, 10), [&](int64_t n) {
    const int64_t target = Target(params, n);
    std::vector<int64_t> expected = {0, 1, 2, 3};
    for (int64_t p = n - (target - 4); p < n; ++p) expected.push_back(p);
    EXPECT_EQ(Kept(*cache, 0), expected) << "n " << n;
  });
}

TEST_F(PolicyCacheTest, H2OKeepsTheRecentHalfOfTheBudget) {
  const CacheParams params = Params(CachePolicy::kH2O, 0.3);
  auto cache = NewKvCache(pool_, params);
  Run(cache.get(), Ids(40, 11), Ids(10, 12), [&](int64_t n) {
    const int64_t target = Target(params, n), recent = target - target / 2;
    for (int l = 0; l < model_->kv_layout().num_layers; ++l) {
      const std::vector<int64_t> pos = Kept(*cache, l);
      for (int64_t i = 0; i < recent; ++i) EXPECT_EQ(pos[pos.size() - 1 - i], n - 1 - i);
    }
  });
}

TEST_F(PolicyCacheTest, CompressedPositionModeFeedsAtTheCacheLength) {
  CacheParams params = Params(CachePolicy::kElastic, 0.5);
  params.position_mode = PositionMode::kCompressed;
  auto cache = NewKvCache(pool_, params);
  Run(cache.get(), Ids(20, 13), Ids(1, 14));
  EXPECT_EQ(cache->NextPosition(), cache->Length(0));
  EXPECT_LT(cache->NextPosition(), 21);
}

// Five sequences, one per policy, sharing one pool that is too small to hold them all at once:
// they start and finish at different steps (a finished one's pages go to a later one), every
// step runs all of them in one pass, and each sequence's logits equal those it gets alone in a
// pool of its own. After every step the pool's pages in use are exactly the pages the caches
// hold, each cache holds the fewest pages its entries fit in, and once every cache is gone
// every page is free again.
TEST_F(PolicyCacheTest, SequencesShareThePoolWithoutLeaksOrCorruption) {
  struct Seq {
    const char* spec;
    int64_t prompt, steps, start;
  };
  const std::vector<Seq> seqs = {
      {"full", 40, 12, 0}, {"elastic", 45, 30, 1},        {"elastic+paper", 33, 25, 3},
      {"h2o", 60, 18, 14}, {"streaming_llm", 27, 20, 16}, {"snapkv+window=6+kernel=3", 38, 22, 5}};
  std::vector<CacheParams> params;
  std::vector<at::Tensor> prompts, answers, alone;
  for (size_t i = 0; i < seqs.size(); ++i) {
    CacheParams base;
    base.budget = 0.35;
    auto p = ParseCacheSpec(seqs[i].spec, base);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    params.push_back(*p);
    prompts.push_back(model_->Embed(Ids(seqs[i].prompt, 30 + i)));
    answers.push_back(model_->Embed(Ids(seqs[i].steps, 60 + i)));
    auto cache = NewKvCache(pool_, *p);
    std::vector<at::Tensor> rows = {Feed({{prompts[i], 0, cache.get(), false}})};
    for (int64_t s = 0; s < seqs[i].steps; ++s) {
      rows.push_back(Feed({{answers[i].narrow(0, s, 1), cache->NextPosition(), cache.get()}}));
    }
    alone.push_back(at::cat(rows, 0));
  }
  ASSERT_EQ(pool_->pages().used_pages(), 0);

  const KvLayout layout = model_->kv_layout();
  KvPool shared(layout, 12 * kKvPageRows * layout.num_layers * layout.bytes_per_entry());
  std::vector<std::unique_ptr<KvCache>> caches(seqs.size());
  std::vector<int64_t> fed(seqs.size(), -1);  // answer rows fed; -1: prompt not yet
  std::vector<std::vector<at::Tensor>> got(seqs.size());
  bool reused = false;
  for (int64_t step = 0;; ++step) {
    std::vector<SequenceChunk> chunks;
    std::vector<size_t> who;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (step < seqs[i].start || fed[i] >= seqs[i].steps) continue;
      if (fed[i] < 0) {
        reused = reused || shared.pages().high_water() > shared.pages().used_pages();
        caches[i] = NewKvCache(&shared, params[i]);
        chunks.push_back({prompts[i], 0, caches[i].get(), false});
      } else {
        chunks.push_back(
            {answers[i].narrow(0, fed[i], 1), caches[i]->NextPosition(), caches[i].get(), false});
      }
      who.push_back(i);
    }
    if (chunks.empty()) break;
    const at::Tensor logits = Pass(*model_, chunks);
    int64_t held = 0;
    for (size_t c = 0; c < who.size(); ++c) {
      const size_t i = who[c];
      got[i].push_back(logits.narrow(0, static_cast<int64_t>(c), 1));
      ++fed[i];
      const KvStats st = caches[i]->Stats();
      const int64_t entries =
          *std::max_element(st.entries_per_layer.begin(), st.entries_per_layer.end());
      ASSERT_EQ(st.bytes_allocated, shared.PagesFor(entries) * shared.page_bytes())
          << seqs[i].spec << " step " << step;
      ASSERT_EQ(caches[i]->PagesHeld() * shared.page_bytes(), st.bytes_allocated);
      if (fed[i] == seqs[i].steps) {
        caches[i].reset();  // finished: its pages go back at once
      } else {
        held += st.bytes_allocated / shared.page_bytes();
      }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (caches[i] && std::find(who.begin(), who.end(), i) == who.end()) {
        held += caches[i]->Stats().bytes_allocated / shared.page_bytes();
      }
    }
    ASSERT_EQ(shared.pages().used_pages(), held) << "step " << step;
  }
  EXPECT_TRUE(reused) << "the pool was big enough never to reuse a page: the test proves less";
  EXPECT_EQ(shared.pages().used_pages(), 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_TRUE(at::allclose(at::cat(got[i], 0), alone[i], 1e-4, 1e-4)) << seqs[i].spec;
  }
}

TEST_F(PolicyCacheTest, ElasticGenerationAcrossBudgets) {
  auto loaded = LoadModel(::llava::testing::TestData() + "/tiny-new", ModelOptions());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  Generator gen(**loaded, EngineLimits{});
  GenerationRequest req;
  req.messages = {{"user", {{ContentPart::Kind::kText, "describe the picture in detail", 0}}}};
  req.sampling.max_tokens = 16;
  for (double gamma : {0.1, 0.2, 0.3, 0.5, 0.8, 1.0}) {
    req.kv_cache = Params(CachePolicy::kElastic, gamma);
    auto r = gen.Generate(req, nullptr);
    ASSERT_TRUE(r.ok()) << gamma << ": " << r.status().ToString();
    const KvLayout layout = (*loaded)->model().kv_layout();
    for (int64_t e : r->kv.entries_per_layer) EXPECT_EQ(e, Target(req.kv_cache, r->kv.tokens_seen));
    EXPECT_EQ(r->kv.bytes_kept,
              layout.num_layers * r->kv.entries_per_layer[0] * layout.bytes_per_entry());
    if (gamma < 1.0) {
      EXPECT_LT(r->kv.bytes_kept, r->kv.full_equivalent_bytes);
    }
  }
  req.kv_cache.budget = 0;
  auto bad = gen.Generate(req, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("kv_cache.budget"), std::string::npos);
}

}  // namespace
}  // namespace llava
