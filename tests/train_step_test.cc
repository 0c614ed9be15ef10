// llava-train's step (train/train_step.h): the batch cut into shards on their own threads gives
// the loss terms and gradients of the whole batch run in one pass.
#include "train/train_step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/io/tokenizer.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "tests/test_util.h"
#include "train/checkpoint_writer.h"

namespace llava {
namespace {

TEST(TrainStep, ShardsOnThreadsGiveTheWholeBatchsGradient) {
  const std::string dir = ::llava::testing::SourceDir() + "/models/shapes-llava";
  auto tok = Tokenizer::Load(dir + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  auto config = LoadLlavaConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ModelOptions f32;
  f32.dtype = DType::kF32;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& [name, t] : RandomLlavaWeights(*config, 7, at::kFloat, 0.2)) {
    weights.emplace_back(name, t.clone());
  }
  auto model = LlavaModel::FromWeights(*config, NewTensorMapSource(weights), f32);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (auto& [name, t] : (*model)->MutableParameters()) {
    params.push_back(t->requires_grad_(true));
    names.push_back(name);
  }

  // Five conversations (shards of unequal size), descriptions and questions, every supervision.
  train::DataMix mix;
  mix.conversation.describe = 0.4;
  mix.patch_labels = true;
  std::vector<train::Example> examples;
  for (int b = 0; b < 5; ++b) examples.push_back(train::MakeExample(**tok, *config, 3, 0, b, mix));
  at::manual_seed(5);
  train::Probes probes;
  const int64_t patch_classes =
      train::kPatchClasses[0] + train::kPatchClasses[1] + train::kPatchClasses[2];
  probes.patch_w = (at::randn({patch_classes, config->text.hidden_size}) * 0.1).requires_grad_();
  probes.patch_b = at::zeros({patch_classes}).requires_grad_();
  probes.count_w =
      (at::randn({train::kInventory * train::kCountClasses, config->text.hidden_size}) * 0.1)
          .requires_grad_();
  probes.count_b = at::zeros({train::kInventory * train::kCountClasses}).requires_grad_();
  for (const at::Tensor& p : {probes.patch_w, probes.patch_b, probes.count_w, probes.count_b}) {
    params.push_back(p);
    names.push_back("probe");
  }
  train::LossOptions o;
  o.bf16 = false;  // fp32, so that the two results may differ only by the order of sums
  o.attn_weight = 0.5;
  o.patch_weight = 0.3;
  o.count_weight = 0.2;
  o.attn_report = true;

  AttentionReport whole_report, sharded_report;
  const train::BatchLosses whole =
      train::BatchGradients(**model, *config, examples, probes, o, params, 1, 1, &whole_report);
  std::vector<at::Tensor> whole_grads;
  for (const at::Tensor& p : params) whole_grads.push_back(p.grad().clone());
  const train::BatchLosses sharded =
      train::BatchGradients(**model, *config, examples, probes, o, params, 3, 2, &sharded_report);

  EXPECT_GT(whole.attn, 0);
  EXPECT_GT(whole.patch, 0);
  EXPECT_GT(whole.count, 0);
  EXPECT_NEAR(sharded.lm, whole.lm, 1e-5 * whole.lm);
  EXPECT_NEAR(sharded.attn, whole.attn, 1e-5 * whole.attn);
  EXPECT_NEAR(sharded.patch, whole.patch, 1e-5 * whole.patch);
  EXPECT_NEAR(sharded.count, whole.count, 1e-5 * whole.count);
  EXPECT_EQ(sharded.tokens, whole.tokens);
  int reached = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].grad().defined(), whole_grads[i].defined()) << i;
    if (!whole_grads[i].defined()) continue;
    ++reached;
    // Relative to the largest entry, and absolute for the gradients that are 0 but for
    // rounding (a key bias shifts every score of a query alike).
    const double scale = whole_grads[i].abs().max().item<double>();
    EXPECT_LE((params[i].grad() - whole_grads[i]).abs().max().item<double>(), 1e-4 * scale + 1e-5)
        << names[i] << ", largest entry " << scale;
  }
  EXPECT_GT(reached, static_cast<int>(params.size()) / 2);
  ASSERT_EQ(sharded_report.size(), whole_report.size());
  for (const auto& [key, masses] : whole_report) {
    EXPECT_EQ(sharded_report.at(key).second, masses.second) << key.second;
    for (size_t h = 0; h < masses.first.size(); ++h) {
      EXPECT_NEAR(sharded_report.at(key).first[h], masses.first[h], 1e-4) << key.second;
    }
  }
}

// Conversations in the paper's layout share their system prompt's rows: run once per shard,
// with every such conversation's cache starting from their keys and values, the loss terms and
// gradients are those of running each conversation whole.
TEST(TrainStep, ASharedPrefixRunOnceGivesTheSameGradient) {
  const std::string dir = ::llava::testing::SourceDir() + "/models/shapes-llava";
  auto tok = Tokenizer::Load(dir + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  auto config = LoadLlavaConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ModelOptions f32;
  f32.dtype = DType::kF32;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& [name, t] : RandomLlavaWeights(*config, 8, at::kFloat, 0.2)) {
    weights.emplace_back(name, t.clone());
  }
  auto model = LlavaModel::FromWeights(*config, NewTensorMapSource(weights), f32);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (auto& [name, t] : (*model)->MutableParameters()) {
    params.push_back(t->requires_grad_(true));
    names.push_back(name);
  }
  // Six conversations, about two thirds in the paper's layout, every answer row supervised.
  train::DataMix mix;
  mix.conversation.describe = 0.3;
  mix.paper_layout = 0.8;
  mix.every_answer_row = true;
  mix.absent_to_bos = true;
  std::vector<train::Example> examples;
  for (int b = 0; b < 7; ++b) examples.push_back(train::MakeExample(**tok, *config, 4, 0, b, mix));
  at::manual_seed(6);
  train::Probes probes;
  probes.count_w =
      (at::randn({train::kInventory * train::kCountClasses, config->text.hidden_size}) * 0.1)
          .requires_grad_();
  probes.count_b = at::zeros({train::kInventory * train::kCountClasses}).requires_grad_();
  params.push_back(probes.count_w);
  params.push_back(probes.count_b);
  names.push_back("count probe");
  names.push_back("count probe bias");
  train::LossOptions o;
  o.bf16 = false;
  o.attn_weight = 0.5;
  o.count_weight = 0.2;
  o.attn_report = true;

  o.share_prefix = false;
  AttentionReport whole_report, shared_report;
  const train::BatchLosses whole =
      train::BatchGradients(**model, *config, examples, probes, o, params, 2, 2, &whole_report);
  std::vector<at::Tensor> whole_grads;
  for (const at::Tensor& p : params) whole_grads.push_back(p.grad().clone());
  o.share_prefix = true;
  const train::BatchLosses shared =
      train::BatchGradients(**model, *config, examples, probes, o, params, 2, 2, &shared_report);

  EXPECT_EQ(whole.rows_saved, 0);
  EXPECT_GT(shared.rows_saved, 50) << "no prefix was shared";  // the system prompt is ~110 rows
  EXPECT_GT(whole.attn, 0);
  EXPECT_GT(whole.count, 0);
  EXPECT_NEAR(shared.lm, whole.lm, 1e-5 * whole.lm);
  EXPECT_NEAR(shared.attn, whole.attn, 1e-5 * whole.attn);
  EXPECT_NEAR(shared.count, whole.count, 1e-5 * whole.count);
  EXPECT_EQ(shared.tokens, whole.tokens);
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].grad().defined(), whole_grads[i].defined()) << names[i];
    if (!whole_grads[i].defined()) continue;
    const double scale = whole_grads[i].abs().max().item<double>();
    EXPECT_LE((params[i].grad() - whole_grads[i]).abs().max().item<double>(), 1e-4 * scale + 1e-5)
        << names[i] << ", largest entry " << scale;
  }
  ASSERT_EQ(shared_report.size(), whole_report.size());
  for (const auto& [key, masses] : whole_report) {
    EXPECT_EQ(shared_report.at(key).second, masses.second) << key.second;
    for (size_t h = 0; h < masses.first.size(); ++h) {
      EXPECT_NEAR(shared_report.at(key).first[h], masses.first[h], 1e-4) << key.second;
    }
  }
}

}  // namespace
}  // namespace llava
