#include <gtest/gtest.h>

#include "engine/io/model_config.h"
#include "engine/io/weight_manifest.h"

namespace llava {
namespace {

// config.json of llava-hf/llava-1.5-7b-hf as published: most fields are left at the Hugging
// Face class defaults, which the parser must fill in.
constexpr char kLlava15Config[] = R"({
  "architectures": ["LlavaForConditionalGeneration"],
  "ignore_index": -100,
  "image_token_index": 32000,
  "model_type": "llava",
  "pad_token_id": 32001,
  "projector_hidden_act": "gelu",
  "text_config": {
    "_name_or_path": "lmsys/vicuna-7b-v1.5",
    "architectures": ["LlamaForCausalLM"],
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "rms_norm_eps": 1e-05,
    "torch_dtype": "float16",
    "vocab_size": 32064
  },
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "vision_config": {
    "hidden_size": 1024,
    "image_size": 336,
    "intermediate_size": 4096,
    "model_type": "clip_vision_model",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "patch_size": 14,
    "projection_dim": 768,
    "vocab_size": 32000
  },
  "vision_feature_layer": -2,
  "vision_feature_select_strategy": "default",
  "vocab_size": 32064
})";

constexpr char kLlava15Preprocessor[] = R"({
  "crop_size": {"height": 336, "width": 336},
  "do_center_crop": true, "do_convert_rgb": true, "do_normalize": true,
  "do_rescale": true, "do_resize": true,
  "image_mean": [0.48145466, 0.4578275, 0.40821073],
  "image_processor_type": "CLIPImageProcessor",
  "image_std": [0.26862954, 0.26130258, 0.27577711],
  "resample": 3, "rescale_factor": 0.00392156862745098,
  "size": {"shortest_edge": 336}
})";

// llava-hf/llava-1.5-7b-hf holds 7,063,427,072 parameters (its safetensors index: 14,126,854,144
// bytes of fp16), of which the last CLIP-L layer (12,596,224) and the vision post-layernorm
// (2,048) are never read.
TEST(Config, Llava15WeightManifestHasThePublishedParameterCount) {
  auto c = ParseLlavaConfig(kLlava15Config, kLlava15Preprocessor);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  int64_t total = 0, unused = 0;
  for (const WeightSpec& s : LlavaWeightManifest(*c)) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    total += n;
    if (!s.used) unused += n;
  }
  EXPECT_EQ(total, 7063427072);
  EXPECT_EQ(unused, 12596224 + 2048);
}

TEST(Config, ParsesLlava15With7BDefaults) {
  auto c = ParseLlavaConfig(kLlava15Config, kLlava15Preprocessor);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->text.hidden_size, 4096);
  EXPECT_EQ(c->text.intermediate_size, 11008);
  EXPECT_EQ(c->text.num_hidden_layers, 32);
  EXPECT_EQ(c->text.num_attention_heads, 32);
  EXPECT_EQ(c->text.num_key_value_heads, 32);
  EXPECT_EQ(c->text.head_dim, 128);
  EXPECT_EQ(c->text.vocab_size, 32064);
  EXPECT_EQ(c->text.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->text.rope_theta, 10000.0);
  EXPECT_EQ(c->vision.hidden_size, 1024);
  EXPECT_EQ(c->vision.hidden_act, "quick_gelu");
  EXPECT_EQ(c->image_tokens(), 576);         // (336 / 14)^2, CLS dropped
  EXPECT_EQ(c->vision_layers_needed(), 23);  // hidden_states[-2] of 24 layers
  EXPECT_EQ(c->image_token_index, 32000);
  EXPECT_EQ(c->image_processor.shortest_edge, 336);
  EXPECT_EQ(c->image_processor.crop_height, 336);
  EXPECT_FLOAT_EQ(c->image_processor.image_std[2], 0.27577711f);
}

TEST(Config, LegacyIntegerSizesInPreprocessor) {
  auto c = ParseLlavaConfig(kLlava15Config, R"({"crop_size": 336, "size": 336})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->image_processor.crop_width, 336);
  EXPECT_EQ(c->image_processor.shortest_edge, 336);
}

// A size that is not an integer (found by fuzz_config: it threw out of the parser) is an error
// naming the field, as is one beyond an int.
TEST(Config, PreprocessorSizesMustBeIntegers) {
  for (const auto& [pre, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"size": {"shortest_edge": "336"}})", "size.shortest_edge"},
           {R"({"crop_size": {"height": 1.5, "width": 336}})", "crop_size.height"},
           {R"({"crop_size": {"height": 336, "width": [1]}})", "crop_size.width"},
           {R"({"crop_size": 4294967296})", "crop_size"},
           {R"({"size": {"shortest_edge": -9223372036854775808}})", "size.shortest_edge"}}) {
    auto c = ParseLlavaConfig(kLlava15Config, pre);
    ASSERT_FALSE(c.ok()) << pre;
    EXPECT_NE(c.status().ToString().find(field + " must be an integer"), std::string::npos)
        << c.status().ToString();
  }
}

TEST(Config, ErrorsNameTheField) {
  struct Case {
    std::string json;
    const char* part;
  } cases[] = {
      {R"({"vision_config": {}})", "text_config is missing"},
      {R"({"text_config": {"hidden_size": 100, "num_attention_heads": 3}, "vision_config": {}})",
       "text_config.num_attention_heads must divide hidden_size"},
      {R"({"text_config": {"num_key_value_heads": 5}, "vision_config": {}})",
       "text_config.num_key_value_heads must divide num_attention_heads"},
      {R"({"text_config": {"hidden_size": "big"}, "vision_config": {}})",
       "text_config.hidden_size must be an integer"},
      {R"({"text_config": {}, "vision_config": {"image_size": 100, "patch_size": 14}})",
       "vision_config.patch_size must divide image_size"},
      {R"({"text_config": {}, "vision_config": {}, "vision_feature_select_strategy": "cls"})",
       "vision_feature_select_strategy"},
      {R"({"text_config": {}, "vision_config": {}, "vision_feature_layer": -20})",
       "vision_feature_layer -20 is out of range"},
      {"[1, 2]", "not a JSON object"},
  };
  for (const auto& c : cases) {
    auto r = ParseLlavaConfig(c.json, "");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find(c.part), std::string::npos) << r.status().message();
  }
}

// The presets against configs written independently of them: LLaVA-1.5-7B's config.json above,
// and the default model's, which llava-train wrote when it trained the shipped model.
TEST(Config, Llava7bPresetHasLlava15DecoderShapes) {
  auto real = ParseLlavaConfig(kLlava15Config, kLlava15Preprocessor);
  ASSERT_TRUE(real.ok()) << real.status().ToString();
  const LlavaConfig p = PresetConfig(ModelPreset::kLlava7b, 32064, 32000);
  EXPECT_EQ(p.text.hidden_size, real->text.hidden_size);
  EXPECT_EQ(p.text.intermediate_size, real->text.intermediate_size);
  EXPECT_EQ(p.text.num_attention_heads, real->text.num_attention_heads);
  EXPECT_EQ(p.text.num_key_value_heads, real->text.num_key_value_heads);
  EXPECT_EQ(p.text.head_dim, real->text.head_dim);
  EXPECT_EQ(p.text.vocab_size, real->text.vocab_size);
  EXPECT_EQ(p.text.max_position_embeddings, real->text.max_position_embeddings);
  EXPECT_EQ(p.image_token_index, real->image_token_index);
  EXPECT_EQ(p.text.num_hidden_layers, 4);
  EXPECT_EQ(p.image_tokens(), 256);
}

TEST(Config, ShapesPresetIsTheShippedDefaultModel) {
  auto shipped = LoadLlavaConfig(std::string(LLAVA_SOURCE_DIR) + "/models/shapes-llava");
  ASSERT_TRUE(shipped.ok()) << shipped.status().ToString();
  const LlavaConfig p =
      PresetConfig(ModelPreset::kShapes, shipped->text.vocab_size, shipped->image_token_index);
  const TextConfig &a = p.text, &b = shipped->text;
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_DOUBLE_EQ(a.rms_norm_eps, b.rms_norm_eps);
  const VisionConfig &va = p.vision, &vb = shipped->vision;
  EXPECT_EQ(va.hidden_size, vb.hidden_size);
  EXPECT_EQ(va.intermediate_size, vb.intermediate_size);
  EXPECT_EQ(va.num_hidden_layers, vb.num_hidden_layers);
  EXPECT_EQ(va.num_attention_heads, vb.num_attention_heads);
  EXPECT_EQ(va.image_size, vb.image_size);
  EXPECT_EQ(va.patch_size, vb.patch_size);
  EXPECT_EQ(p.image_processor.shortest_edge, shipped->image_processor.shortest_edge);
  EXPECT_EQ(p.image_processor.crop_height, shipped->image_processor.crop_height);
  EXPECT_EQ(p.image_tokens(), 144);
}

}  // namespace
}  // namespace llava
