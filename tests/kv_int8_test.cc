// int8 KV entries (KvDtype::kInt8, engine/kv/kv_pool.h): the row quantizer, the pool's sizes,
// what a cache reads back, the decode attention over integers and scales, merges and blends on
// dequantized values, and a model's logits with an int8 cache against the same cache unquantized.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/kernels/decode_attention.h"
#include "engine/kernels/runtime.h"
#include "engine/kv/kv_cache.h"
#include "engine/kv/kv_pool.h"
#include "engine/model/llava_model.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"

namespace llava {
namespace {

KvLayout Layout(int layers, int kv_heads, int hd, KvDtype entries) {
  KvLayout l;
  l.num_layers = layers;
  l.kv_heads = kv_heads;
  l.head_dim = hd;
  l.dtype = DType::kF32;
  l.entries = entries;
  return l;
}

CacheParams FullParams() {
  CacheParams p;
  p.policy = CachePolicy::kFull;
  p.budget = 1.0;
  return p;
}

TEST(KvInt8, QuantizeKvRowRoundsToTheNearestStep) {
  // max |x| = 2.54: d = 0.02; -1.0 -> -50, 0.066 -> 3.3 -> 3, -0.013 -> -0.65 -> -1.
  const std::vector<float> x = {2.54f, -1.0f, 0.066f, -0.013f, 0.f};
  std::vector<int8_t> q(x.size());
  const float d = QuantizeKvRow(x.data(), static_cast<int64_t>(x.size()), q.data());
  EXPECT_FLOAT_EQ(d, 0.02f);
  EXPECT_EQ(q, (std::vector<int8_t>{127, -50, 3, -1, 0}));
  // A row of zeros: scale 0, integers 0 (no division by zero).
  const std::vector<float> zeros(4, 0.f);
  std::vector<int8_t> qz(4, 9);
  EXPECT_EQ(QuantizeKvRow(zeros.data(), 4, qz.data()), 0.f);
  EXPECT_EQ(qz, std::vector<int8_t>(4, 0));
  // A non-finite row stays non-finite when read back (scale NaN), without a UB conversion.
  const std::vector<float> bad = {1.f, std::nanf(""), 2.f, INFINITY};
  std::vector<int8_t> qb(4, 9);
  EXPECT_TRUE(std::isnan(QuantizeKvRow(bad.data(), 4, qb.data())));
  EXPECT_EQ(qb, std::vector<int8_t>(4, 0));
}

TEST(KvInt8, AnEntryCostsItsIntegersAndScalesAndThePoolHoldsMore) {
  const KvLayout bf16 = [] {
    KvLayout l = Layout(2, 2, 128, KvDtype::kModel);
    l.dtype = DType::kBF16;
    return l;
  }();
  KvLayout int8 = bf16;
  int8.entries = KvDtype::kInt8;
  EXPECT_EQ(bf16.bytes_per_entry(), 2 * 2 * 128 * 2);
  EXPECT_EQ(int8.bytes_per_entry(), 2 * 2 * (128 + 4));
  EXPECT_EQ(int8.model_bytes_per_entry(), bf16.bytes_per_entry());
  const int64_t bytes = int64_t{8} << 20;
  KvPool a(bf16, bytes), b(int8, bytes);
  EXPECT_EQ(b.page_bytes(), kKvPageRows * 2 * int8.bytes_per_entry());
  EXPECT_EQ(a.num_pages(), bytes / a.page_bytes());
  EXPECT_EQ(b.num_pages(), bytes / b.page_bytes());
  EXPECT_GT(b.num_pages(), a.num_pages() * 19 / 10);
  EXPECT_EQ(b.Pages(0, false).scalar_type(), at::kChar);
  EXPECT_NE(b.ScaleBase(1, true), nullptr);
  EXPECT_EQ(a.ScaleBase(0, false), nullptr);
}

// Rows appended over several pages read back within half a quantization step of what was
// written, and the stored integers times their scales are exactly what Keys() returns.
TEST(KvInt8, StoredRowsReadBackWithinHalfAStep) {
  const KvLayout layout = Layout(2, 2, 32, KvDtype::kInt8);
  KvPool pool(layout, int64_t{1} << 20);
  auto cache = NewKvCache(&pool, FullParams());
  at::manual_seed(4);
  const int64_t n = 40;  // three pages of 16
  const at::Tensor k = at::randn({2, n, 32}) * 3, v = at::randn({2, n, 32});
  ASSERT_TRUE(cache->Reserve(n));
  for (int l = 0; l < 2; ++l) cache->Append(l, k, v);
  cache->OnForwardDone(n);
  for (int l = 0; l < 2; ++l) {
    for (const auto& [got, want] : {std::pair{cache->Keys(l), k}, std::pair{cache->Values(l), v}}) {
      ASSERT_EQ(got.sizes(), want.sizes());
      const at::Tensor half_step = want.abs().amax({2}, true) / 254;
      EXPECT_TRUE((got - want).abs().le(half_step * 1.0001 + 1e-7).all().item<bool>());
      EXPECT_FALSE(at::equal(got, want));  // quantized, not stored as given
    }
    // The storage view: integers and scales where the decode attention reads them.
    const KvStorage st = cache->Storage(l);
    ASSERT_NE(st.key_scales, nullptr);
    const at::Tensor keys = cache->Keys(l);
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t s = 0; s < n; s += 7) {
        const int64_t page = st.pages[s / st.page_rows], r = s % st.page_rows;
        const auto* row = static_cast<const int8_t*>(st.keys) + page * st.page_stride +
                          h * st.key_head_stride + r * st.row_stride;
        const float d = st.key_scales[page * st.scale_page_stride + h * st.scale_head_stride + r];
        for (int64_t e = 0; e < 32; ++e) {
          ASSERT_EQ(keys[h][s][e].item<float>(), d * row[e]) << "head " << h << " slot " << s;
        }
      }
    }
  }
  const KvStats stats = cache->Stats();
  EXPECT_EQ(stats.bytes_kept, 2 * n * layout.bytes_per_entry());
  EXPECT_EQ(stats.full_equivalent_bytes, 2 * n * layout.model_bytes_per_entry());
}

// The decode attention over an int8 pool gives exactly what it gives over the same pool
// dequantized to fp32: the kernels convert a row to fp32 and multiply by its scale, the value
// the fp32 pool holds (tests/CMakeLists.txt runs this on each CPU path).
TEST(KvInt8, DecodeAttentionEqualsTheDequantizedCache) {
  for (const int64_t hd : {64, 128, 40}) {  // 40: the portable loops
    constexpr int64_t kPage = 16, kPages = 24, kHeads = 4, kKvHeads = 2;
    at::manual_seed(hd);
    const at::Tensor qk = at::randint(-127, 128, {kPages, kKvHeads, kPage, hd}, at::kChar);
    const at::Tensor qv = at::randint(-127, 128, {kPages, kKvHeads, kPage, hd}, at::kChar);
    const at::Tensor sk = at::rand({kPages, kKvHeads, kPage}) / 40;
    const at::Tensor sv = at::rand({kPages, kKvHeads, kPage}) / 40;
    const at::Tensor fk = qk.to(at::kFloat) * sk.unsqueeze(3);
    const at::Tensor fv = qv.to(at::kFloat) * sv.unsqueeze(3);
    const std::vector<int64_t> lengths = {1, 16, 53, 150};
    std::vector<std::vector<int32_t>> tables;
    int32_t next = 0;
    for (int64_t len : lengths) {
      std::vector<int32_t> t;
      for (int64_t s = 0; s < len; s += kPage) t.push_back((next++ * 7 + 3) % kPages);
      tables.push_back(t);
    }
    std::vector<DecodeKv> as_int8, as_float;
    for (size_t b = 0; b < lengths.size(); ++b) {
      DecodeKv c;
      c.pages = tables[b].data();
      c.page_rows = kPage;
      c.page_stride = kKvHeads * kPage * hd;
      c.key_head_stride = c.value_head_stride = kPage * hd;
      c.key_row_stride = c.value_row_stride = hd;
      c.len = lengths[b];
      c.keys = fk.data_ptr();
      c.values = fv.data_ptr();
      as_float.push_back(c);
      c.keys = qk.data_ptr();
      c.values = qv.data_ptr();
      c.key_scales = sk.data_ptr<float>();
      c.value_scales = sv.data_ptr<float>();
      c.scale_page_stride = kKvHeads * kPage;
      c.scale_head_stride = kPage;
      as_int8.push_back(c);
    }
    const at::Tensor q = at::randn({static_cast<int64_t>(lengths.size()), kHeads, hd});
    const std::vector<bool> want = {true, false, true, true};
    std::vector<at::Tensor> p_int8, p_float;
    const at::Tensor got = DecodeAttention(q, as_int8, at::kChar, kKvHeads, want, &p_int8);
    const at::Tensor ref = DecodeAttention(q, as_float, at::kFloat, kKvHeads, want, &p_float);
    EXPECT_TRUE(at::allclose(got, ref, 1e-6, 1e-6)) << "hd " << hd;
    for (size_t b = 0; b < lengths.size(); ++b) {
      if (want[b]) {
        EXPECT_TRUE(at::allclose(p_int8[b], p_float[b], 1e-6, 1e-7)) << "hd " << hd;
      }
    }
    // Scales are read: doubling one sequence's value scales doubles its output.
    const at::Tensor sv2 = sv * 2;
    for (DecodeKv& c : as_int8) c.value_scales = sv2.data_ptr<float>();
    const at::Tensor doubled = DecodeAttention(q, as_int8, at::kChar, kKvHeads, want, nullptr);
    EXPECT_TRUE(at::allclose(doubled, got * 2, 1e-5, 1e-6)) << "hd " << hd;
  }
}

// The prompt merge's weighted means come out within a step of the unquantized ones (the decode
// merge's blend: policy_cache_test.cc, ElasticDecodeMerge).
TEST(KvInt8, PromptMergesWorkOnDequantizedValues) {
  // Elastic's merge on random rows, int8 against an fp32 pool.
  CacheParams merge;
  merge.policy = CachePolicy::kElastic;
  merge.budget = 0.3;
  merge.elastic = ElasticPreset(ElasticVariant::kPaper);
  KvPool f32_pool(Layout(1, 2, 16, KvDtype::kModel), int64_t{1} << 20);
  KvPool int8_pool(Layout(1, 2, 16, KvDtype::kInt8), int64_t{1} << 20);
  auto a = NewPolicyKvCache(&f32_pool, merge), b = NewPolicyKvCache(&int8_pool, merge);
  at::manual_seed(12);
  const int64_t t = 50;
  const at::Tensor k = at::randn({2, t, 16}), val = at::randn({2, t, 16});
  const at::Tensor probs = at::softmax(at::randn({2, t, t}), 2);
  for (KvCache* c : {a.get(), b.get()}) {
    ASSERT_TRUE(c->Reserve(t));
    c->Append(0, k, val);
    c->ObserveAttention(0, probs);
    c->OnForwardDone(t);
  }
  ASSERT_EQ(a->Positions(0), b->Positions(0));
  ASSERT_LT(a->Length(0), t / 2);
  // Inputs are off by half a step of their row (max |x| / 254 <= 4.5 / 254 here), means of them
  // no more, and the merged row's own quantization adds half a step of it.
  const double tol = 2 * val.abs().max().item<double>() / 254;
  EXPECT_LT((a->Values(0) - b->Values(0)).abs().max().item<double>(), tol);
  EXPECT_LT((a->Keys(0) - b->Keys(0)).abs().max().item<double>(),
            2 * k.abs().max().item<double>() / 254);
}

// The model with an int8 cache, prompt and decode steps, under Full, Elastic (prompt merge and
// decode eviction) and H2O: the logits stay close to those of the same cache in fp32 and rank
// the same token first almost everywhere.
TEST(KvInt8, ModelLogitsStayCloseUnderEveryPolicy) {
  InitTorchThreads(2);
  ModelOptions o;
  o.dtype = DType::kF32;
  auto m = LlavaModel::Load(::llava::testing::TestData() + "/tiny-new", o);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const LlavaModel& model = **m;
  KvLayout int8_layout = model.kv_layout();
  int8_layout.entries = KvDtype::kInt8;
  KvPool f32_pool(model.kv_layout(), int64_t{16} << 20), int8_pool(int8_layout, int64_t{16} << 20);
  at::manual_seed(21);
  const int64_t vocab = model.config().text.vocab_size;
  const at::Tensor prompt = at::randint(3, vocab, {40}, at::kLong);
  const at::Tensor steps = at::randint(3, vocab, {16}, at::kLong);
  auto run = [&](KvCache* cache) {
    std::vector<at::Tensor> out = {
        ::llava::testing::Pass(model, {{model.Embed(prompt), 0, cache, false}})};
    for (int64_t i = 0; i < steps.size(0); ++i) {
      out.push_back(::llava::testing::Pass(
          model, {{model.Embed(steps.narrow(0, i, 1)), cache->NextPosition(), cache, false}}));
    }
    return at::cat(out, 0);
  };
  for (const char* spec : {"full", "elastic", "h2o"}) {
    CacheParams base;
    base.budget = 0.5;
    auto params = ParseCacheSpec(spec, base);
    ASSERT_TRUE(params.ok());
    auto ref_cache = NewKvCache(&f32_pool, *params);
    auto int8_cache = NewKvCache(&int8_pool, *params);
    const at::Tensor ref = run(ref_cache.get()), got = run(int8_cache.get());
    EXPECT_FALSE(at::equal(got, ref)) << spec;
    const double rel = ((got - ref).pow(2).mean() / ref.var()).sqrt().item<double>();
    EXPECT_LT(rel, 0.05) << spec;
    const double agree = got.argmax(1).eq(ref.argmax(1)).to(at::kFloat).mean().item<double>();
    EXPECT_GE(agree, 0.9) << spec;
    EXPECT_EQ(int8_cache->Positions(0), ref_cache->Positions(0)) << spec;
    EXPECT_LT(int8_cache->Stats().bytes_allocated, ref_cache->Stats().bytes_allocated) << spec;
  }
}

TEST(KvInt8, RefusedOffTheCpu) {
  KvLayout l = Layout(1, 1, 16, KvDtype::kInt8);
  l.device = "cuda";
  EXPECT_THROW(KvPool(l, int64_t{1} << 20), c10::Error);
  EXPECT_EQ(ParseKvDtype("int8").value(), KvDtype::kInt8);
  EXPECT_EQ(ParseKvDtype("auto").value(), KvDtype::kModel);
  const auto bad = ParseKvDtype("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("fp8"), std::string::npos);
}

}  // namespace
}  // namespace llava
