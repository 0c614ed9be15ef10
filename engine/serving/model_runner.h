// What the serving loop needs of a model: its facts (config, tokenizer, KV layout), the input
// rows of a prepared prompt and of sampled tokens, and one forward pass over chunks of many
// sequences. LoadedModel (generator.h) implements it with the LLaVA model; the engine loop's
// tests drive it with a scripted fake, without weights (tests/engine_loop_test.cc).
//
// Torch-free declarations (at::Tensor is only named), so the server can hold a runner.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/tokenizer.h"
#include "engine/kv/kv_cache.h"
#include "engine/serving/request.h"

namespace at {
class Tensor;
}

namespace llava {

struct SequenceChunk;  // engine/model/llava_model.h

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual const LlavaConfig& config() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual KvLayout kv_layout() const = 0;

  // The prompt's input rows [T, D]: its images through the vision tower, spliced into the
  // token embeddings at their image rows. `vision_seconds` (may be null) gets the vision time.
  virtual at::Tensor EmbedPrompt(const PreparedRequest& prepared, double* vision_seconds) const = 0;
  // Token embeddings [ids.size(), D].
  virtual at::Tensor EmbedTokens(const std::vector<int64_t>& ids) const = 0;
  // One pass over `chunks` (rows of different sequences): appends each chunk's K/V rows to its
  // cache and tells the cache the pass is done; returns fp32 logits [rows, V] on the CPU,
  // contiguous, one row per chunk (its last) unless the chunk asks for all of them. Throws
  // c10::Error when the model fails.
  virtual at::Tensor Forward(const std::vector<SequenceChunk>& chunks) const = 0;
};

}  // namespace llava
