// One optimizer step's losses and gradients for llava-train. The batch's conversations are
// dealt into shards of about equal tokens; each shard runs its forward and backward pass on its
// own thread with single-threaded ATen (data parallelism inside one process; on 2 cores it is
// faster than one pass on 2 intra-op threads, whose many small parallel regions wait on each
// other; docs/TRAINING.md, "Training throughput"). Every count a loss term is divided by is known
// from the examples before any pass, so the shards never wait on each other; their gradients are
// summed in shard order, so the result is the whole batch's gradient and does not depend on
// thread timing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "engine/io/model_config.h"
#include "train/attention_supervision.h"
#include "train/shapes_world.h"
#include "train/training_data.h"

namespace llava {
class LlavaModel;
}

namespace llava::train {

// The probes trained alongside the model and never saved (--patch-weight, --count-weight).
inline constexpr int64_t kPatchClasses[3] = {shapes::kNumShapes + 1, shapes::kNumColours + 1,
                                             shapes::kNumSizes + 1};
inline constexpr int64_t kInventory = shapes::kNumShapes + shapes::kNumColours;
inline constexpr int64_t kCountClasses = shapes::kMaxObjects + 1;

struct Probes {
  at::Tensor patch_w, patch_b;  // image row -> shape, colour and size logits
  at::Tensor count_w, count_b;  // answer row -> kInventory classifications over 0..kMaxObjects
};

// What the loss is made of (llava-train's flags of the same names).
struct LossOptions {
  bool bf16 = true;  // bf16 autocast for the forward pass (matmuls in bf16, loss in fp32)
  double attn_weight = 0, patch_weight = 0, count_weight = 0;
  std::vector<int> attn_layers = {1, 2};
  int count_layer = 2;
  bool attn_report = false;  // fill `report` with every head's mass on the targets
  // Conversations of a shard that begin with the same rows (the paper layout's system prompt,
  // ~110 tokens) run those rows once: each one's cache starts with their keys and values, which
  // is exact (a row's keys and values depend only on the rows before it).
  bool share_prefix = true;
};

struct BatchLosses {
  double lm = 0, attn = 0, patch = 0, count = 0;  // the batch's means (0 when off)
  int64_t tokens = 0;                             // positions of the batch
  int64_t rows_saved = 0;  // rows not run: shared prefixes run once (LossOptions::share_prefix)
  double forward_s = 0, backward_s = 0;  // wall time of the two passes
};

// The batch's loss is the mean cross-entropy of its labelled tokens, plus attn_weight x the
// mean of its attention terms (train/attention_supervision.h), plus patch_weight x the mean over
// the three patch classifications of their mean over the image rows, plus count_weight x the mean
// of the count classifications. Sets the .grad of every tensor of `params` to that loss's
// gradient (undefined where it does not reach) and returns the terms. `examples` is dealt into
// `shards` shards (at most one per example), each on its own thread with max(1, threads /
// shards) intra-op threads; shards == 1 runs on the calling thread with the intra-op threads it
// has. `report` (with options.attn_report) gets every shard's masses. The times are the slowest
// shard's.
BatchLosses BatchGradients(LlavaModel& model, const LlavaConfig& config,
                           const std::vector<Example>& examples, const Probes& probes,
                           const LossOptions& options, const std::vector<at::Tensor>& params,
                           int shards, int threads, AttentionReport* report);

}  // namespace llava::train
