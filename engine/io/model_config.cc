#include "engine/io/model_config.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace llava {
namespace {

using nlohmann::json;

// Reads an optional field with a type check. Returns an error naming `origin:section.key`.
template <typename T>
Status Get(const json& obj, const char* key, const std::string& where, T* out) {
  if (!obj.contains(key) || obj[key].is_null()) return Status::Ok();
  const json& v = obj[key];
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return InvalidArgument(where + "." + key + " must be a boolean");
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return InvalidArgument(where + "." + key + " must be an integer");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return InvalidArgument(where + "." + key + " must be a number");
  } else {
    if (!v.is_string()) return InvalidArgument(where + "." + key + " must be a string");
  }
  *out = v.get<T>();
  return Status::Ok();
}

Status Positive(int v, const std::string& name) {
  if (v <= 0) return InvalidArgument(name + " must be positive, got " + std::to_string(v));
  return Status::Ok();
}

Status ParseText(const json& j, const std::string& where, TextConfig* t) {
  LLAVA_RETURN_IF_ERROR(Get(j, "hidden_size", where, &t->hidden_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "intermediate_size", where, &t->intermediate_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "num_hidden_layers", where, &t->num_hidden_layers));
  LLAVA_RETURN_IF_ERROR(Get(j, "num_attention_heads", where, &t->num_attention_heads));
  t->num_key_value_heads = t->num_attention_heads;
  LLAVA_RETURN_IF_ERROR(Get(j, "num_key_value_heads", where, &t->num_key_value_heads));
  LLAVA_RETURN_IF_ERROR(Get(j, "vocab_size", where, &t->vocab_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "max_position_embeddings", where, &t->max_position_embeddings));
  LLAVA_RETURN_IF_ERROR(Get(j, "rms_norm_eps", where, &t->rms_norm_eps));
  LLAVA_RETURN_IF_ERROR(Get(j, "rope_theta", where, &t->rope_theta));
  LLAVA_RETURN_IF_ERROR(Get(j, "tie_word_embeddings", where, &t->tie_word_embeddings));
  LLAVA_RETURN_IF_ERROR(Get(j, "attention_bias", where, &t->attention_bias));
  LLAVA_RETURN_IF_ERROR(Get(j, "bos_token_id", where, &t->bos_token_id));
  LLAVA_RETURN_IF_ERROR(Get(j, "eos_token_id", where, &t->eos_token_id));
  LLAVA_RETURN_IF_ERROR(Positive(t->hidden_size, where + ".hidden_size"));
  LLAVA_RETURN_IF_ERROR(Positive(t->intermediate_size, where + ".intermediate_size"));
  LLAVA_RETURN_IF_ERROR(Positive(t->num_hidden_layers, where + ".num_hidden_layers"));
  LLAVA_RETURN_IF_ERROR(Positive(t->num_attention_heads, where + ".num_attention_heads"));
  LLAVA_RETURN_IF_ERROR(Positive(t->num_key_value_heads, where + ".num_key_value_heads"));
  LLAVA_RETURN_IF_ERROR(Positive(t->vocab_size, where + ".vocab_size"));
  if (t->hidden_size % t->num_attention_heads != 0) {
    return InvalidArgument(where + ".num_attention_heads must divide hidden_size");
  }
  t->head_dim = t->hidden_size / t->num_attention_heads;
  LLAVA_RETURN_IF_ERROR(Get(j, "head_dim", where, &t->head_dim));
  if (t->num_attention_heads % t->num_key_value_heads != 0) {
    return InvalidArgument(where + ".num_key_value_heads must divide num_attention_heads");
  }
  if (t->head_dim % 2 != 0) return InvalidArgument(where + ".head_dim must be even (rotary)");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    return Unimplemented(where + ".rope_scaling is not supported");
  }
  // transformers >= 5 writes {"rope_type": ..., "rope_theta": ...} instead of rope_theta.
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const json& rp = j["rope_parameters"];
    const std::string rp_where = where + ".rope_parameters";
    if (!rp.is_object()) return InvalidArgument(rp_where + " must be an object");
    std::string type = "default";
    LLAVA_RETURN_IF_ERROR(Get(rp, "rope_type", rp_where, &type));
    if (type != "default") {
      return Unimplemented(rp_where + ".rope_type '" + type + "' is not supported");
    }
    LLAVA_RETURN_IF_ERROR(Get(rp, "rope_theta", rp_where, &t->rope_theta));
  }
  return Status::Ok();
}

Status ParseVision(const json& j, const std::string& where, VisionConfig* v) {
  LLAVA_RETURN_IF_ERROR(Get(j, "hidden_size", where, &v->hidden_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "intermediate_size", where, &v->intermediate_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "num_hidden_layers", where, &v->num_hidden_layers));
  LLAVA_RETURN_IF_ERROR(Get(j, "num_attention_heads", where, &v->num_attention_heads));
  LLAVA_RETURN_IF_ERROR(Get(j, "num_channels", where, &v->num_channels));
  LLAVA_RETURN_IF_ERROR(Get(j, "image_size", where, &v->image_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "patch_size", where, &v->patch_size));
  LLAVA_RETURN_IF_ERROR(Get(j, "layer_norm_eps", where, &v->layer_norm_eps));
  LLAVA_RETURN_IF_ERROR(Get(j, "hidden_act", where, &v->hidden_act));
  LLAVA_RETURN_IF_ERROR(Positive(v->hidden_size, where + ".hidden_size"));
  LLAVA_RETURN_IF_ERROR(Positive(v->num_hidden_layers, where + ".num_hidden_layers"));
  LLAVA_RETURN_IF_ERROR(Positive(v->num_attention_heads, where + ".num_attention_heads"));
  LLAVA_RETURN_IF_ERROR(Positive(v->image_size, where + ".image_size"));
  LLAVA_RETURN_IF_ERROR(Positive(v->patch_size, where + ".patch_size"));
  if (v->num_channels != 3) return InvalidArgument(where + ".num_channels must be 3");
  if (v->hidden_size % v->num_attention_heads != 0) {
    return InvalidArgument(where + ".num_attention_heads must divide hidden_size");
  }
  if (v->image_size % v->patch_size != 0) {
    return InvalidArgument(where + ".patch_size must divide image_size");
  }
  if (v->hidden_act != "quick_gelu" && v->hidden_act != "gelu") {
    return Unimplemented(where + ".hidden_act '" + v->hidden_act + "' is not supported");
  }
  return Status::Ok();
}

// One size: an integer that fits an int (the caller checks its range), else an error naming
// the field.
Status SizeValue(const json& v, const std::string& field, int* out) {
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT32_MAX) ||
      v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX) {
    return InvalidArgument(field + " must be an integer");
  }
  *out = static_cast<int>(v.get<int64_t>());
  return Status::Ok();
}

// Accepts both {"height": h, "width": w} / {"shortest_edge": s} and plain integers.
Status ParseSize(const json& j, const char* key, const std::string& where, int* h, int* w,
                 int* shortest) {
  if (!j.contains(key) || j[key].is_null()) return Status::Ok();
  const json& v = j[key];
  const std::string field = where + "." + key;
  if (v.is_number_integer()) {
    LLAVA_RETURN_IF_ERROR(SizeValue(v, field, shortest));
    *h = *w = *shortest;
  } else if (v.is_object()) {
    if (v.contains("shortest_edge")) {
      LLAVA_RETURN_IF_ERROR(SizeValue(v["shortest_edge"], field + ".shortest_edge", shortest));
      *h = *w = *shortest;
    }
    if (v.contains("height")) LLAVA_RETURN_IF_ERROR(SizeValue(v["height"], field + ".height", h));
    if (v.contains("width")) LLAVA_RETURN_IF_ERROR(SizeValue(v["width"], field + ".width", w));
  } else {
    return InvalidArgument(where + "." + key + " must be an integer or an object");
  }
  return Status::Ok();
}

Status ParsePreprocessor(const json& j, const std::string& where, ImageProcessorConfig* p) {
  int h = p->crop_height, w = p->crop_width, s = p->shortest_edge;
  int unused_h = 0, unused_w = 0;
  LLAVA_RETURN_IF_ERROR(ParseSize(j, "size", where, &unused_h, &unused_w, &s));
  p->shortest_edge = s;
  int crop_short = 0;
  LLAVA_RETURN_IF_ERROR(ParseSize(j, "crop_size", where, &h, &w, &crop_short));
  p->crop_height = h;
  p->crop_width = w;
  LLAVA_RETURN_IF_ERROR(Get(j, "do_center_crop", where, &p->do_center_crop));
  LLAVA_RETURN_IF_ERROR(Get(j, "rescale_factor", where, &p->rescale_factor));
  for (const char* key : {"image_mean", "image_std"}) {
    if (!j.contains(key)) continue;
    const json& v = j[key];
    if (!v.is_array() || v.size() != 3) {
      return InvalidArgument(where + "." + key + " must be an array of 3 numbers");
    }
    auto& dst = std::string(key) == "image_mean" ? p->image_mean : p->image_std;
    for (int c = 0; c < 3; ++c) dst[c] = v[c].get<float>();
  }
  for (float s_ : p->image_std) {
    if (!(s_ > 0)) return InvalidArgument(where + ".image_std must be positive");
  }
  LLAVA_RETURN_IF_ERROR(Positive(p->shortest_edge, where + ".size"));
  LLAVA_RETURN_IF_ERROR(Positive(p->crop_height, where + ".crop_size.height"));
  LLAVA_RETURN_IF_ERROR(Positive(p->crop_width, where + ".crop_size.width"));
  return Status::Ok();
}

}  // namespace

StatusOr<LlavaConfig> ParseLlavaConfig(const std::string& config_json,
                                       const std::string& preprocessor_json,
                                       const std::string& origin) {
  json j = json::parse(config_json, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument(origin + " is not a JSON object");
  LlavaConfig c;
  if (!j.contains("text_config") || !j["text_config"].is_object()) {
    return InvalidArgument(origin + ": text_config is missing");
  }
  if (!j.contains("vision_config") || !j["vision_config"].is_object()) {
    return InvalidArgument(origin + ": vision_config is missing");
  }
  LLAVA_RETURN_IF_ERROR(ParseText(j["text_config"], origin + ":text_config", &c.text));
  LLAVA_RETURN_IF_ERROR(ParseVision(j["vision_config"], origin + ":vision_config", &c.vision));
  LLAVA_RETURN_IF_ERROR(Get(j, "image_token_index", origin, &c.image_token_index));
  LLAVA_RETURN_IF_ERROR(Get(j, "vision_feature_layer", origin, &c.vision_feature_layer));
  LLAVA_RETURN_IF_ERROR(
      Get(j, "vision_feature_select_strategy", origin, &c.vision_feature_select_strategy));
  LLAVA_RETURN_IF_ERROR(Get(j, "projector_hidden_act", origin, &c.projector_hidden_act));
  LLAVA_RETURN_IF_ERROR(Get(j, "multimodal_projector_bias", origin, &c.multimodal_projector_bias));
  if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean()) {
    c.text.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
    if (j["text_config"].contains("tie_word_embeddings")) {
      c.text.tie_word_embeddings = j["text_config"]["tie_word_embeddings"].get<bool>();
    }
  }
  if (c.vision_feature_select_strategy != "default" && c.vision_feature_select_strategy != "full") {
    return InvalidArgument(origin + ".vision_feature_select_strategy must be 'default' or 'full'");
  }
  const int needed = c.vision_layers_needed();
  if (needed < 0 || needed > c.vision.num_hidden_layers) {
    return InvalidArgument(origin + ".vision_feature_layer " +
                           std::to_string(c.vision_feature_layer) + " is out of range");
  }
  if (c.projector_hidden_act != "gelu") {
    return Unimplemented(origin + ".projector_hidden_act '" + c.projector_hidden_act +
                         "' is not supported");
  }
  // Without a preprocessor config, CLIP's processor for this tower's size is implied.
  c.image_processor.shortest_edge = c.vision.image_size;
  c.image_processor.crop_height = c.image_processor.crop_width = c.vision.image_size;
  if (!preprocessor_json.empty()) {
    json p = json::parse(preprocessor_json, nullptr, false);
    if (p.is_discarded() || !p.is_object()) {
      return InvalidArgument("preprocessor_config.json is not a JSON object");
    }
    LLAVA_RETURN_IF_ERROR(ParsePreprocessor(p, "preprocessor_config.json", &c.image_processor));
    if (p.contains("image_aspect_ratio") && p["image_aspect_ratio"] == "pad") {
      c.image_processor.pad_to_square = true;
    }
  }
  if (c.image_processor.crop_height != c.vision.image_size ||
      c.image_processor.crop_width != c.vision.image_size) {
    return InvalidArgument("preprocessor crop_size must equal vision_config.image_size (" +
                           std::to_string(c.vision.image_size) + ")");
  }
  return c;
}

StatusOr<LlavaConfig> LoadLlavaConfig(const std::string& dir) {
  std::string config, pre;
  if (!ReadFileToString(dir + "/config.json", &config))
    return NotFound(dir + "/config.json not found");
  ReadFileToString(dir + "/preprocessor_config.json", &pre);  // optional
  return ParseLlavaConfig(config, pre, dir + "/config.json");
}

LlavaConfig PresetConfig(ModelPreset preset, int vocab_size, int image_token_index) {
  LlavaConfig c;
  VisionConfig& v = c.vision;
  TextConfig& t = c.text;
  t.vocab_size = (vocab_size + 63) / 64 * 64;
  t.rms_norm_eps = 1e-5;
  c.image_token_index = image_token_index;
  switch (preset) {
    case ModelPreset::kTiny:
      v.hidden_size = 32;
      v.intermediate_size = 64;
      v.num_hidden_layers = 3;
      v.num_attention_heads = 2;
      v.image_size = 32;
      v.patch_size = 8;
      t.hidden_size = 64;
      t.intermediate_size = 128;
      t.num_hidden_layers = 2;
      t.num_attention_heads = 4;
      t.num_key_value_heads = 2;  // grouped KV heads
      t.head_dim = 16;
      t.max_position_embeddings = 512;
      break;
    case ModelPreset::kShapes:
      v.hidden_size = 192;
      v.intermediate_size = 768;
      v.num_hidden_layers = 5;  // features from layer -2: the last one is never used
      v.num_attention_heads = 6;
      v.image_size = 96;
      v.patch_size = 8;
      t.hidden_size = 256;
      t.intermediate_size = 688;
      t.num_hidden_layers = 4;
      t.num_attention_heads = 4;
      t.num_key_value_heads = 2;
      t.head_dim = 64;
      t.max_position_embeddings = 1024;
      break;
    case ModelPreset::kLlava7b:
      v.hidden_size = 256;
      v.intermediate_size = 1024;
      v.num_hidden_layers = 4;
      v.num_attention_heads = 4;
      v.image_size = 224;
      v.patch_size = 14;
      t.hidden_size = 4096;
      t.intermediate_size = 11008;
      t.num_hidden_layers = 4;
      t.num_attention_heads = t.num_key_value_heads = 32;
      t.head_dim = 128;
      t.max_position_embeddings = 4096;
      break;
  }
  c.image_processor.shortest_edge = c.image_processor.crop_height = c.image_processor.crop_width =
      v.image_size;
  return c;
}

}  // namespace llava
