#include "engine/kv/kv_policy.h"

#include <numeric>

#include "engine/kv/elastic_policy.h"
#include "engine/kv/h2o_policy.h"
#include "engine/kv/snapkv_policy.h"
#include "engine/kv/streaming_policy.h"

namespace llava {
namespace {

// Keeps every entry: the reference the other policies are measured against.
class FullPolicy final : public KvPolicy {
 public:
  int64_t Target(int64_t n) const override { return n; }
  MergePlan PlanPrompt(int, int64_t len) override {
    std::vector<int64_t> all(len);
    std::iota(all.begin(), all.end(), 0);
    return KeepOnlyPlan(std::move(all), len);
  }
  int64_t Victim(int, int64_t, int64_t) const override { return -1; }
};

Status NoExtraChecks(const CacheParams&) { return Status::Ok(); }

std::unique_ptr<KvPolicy> NewFullPolicy(const CacheParams&, const PromptSegments&, int) {
  return std::make_unique<FullPolicy>();
}

}  // namespace

MergePlan KeepOnlyPlan(std::vector<int64_t> kept, int64_t len) {
  MergePlan plan;
  plan.kept = std::move(kept);
  plan.bucket.assign(len, -1);
  for (size_t i = 0; i < plan.kept.size(); ++i) {
    plan.bucket[plan.kept[i]] = static_cast<int64_t>(i);
  }
  plan.dropped = len - static_cast<int64_t>(plan.kept.size());
  return plan;
}

const std::vector<KvPolicyInfo>& KvPolicyRegistry() {
  static const std::vector<KvPolicyInfo> kRegistry = {
      {CachePolicy::kFull,
       "full",
       {nullptr, nullptr},
       0,
       "keep every entry (the reference)",
       NoExtraChecks,
       NewFullPolicy},
      {CachePolicy::kElastic,
       "elastic",
       {nullptr, nullptr},
       1,
       "Elastic Cache: merge the prompt into important anchors, evict at a fixed point",
       ValidateElasticParams,
       NewElasticPolicy},
      {CachePolicy::kH2O,
       "h2o",
       {nullptr, nullptr},
       0,
       "heavy hitters + recent window",
       NoExtraChecks,
       NewH2OPolicy},
      {CachePolicy::kStreamingLLM,
       "streaming_llm",
       {"streaming", "local"},
       4,
       "attention sinks + recent window",
       NoExtraChecks,
       NewStreamingPolicy},
      {CachePolicy::kSnapKV,
       "snapkv",
       {nullptr, nullptr},
       0,
       "SnapKV: the question's last queries vote, pooled over neighbours, for the entries kept",
       ValidateSnapKvParams,
       NewSnapKvPolicy},
  };
  return kRegistry;
}

const KvPolicyInfo& KvPolicyInfoOf(CachePolicy id) {
  for (const KvPolicyInfo& info : KvPolicyRegistry()) {
    if (info.id == id) return info;
  }
  return KvPolicyRegistry().front();  // unreachable: every enum value has a row
}

std::string KvPolicyNames() {
  std::string out;
  for (const KvPolicyInfo& info : KvPolicyRegistry()) {
    out += (out.empty() ? "" : " | ") + std::string(info.name);
  }
  return out;
}

std::unique_ptr<KvPolicy> NewKvPolicy(const CacheParams& params, const PromptSegments& segments,
                                      int num_layers) {
  return KvPolicyInfoOf(params.policy).make(params, segments, num_layers);
}

int64_t ProjectedEntries(const CacheParams& params, const PromptSegments& segments, int64_t n) {
  if (params.KeepsEverything()) return n;
  // A fresh policy's target for n tokens counts what it protects at the prompt's merge, which
  // is at least what it protects later.
  return NewKvPolicy(params, segments, /*num_layers=*/0)->Target(n);
}

}  // namespace llava
