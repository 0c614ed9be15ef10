// The trainer's checkpoint: weights changed in place (as AdamW does) come back exactly when the
// saved llava-hf folder is loaded, including the stacked q/k/v and gate/up matrices that the
// model holds fused and the checkpoint stores split.
#include <gtest/gtest.h>

#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"
#include "train/checkpoint_writer.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

at::Tensor Logits(const LlavaModel& model) {
  const LlavaConfig& c = model.config();
  at::manual_seed(3);
  at::Tensor pixels = at::randn({1, 3, c.vision.image_size, c.vision.image_size});
  std::vector<int> ids = {1, 5, 9};
  ids.insert(ids.end(), c.image_tokens(), c.image_token_index);
  ids.insert(ids.end(), {17, 23, 4});
  auto cache = model.NewFullCache();
  SequenceChunk chunk{model.EmbedPrompt(ids, {3}, model.EncodeImages(pixels)), 0, cache.get(),
                      true};
  return Pass(model, {chunk});
}

void CheckRoundTrip(bool tied) {
  ModelOptions f32;
  f32.dtype = DType::kF32;
  auto tiny = LlavaModel::Load(::llava::testing::TestData() + "/tiny-new", f32);
  ASSERT_TRUE(tiny.ok()) << tiny.status().ToString();
  LlavaConfig config = (*tiny)->config();
  config.text.tie_word_embeddings = tied;  // llava-train --tie-embeddings
  const auto init = RandomLlavaWeights(config, 11, at::kFloat, 0.2);
  std::vector<std::pair<std::string, at::Tensor>> copies;
  for (const auto& [name, t] : init) copies.emplace_back(name, t.clone());
  auto model = LlavaModel::FromWeights(config, NewTensorMapSource(copies), f32);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const at::Tensor before = Logits(**model);

  at::manual_seed(5);
  for (auto& [name, t] : (*model)->MutableParameters()) t->add_(at::randn_like(*t) * 0.05);
  const at::Tensor trained = Logits(**model);
  ASSERT_GT((trained - before).abs().max().item<double>(), 1e-2);  // the update matters
  int heads = 0;
  for (auto& [name, t] : (*model)->MutableParameters()) heads += name == "lm_head.weight";
  EXPECT_EQ(heads, tied ? 0 : 1);  // a tied head is the embedding matrix, trained once

  auto tensors = TrainedCheckpointTensors(**model, init, at::kFloat);
  ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
  const std::string dir =
      ::llava::testing::TestData() + (tied ? "/trained-roundtrip-tied" : "/trained-roundtrip");
  ASSERT_TRUE(WriteLlavaCheckpoint(dir, config, *tensors, TensorNaming::kOld, 1).ok());
  auto loaded = LlavaModel::Load(dir, f32);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->config().text.tie_word_embeddings, tied);
  EXPECT_LT((Logits(**loaded) - trained).abs().max().item<double>(), 1e-5);
}

TEST(TrainerCheckpoint, SavedWeightsReproduceTheTrainedModel) { CheckRoundTrip(false); }

TEST(TrainerCheckpoint, TiedEmbeddingsRoundTrip) { CheckRoundTrip(true); }

}  // namespace
}  // namespace llava
