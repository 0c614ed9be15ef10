#include "engine/kv/h2o_policy.h"

#include <algorithm>
#include <numeric>

namespace llava {
namespace {

// Invariant: every layer's scores are aligned with its entries.
class H2OPolicy final : public KvPolicy {
 public:
  H2OPolicy(const CacheParams& params, int num_layers) : params_(params), scores_(num_layers) {}

  int64_t Target(int64_t n) const override {
    return EntryTarget(params_.budget, n, 1);  // the newest entry
  }
  bool WantsScores(bool) const override { return true; }
  void AddScores(int layer, int64_t, const float* col, int64_t len) override {
    std::vector<float>& s = scores_[layer];
    s.resize(std::max<int64_t>(len, s.size()), 0.f);
    for (int64_t j = 0; j < len; ++j) s[j] += col[j];
  }
  MergePlan PlanPrompt(int layer, int64_t len) override {
    std::vector<float>& s = scores_[layer];
    s.resize(len, 0.f);
    MergePlan plan = KeepOnlyPlan(H2OKeep(s, Target(len)), len);
    std::vector<float> kept_scores;
    for (int64_t i : plan.kept) kept_scores.push_back(s[i]);
    s = std::move(kept_scores);
    return plan;
  }
  void OnAppend(int layer, int64_t n_new) override {
    scores_[layer].resize(scores_[layer].size() + n_new, 0.f);
  }
  int64_t Victim(int layer, int64_t len, int64_t target) const override {
    return H2OVictim(scores_[layer], target);
  }
  void OnEvict(int layer, int64_t index) override {
    scores_[layer].erase(scores_[layer].begin() + index);
  }

 private:
  const CacheParams params_;
  std::vector<std::vector<float>> scores_;  // per layer: accumulated attention received
};

}  // namespace

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

std::unique_ptr<KvPolicy> NewH2OPolicy(const CacheParams& params, const PromptSegments&,
                                       int num_layers) {
  return std::make_unique<H2OPolicy>(params, num_layers);
}

}  // namespace llava
