#include "train/initial_weights.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "engine/model/weights.h"
#include "train/checkpoint_writer.h"

namespace llava::train {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

llava::LlavaConfig DefaultConfig(const llava::Tokenizer& tok, bool tie_embeddings) {
  llava::LlavaConfig c =
      llava::PresetConfig(llava::ModelPreset::kShapes, tok.vocab_size(), tok.PieceToId("<image>"));
  c.text.tie_word_embeddings = tie_embeddings;
  return c;
}

// 2-D sin-cos patch positions (as in MAE) for the learned CLIP position embedding, scaled to
// `rms` per element; the class token's row is zero. The checkpoint writer's N(0, 0.2) positions
// are ~2.5x weaker than the patch contents (RMS ~0.5 with N(0, 0.02) patch weights), and the
// first model never learnt where objects are (docs/TRAINING.md).
at::Tensor SinCosPositions(const llava::VisionConfig& v, double rms) {
  const int64_t grid = v.image_size / v.patch_size, d = v.hidden_size, quarter = d / 4;
  at::Tensor out = at::zeros({grid * grid + 1, d});
  auto a = out.accessor<float, 2>();
  for (int64_t r = 0; r < grid; ++r) {
    for (int64_t c = 0; c < grid; ++c) {
      for (int64_t k = 0; k < quarter; ++k) {
        // wavelengths from 2 pi to 2 pi * 100 patches: the grid is only `grid` wide
        const double omega = std::pow(100.0, -double(k) / quarter);
        float* row = &a[1 + r * grid + c][0];
        row[k] = static_cast<float>(std::sin(r * omega));
        row[quarter + k] = static_cast<float>(std::cos(r * omega));
        row[2 * quarter + k] = static_cast<float>(std::sin(c * omega));
        row[3 * quarter + k] = static_cast<float>(std::cos(c * omega));
      }
    }
  }
  return out * (rms / std::sqrt(0.5));
}

// Seeded random weights, or --init's.
StatusOr<NamedTensors> InitialWeights(const LlavaConfig& config, const InitOptions& f) {
  NamedTensors init = llava::RandomLlavaWeights(config, f.seed, at::kFloat, 0.02);
  {
    // LLaMA/CLIP-style small initial embeddings (the test checkpoints' N(0, 1) token
    // embeddings dwarf every layer's update, and large patch embeddings make the pre-layernorm
    // erase brightness): see docs/TRAINING.md.
    at::NoGradGuard no_grad;
    at::Generator gen = at::detail::createCPUGenerator(f.seed + 1);
    for (auto& [name, t] : init) {
      if (name == "lm.embed_tokens.weight") t.normal_(0.0, f.embed_std, gen);
      if (name == "vision.embeddings.patch_embedding.weight") t.normal_(0.0, f.patch_std, gen);
      if (name == "vision.embeddings.position_embedding.weight" && f.pos_rms > 0) {
        t.copy_(SinCosPositions(config.vision, f.pos_rms));
      }
    }
  }
  if (f.init_dir.empty()) return init;
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<llava::CheckpointReader> reader,
                         llava::CheckpointReader::Open(f.init_dir));
  for (auto& [name, t] : init) {
    LLAVA_RETURN_IF_ERROR(reader->Take(name, t.sizes().vec(), llava::DType::kF32, "cpu", &t));
    t = t.clone();  // the reader's mapping goes away on return
  }
  return init;
}

}  // namespace llava::train
