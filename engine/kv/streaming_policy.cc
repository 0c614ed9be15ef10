#include "engine/kv/streaming_policy.h"

#include <algorithm>

namespace llava {
namespace {

class StreamingPolicy final : public KvPolicy {
 public:
  explicit StreamingPolicy(const CacheParams& params) : params_(params) {}

  int64_t Target(int64_t n) const override {
    return EntryTarget(params_.budget, n, params_.sinks() + 1);  // the sinks and the newest
  }
  MergePlan PlanPrompt(int, int64_t len) override {
    return KeepOnlyPlan(StreamingKeep(len, Target(len), params_.sinks()), len);
  }
  int64_t Victim(int, int64_t len, int64_t) const override {
    return std::min<int64_t>(params_.sinks(), len - 1);
  }

 private:
  const CacheParams params_;
};

}  // namespace

std::vector<int64_t> StreamingKeep(int64_t len, int64_t target, int sinks) {
  std::vector<int64_t> keep;
  const int64_t s = std::min<int64_t>({sinks, len, target});
  for (int64_t i = 0; i < s; ++i) keep.push_back(i);
  for (int64_t i = std::max(s, len - (target - s)); i < len; ++i) keep.push_back(i);
  return keep;
}

std::unique_ptr<KvPolicy> NewStreamingPolicy(const CacheParams& params, const PromptSegments&,
                                             int) {
  return std::make_unique<StreamingPolicy>(params);
}

}  // namespace llava
