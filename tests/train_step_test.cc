// llava-train's step (train/train_step.h): the batch cut into shards on their own threads, and
// a prefix shared by several conversations run once, give the loss terms and gradients of the
// whole batch run in one pass.
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

// The default model's config and tokenizer with random fp32 weights (fp32, so that two ways of
// computing a step may differ only by the order of sums), every parameter trainable.
class TrainStepTest : public ::testing::Test {
 protected:
  void Build(uint64_t weight_seed) {
    const std::string dir = ::llava::testing::SourceDir() + "/models/shapes-llava";
    auto tok = Tokenizer::Load(dir + "/tokenizer.model");
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tok_ = std::move(*tok);
    auto config = LoadLlavaConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    config_ = *config;
    ModelOptions f32;
    f32.dtype = DType::kF32;
    std::vector<std::pair<std::string, at::Tensor>> weights;
    for (const auto& [name, t] : RandomLlavaWeights(config_, weight_seed, at::kFloat, 0.2)) {
      weights.emplace_back(name, t.clone());
    }
    auto model = LlavaModel::FromWeights(config_, NewTensorMapSource(weights), f32);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(*model);
    for (auto& [name, t] : model_->MutableParameters()) {
      params_.push_back(t->requires_grad_(true));
      names_.push_back(name);
    }
  }
  void AddProbe(at::Tensor w, at::Tensor b, const std::string& name) {
    params_.push_back(w);
    params_.push_back(b);
    names_.push_back(name);
    names_.push_back(name + " bias");
  }

  // The step with `shards` shards, its gradients left in `grads`.
  train::BatchLosses Step(const std::vector<train::Example>& examples, const train::Probes& probes,
                          const train::LossOptions& o, int shards, int threads,
                          AttentionReport* report, std::vector<at::Tensor>* grads) {
    const train::BatchLosses l = train::BatchGradients(*model_, config_, examples, probes, o,
                                                       params_, shards, threads, report);
    grads->clear();
    for (const at::Tensor& p : params_) {
      grads->push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    }
    return l;
  }

  // Every loss term, gradient and attention mass of `b` equals `a`'s but for rounding.
  void ExpectSameStep(const train::BatchLosses& a, const std::vector<at::Tensor>& a_grads,
                      const AttentionReport& a_report, const train::BatchLosses& b,
                      const std::vector<at::Tensor>& b_grads, const AttentionReport& b_report) {
    EXPECT_NEAR(b.lm, a.lm, 1e-5 * a.lm);
    EXPECT_NEAR(b.attn, a.attn, 1e-5 * a.attn);
    EXPECT_NEAR(b.patch, a.patch, 1e-5 * a.patch);
    EXPECT_NEAR(b.count, a.count, 1e-5 * a.count);
    EXPECT_EQ(b.tokens, a.tokens);
    int reached = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      ASSERT_EQ(b_grads[i].defined(), a_grads[i].defined()) << names_[i];
      if (!a_grads[i].defined()) continue;
      ++reached;
      // Relative to the largest entry, and absolute for the gradients that are 0 but for
      // rounding (a key bias shifts every score of a query alike).
      const double scale = a_grads[i].abs().max().item<double>();
      EXPECT_LE((b_grads[i] - a_grads[i]).abs().max().item<double>(), 1e-4 * scale + 1e-5)
          << names_[i] << ", largest entry " << scale;
    }
    EXPECT_GT(reached, static_cast<int>(params_.size()) / 2);
    ASSERT_EQ(b_report.size(), a_report.size());
    for (const auto& [key, masses] : a_report) {
      EXPECT_EQ(b_report.at(key).second, masses.second) << key.second;
      for (size_t h = 0; h < masses.first.size(); ++h) {
        EXPECT_NEAR(b_report.at(key).first[h], masses.first[h], 1e-4) << key.second;
      }
    }
  }

  std::unique_ptr<Tokenizer> tok_;
  LlavaConfig config_;
  std::unique_ptr<LlavaModel> model_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
};

at::Tensor CountProbeWeight(const LlavaConfig& config) {
  return (at::randn({train::kInventory * train::kCountClasses, config.text.hidden_size}) * 0.1)
      .requires_grad_();
}
at::Tensor CountProbeBias() {
  return at::zeros({train::kInventory * train::kCountClasses}).requires_grad_();
}

TEST_F(TrainStepTest, ShardsOnThreadsGiveTheWholeBatchsGradient) {
  ASSERT_NO_FATAL_FAILURE(Build(7));
  // Five conversations (shards of unequal size), descriptions and questions, every supervision.
  train::DataMix mix;
  mix.conversation.describe = 0.4;
  mix.patch_labels = true;
  std::vector<train::Example> examples;
  for (int b = 0; b < 5; ++b) examples.push_back(train::MakeExample(*tok_, config_, 3, 0, b, mix));
  at::manual_seed(5);
  train::Probes probes;
  const int64_t patch_classes =
      train::kPatchClasses[0] + train::kPatchClasses[1] + train::kPatchClasses[2];
  probes.patch_w = (at::randn({patch_classes, config_.text.hidden_size}) * 0.1).requires_grad_();
  probes.patch_b = at::zeros({patch_classes}).requires_grad_();
  probes.count_w = CountProbeWeight(config_);
  probes.count_b = CountProbeBias();
  AddProbe(probes.patch_w, probes.patch_b, "patch probe");
  AddProbe(probes.count_w, probes.count_b, "count probe");
  train::LossOptions o;
  o.bf16 = false;
  o.attn_weight = 0.5;
  o.patch_weight = 0.3;
  o.count_weight = 0.2;
  o.attn_report = true;

  AttentionReport whole_report, sharded_report;
  std::vector<at::Tensor> whole_grads, sharded_grads;
  const train::BatchLosses whole = Step(examples, probes, o, 1, 1, &whole_report, &whole_grads);
  const train::BatchLosses sharded =
      Step(examples, probes, o, 3, 2, &sharded_report, &sharded_grads);
  EXPECT_GT(whole.attn, 0);
  EXPECT_GT(whole.patch, 0);
  EXPECT_GT(whole.count, 0);
  ExpectSameStep(whole, whole_grads, whole_report, sharded, sharded_grads, sharded_report);
}

// Conversations in the paper's layout share their system prompt's rows: run once per shard,
// with every such conversation's cache starting from their keys and values, the loss terms and
// gradients are those of running each conversation whole.
TEST_F(TrainStepTest, ASharedPrefixRunOnceGivesTheSameGradient) {
  ASSERT_NO_FATAL_FAILURE(Build(8));
  // Seven conversations, three of them in the paper's layout, every answer row supervised.
  train::DataMix mix;
  mix.conversation.describe = 0.3;
  mix.paper_layout = 0.8;
  mix.every_answer_row = true;
  mix.absent_to_bos = true;
  std::vector<train::Example> examples;
  for (int b = 0; b < 7; ++b) examples.push_back(train::MakeExample(*tok_, config_, 4, 0, b, mix));
  at::manual_seed(6);
  train::Probes probes;
  probes.count_w = CountProbeWeight(config_);
  probes.count_b = CountProbeBias();
  AddProbe(probes.count_w, probes.count_b, "count probe");
  train::LossOptions o;
  o.bf16 = false;
  o.attn_weight = 0.5;
  o.count_weight = 0.2;
  o.attn_report = true;

  AttentionReport whole_report, shared_report;
  std::vector<at::Tensor> whole_grads, shared_grads;
  o.share_prefix = false;
  const train::BatchLosses whole = Step(examples, probes, o, 2, 2, &whole_report, &whole_grads);
  o.share_prefix = true;
  const train::BatchLosses shared = Step(examples, probes, o, 2, 2, &shared_report, &shared_grads);
  EXPECT_EQ(whole.rows_saved, 0);
  EXPECT_GT(shared.rows_saved, 50) << "no prefix was shared";  // the system prompt is ~110 rows
  EXPECT_GT(whole.attn, 0);
  EXPECT_GT(whole.count, 0);
  ExpectSameStep(whole, whole_grads, whole_report, shared, shared_grads, shared_report);
}

}  // namespace
}  // namespace llava
