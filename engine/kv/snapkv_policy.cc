#include "engine/kv/snapkv_policy.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace llava {
namespace {

// Invariant: every layer's scores are aligned with its entries.
class SnapKvPolicy final : public KvPolicy {
 public:
  SnapKvPolicy(const CacheParams& params, const PromptSegments& segments, int num_layers)
      : params_(params),
        split_(segments.instruction.end > 0
                   ? std::max<int64_t>(0, segments.instruction.end - params.snapkv.window)
                   : 0),
        scores_(num_layers) {}

  int64_t Target(int64_t n) const override {
    return EntryTarget(params_.budget, n, params_.snapkv.window);
  }
  bool WantsScores(bool) const override { return true; }
  // Only the observation window's rows vote; without a layout (split 0) every row does.
  int64_t ScoreSplitRow() const override { return split_; }
  bool ScoresBeforeSplit() const override { return split_ == 0; }
  void AddScores(int layer, int64_t, const float* col, int64_t len) override {
    std::vector<float>& s = scores_[layer];
    s.resize(std::max<int64_t>(len, s.size()), 0.f);
    for (int64_t j = 0; j < len; ++j) s[j] += col[j];
  }
  MergePlan PlanPrompt(int layer, int64_t len) override {
    std::vector<float>& s = scores_[layer];
    s.resize(len, 0.f);
    MergePlan plan =
        KeepOnlyPlan(SnapKvKeep(s, params_.snapkv.window, params_.snapkv.kernel, Target(len)), len);
    std::vector<float> kept_scores;
    for (int64_t i : plan.kept) kept_scores.push_back(s[i]);
    s = std::move(kept_scores);
    return plan;
  }
  void OnAppend(int layer, int64_t n_new) override {
    scores_[layer].resize(scores_[layer].size() + n_new, 0.f);
  }
  int64_t Victim(int layer, int64_t, int64_t) const override {
    return SnapKvVictim(scores_[layer], params_.snapkv.window);
  }
  void OnEvict(int layer, int64_t index) override {
    scores_[layer].erase(scores_[layer].begin() + index);
  }

 private:
  const CacheParams params_;
  const int64_t split_;                     // the first prompt row of the observation window
  std::vector<std::vector<float>> scores_;  // per layer: votes, then decode attention received
};

}  // namespace

std::vector<float> SnapKvPool(const std::vector<float>& votes, int kernel) {
  const int64_t n = static_cast<int64_t>(votes.size());
  const int64_t half = kernel / 2;
  std::vector<float> out(n, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    double sum = 0;
    for (int64_t i = std::max<int64_t>(0, j - half); i <= std::min(n - 1, j + half); ++i) {
      sum += votes[i];
    }
    out[j] = static_cast<float>(sum / kernel);
  }
  return out;
}

std::vector<int64_t> SnapKvKeep(const std::vector<float>& votes, int window, int kernel,
                                int64_t target) {
  const int64_t len = static_cast<int64_t>(votes.size());
  std::vector<int64_t> keep(len);
  std::iota(keep.begin(), keep.end(), 0);
  if (target >= len) return keep;
  const int64_t observed = std::min<int64_t>(window, len);
  const int64_t prefix = len - observed;
  const std::vector<float> pooled =
      SnapKvPool(std::vector<float>(votes.begin(), votes.begin() + prefix), kernel);
  std::vector<int64_t> order(prefix);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return pooled[a] > pooled[b]; });
  const int64_t chosen = std::clamp<int64_t>(target - observed, 0, prefix);
  keep.assign(order.begin(), order.begin() + chosen);
  for (int64_t i = prefix; i < len; ++i) keep.push_back(i);
  std::sort(keep.begin(), keep.end());
  return keep;
}

int64_t SnapKvVictim(const std::vector<float>& scores, int window) {
  const int64_t len = static_cast<int64_t>(scores.size());
  int64_t victim = -1;
  for (int64_t i = 0; i < len - window; ++i) {
    if (victim < 0 || scores[i] < scores[victim]) victim = i;
  }
  return victim;
}

Status ValidateSnapKvParams(const CacheParams& p) {
  if (p.snapkv.window < 1 || p.snapkv.window > 4096) {
    return InvalidArgument("kv_cache.snapkv.window must be in [1, 4096], got " +
                           std::to_string(p.snapkv.window));
  }
  if (p.snapkv.kernel < 1 || p.snapkv.kernel > 63 || p.snapkv.kernel % 2 == 0) {
    return InvalidArgument("kv_cache.snapkv.kernel must be odd, in [1, 63], got " +
                           std::to_string(p.snapkv.kernel));
  }
  return Status::Ok();
}

std::unique_ptr<KvPolicy> NewSnapKvPolicy(const CacheParams& params, const PromptSegments& segments,
                                          int num_layers) {
  return std::make_unique<SnapKvPolicy>(params, segments, num_layers);
}

}  // namespace llava
