#include "train/checkpoint_writer.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "engine/io/safetensors.h"
#include "engine/model/llava_model.h"

namespace llava {

std::string LlavaConfigJson(const LlavaConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlavaForConditionalGeneration"};
  j["model_type"] = "llava";
  j["image_token_index"] = c.image_token_index;
  j["projector_hidden_act"] = c.projector_hidden_act;
  j["vision_feature_layer"] = c.vision_feature_layer;
  j["vision_feature_select_strategy"] = c.vision_feature_select_strategy;
  j["tie_word_embeddings"] = c.text.tie_word_embeddings;
  const TextConfig& t = c.text;
  j["text_config"] = {{"model_type", "llama"},
                      {"hidden_size", t.hidden_size},
                      {"intermediate_size", t.intermediate_size},
                      {"num_hidden_layers", t.num_hidden_layers},
                      {"num_attention_heads", t.num_attention_heads},
                      {"num_key_value_heads", t.num_key_value_heads},
                      {"vocab_size", t.vocab_size},
                      {"max_position_embeddings", t.max_position_embeddings},
                      {"rms_norm_eps", t.rms_norm_eps},
                      {"rope_theta", t.rope_theta},
                      {"tie_word_embeddings", t.tie_word_embeddings},
                      {"bos_token_id", t.bos_token_id},
                      {"eos_token_id", t.eos_token_id}};
  const VisionConfig& v = c.vision;
  j["vision_config"] = {{"model_type", "clip_vision_model"},
                        {"hidden_size", v.hidden_size},
                        {"intermediate_size", v.intermediate_size},
                        {"num_hidden_layers", v.num_hidden_layers},
                        {"num_attention_heads", v.num_attention_heads},
                        {"image_size", v.image_size},
                        {"patch_size", v.patch_size},
                        {"layer_norm_eps", v.layer_norm_eps},
                        {"hidden_act", v.hidden_act}};
  return j.dump(2) + "\n";
}

std::string PreprocessorConfigJson(const LlavaConfig& c) {
  const ImageProcessorConfig& p = c.image_processor;
  nlohmann::ordered_json j;
  j["image_processor_type"] = "CLIPImageProcessor";
  j["do_resize"] = true;
  j["size"] = {{"shortest_edge", p.shortest_edge}};
  j["resample"] = 3;
  j["do_center_crop"] = p.do_center_crop;
  j["crop_size"] = {{"height", p.crop_height}, {"width", p.crop_width}};
  j["do_rescale"] = true;
  j["rescale_factor"] = p.rescale_factor;
  j["do_normalize"] = true;
  j["image_mean"] = p.image_mean;
  j["image_std"] = p.image_std;
  j["do_convert_rgb"] = true;
  return j.dump(2) + "\n";
}

Status WriteLlavaCheckpoint(const std::string& dir, const LlavaConfig& config,
                            const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                            TensorNaming naming, int shards) {
  ::mkdir(dir.c_str(), 0755);
  {
    std::ofstream(dir + "/config.json") << LlavaConfigJson(config);
    std::ofstream(dir + "/preprocessor_config.json") << PreprocessorConfigJson(config);
  }
  shards = std::max(1, std::min<int>(shards, static_cast<int>(tensors.size())));
  std::vector<at::Tensor> keep;  // contiguous CPU copies alive until written
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  const size_t per_shard = (tensors.size() + shards - 1) / shards;
  for (int s = 0; s < shards; ++s) {
    const std::string file = shards == 1
                                 ? "model.safetensors"
                                 : "model-" + std::to_string(100001 + s).substr(1) + "-of-" +
                                       std::to_string(100000 + shards).substr(1) + ".safetensors";
    std::vector<TensorToWrite> out;
    for (size_t i = s * per_shard; i < std::min(tensors.size(), (s + 1) * per_shard); ++i) {
      at::Tensor t = tensors[i].second.contiguous().cpu();
      keep.push_back(t);
      DType d;
      switch (t.scalar_type()) {
        case at::kFloat:
          d = DType::kF32;
          break;
        case at::kHalf:
          d = DType::kF16;
          break;
        case at::kBFloat16:
          d = DType::kBF16;
          break;
        default:
          return InvalidArgument("tensor " + tensors[i].first + ": unsupported dtype");
      }
      const std::string name = CheckpointTensorName(tensors[i].first, naming);
      out.push_back({name, d, t.sizes().vec(), t.data_ptr()});
      weight_map[name] = file;
    }
    LLAVA_RETURN_IF_ERROR(WriteSafetensors(dir + "/" + file, out, {{"format", "pt"}}));
  }
  if (shards > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = nlohmann::ordered_json::object();
    index["weight_map"] = weight_map;
    std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2) << "\n";
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<Tokenizer>> TrainTokenizer(const std::string& corpus_path,
                                                    const std::string& out_dir, int vocab_size) {
  const std::string log = out_dir + "/.spm_train.log";
  const std::string cmd =
      "spm_train --input='" + corpus_path + "' --model_prefix='" + out_dir + "/tokenizer'" +
      " --vocab_size=" + std::to_string(vocab_size) +
      " --model_type=bpe --byte_fallback=true --normalization_rule_name=identity"
      " --remove_extra_whitespaces=false --split_digits=true --character_coverage=1.0"
      " --user_defined_symbols='<image>' --hard_vocab_limit=false --num_threads=1"
      " --seed_sentencepiece_size=10000 > '" +
      log + "' 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    return Internal("spm_train failed; see " + log);
  }
  std::remove((out_dir + "/tokenizer.vocab").c_str());
  std::remove(log.c_str());
  std::remove(corpus_path.c_str());
  return Tokenizer::Load(out_dir + "/tokenizer.model");
}

std::vector<std::pair<std::string, at::Tensor>> RandomLlavaWeights(const LlavaConfig& c,
                                                                   uint64_t seed,
                                                                   at::ScalarType dtype,
                                                                   double matrix_std) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  auto randn = [&](const std::vector<int64_t>& shape, double std) {
    return (at::randn(shape, gen, at::kFloat) * std).to(dtype);
  };
  std::vector<std::pair<std::string, at::Tensor>> w;
  for (const WeightSpec& s : LlavaWeightManifest(c)) {
    at::Tensor x;
    switch (s.role) {
      case WeightRole::kMatrix:
        x = randn(s.shape, matrix_std);
        break;
      case WeightRole::kBias:
      case WeightRole::kNormBias:
        x = randn(s.shape, 0.05);
        break;
      case WeightRole::kNormWeight:
        x = (1.0 + at::randn(s.shape, gen, at::kFloat) * 0.1).to(dtype);
        break;
      case WeightRole::kTokenEmbedding:
        x = randn(s.shape, 1.0);
        break;
      case WeightRole::kClassEmbedding:
        x = randn(s.shape, 0.5);
        break;
      case WeightRole::kPatchEmbedding:
      case WeightRole::kPositionEmbedding:
        x = randn(s.shape, 0.2);
        break;
    }
    w.emplace_back(s.name, x);
  }
  return w;
}

// Canonical tensors for the checkpoint: the trained ones, the stacked projections split back
// into q/k/v and gate/up, and the initial values of tensors the forward pass never reads (the
// last vision layer and post-layernorm, present in every llava-hf checkpoint).
StatusOr<std::vector<std::pair<std::string, at::Tensor>>> TrainedCheckpointTensors(
    LlavaModel& model, const std::vector<std::pair<std::string, at::Tensor>>& init,
    at::ScalarType dtype) {
  const TextConfig& t = model.config().text;
  std::map<std::string, at::Tensor> trained;
  for (auto& [name, tensor] : model.MutableParameters()) {
    const at::Tensor w = tensor->detach();
    const std::string suffix = name.substr(name.rfind('.'));  // ".weight" or ".bias"
    if (name.find(".self_attn.qkv_proj.") != std::string::npos) {
      const std::string p = name.substr(0, name.find(".self_attn.qkv_proj.")) + ".self_attn.";
      const int64_t q = t.num_attention_heads * t.head_dim, kv = t.num_key_value_heads * t.head_dim;
      trained[p + "q_proj" + suffix] = w.narrow(0, 0, q);
      trained[p + "k_proj" + suffix] = w.narrow(0, q, kv);
      trained[p + "v_proj" + suffix] = w.narrow(0, q + kv, kv);
    } else if (name.find(".mlp.gate_up_proj.") != std::string::npos) {
      const std::string p = name.substr(0, name.find(".mlp.gate_up_proj.")) + ".mlp.";
      const int64_t f = t.intermediate_size;
      trained[p + "gate_proj" + suffix] = w.narrow(0, 0, f);
      trained[p + "up_proj" + suffix] = w.narrow(0, f, f);
    } else {
      trained[name] = w;
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, tensor] : init) {
    auto it = trained.find(name);
    if (it == trained.end()) {
      out.emplace_back(name, tensor.to(dtype).contiguous());
    } else {
      out.emplace_back(name, it->second.to(dtype).contiguous());
      trained.erase(it);
    }
  }
  // Every trained tensor must land under a checkpoint name (a typo here once saved the
  // initial q/k/v and gate/up weights instead of the trained ones).
  if (!trained.empty()) {
    return Internal("trained tensor " + trained.begin()->first + " has no checkpoint name");
  }
  return out;
}

}  // namespace llava
