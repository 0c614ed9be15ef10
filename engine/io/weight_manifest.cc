#include "engine/io/weight_manifest.h"

#include <cstdlib>

namespace llava {
namespace {

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

struct Prefix {
  const char* canonical;
  const char* old_name;
  const char* new_name;
};
constexpr Prefix kPrefixes[] = {
    {"lm.", "language_model.model.", "model.language_model."},
    {"lm_head.", "language_model.lm_head.", "lm_head."},
    {"vision.", "vision_tower.vision_model.", "model.vision_tower.vision_model."},
    {"projector.", "multi_modal_projector.", "model.multi_modal_projector."},
    // transformers >= 5: the CLIP transformer without its `vision_model.` wrapper (read only;
    // after the entry above, whose prefixes are longer).
    {"vision.", "vision_tower.", "model.vision_tower."},
};

}  // namespace

StatusOr<std::string> CanonicalTensorName(const std::string& name) {
  for (const Prefix& p : kPrefixes) {
    for (const char* from : {p.old_name, p.new_name}) {
      if (StartsWith(name, from)) {
        return std::string(p.canonical) + name.substr(std::string(from).size());
      }
    }
  }
  return InvalidArgument("unknown tensor '" + name + "' (not a llava-hf tensor name)");
}

std::string CheckpointTensorName(const std::string& canonical, TensorNaming naming) {
  for (const Prefix& p : kPrefixes) {
    if (StartsWith(canonical, p.canonical)) {
      const std::string to = naming == TensorNaming::kOld ? p.old_name : p.new_name;
      return to + canonical.substr(std::string(p.canonical).size());
    }
  }
  return canonical;
}

std::vector<WeightSpec> LlavaWeightManifest(const LlavaConfig& c) {
  std::vector<WeightSpec> w;
  auto add = [&w](std::string name, std::vector<int64_t> shape, WeightRole role, bool used = true) {
    w.push_back({std::move(name), std::move(shape), role, used});
  };
  auto linear = [&add](const std::string& name, int64_t out, int64_t in, bool bias,
                       bool used = true) {
    add(name + ".weight", {out, in}, WeightRole::kMatrix, used);
    if (bias) add(name + ".bias", {out}, WeightRole::kBias, used);
  };
  auto layer_norm = [&add](const std::string& name, int64_t d, bool used = true) {
    add(name + ".weight", {d}, WeightRole::kNormWeight, used);
    add(name + ".bias", {d}, WeightRole::kNormBias, used);
  };

  const VisionConfig& v = c.vision;
  const int64_t dv = v.hidden_size;
  add("vision.embeddings.class_embedding", {dv}, WeightRole::kClassEmbedding);
  add("vision.embeddings.patch_embedding.weight", {dv, 3, v.patch_size, v.patch_size},
      WeightRole::kPatchEmbedding);
  add("vision.embeddings.position_embedding.weight", {v.num_patches() + 1, dv},
      WeightRole::kPositionEmbedding);
  layer_norm("vision.pre_layrnorm", dv);
  for (int i = 0; i < v.num_hidden_layers; ++i) {
    const std::string p = "vision.encoder.layers." + std::to_string(i);
    const bool used = i < c.vision_layers_needed();
    layer_norm(p + ".layer_norm1", dv, used);
    layer_norm(p + ".layer_norm2", dv, used);
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      linear(p + ".self_attn." + proj, dv, dv, true, used);
    }
    linear(p + ".mlp.fc1", v.intermediate_size, dv, true, used);
    linear(p + ".mlp.fc2", dv, v.intermediate_size, true, used);
  }
  layer_norm("vision.post_layernorm", dv, /*used=*/false);

  const TextConfig& t = c.text;
  const int64_t d = t.hidden_size, hd = t.head_dim, f = t.intermediate_size;
  linear("projector.linear_1", d, dv, c.multimodal_projector_bias);
  linear("projector.linear_2", d, d, c.multimodal_projector_bias);
  add("lm.embed_tokens.weight", {t.vocab_size, d}, WeightRole::kTokenEmbedding);
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    const std::string p = "lm.layers." + std::to_string(i);
    const bool ab = t.attention_bias;
    add(p + ".input_layernorm.weight", {d}, WeightRole::kNormWeight);
    linear(p + ".self_attn.q_proj", t.num_attention_heads * hd, d, ab);
    linear(p + ".self_attn.k_proj", t.num_key_value_heads * hd, d, ab);
    linear(p + ".self_attn.v_proj", t.num_key_value_heads * hd, d, ab);
    linear(p + ".self_attn.o_proj", d, t.num_attention_heads * hd, ab);
    add(p + ".post_attention_layernorm.weight", {d}, WeightRole::kNormWeight);
    linear(p + ".mlp.gate_proj", f, d, false);
    linear(p + ".mlp.up_proj", f, d, false);
    linear(p + ".mlp.down_proj", d, f, false);
  }
  add("lm.norm.weight", {d}, WeightRole::kNormWeight);
  if (!t.tie_word_embeddings) add("lm_head.weight", {t.vocab_size, d}, WeightRole::kMatrix);
  return w;
}

bool IgnorableTensor(const std::string& name, const LlavaConfig& c) {
  if (name == "vision.embeddings.position_ids") return true;
  if (name.find("rotary_emb.inv_freq") != std::string::npos) return true;
  if (StartsWith(name, "vision.post_layernorm.")) return true;
  static const std::string kVisionLayer = "vision.encoder.layers.";
  if (StartsWith(name, kVisionLayer)) {
    const int idx = std::atoi(name.c_str() + kVisionLayer.size());
    return idx >= c.vision_layers_needed() && idx < c.vision.num_hidden_layers;
  }
  return false;
}

}  // namespace llava
