// Writes LLaVA checkpoints in the exact llava-hf folder layout (config.json,
// preprocessor_config.json, safetensors shards + index). Used by the tiny-checkpoint tool,
// tests and (later) the trainer.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/status.h"
#include "engine/io/tokenizer.h"
#include "engine/io/weight_manifest.h"

namespace llava {

class LlavaModel;

// config.json text for `c` in llava-hf style.
std::string LlavaConfigJson(const LlavaConfig& c);
std::string PreprocessorConfigJson(const LlavaConfig& c);

// Writes config files and tensors (canonical names; stored in each tensor's dtype, which must
// be float, half or bfloat16) into `dir`, split into `shards` files (+ index when > 1).
Status WriteLlavaCheckpoint(const std::string& dir, const LlavaConfig& config,
                            const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                            TensorNaming naming, int shards);

// Trains `out_dir`/tokenizer.model with the `spm_train` command on a text file (one sentence
// per line; deleted afterwards): BPE, byte fallback, digits split, no normalisation, `<image>`
// as a user symbol. Returns the trained tokenizer, loaded.
StatusOr<std::unique_ptr<Tokenizer>> TrainTokenizer(const std::string& corpus_path,
                                                    const std::string& out_dir, int vocab_size);

// Random weights for `c` with fixed `seed` (matrices ~N(0, matrix_std), norms near 1),
// canonical names, every tensor a real llava-hf checkpoint has (including the unused last
// vision layer). Wide models need a small matrix_std (0.02) to keep activations finite in bf16.
std::vector<std::pair<std::string, at::Tensor>> RandomLlavaWeights(const LlavaConfig& c,
                                                                   uint64_t seed,
                                                                   at::ScalarType dtype,
                                                                   double matrix_std = 0.2);

// The checkpoint tensors of a model being trained (train/train_main.cc): its current weights
// (LlavaModel::MutableParameters), the stacked q/k/v and gate/up matrices split back into the
// llava-hf tensors, and `init`'s values for the tensors the forward pass never reads (the last
// vision layer, the vision post-layernorm). Canonical names in `init`'s order, as `dtype`.
StatusOr<std::vector<std::pair<std::string, at::Tensor>>> TrainedCheckpointTensors(
    LlavaModel& model, const std::vector<std::pair<std::string, at::Tensor>>& init,
    at::ScalarType dtype);

}  // namespace llava
