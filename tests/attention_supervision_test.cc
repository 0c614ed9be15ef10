// llava-train's attention supervision (train/attention_supervision.h): the wrapped cache leaves
// the forward pass unchanged, its mass is a probability over the row's visible entries, and its
// term depends only on the layers up to the supervised one.
#include "train/attention_supervision.h"

#include <gtest/gtest.h>

#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"
#include "train/checkpoint_writer.h"
#include "train/training_data.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

TEST(AttentionSupervision, SameLogitsTermsFromTheSupervisedLayerOnly) {
  ModelOptions f32;
  f32.dtype = DType::kF32;
  auto tiny = LlavaModel::Load(::llava::testing::TestData() + "/tiny-new", f32);
  ASSERT_TRUE(tiny.ok()) << tiny.status().ToString();
  const LlavaConfig config = (*tiny)->config();
  ASSERT_GE(config.text.num_hidden_layers, 2);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& [name, t] : RandomLlavaWeights(config, 11, at::kFloat, 0.2)) {
    weights.emplace_back(name, t.clone());
  }
  auto model = LlavaModel::FromWeights(config, NewTensorMapSource(weights), f32);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  for (auto& [name, t] : (*model)->MutableParameters()) t->requires_grad_(true);

  at::manual_seed(3);
  const at::Tensor pixels = at::randn({1, 3, config.vision.image_size, config.vision.image_size});
  std::vector<int> ids = {1, 5, 9};
  ids.insert(ids.end(), config.image_tokens(), config.image_token_index);
  ids.insert(ids.end(), {17, 23, 4, 8});
  const int64_t n = static_cast<int64_t>(ids.size());
  auto run = [&](std::unique_ptr<KvCache> cache) {
    SequenceChunk chunk{(*model)->EmbedPrompt(ids, {3}, (*model)->EncodeImages(pixels)), 0,
                        cache.get(), true};
    return Pass(**model, {chunk});
  };
  const at::Tensor plain = run((*model)->NewFullCache()).detach();

  std::vector<AttentionTarget> targets = {
      {n - 2, {{3, 4, 5, 10}}, "colour"},        // a few image rows
      {n - 3, {{}}, "all"},                      // every entry row n - 3 can see: mass 1
      {n - 1, {{0}, {3, 4}, {5, 10}}, "count"},  // <s> and two objects: equal shares wanted
      {n - 1, {{0}}, "s"},                       // and each of its parts alone
      {n - 1, {{3, 4}}, "a"},
      {n - 1, {{5, 10}}, "b"},
  };
  for (int64_t c = 0; c <= n - 3; ++c) targets[1].parts[0].push_back(c);
  std::vector<at::Tensor> blocks;
  AttentionReport report;
  const at::Tensor logits =
      run(NewSupervisedAttentionCache((*model)->NewFullCache(), {0}, targets, &blocks, &report));
  const at::Tensor terms = at::cat(blocks);
  EXPECT_LT((logits.detach() - plain).abs().max().item<double>(), 1e-6);

  ASSERT_EQ(terms.numel(), 6);  // one per target in the one supervised layer
  const auto& some = report.at({0, "colour"});
  const auto& all = report.at({0, "all"});
  ASSERT_EQ(some.second, 1);
  ASSERT_EQ(static_cast<int>(some.first.size()), config.text.num_attention_heads);
  for (size_t h = 0; h < some.first.size(); ++h) {
    EXPECT_GT(some.first[h], 0.0);
    EXPECT_LT(some.first[h], 1.0);
    EXPECT_NEAR(all.first[h], 1.0, 1e-5);
  }
  EXPECT_NEAR(std::exp(-terms[0].item<double>()), some.first[0] + 1e-6, 1e-5);  // head 0
  // Several parts: the mean of the parts' own terms, and (AM-GM) never below -log of an equal
  // share of their total mass, which the report gives.
  const double parts = (terms[3] + terms[4] + terms[5]).item<double>() / 3;
  EXPECT_NEAR(terms[2].item<double>(), parts, 1e-6);
  EXPECT_GE(terms[2].item<double>(), -std::log(report.at({0, "count"}).first[0] / 3) - 1e-6);

  // Layer 0's attention depends on layer 0's weights and what feeds it, never on later layers.
  terms[0].backward();
  for (auto& [name, t] : (*model)->MutableParameters()) {
    const bool later = name.rfind("lm.layers.1.", 0) == 0 || name.rfind("lm_head", 0) == 0 ||
                       name.rfind("lm.norm", 0) == 0;
    const double g = t->grad().defined() ? t->grad().abs().sum().item<double>() : 0.0;
    if (later) {
      EXPECT_EQ(g, 0.0) << name;
    } else if (name == "lm.layers.0.self_attn.qkv_proj.weight" ||
               name == "projector.linear_2.weight") {
      EXPECT_GT(g, 0.0) << name;
    }
  }
}

// --attn-every-row: each short answer's target is repeated for the rows that predict its later
// tokens (not its </s>), with the same parts; descriptions keep one row. The same conversations
// (same seed) with and without it.
TEST(TrainingData, EveryAnswerRowRepeatsTheFirstRowsTarget) {
  const std::string dir = ::llava::testing::SourceDir() + "/models/shapes-llava";
  auto tok = Tokenizer::Load(dir + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  auto config = LoadLlavaConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  train::DataMix mix;
  mix.conversation.describe = 0.3;
  int repeated = 0;
  for (int b = 0; b < 16; ++b) {
    mix.every_answer_row = false;
    const train::Example first = train::MakeExample(**tok, *config, 5, 0, b, mix);
    mix.every_answer_row = true;
    const train::Example every = train::MakeExample(**tok, *config, 5, 0, b, mix);
    ASSERT_EQ(first.ids, every.ids);
    ASSERT_GE(every.attn_targets.size(), first.attn_targets.size());
    for (const AttentionTarget& t : first.attn_targets) {
      // This answer's rows: from t.row up to, not including, the row that predicts </s>.
      int64_t end = t.row + 1;
      while (first.ids[end] != (*tok)->eos_id()) ++end;
      --end;
      int found = 0;
      for (const AttentionTarget& e : every.attn_targets) {
        if (e.row < t.row || e.row >= end) continue;
        EXPECT_EQ(e.parts, t.parts);
        EXPECT_EQ(e.kind, t.kind);
        ++found;
      }
      EXPECT_EQ(found, t.kind == "describe" ? 1 : end - t.row) << t.kind << " row " << t.row;
      repeated += found - 1;
    }
  }
  EXPECT_GT(repeated, 0);
}

}  // namespace
}  // namespace llava
