// The trainer's starting point: the default model's config and its initial weights, seeded
// (the checkpoint writer's random weights with small embeddings and sin-cos patch positions),
// or the weights of an earlier run to continue from.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/status.h"
#include "engine/io/tokenizer.h"

namespace llava::train {

// The shapes preset for `tok`'s vocabulary (engine/io/model_config.h).
LlavaConfig DefaultConfig(const Tokenizer& tok, bool tie_embeddings);

// 2-D sin-cos patch positions [patches + 1, D] scaled to `rms` per element (the class row 0).
at::Tensor SinCosPositions(const VisionConfig& v, double rms);

struct InitOptions {
  uint64_t seed = 0;
  double embed_std = 0.02;  // token embeddings ~N(0, embed_std)
  double patch_std = 0.02;  // patch embedding ~N(0, patch_std)
  double pos_rms = 0.5;     // sin-cos positions of this RMS; 0 keeps the writer's random ones
  std::string init_dir;     // when set, every tensor comes from this llava-hf folder instead
};

// Every checkpoint tensor (canonical names, fp32) to start training from.
StatusOr<std::vector<std::pair<std::string, at::Tensor>>> InitialWeights(
    const LlavaConfig& config, const InitOptions& options);

}  // namespace llava::train
