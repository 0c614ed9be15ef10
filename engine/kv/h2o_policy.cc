#include "engine/kv/h2o_policy.h"

#include <algorithm>
#include <numeric>

namespace llava {
namespace {

// Invariant: every layer's scores are aligned with its entries. With shared scores every
// layer's vector is the sum over all layers (each step's sums are added to every layer before
// any eviction, and every layer then evicts the same position).
class H2OPolicy final : public KvPolicy {
 public:
  H2OPolicy(const CacheParams& params, int num_layers)
      : params_(params), sinks_(params.sinks()), scores_(num_layers) {}

  int64_t Target(int64_t n) const override {
    return EntryTarget(params_.budget, n, sinks_ + 1);  // the sinks and the newest entry
  }
  bool WantsScores(bool) const override { return true; }
  void AddScores(int layer, int64_t, const float* col, int64_t len) override {
    auto add = [&](std::vector<float>& s) {
      s.resize(std::max<int64_t>(len, s.size()), 0.f);
      for (int64_t j = 0; j < len; ++j) s[j] += col[j];
    };
    if (!params_.h2o.shared_scores) return add(scores_[layer]);
    for (std::vector<float>& s : scores_) add(s);
  }
  MergePlan PlanPrompt(int layer, int64_t len) override {
    std::vector<float>& s = scores_[layer];
    s.resize(len, 0.f);
    const int64_t target = Target(len);
    MergePlan plan = KeepOnlyPlan(H2OKeep(s, target, Recent(target), sinks_), len);
    std::vector<float> kept_scores;
    for (int64_t i : plan.kept) kept_scores.push_back(s[i]);
    s = std::move(kept_scores);
    return plan;
  }
  void OnAppend(int layer, int64_t n_new) override {
    scores_[layer].resize(scores_[layer].size() + n_new, 0.f);
  }
  int64_t Victim(int layer, int64_t len, int64_t target) const override {
    return H2OVictim(scores_[layer], target, Recent(target), sinks_);
  }
  void OnEvict(int layer, int64_t index) override {
    scores_[layer].erase(scores_[layer].begin() + index);
  }

 private:
  // The most recent entries kept whatever their scores: half the budget, or the newest one.
  int64_t Recent(int64_t target) const {
    return params_.h2o.recent_window ? target - target / 2 : 1;
  }

  const CacheParams params_;
  const int64_t sinks_;
  std::vector<std::vector<float>> scores_;  // per layer: accumulated attention received
};

}  // namespace

std::vector<int64_t> H2OKeep(const std::vector<float>& scores, int64_t target, int64_t recent,
                             int64_t sinks) {
  const int64_t len = static_cast<int64_t>(scores.size());
  if (target >= len) {
    std::vector<int64_t> all(len);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  if (recent < 0) recent = target - target / 2;
  recent = std::min(recent, target);
  sinks = std::clamp<int64_t>(sinks, 0, std::min(target - recent, len - recent));
  std::vector<int64_t> keep(sinks);
  std::iota(keep.begin(), keep.end(), 0);
  std::vector<int64_t> older(len - recent - sinks);
  std::iota(older.begin(), older.end(), sinks);
  std::stable_sort(older.begin(), older.end(),
                   [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  keep.insert(keep.end(), older.begin(), older.begin() + (target - recent - sinks));
  for (int64_t i = len - recent; i < len; ++i) keep.push_back(i);
  std::sort(keep.begin(), keep.end());
  return keep;
}

int64_t H2OVictim(const std::vector<float>& scores, int64_t target, int64_t recent, int64_t sinks) {
  const int64_t len = static_cast<int64_t>(scores.size());
  if (recent < 0) recent = target - target / 2;
  int64_t victim = -1;
  for (int64_t i = std::max<int64_t>(0, sinks); i < len - recent; ++i) {
    if (victim < 0 || scores[i] < scores[victim]) victim = i;
  }
  return victim;
}

std::unique_ptr<KvPolicy> NewH2OPolicy(const CacheParams& params, const PromptSegments&,
                                       int num_layers) {
  return std::make_unique<H2OPolicy>(params, num_layers);
}

}  // namespace llava
