// The weight manifest (engine/io/weight_manifest.h) against a checkpoint it did not write (the
// shipped default model's tensors; LLaVA-1.5-7B's published parameter count is checked in
// config_test.cc, beside its config.json); names in both llava-hf generations; the used /
// ignorable split the loader relies on.
#include "engine/io/weight_manifest.h"

#include <gtest/gtest.h>

#include <map>

#include "engine/io/safetensors.h"

namespace llava {
namespace {

TEST(WeightManifestTest, MatchesTheShippedModelsTensors) {
  const std::string dir = std::string(LLAVA_SOURCE_DIR) + "/models/shapes-llava";
  auto config = LoadLlavaConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::map<std::string, std::vector<int64_t>> in_file;
  for (const TensorInfo& t : (*file)->tensors()) {
    auto canonical = CanonicalTensorName(t.name);
    ASSERT_TRUE(canonical.ok()) << canonical.status().ToString();
    in_file[*canonical] = t.shape;
  }
  std::map<std::string, std::vector<int64_t>> listed;
  for (const WeightSpec& s : LlavaWeightManifest(*config)) {
    EXPECT_TRUE(listed.emplace(s.name, s.shape).second) << "listed twice: " << s.name;
  }
  EXPECT_EQ(listed, in_file);
}

TEST(WeightManifestTest, UnusedTensorsAreExactlyTheIgnorableOnes) {
  for (ModelPreset preset : {ModelPreset::kTiny, ModelPreset::kShapes, ModelPreset::kLlava7b}) {
    const LlavaConfig c = PresetConfig(preset, 512, 500);
    for (const WeightSpec& s : LlavaWeightManifest(c)) {
      EXPECT_EQ(IgnorableTensor(s.name, c), !s.used) << s.name;
    }
  }
  const LlavaConfig c = PresetConfig(ModelPreset::kTiny, 512, 500);
  EXPECT_TRUE(IgnorableTensor("vision.embeddings.position_ids", c));
  EXPECT_TRUE(IgnorableTensor("lm.layers.0.self_attn.rotary_emb.inv_freq", c));
  EXPECT_FALSE(IgnorableTensor("lm.layers.0.self_attn.q_proj.weight", c));
}

TEST(WeightManifestTest, EveryNameRoundTripsThroughBothGenerations) {
  const LlavaConfig c = PresetConfig(ModelPreset::kTiny, 512, 500);
  for (const WeightSpec& s : LlavaWeightManifest(c)) {
    for (TensorNaming naming : {TensorNaming::kOld, TensorNaming::kNew}) {
      const std::string stored = CheckpointTensorName(s.name, naming);
      if (s.name != "lm_head.weight" || naming == TensorNaming::kOld) {
        EXPECT_NE(stored, s.name);
      }
      auto back = CanonicalTensorName(stored);
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      EXPECT_EQ(*back, s.name);
    }
  }
  // transformers >= 5 leaves out the CLIP tower's `vision_model.` level.
  EXPECT_EQ(*CanonicalTensorName("model.vision_tower.encoder.layers.0.mlp.fc1.weight"),
            "vision.encoder.layers.0.mlp.fc1.weight");
  EXPECT_EQ(*CanonicalTensorName("lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(*CanonicalTensorName("language_model.lm_head.weight"), "lm_head.weight");
}

}  // namespace
}  // namespace llava
