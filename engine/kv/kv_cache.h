// Per-request KV cache behind one interface: the Full cache, or a compressing cache whose
// decisions come from a KvPolicy (kv_policy.h: Elastic, H2O, StreamingLLM).
//
// Shapes: every layer stores K and V as [kv_heads, len, head_dim] in the model dtype; keys are
// stored after rotary embedding. Entries of a layer stay in position order.
//
// Thread safety: a cache belongs to one request and is touched only by the engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/kv/cache_policy.h"
#include "engine/kv/kv_policy.h"

namespace at {
class Tensor;
}

namespace llava {

// Memory accounting reported per request (DESIGN.md section 4.5).
struct KvStats {
  int64_t tokens_seen = 0;  // n = prompt + generated tokens fed so far
  std::vector<int64_t> entries_per_layer;
  int64_t bytes_kept = 0;             // sum over layers of entries x bytes_per_entry
  int64_t full_equivalent_bytes = 0;  // what Full would hold: layers x n x bytes_per_entry
  int64_t tokens_merged = 0;
  int64_t tokens_evicted = 0;
};

struct KvLayout {
  int num_layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int dtype_bytes = 2;
  // K and V of one entry in one layer.
  int64_t bytes_per_entry() const { return int64_t{2} * kv_heads * head_dim * dtype_bytes; }
};

class KvCache {
 public:
  virtual ~KvCache() = default;

  virtual const KvLayout& layout() const = 0;
  // Appends `k`, `v` [kv_heads, n, head_dim] to `layer`.
  virtual void Append(int layer, const at::Tensor& k, const at::Tensor& v) = 0;
  // All stored entries of `layer`: [kv_heads, len, head_dim] views, valid until the next
  // mutation of this cache.
  virtual at::Tensor Keys(int layer) const = 0;
  virtual at::Tensor Values(int layer) const = 0;
  virtual int64_t Length(int layer) const = 0;
  // True token index of every stored entry of `layer` (a merged entry reports its anchor).
  virtual const std::vector<int64_t>& Positions(int layer) const = 0;

  // Policies that score entries by attention return true for the layers they need; the model
  // then hands them that layer's softmax probabilities [heads, rows, len], one block of query
  // rows per call (the blocks of one forward pass add up to all n_new rows).
  virtual bool WantsAttentionProbs(int layer) const { return false; }
  virtual void ObserveAttention(int layer, const at::Tensor& probs) {}

  // Called once after each forward pass that fed `n_new` tokens to every layer: the point at
  // which policies compress (merge after prefill, evict after a decode step).
  virtual void OnForwardDone(int64_t n_new) = 0;
  // Called instead of OnForwardDone after a pass that fed `n_new` rows of a prompt whose
  // remaining rows follow in later passes (chunked prefill): the entries are counted and kept
  // as they are; attention scores keep accumulating (a later chunk's queries see every earlier
  // entry, so the column sums add up to those of one whole-prompt pass); compression waits for
  // the OnForwardDone of the last chunk.
  virtual void OnPromptChunkDone(int64_t n_new) = 0;

  // Rotary position of the next token fed (its true index for Full).
  virtual int64_t NextPosition() const = 0;
  virtual KvStats Stats() const = 0;
};

// Keeps every entry. Storage (device and dtype of the first append) grows by doubling, so
// appends are amortised O(new rows).
std::unique_ptr<KvCache> NewFullKvCache(const KvLayout& layout);

// The cache for `params` (validated by the caller) and the prompt's layout (empty when
// unknown): Full, or a compressing cache applying the policy (DESIGN.md section 4). Any policy
// at budget 1 is exactly Full and gets the Full cache (no attention probabilities are
// materialised).
std::unique_ptr<KvCache> NewKvCache(const KvLayout& layout, const CacheParams& params,
                                    const PromptSegments& segments = {});

// Always the policy's compressing cache, even at budget 1 (tests and evaluation use it to check
// that budget 1 reproduces Full; Full itself gets the Full cache).
std::unique_ptr<KvCache> NewPolicyKvCache(const KvLayout& layout, const CacheParams& params,
                                          const PromptSegments& segments = {});

// The prompt merge of one layer's rows: rows [Hkv, T, hd] -> [Hkv, plan.kept.size(), hd], each
// kept entry the mean (plain, or weighted by plan.weight; computed in fp32) of its bucket.
at::Tensor MergeRows(const at::Tensor& rows, const MergePlan& plan);
// The same with tensor ops on any device (MergeRows uses it off the CPU; tests compare the two).
at::Tensor MergeRowsReference(const at::Tensor& rows, const MergePlan& plan);
// MergeRows written over `rows`' first plan.kept.size() rows of each head (a CPU fp32 or bf16
// view with contiguous rows, e.g. a cache buffer's; what the cache does after a prompt). False,
// with nothing written, for any other tensor.
bool MergeRowsInPlace(const at::Tensor& rows, const MergePlan& plan);

}  // namespace llava
