// H2O (heavy hitters + recent window), a baseline: per layer, scores accumulate the attention
// each entry receives (the prompt's column sums, then every decode step's row); the budget is
// split half heavy hitters, half most recent entries. Nothing is merged. `h2o+paper`
// (H2OParams): the Elastic Cache paper's code, with no recent window and one score per position
// summed over the layers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv/kv_policy.h"

namespace llava {

// Keep set at prefill: the first `sinks` entries, the `recent` most recent entries (-1: the
// H2O paper's `target - target/2`) and the highest-scored others up to `target` (ties: the
// earlier), ascending.
std::vector<int64_t> H2OKeep(const std::vector<float>& scores, int64_t target, int64_t recent = -1,
                             int64_t sinks = 0);
// Victim during decoding: the lowest-scored entry outside the first `sinks` and the `recent`
// most recent ones (-1: `target - target/2`; ties: the earlier entry); -1 when there is none.
int64_t H2OVictim(const std::vector<float>& scores, int64_t target, int64_t recent = -1,
                  int64_t sinks = 0);

std::unique_ptr<KvPolicy> NewH2OPolicy(const CacheParams& params, const PromptSegments& segments,
                                       int num_layers);

}  // namespace llava
