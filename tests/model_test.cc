// Model numerics: every op checked two ways (llama.cpp's habit), on the tiny f32 checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

std::unique_ptr<LlavaModel> LoadTiny(const std::string& name, DType dtype,
                                     WeightFormat weights = WeightFormat::kBf16) {
  ModelOptions o;
  o.dtype = dtype;
  o.weights = weights;
  auto m = LlavaModel::Load(::llava::testing::TestData() + "/" + name, o);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m).value() : nullptr;
}

// Normalised mean squared error between two tensors.
double Nmse(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).pow(2).sum().item<double>() / std::max(1e-30, y.pow(2).sum().item<double>());
}

TEST(Rotary, MatchesPairwiseRotation) {
  // rotate-half convention: dims i and i + hd/2 form a pair rotated by pos * theta^(-2i/hd).
  const int64_t n = 5, heads = 3, hd = 8;
  at::manual_seed(0);
  at::Tensor x = at::randn({n, heads, hd}, at::kDouble);
  at::Tensor pos = at::tensor({0, 1, 7, 100, 513}, at::kLong);
  const double theta = 10000.0;
  at::Tensor inv =
      at::pow(theta, at::arange(0, hd, 2, at::kDouble) / double(hd)).reciprocal().to(at::kFloat);
  at::Tensor got = ApplyRotary(x.to(at::kFloat), MakeRotaryTable(pos, inv)).to(at::kDouble);
  auto xa = x.accessor<double, 3>();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double ang = pos[t].item<int64_t>() * std::pow(theta, -2.0 * i / hd);
        const double a = xa[t][h][i], b = xa[t][h][i + hd / 2];
        EXPECT_NEAR(got[t][h][i].item<double>(), a * std::cos(ang) - b * std::sin(ang), 1e-4);
        EXPECT_NEAR(got[t][h][i + hd / 2].item<double>(), b * std::cos(ang) + a * std::sin(ang),
                    1e-4);
      }
    }
  }
}

TEST(FusedCpuOps, Bf16NormsAndRotaryMatchTheFp32Ops) {
  // bf16 CPU tensors outside autograd take one-pass loops; the fp32 path is the ATen ops.
  at::manual_seed(4);
  at::Tensor x = at::randn({7, 96}) * 3;
  at::Tensor w = at::rand({96}) + 0.5;
  at::Tensor want = RmsNorm(x, w, 1e-5);
  at::Tensor got = RmsNorm(x.to(at::kBFloat16), w.to(at::kBFloat16), 1e-5);
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  ASSERT_EQ(got.sizes(), want.sizes());
  // Inputs rounded to bf16 and two bf16 roundings on the way: within 2^-6 relative.
  EXPECT_LT((got.to(at::kFloat) - want).abs().max().item<double>(),
            want.abs().max().item<double>() / 64);

  LayerNorm ln{(at::rand({96}) + 0.5).to(at::kBFloat16), at::randn({96}).to(at::kBFloat16)};
  at::Tensor ln_want = at::layer_norm(x.to(at::kBFloat16).to(at::kFloat), {96},
                                      ln.weight.to(at::kFloat), ln.bias.to(at::kFloat), ln.eps);
  at::Tensor ln_got = ln(x.to(at::kBFloat16));
  ASSERT_EQ(ln_got.scalar_type(), at::kBFloat16);
  EXPECT_LT((ln_got.to(at::kFloat) - ln_want).abs().max().item<double>(),
            ln_want.abs().max().item<double>() / 128);

  // Rotary on a strided view, as the decoder applies it to the fused q/k/v rows.
  const int64_t n = 6, heads = 3, hd = 16;
  at::Tensor qkv = at::randn({n, 2 * heads * hd});
  at::Tensor pos = at::tensor({0, 1, 2, 50, 51, 400}, at::kLong);
  at::Tensor inv = at::pow(10000.0, at::arange(0, hd, 2, at::kFloat) / double(hd)).reciprocal();
  const RotaryTable table = MakeRotaryTable(pos, inv);
  at::Tensor q16 = qkv.to(at::kBFloat16).narrow(1, heads * hd, heads * hd).view({n, heads, hd});
  ASSERT_FALSE(q16.is_contiguous());
  at::Tensor rot = ApplyRotary(q16, table);
  at::Tensor ref = ApplyRotary(q16.to(at::kFloat), table);
  ASSERT_EQ(rot.scalar_type(), at::kBFloat16);
  EXPECT_LT((rot.to(at::kFloat) - ref).abs().max().item<double>(),
            ref.abs().max().item<double>() / 128);
  // Rotated over its rows of the fused tensor (the decoder's q and k): the same values, and
  // the rows around them untouched.
  const at::Tensor before = qkv.to(at::kBFloat16);
  at::Tensor fused = before.clone();
  const at::Tensor over =
      ApplyRotary(fused.narrow(1, heads * hd, heads * hd).view({n, heads, hd}), table, true);
  EXPECT_TRUE(over.is_alias_of(fused));
  EXPECT_TRUE(at::equal(over, rot));
  EXPECT_TRUE(at::equal(fused.narrow(1, 0, heads * hd), before.narrow(1, 0, heads * hd)));
}

TEST(Attention, MatchesNaiveLoopsWithCachedPrefixAndGroupedHeads) {
  const int64_t n = 3, past = 4, len = past + n, h = 4, hkv = 2, hd = 8;
  at::manual_seed(1);
  at::Tensor q = at::randn({n, h, hd}, at::kDouble);
  at::Tensor k = at::randn({hkv, len, hd}, at::kDouble);
  at::Tensor v = at::randn({hkv, len, hd}, at::kDouble);
  std::vector<at::Tensor> blocks;
  const ProbsObserver collect = [&](int64_t, const at::Tensor& p) { blocks.push_back(p.clone()); };
  at::Tensor got = CachedAttention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), &collect)
                       .to(at::kDouble);
  at::Tensor probs = at::cat(blocks, 1);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{n, h * hd}));
  ASSERT_EQ(probs.sizes(), (std::vector<int64_t>{h, n, len}));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t kv = hh / (h / hkv);
      const int64_t visible = past + i + 1;
      std::vector<double> w(visible);
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j < visible; ++j) {
        w[j] = (q[i][hh] * k[kv][j]).sum().item<double>() / std::sqrt(double(hd));
        mx = std::max(mx, w[j]);
      }
      for (auto& x : w) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j < len; ++j) {
        const double p = j < visible ? w[j] / sum : 0.0;
        EXPECT_NEAR(probs[hh][i][j].item<double>(), p, 1e-5);
      }
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0;
        for (int64_t j = 0; j < visible; ++j) o += w[j] / sum * v[kv][j][d].item<double>();
        EXPECT_NEAR(got[i][hh * hd + d].item<double>(), o, 1e-4);
      }
    }
  }
}

TEST(Attention, QueryBlocksGiveSameResultAsOneBlock) {
  // 300 queries span two query blocks of 256; compare against computing each row alone.
  const int64_t n = 300, h = 2, hd = 4;
  at::manual_seed(2);
  at::Tensor q = at::randn({n, h, hd}), k = at::randn({h, n, hd}), v = at::randn({h, n, hd});
  at::Tensor all = CachedAttention(q, k, v, nullptr);
  for (int64_t i : {0L, 255L, 256L, 299L}) {
    at::Tensor row =
        CachedAttention(q.narrow(0, i, 1), k.narrow(1, 0, i + 1), v.narrow(1, 0, i + 1), nullptr);
    EXPECT_LT(Nmse(row[0], all[i]), 1e-10) << i;
  }
}

class TinyModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { InitTorchThreads(2); }
  at::Tensor RandomIds(int64_t n, int seed) const {
    at::manual_seed(seed);
    return at::randint(3, model_->config().text.vocab_size, {n}, at::kLong);
  }
  std::unique_ptr<LlavaModel> model_ = LoadTiny("tiny-new", DType::kF32);
};

TEST_F(TinyModelTest, IncrementalDecodingMatchesFullForward) {
  ASSERT_NE(model_, nullptr);
  const int64_t total = 24, prefix = 10;
  at::Tensor ids = RandomIds(total, 3);
  // One pass over the whole sequence, logits for every row.
  auto full_cache = model_->NewFullCache();
  at::Tensor full = Pass(*model_, {{model_->Embed(ids), 0, full_cache.get(), true}});
  // Prefill the prefix, then one token at a time through the KV cache.
  auto cache = model_->NewFullCache();
  std::vector<at::Tensor> rows = {
      Pass(*model_, {{model_->Embed(ids.narrow(0, 0, prefix)), 0, cache.get(), false}})};
  for (int64_t t = prefix; t < total; ++t) {
    rows.push_back(Pass(*model_, {{model_->Embed(ids.narrow(0, t, 1)), cache->NextPosition(),
                                   cache.get(), false}}));
  }
  at::Tensor inc = at::cat(rows, 0);
  EXPECT_LT(Nmse(inc, full.narrow(0, prefix - 1, total - prefix + 1)), 1e-10);
  EXPECT_EQ(cache->Length(0), total);
  const KvStats s = cache->Stats();
  EXPECT_EQ(s.tokens_seen, total);
  EXPECT_EQ(s.bytes_kept, s.full_equivalent_bytes);
  EXPECT_EQ(s.bytes_kept, 2 /*layers*/ * total * 2 * 2 /*kv heads*/ * 16 /*hd*/ * 4 /*f32*/);
}

TEST_F(TinyModelTest, BatchOfTwoEqualsEachAlone) {
  ASSERT_NE(model_, nullptr);
  at::Tensor a = RandomIds(9, 4), b = RandomIds(14, 5);
  auto ca = model_->NewFullCache(), cb = model_->NewFullCache();
  at::Tensor alone_a = Pass(*model_, {{model_->Embed(a), 0, ca.get(), true}});
  at::Tensor alone_b = Pass(*model_, {{model_->Embed(b), 0, cb.get(), true}});
  auto ba = model_->NewFullCache(), bb = model_->NewFullCache();
  at::Tensor both =
      Pass(*model_, {{model_->Embed(a), 0, ba.get(), true}, {model_->Embed(b), 0, bb.get(), true}});
  EXPECT_LT(Nmse(both.narrow(0, 0, 9), alone_a), 1e-10);
  EXPECT_LT(Nmse(both.narrow(0, 9, 14), alone_b), 1e-10);
  // A batched decode step over ragged caches equals the two steps alone.
  at::Tensor na = RandomIds(1, 6), nb = RandomIds(1, 7);
  at::Tensor step_a = Pass(*model_, {{model_->Embed(na), 9, ca.get(), false}});
  at::Tensor step_b = Pass(*model_, {{model_->Embed(nb), 14, cb.get(), false}});
  at::Tensor step = Pass(
      *model_, {{model_->Embed(na), 9, ba.get(), false}, {model_->Embed(nb), 14, bb.get(), false}});
  EXPECT_LT(Nmse(step[0], step_a[0]), 1e-10);
  EXPECT_LT(Nmse(step[1], step_b[0]), 1e-10);
}

TEST_F(TinyModelTest, LogitRowsAreThoseRowsOfAllLogits) {
  // The trainer asks for the labelled rows only (train/train_step.cc).
  ASSERT_NE(model_, nullptr);
  at::Tensor a = RandomIds(9, 4), b = RandomIds(14, 5);
  auto ca = model_->NewFullCache(), cb = model_->NewFullCache();
  at::Tensor all =
      Pass(*model_, {{model_->Embed(a), 0, ca.get(), true}, {model_->Embed(b), 0, cb.get(), true}});
  auto sa = model_->NewFullCache(), sb = model_->NewFullCache();
  SequenceChunk first{model_->Embed(a), 0, sa.get(), true}, second{model_->Embed(b), 0, sb.get()};
  first.logit_rows = {0, 3, 8};
  second.logit_rows = {2, 13};
  at::Tensor some = Pass(*model_, {first, second});
  ASSERT_EQ(some.size(0), 5);
  const std::vector<int64_t> rows = {0, 3, 8, 9 + 2, 9 + 13};
  EXPECT_LT(Nmse(some, all.index_select(0, at::tensor(rows, at::kLong))), 1e-10);
}

TEST_F(TinyModelTest, LayerOutputsAreTheResidualStreamInChunkOrder) {
  // The trainer's count probe reads these rows (train/train_main.cc --count-weight).
  ASSERT_NE(model_, nullptr);
  const TextConfig& t = model_->config().text;
  at::Tensor a = RandomIds(9, 4), b = RandomIds(14, 5);
  auto ca = model_->NewFullCache(), cb = model_->NewFullCache();
  std::vector<at::Tensor> alone_b;
  Pass(*model_, {{model_->Embed(b), 0, cb.get(), true}}, &alone_b);
  auto ba = model_->NewFullCache(), bb = model_->NewFullCache();
  std::vector<at::Tensor> both;
  at::Tensor logits =
      Pass(*model_, {{model_->Embed(a), 0, ba.get(), true}, {model_->Embed(b), 0, bb.get(), true}},
           &both);
  ASSERT_EQ(both.size(), static_cast<size_t>(t.num_hidden_layers));
  ASSERT_EQ(alone_b.size(), both.size());
  for (size_t l = 0; l < both.size(); ++l) {
    ASSERT_EQ(both[l].sizes(), (at::IntArrayRef{23, t.hidden_size}));
    EXPECT_LT(Nmse(both[l].narrow(0, 9, 14), alone_b[l]), 1e-10) << "layer " << l;
  }
  EXPECT_GT(Nmse(both[0], both[1]), 1e-3);  // every layer's own output, not one tensor twice
  // The last one is what the output head reads: final norm, then lm_head.
  std::map<std::string, at::Tensor*> w;
  for (auto& [name, tensor] : model_->MutableParameters()) w[name] = tensor;
  at::Tensor* head = w.count("lm_head.weight") ? w["lm_head.weight"] : w["lm.embed_tokens.weight"];
  at::Tensor want =
      at::linear(RmsNorm(both.back(), *w["lm.norm.weight"], t.rms_norm_eps), *head).to(at::kFloat);
  EXPECT_LT(Nmse(logits, want), 1e-10);
}

TEST_F(TinyModelTest, ImageFeaturesHaveConfiguredShapeAndDependOnPixels) {
  ASSERT_NE(model_, nullptr);
  const auto& c = model_->config();
  at::manual_seed(8);
  at::Tensor px = at::randn({2, 3, c.vision.image_size, c.vision.image_size});
  at::Tensor f = model_->EncodeImages(px);
  EXPECT_EQ(f.sizes(), (std::vector<int64_t>{2, c.image_tokens(), c.text.hidden_size}));
  at::Tensor f0 = model_->EncodeImages(px.narrow(0, 0, 1));
  EXPECT_LT(Nmse(f0[0], f[0]), 1e-10);  // batching images changes nothing
  EXPECT_GT(Nmse(f[0], f[1]), 1e-3);    // different pixels, different features
}

// Quantized decoder weights: an 80-row pass (the prefill's dequantized panels) close to the f32
// model's, int4 less close than int8; and decoding one row at a time (the quantized GEMV,
// which also quantizes x) close to the same model's full pass.
TEST_F(TinyModelTest, QuantizedWeightsTrackTheF32Run) {
  ASSERT_NE(model_, nullptr);
  const int64_t total = 80, prefix = 70;
  at::Tensor ids = RandomIds(total, 13);
  auto c32 = model_->NewFullCache();
  at::Tensor l32 = Pass(*model_, {{model_->Embed(ids), 0, c32.get(), true}});
  double err8 = 0;
  for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
    auto q = LoadTiny("tiny-new", DType::kF32, f);
    ASSERT_NE(q, nullptr);
    auto cq = q->NewFullCache();
    at::Tensor lq = Pass(*q, {{q->Embed(ids), 0, cq.get(), true}});
    const double err = Nmse(lq, l32);
    EXPECT_GT(err, 0.0) << WeightFormatName(f) << ": the weights were not quantized";
    // Random weights: int4's 16 levels per group cost this model much more than int8's 255
    // (the trained model's cost is measured in docs/BENCHMARKS.md, "Quantized weights"). An
    // int8 prefill off oneDNN also quantizes its activations (QuantLinear), as decoding does.
    EXPECT_LT(err, f == WeightFormat::kInt8 ? 3e-3 : 0.3) << WeightFormatName(f);
    if (f == WeightFormat::kInt8) err8 = err;
    if (f == WeightFormat::kInt4) {
      EXPECT_GT(err, err8);
    }
    auto cache = q->NewFullCache();
    std::vector<at::Tensor> rows = {
        Pass(*q, {{q->Embed(ids.narrow(0, 0, prefix)), 0, cache.get(), false}})};
    for (int64_t t = prefix; t < total; ++t) {
      rows.push_back(
          Pass(*q, {{q->Embed(ids.narrow(0, t, 1)), cache->NextPosition(), cache.get(), false}}));
    }
    EXPECT_LT(Nmse(at::cat(rows, 0), lq.narrow(0, prefix - 1, total - prefix + 1)),
              f == WeightFormat::kInt8 ? 1e-3 : 1e-2)
        << WeightFormatName(f);
  }
  // bf16 activations and the other naming generation.
  auto b8 = LoadTiny("tiny-old", DType::kBF16, WeightFormat::kInt8);
  ASSERT_NE(b8, nullptr);
  auto cb = b8->NewFullCache();
  EXPECT_LT(Nmse(Pass(*b8, {{b8->Embed(ids), 0, cb.get(), true}}), l32), 3e-3);
}

TEST_F(TinyModelTest, Bf16RunTracksF32Run) {
  ASSERT_NE(model_, nullptr);
  auto bf16 = LoadTiny("tiny-new", DType::kBF16);
  ASSERT_NE(bf16, nullptr);
  at::Tensor ids = RandomIds(16, 9);
  auto c32 = model_->NewFullCache(), c16 = bf16->NewFullCache();
  at::Tensor l32 = Pass(*model_, {{model_->Embed(ids), 0, c32.get(), true}});
  at::Tensor l16 = Pass(*bf16, {{bf16->Embed(ids), 0, c16.get(), true}});
  EXPECT_LT(Nmse(l16, l32), 1e-3);  // bf16 has 8 mantissa bits
}

}  // namespace
}  // namespace llava

namespace llava {
using ::llava::testing::Pass;
namespace {

// In bf16 the decode steps (1 row) take the AVX512-BF16 kernel while the full pass (24 rows)
// takes oneDNN: the two must agree to bf16 precision.
TEST(TinyModelBf16, IncrementalDecodingTracksFullForward) {
  InitTorchThreads(2);
  auto model = LoadTiny("tiny-old", DType::kBF16);
  ASSERT_NE(model, nullptr);
  at::manual_seed(12);
  at::Tensor ids = at::randint(3, model->config().text.vocab_size, {24}, at::kLong);
  auto full_cache = model->NewFullCache();
  at::Tensor full = Pass(*model, {{model->Embed(ids), 0, full_cache.get(), true}});
  auto cache = model->NewFullCache();
  std::vector<at::Tensor> rows = {
      Pass(*model, {{model->Embed(ids.narrow(0, 0, 8)), 0, cache.get(), false}})};
  for (int64_t t = 8; t < 24; ++t) {
    rows.push_back(Pass(
        *model, {{model->Embed(ids.narrow(0, t, 1)), cache->NextPosition(), cache.get(), false}}));
  }
  EXPECT_LT(Nmse(at::cat(rows, 0), full.narrow(0, 7, 17)), 1e-3);
}

}  // namespace
}  // namespace llava
