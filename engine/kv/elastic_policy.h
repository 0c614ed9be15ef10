// Elastic Cache (ECCV 2024, DESIGN.md section 4.2): importance-driven merging of the prompt at
// prefill, fixed-point eviction while decoding; plus the variants that keep it robust to
// image-first prompts (protected instruction, exposure-normalised or instruction-only
// importance, segment-scoped and importance-weighted merges). ElasticPreset names the two
// configurations: "paper" (the method as published) and "product" (the default).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv/kv_policy.h"

namespace llava {

// Prompt positions that are never merged, never anchors of other entries and never evicted:
// the first `sinks`, plus the instruction (and a question before the image) and the system
// prompt when the params protect them, within half of the budget's entries beyond the sinks:
// the instruction first, then the question, then the system prompt, each from its end; and
// the last protect_tail positions.
// The last prompt position is kept at the merge (the paper) but is not pinned unless it lies
// in a protected span. Sorted, unique, all < t.
std::vector<int64_t> ElasticPinned(const CacheParams& params, const PromptSegments& segments,
                                   int64_t t);

// Importance [t] from the attention column sums of every prompt query (`sums`) and of the
// instruction's queries, rows >= `instruction_begin` (`instruction_sums`). kSum: `sums`;
// kMean: each sum divided by the t - j queries that see position j; kInstruction: the
// instruction's sums divided by the t - max(j, instruction_begin) of its queries that see j;
// kHybrid: kMean + kInstruction. With no instruction known (begin 0) both sums are the same.
std::vector<float> ElasticImportance(const std::vector<float>& sums,
                                     const std::vector<float>& instruction_sums,
                                     ImportanceMode mode, int64_t instruction_begin);

// The merge of one layer's t prompt entries. Kept: the pinned positions, position t-1, and as
// anchors the K - |those| other positions of highest importance (ties: earlier position),
// K = EntryTarget(budget, t, |pinned + {t-1}|). Every other position joins the bucket of its
// nearest anchor by position (ties: the earlier anchor) -- within its own segment under
// MergeScope::kSegment -- or is dropped when it has no anchor or `params.elastic.merge` is
// false. With `weighted_merge` each member weighs its importance (plus 1e-6, so an all-zero
// bucket is a plain mean). Note: the official code picks anchors by rank instead of position
// (an indexing bug); this is the intended top-k.
MergePlan PlanElasticMerge(const std::vector<float>& importance, const CacheParams& params,
                           const PromptSegments& segments = {});

// Elastic fixed point N_tl = max(sinks, S0 - recent_distance + 1) for a merged length S0.
int64_t ElasticFixedPoint(int64_t merged_length, const CacheParams& params);

// The decode-time victim: the first entry at or after `fixed_point` that is neither pinned nor
// the newest; if there is none, the last such entry before it. -1 if every entry is protected.
int64_t ElasticVictim(const std::vector<bool>& pinned, int64_t fixed_point);

// DecodeEviction::kScored: the unpinned entry other than the newest with the lowest rank
// scores[i] / max(1, ages[i])^age_exponent (ties: the earlier entry), or -1 if there is none.
// ages[i]: the decode steps entry i has been in the cache; exponent 0 (or no ages) ranks by the
// plain score.
int64_t ScoredVictim(const std::vector<bool>& pinned, const std::vector<float>& scores,
                     const std::vector<int64_t>& ages = {}, float age_exponent = 0.f);

std::unique_ptr<KvPolicy> NewElasticPolicy(const CacheParams& params,
                                           const PromptSegments& segments, int num_layers);
Status ValidateElasticParams(const CacheParams& params);

}  // namespace llava
