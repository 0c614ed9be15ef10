// One forward pass of the model as the serving loop runs it (engine.h): every chunk's cache
// reserves its rows, the model runs, and the pass is committed to each cache afterwards.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "engine/kv/kv_cache.h"
#include "engine/model/llava_model.h"

namespace llava::testing {

// Every chunk's `kv` must be a KvCache (all the tests' caches are).
inline at::Tensor Pass(const LlavaModel& model, const std::vector<SequenceChunk>& chunks,
                       std::vector<at::Tensor>* layer_outputs = nullptr) {
  for (const SequenceChunk& c : chunks) {
    TORCH_CHECK(static_cast<KvCache*>(c.kv)->Reserve(c.embeds.size(0)), "test KV pool too small");
  }
  at::Tensor logits = model.Forward(chunks, layer_outputs);
  for (const SequenceChunk& c : chunks) {
    static_cast<KvCache*>(c.kv)->Commit(c.embeds.size(0), c.prompt_continues);
  }
  return logits;
}

}  // namespace llava::testing
