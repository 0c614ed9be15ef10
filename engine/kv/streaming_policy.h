// StreamingLLM / "Local" (DESIGN.md section 4.4), a baseline: the first `sinks` entries plus the
// most recent ones, EntryTarget(n) in all. No attention scores.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv/kv_policy.h"

namespace llava {

// Keep set for `len` entries and `target` survivors: the first sinks and the most recent ones,
// ascending.
std::vector<int64_t> StreamingKeep(int64_t len, int64_t target, int sinks);

std::unique_ptr<KvPolicy> NewStreamingPolicy(const CacheParams& params,
                                             const PromptSegments& segments, int num_layers);

}  // namespace llava
