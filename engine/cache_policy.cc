#include "engine/cache_policy.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace llava {

const char* CachePolicyName(CachePolicy p) {
  switch (p) {
    case CachePolicy::kFull:
      return "full";
    case CachePolicy::kElastic:
      return "elastic";
    case CachePolicy::kH2O:
      return "h2o";
    case CachePolicy::kStreamingLLM:
      return "streaming_llm";
  }
  return "?";
}

StatusOr<CachePolicy> ParseCachePolicy(std::string_view name) {
  for (CachePolicy p :
       {CachePolicy::kFull, CachePolicy::kElastic, CachePolicy::kH2O, CachePolicy::kStreamingLLM}) {
    if (name == CachePolicyName(p)) return p;
  }
  if (name == "streaming" || name == "local") return CachePolicy::kStreamingLLM;
  return InvalidArgument("kv_cache.policy '" + std::string(name) +
                         "' is unknown (full, elastic, h2o, streaming_llm)");
}

const char* PositionModeName(PositionMode m) {
  return m == PositionMode::kOriginal ? "original" : "compressed";
}

StatusOr<PositionMode> ParsePositionMode(std::string_view name) {
  if (name == "original") return PositionMode::kOriginal;
  if (name == "compressed") return PositionMode::kCompressed;
  return InvalidArgument("kv_cache.position_mode '" + std::string(name) +
                         "' is unknown (original, compressed)");
}

int CacheParams::sinks() const {
  if (sink_tokens >= 0) return sink_tokens;
  switch (policy) {
    case CachePolicy::kElastic:
      return 1;
    case CachePolicy::kStreamingLLM:
      return 4;
    default:
      return 0;
  }
}

int64_t CacheParams::Protected(int64_t n) const {
  const int64_t p = policy == CachePolicy::kH2O ? 1 : sinks() + 1;
  return std::min(n, p);
}

int64_t CacheParams::EntryTarget(int64_t n) const {
  if (policy == CachePolicy::kFull) return n;
  return std::min(n, std::max(Protected(n), CeilBudget(budget, n)));
}

Status ValidateCacheParams(const CacheParams& p, int64_t max_sink_tokens) {
  if (!(p.budget > 0.0 && p.budget <= 1.0)) {  // also rejects NaN
    return InvalidArgument("kv_cache.budget must be in (0, 1], got " + std::to_string(p.budget));
  }
  if (p.recent_distance < 1) {
    return InvalidArgument("kv_cache.recent_distance must be >= 1, got " +
                           std::to_string(p.recent_distance));
  }
  if (p.sink_tokens < -1 || p.sink_tokens > max_sink_tokens) {
    return InvalidArgument("kv_cache.sink_tokens must be in [0, " +
                           std::to_string(max_sink_tokens) + "], got " +
                           std::to_string(p.sink_tokens));
  }
  return Status::Ok();
}

int64_t CeilBudget(double gamma, int64_t n) {
  const double x = gamma * static_cast<double>(n);
  const double r = std::round(x);
  if (std::abs(x - r) < 1e-9 * std::max(1.0, x)) return static_cast<int64_t>(r);
  return static_cast<int64_t>(std::ceil(x));
}

MergePlan PlanElasticMerge(const std::vector<float>& importance, const CacheParams& params) {
  const int64_t t = static_cast<int64_t>(importance.size());
  MergePlan plan;
  plan.bucket.assign(t, -1);
  if (t == 0) return plan;
  const int64_t sinks = std::min<int64_t>(params.sinks(), t);
  std::vector<bool> is_kept(t, false);
  for (int64_t i = 0; i < sinks; ++i) is_kept[i] = true;
  is_kept[t - 1] = true;
  const int64_t n_protected = std::count(is_kept.begin(), is_kept.end(), true);
  const int64_t k = params.EntryTarget(t);

  std::vector<int64_t> candidates;
  for (int64_t i = sinks; i < t - 1; ++i) candidates.push_back(i);
  const int64_t n_anchors =
      std::max<int64_t>(0, std::min<int64_t>(k - n_protected, candidates.size()));
  std::stable_sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) {
    return importance[a] > importance[b];  // stable: ties keep the earlier position first
  });
  std::vector<int64_t> anchors(candidates.begin(), candidates.begin() + n_anchors);
  std::sort(anchors.begin(), anchors.end());
  for (int64_t a : anchors) is_kept[a] = true;

  for (int64_t i = 0; i < t; ++i) {
    if (is_kept[i]) {
      plan.bucket[i] = static_cast<int64_t>(plan.kept.size());
      plan.kept.push_back(i);
    }
  }
  // Unprotected, non-anchor positions join the nearest anchor (ties to the earlier one).
  for (int64_t i = sinks; i < t - 1; ++i) {
    if (is_kept[i]) continue;
    if (anchors.empty() || !params.elastic_merge) {
      ++plan.dropped;
      continue;
    }
    auto next = std::lower_bound(anchors.begin(), anchors.end(), i);
    int64_t best;
    if (next == anchors.end()) {
      best = anchors.back();
    } else if (next == anchors.begin()) {
      best = *next;
    } else {
      const int64_t after = *next, before = *(next - 1);
      best = (i - before <= after - i) ? before : after;
    }
    plan.bucket[i] = plan.bucket[best];
    ++plan.merged;
  }
  return plan;
}

int64_t ElasticFixedPoint(int64_t merged_length, const CacheParams& params) {
  return std::max<int64_t>(params.sinks(), merged_length - params.recent_distance + 1);
}

std::vector<int64_t> StreamingKeep(int64_t len, int64_t target, int sinks) {
  std::vector<int64_t> keep;
  const int64_t s = std::min<int64_t>({sinks, len, target});
  for (int64_t i = 0; i < s; ++i) keep.push_back(i);
  for (int64_t i = std::max(s, len - (target - s)); i < len; ++i) keep.push_back(i);
  return keep;
}

std::vector<int64_t> H2OKeep(const std::vector<float>& scores, int64_t target) {
  const int64_t len = static_cast<int64_t>(scores.size());
  if (target >= len) {
    std::vector<int64_t> all(len);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  const int64_t recent = target - target / 2;
  std::vector<int64_t> older(len - recent);
  std::iota(older.begin(), older.end(), 0);
  std::stable_sort(older.begin(), older.end(),
                   [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  std::vector<int64_t> keep(older.begin(), older.begin() + target / 2);
  for (int64_t i = len - recent; i < len; ++i) keep.push_back(i);
  std::sort(keep.begin(), keep.end());
  return keep;
}

int64_t H2OVictim(const std::vector<float>& scores, int64_t target) {
  const int64_t len = static_cast<int64_t>(scores.size());
  const int64_t recent = target - target / 2;
  int64_t victim = -1;
  for (int64_t i = 0; i < len - recent; ++i) {
    if (victim < 0 || scores[i] < scores[victim]) victim = i;
  }
  return victim;
}

}  // namespace llava
