// KV-cache policies: parameters and the index logic (which entries to keep, which bucket each
// merged entry joins, which slot to evict). Torch-free, so every decision is testable exactly;
// the tensor side (kv_cache.cc) only gathers, averages and deletes what these functions say.
//
// Notation (DESIGN.md section 4): T prompt tokens, n tokens fed so far, gamma the budget ratio.
// After every step a compressed cache holds EntryTarget(n) = min(n, max(P, ceil(gamma * n)))
// entries per layer, where P is the policy's protected count.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/status.h"

namespace llava {

enum class CachePolicy { kFull, kElastic, kH2O, kStreamingLLM };
enum class PositionMode {
  kOriginal,    // a new token's rotary position is its true index n (default)
  kCompressed,  // ... is the compressed cache length (the Elastic Cache reference code)
};

const char* CachePolicyName(CachePolicy p);  // "full", "elastic", "h2o", "streaming_llm"
StatusOr<CachePolicy> ParseCachePolicy(std::string_view name);
const char* PositionModeName(PositionMode m);  // "original", "compressed"
StatusOr<PositionMode> ParsePositionMode(std::string_view name);

struct CacheParams {
  CachePolicy policy = CachePolicy::kElastic;
  double budget = 1.0;       // gamma in (0, 1]; ignored by Full
  int recent_distance = 25;  // Elastic: the fixed point sits this far from the merged end
  int sink_tokens = -1;      // -1: the policy's default (Elastic 1, StreamingLLM 4, H2O 0)
  PositionMode position_mode = PositionMode::kOriginal;
  // Elastic only, an ablation for llava-eval (not in the API): false keeps the same anchors
  // but drops the other prompt entries instead of averaging them into their anchor.
  bool elastic_merge = true;
  // Elastic only, an ablation: divide each prompt position's attention column sum by the
  // number of prompt queries that can see it (T - n), removing the causal bias of the plain
  // sum toward early positions (docs/POLICIES.md).
  bool elastic_mean_importance = false;

  int sinks() const;
  // Entries a policy never lets the cache drop below once n tokens are in: the sinks plus the
  // newest entry (Elastic, StreamingLLM) or the newest entry alone (H2O).
  int64_t Protected(int64_t n) const;
  // min(n, max(Protected(n), ceil(gamma * n))); n for Full.
  int64_t EntryTarget(int64_t n) const;
};

// Checks ranges; errors name the field ("kv_cache.budget must be in (0, 1], got 0").
Status ValidateCacheParams(const CacheParams& params, int64_t max_sink_tokens = 1024);

// ceil(gamma * n), robust to binary rounding (0.2 * 10 is exactly 2).
int64_t CeilBudget(double gamma, int64_t n);

// Elastic Cache merge of one layer's prompt entries.
struct MergePlan {
  std::vector<int64_t> kept;    // positions kept (protected + anchors), ascending
  std::vector<int64_t> bucket;  // [T] index into `kept` each position is averaged into,
                                // or -1 when dropped (no anchor at all, or no merging)
  int64_t merged = 0;           // positions folded into an anchor (the anchor not counted)
  int64_t dropped = 0;
};
// importance [T]: column sums of the prefill attention, head-averaged. Protected: the first
// `sinks` positions and position T-1. The K - |protected| unprotected positions of highest
// importance (ties: earlier position) are anchors, K = EntryTarget(T); every other unprotected
// position joins the bucket of its nearest anchor by position (ties: the earlier anchor), or
// is dropped when `params.elastic_merge` is false. Note: the official code picks anchors by rank
// instead of position (an indexing bug); this is the intended top-k.
MergePlan PlanElasticMerge(const std::vector<float>& importance, const CacheParams& params);

// Elastic fixed point N_tl = max(sinks, S0 - recent_distance + 1) for a merged length S0.
int64_t ElasticFixedPoint(int64_t merged_length, const CacheParams& params);

// StreamingLLM keep set for `len` entries and `target` survivors: the first sinks and the
// most recent ones, ascending.
std::vector<int64_t> StreamingKeep(int64_t len, int64_t target, int sinks);

// H2O keep set at prefill: the `target - target/2` most recent entries plus the target/2
// highest-scored others (ties: earlier), ascending.
std::vector<int64_t> H2OKeep(const std::vector<float>& scores, int64_t target);
// H2O victim during decoding: the lowest-scored entry outside the `target - target/2` most
// recent ones (ties: the earlier entry).
int64_t H2OVictim(const std::vector<float>& scores, int64_t target);

}  // namespace llava
