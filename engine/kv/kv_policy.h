// The decisions of a KV-cache policy, behind one interface: which prompt entries survive the
// prefill (and which are averaged into which), and which entry a decode step evicts. One object
// per request, made by the registry from the request's CacheParams and prompt layout; each
// policy lives in its own file pair (elastic_policy, h2o_policy, streaming_policy). Torch-free,
// so every decision is tested exactly; the cache (kv_cache.cc) owns the tensors, hands the
// policy attention column sums, and gathers, averages and deletes what the policy says.
//
// Call order, per request: AddScores (while the prompt is fed, if WantsScores), PlanPrompt once
// per layer after the prompt's last forward pass, then per decode step OnAppend, AddScores (if
// WantsScores) and Victim / OnEvict until the layer holds Target(n) entries.
//
// Thread safety: a policy belongs to one request's cache; the engine thread alone calls it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv/cache_policy.h"

namespace llava {

// What survives the prompt's compression in one layer holding `len` entries.
struct MergePlan {
  std::vector<int64_t> kept;    // entries kept, ascending
  std::vector<int64_t> bucket;  // [len] index into `kept` each entry is averaged into, or -1
                                // when dropped
  std::vector<float> weight;    // [len] each entry's weight in its bucket's mean; empty: equal
  // true: a bucket's weighted sum is divided by its number of entries, not by the sum of its
  // weights (KeyMerge::kWeighted).
  bool divide_by_count = false;
  bool merge_keys = true;  // false: a kept entry keeps its own key; only values are averaged
  // true: the cache re-assigns every merged entry to the kept, unpinned entry whose key is the
  // most similar (AssignMergesByKey), and combines them as key_merge says; `bucket` is the
  // fallback where none is kept.
  bool merge_by_key = false;
  KeyMerge key_merge = KeyMerge::kAveraged;
  std::vector<bool> pinned;  // [kept.size()] never evicted while decoding; empty: none
  int64_t merged = 0;        // entries folded into another (the anchor not counted)
  int64_t dropped = 0;
};

// The plan that keeps `kept` (ascending entries of `len`) and drops the rest, merging nothing.
MergePlan KeepOnlyPlan(std::vector<int64_t> kept, int64_t len);

class KvPolicy {
 public:
  virtual ~KvPolicy() = default;

  // Entries per layer after n tokens are in (n for Full): min(n, max(protected, ceil(gamma n))).
  virtual int64_t Target(int64_t n) const = 0;

  // Attention column sums: true while the policy wants them (`prefilled` is false while the
  // prompt is fed).
  virtual bool WantsScores(bool prefilled) const { return false; }
  // Blocks of prompt query rows handed to AddScores never straddle this row, so a policy can
  // tell the instruction's queries from the others.
  virtual int64_t ScoreSplitRow() const { return 0; }
  // False when prompt rows before ScoreSplitRow() would be ignored: the cache then skips their
  // column sums (the prefill's largest share of a policy's cost).
  virtual bool ScoresBeforeSplit() const { return true; }
  // `column_sums` [len]: attention each of the layer's `len` entries received from a block of
  // query rows starting at prompt position `first_row` (-1: a decode row), summed over the rows
  // and averaged over heads.
  virtual void AddScores(int layer, int64_t first_row, const float* column_sums, int64_t len) {}

  // After the prompt's last forward pass; the layer holds `len` prompt entries in position
  // order. A plan that keeps all `len` entries leaves the layer as it is.
  virtual MergePlan PlanPrompt(int layer, int64_t len) = 0;
  // While decoding: `n_new` entries were appended to `layer`.
  virtual void OnAppend(int layer, int64_t n_new) {}
  // The index of the entry to evict from `layer`, which holds `len` > `target` entries.
  virtual int64_t Victim(int layer, int64_t len, int64_t target) const = 0;
  // Where the victim's value goes before it is evicted: the index of the entry whose value
  // becomes the weighted mean of both (weights victim_weight and into_weight), or -1 to drop it.
  struct DecodeMerge {
    int64_t into = -1;
    float victim_weight = 0, into_weight = 0;
  };
  virtual DecodeMerge MergeVictim(int layer, int64_t victim) { return {}; }
  virtual void OnEvict(int layer, int64_t index) {}
};

// The registry: one row per policy, found by enum or by name (ParseCachePolicy).
struct KvPolicyInfo {
  CachePolicy id;
  const char* name;
  std::array<const char*, 2> aliases;  // nullptr: none
  int default_sinks;
  const char* summary;  // one line for --help texts and docs
  Status (*validate)(const CacheParams&);
  std::unique_ptr<KvPolicy> (*make)(const CacheParams&, const PromptSegments&, int num_layers);
};
const std::vector<KvPolicyInfo>& KvPolicyRegistry();
const KvPolicyInfo& KvPolicyInfoOf(CachePolicy id);
// "full | elastic | h2o | streaming_llm | snapkv": for --help texts.
std::string KvPolicyNames();

// The policy object for a request (params validated by the caller). `segments` may be empty.
std::unique_ptr<KvPolicy> NewKvPolicy(const CacheParams& params, const PromptSegments& segments,
                                      int num_layers);

// Upper bound of the entries per layer a request holds once `n` >= T tokens are in (admission).
int64_t ProjectedEntries(const CacheParams& params, const PromptSegments& segments, int64_t n);

}  // namespace llava
