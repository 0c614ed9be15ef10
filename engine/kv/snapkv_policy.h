// SnapKV (Li et al., NeurIPS 2024), a question-aware baseline: the prompt's last `window` queries
// (the observation window: the end of the question) vote for the prompt entries before them; the
// votes are average-pooled over `kernel` neighbouring positions, so that an entry's neighbours
// survive with it; the highest-voted entries and the window itself are kept. Nothing is merged.
//
// Differences from the paper, so that it is compared at equal bytes with the other policies:
// - votes are averaged over heads and one keep set serves every head of a layer (the pool holds
//   the same entries for all heads), where the paper selects per head;
// - the budget covers the whole sequence, not only the prompt: while decoding, the entry with the
//   lowest accumulated attention (window votes, then every decode step's) outside the `window`
//   most recent entries is evicted, as H2O does.
// The window is the last `window` rows of the prompt when the prompt's layout is known (the
// instruction span ends the prompt); without a layout every prompt row votes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv/kv_policy.h"

namespace llava {

// `votes` average-pooled over `kernel` (odd) neighbours with zero padding, each sum divided by
// `kernel` (torch's avg_pool1d with padding kernel / 2, as the paper's code).
std::vector<float> SnapKvPool(const std::vector<float>& votes, int kernel);
// The entries kept of `votes.size()` at the prompt's end: the last min(window, len) entries, and
// the `target` - that many others with the highest pooled votes (ties: earlier), ascending.
std::vector<int64_t> SnapKvKeep(const std::vector<float>& votes, int window, int kernel,
                                int64_t target);
// The victim while decoding: the lowest score outside the `window` most recent entries (ties:
// the earlier entry).
int64_t SnapKvVictim(const std::vector<float>& scores, int window);

Status ValidateSnapKvParams(const CacheParams& params);
std::unique_ptr<KvPolicy> NewSnapKvPolicy(const CacheParams& params, const PromptSegments& segments,
                                          int num_layers);

}  // namespace llava
