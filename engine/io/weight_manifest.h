// The tensors of a llava-hf checkpoint: their names under both naming generations and the
// canonical names the engine uses, and, for a config, every tensor's shape and role. The one
// table that the loader (engine/model), the checkpoint writer, the trainer and the bench share.
// Torch-free.
//
// Canonical names (both llava-hf generations map onto them):
//   lm.<...>          language_model.model.<...>          | model.language_model.<...>
//   lm_head.weight    language_model.lm_head.weight       | lm_head.weight
//   vision.<...>      vision_tower.vision_model.<...>     | model.vision_tower.vision_model.<...>
//   projector.<...>   multi_modal_projector.<...>         | model.multi_modal_projector.<...>
// (transformers >= 5 also saves the CLIP tower without its `vision_model.` level; read only.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/status.h"

namespace llava {

enum class TensorNaming { kOld, kNew };  // the llava-hf generations above

// A checkpoint tensor name of either generation -> its canonical name; an error names the
// tensor for names of neither.
StatusOr<std::string> CanonicalTensorName(const std::string& name);
// A canonical name -> the checkpoint name of `naming` (other names unchanged).
std::string CheckpointTensorName(const std::string& canonical, TensorNaming naming);

// What a tensor is, for initialisers (a checkpoint writer fills each role its own way).
enum class WeightRole {
  kMatrix,             // a linear layer's weight, lm_head
  kBias,               // a linear layer's bias
  kNormWeight,         // a (RMS or layer) norm's scale
  kNormBias,           // a layer norm's shift
  kTokenEmbedding,     // lm.embed_tokens
  kPatchEmbedding,     // the vision tower's patch convolution
  kClassEmbedding,     // the vision tower's CLS vector
  kPositionEmbedding,  // the vision tower's learned positions
};

struct WeightSpec {
  std::string name;  // canonical
  std::vector<int64_t> shape;
  WeightRole role;
  // False for tensors that every llava-hf checkpoint holds and the forward pass never reads:
  // the vision layers after the feature layer, the vision post-layernorm.
  bool used = true;
};

// Every tensor of a llava-hf checkpoint for `config`, in the order the checkpoint writer fills
// them: the vision tower (embeddings, pre-layernorm, layers, post-layernorm), the projector,
// the token embeddings, the decoder layers, the final norm and an untied lm_head.
std::vector<WeightSpec> LlavaWeightManifest(const LlavaConfig& config);

// True for a canonical name that a checkpoint may hold and inference does not read: an unused
// tensor of the manifest, or a buffer some exports keep (CLIP's position ids, rotary tables).
bool IgnorableTensor(const std::string& canonical, const LlavaConfig& config);

}  // namespace llava
