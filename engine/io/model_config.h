// The llava-hf `config.json` (and `preprocessor_config.json`) as plain structs. Torch-free.
//
// Fields missing from the JSON take the Hugging Face class defaults (LlamaConfig,
// CLIPVisionConfig, LlavaConfig), because real checkpoints such as llava-hf/llava-1.5-7b-hf
// omit everything that equals the default.
#pragma once

#include <array>
#include <string>

#include "engine/io/status.h"

namespace llava {

struct TextConfig {  // LLaMA decoder
  int hidden_size = 4096;
  int intermediate_size = 11008;
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 32;  // defaults to num_attention_heads
  int head_dim = 128;            // defaults to hidden_size / num_attention_heads
  int vocab_size = 32000;
  int max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  int bos_token_id = 1;
  int eos_token_id = 2;
};

struct VisionConfig {  // CLIP ViT
  int hidden_size = 768;
  int intermediate_size = 3072;
  int num_hidden_layers = 12;
  int num_attention_heads = 12;
  int num_channels = 3;
  int image_size = 224;
  int patch_size = 32;
  double layer_norm_eps = 1e-5;
  std::string hidden_act = "quick_gelu";

  int num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
};

// CLIPImageProcessor settings.
struct ImageProcessorConfig {
  int shortest_edge = 224;  // resize target of the shorter side
  int crop_height = 224;
  int crop_width = 224;
  bool do_center_crop = true;
  bool pad_to_square = false;  // original LLaVA-1.5 "pad" aspect mode (mean-colour padding)
  double rescale_factor = 1.0 / 255.0;
  std::array<float, 3> image_mean = {0.48145466f, 0.4578275f, 0.40821073f};
  std::array<float, 3> image_std = {0.26862954f, 0.26130258f, 0.27577711f};
};

struct LlavaConfig {
  TextConfig text;
  VisionConfig vision;
  ImageProcessorConfig image_processor;
  int image_token_index = 32000;
  int vision_feature_layer = -2;                           // index into CLIP hidden states
  std::string vision_feature_select_strategy = "default";  // "default" drops CLS, "full" keeps
  std::string projector_hidden_act = "gelu";
  bool multimodal_projector_bias = true;

  // Image tokens one image expands to in the prompt.
  int image_tokens() const {
    return vision.num_patches() + (vision_feature_select_strategy == "full" ? 1 : 0);
  }
  // Number of CLIP encoder layers that must run to produce the selected feature layer.
  int vision_layers_needed() const {
    return vision_feature_layer < 0 ? vision.num_hidden_layers + 1 + vision_feature_layer
                                    : vision_feature_layer;
  }
};

// Parses `dir/config.json` and, when present, `dir/preprocessor_config.json`. Errors name the
// file and the field; values are range-checked (positive sizes, heads dividing widths, ...).
StatusOr<LlavaConfig> LoadLlavaConfig(const std::string& dir);
// Same from JSON text (tests). `preprocessor_json` may be empty.
StatusOr<LlavaConfig> ParseLlavaConfig(const std::string& config_json,
                                       const std::string& preprocessor_json,
                                       const std::string& origin = "config.json");

// The model shapes this project makes itself, in one place for the tools that make them:
enum class ModelPreset {
  kTiny,     // the test fixture (llava-make-tiny): text 2 x 64 wide, vision 32 px, 16 image tokens
  kShapes,   // the default model (llava-train): text 4 x 256, vision 96 px, 144 image tokens
  kLlava7b,  // LLaVA-1.5-7B's decoder layers (4096 wide, 32 heads of 128, MLP 11008), 4 of them,
             // with a small vision tower of 256 image tokens (llava-bench, llava-make-tiny
             // --preset bench)
};
// `vocab_size` is the tokenizer's piece count (padded here to a multiple of 64, as LLaVA's
// 32064); `image_token_index` the id of its "<image>" piece.
LlavaConfig PresetConfig(ModelPreset preset, int vocab_size, int image_token_index);

}  // namespace llava
