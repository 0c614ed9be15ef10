// H2O (heavy hitters + recent window, DESIGN.md section 4.3), a baseline: per layer, scores
// accumulate the attention each entry receives (the prompt's column sums, then every decode
// step's row); the budget is split half heavy hitters, half most recent entries. Nothing is
// merged.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv/kv_policy.h"

namespace llava {

// Keep set at prefill: the `target - target/2` most recent entries plus the target/2
// highest-scored others (ties: earlier), ascending.
std::vector<int64_t> H2OKeep(const std::vector<float>& scores, int64_t target);
// Victim during decoding: the lowest-scored entry outside the `target - target/2` most recent
// ones (ties: the earlier entry).
int64_t H2OVictim(const std::vector<float>& scores, int64_t target);

std::unique_ptr<KvPolicy> NewH2OPolicy(const CacheParams& params, const PromptSegments& segments,
                                       int num_layers);

}  // namespace llava
