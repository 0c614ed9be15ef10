// Per-request KV cache behind one interface: the Full cache, or a compressing cache whose
// decisions come from a KvPolicy (kv_policy.h: Elastic, H2O, StreamingLLM).
//
// Storage: the serving caches keep their entries in the engine's KV pool (kv_pool.h), in the
// pages of one page table per sequence that serves every layer. Entries are held in storage
// (slot) order: a prompt fills slots 0..T-1 in position order and its compression writes the
// kept and merged rows to the first slots and returns the pages past them to the pool; a decode
// step appends its entry to the next slot, and an eviction moves the entry in the last slot into
// the victim's (one row, not the tail), so slots stay dense. Keys are stored after rotary
// embedding and each slot's token position is tracked (Positions), so attention does not need
// position order. The policies still decide in position order (their "index" is an entry's
// rank by position); the cache maps ranks to slots. Physical bytes held = logical bytes up to
// the last, partly filled page (KvStats::bytes_allocated).
//
// Shapes: K and V of a layer are [kv_heads, len, head_dim] in the model dtype.
//
// Thread safety: a cache belongs to one request and is touched only by the engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/kv/cache_policy.h"
#include "engine/kv/kv_layout.h"
#include "engine/kv/kv_policy.h"

namespace at {
class Tensor;
}

namespace llava {

class KvPool;

// Memory accounting reported per request (docs/ARCHITECTURE.md, "KV cache").
struct KvStats {
  int64_t tokens_seen = 0;  // n = prompt + generated tokens fed so far
  std::vector<int64_t> entries_per_layer;
  int64_t bytes_kept = 0;       // sum over layers of entries x bytes_per_entry
  int64_t bytes_allocated = 0;  // pool pages held x page bytes (0 for an unpooled cache)
  // What Full would hold in the model's dtype: layers x n x model_bytes_per_entry (so the
  // saving of int8 entries counts, as the saving of fewer entries does).
  int64_t full_equivalent_bytes = 0;
  int64_t tokens_merged = 0;
  int64_t tokens_evicted = 0;
};

// Where one layer's entries live, in storage order, for a kernel that reads them in place:
// slot s is in page pages[s / page_rows] at row s % page_rows; KV head h of page p starts at
// keys + p * page_stride + h * key_head_stride elements (values likewise); rows of a page are
// row_stride elements apart. An unpooled cache is one page holding every row. int8 entries
// (KvLayout::int8) come with one fp32 scale per row: slot s of KV head h has its key's at
// key_scales + p * scale_page_stride + h * scale_head_stride + s % page_rows (values likewise);
// the scale pointers are null otherwise.
struct KvStorage {
  const void* keys = nullptr;
  const void* values = nullptr;
  const int32_t* pages = nullptr;
  int64_t page_rows = 0, page_stride = 0;
  int64_t key_head_stride = 0, value_head_stride = 0, row_stride = 0;
  int64_t len = 0;
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  int64_t scale_page_stride = 0, scale_head_stride = 0;
};

// What one forward pass may do to a sequence's KV (the model's view of it, SequenceChunk::kv):
// write the pass's new rows into the slots reserved for them, read every stored row, and hand
// over attention probabilities. Nothing here changes what the cache has committed: the policy
// sees the pass's rows and scores only when the caller commits the pass (KvCache below), after
// the whole pass has succeeded.
class SequenceKv {
 public:
  virtual ~SequenceKv() = default;

  virtual const KvLayout& layout() const = 0;
  // Appends `k`, `v` [kv_heads, n, head_dim] to `layer` (a pooled cache: within its reservation).
  virtual void Append(int layer, const at::Tensor& k, const at::Tensor& v) = 0;
  // All stored entries of `layer` in storage order, this pass's included: [kv_heads, len,
  // head_dim], a copy out of the pool (a view of an unpooled cache, valid until its next
  // mutation).
  virtual at::Tensor Keys(int layer) const = 0;
  virtual at::Tensor Values(int layer) const = 0;
  // The same entries where they are (valid until the next mutation of this cache).
  virtual KvStorage Storage(int layer) const = 0;
  virtual int64_t Length(int layer) const = 0;
  // True token index of every stored entry of `layer`, in storage order (a merged entry reports
  // its anchor).
  virtual const std::vector<int64_t>& Positions(int layer) const = 0;

  // Policies that score entries by attention return true for the layers they need; the model
  // then hands them that layer's softmax probabilities [heads, rows, len] over the entries in
  // storage order, one block of query rows per call (the blocks of one forward pass add up to
  // all n_new rows). They are held until the pass is committed.
  virtual bool WantsAttentionProbs(int layer) const { return false; }
  virtual void ObserveAttention(int layer, const at::Tensor& probs) {}
};

// A request's cache, as the serving loop drives it (the KV manager's three steps, in
// llama.cpp's prepare/apply shape): Reserve the slots a pass will write (or refuse), run the
// pass over the SequenceKv view, then commit it with OnForwardDone / OnPromptChunkDone, where
// the policy decides. A pass that fails is never committed: its request ends and the cache
// returns all its pages when destroyed.
class KvCache : public SequenceKv {
 public:
  // Makes room for `n_new` more entries in every layer (pool pages): false, with nothing
  // changed, when the pool has too few free pages. A pass may only append what was reserved.
  virtual bool Reserve(int64_t n_new) { return true; }

  // Commits a forward pass that fed `n_new` tokens to every layer: the point at which policies
  // compress (merge after prefill, evict after a decode step).
  virtual void OnForwardDone(int64_t n_new) = 0;
  // Commits, instead of OnForwardDone, a pass that fed `n_new` rows of a prompt whose remaining
  // rows follow in later passes (chunked prefill): the entries are counted and kept as they
  // are; attention scores keep accumulating (a later chunk's queries see every earlier entry,
  // so the column sums add up to those of one whole-prompt pass); compression waits for the
  // OnForwardDone of the last chunk.
  virtual void OnPromptChunkDone(int64_t n_new) = 0;
  // OnForwardDone, or OnPromptChunkDone for a chunk with more prompt rows to follow.
  void Commit(int64_t n_new, bool prompt_continues) {
    prompt_continues ? OnPromptChunkDone(n_new) : OnForwardDone(n_new);
  }

  // Rotary position of the next token fed (its true index for Full).
  virtual int64_t NextPosition() const = 0;
  virtual KvStats Stats() const = 0;
  // Pool pages held now (0 for an unpooled cache): Stats().bytes_allocated / page bytes.
  virtual int64_t PagesHeld() const { return 0; }
};

// A Full cache outside any pool, in growable per-layer buffers that autograd can flow through:
// the trainer's (and the model tests') cache. Not for serving: its capacity doubles.
std::unique_ptr<KvCache> NewFullKvCache(const KvLayout& layout);

// The serving cache for `params` (validated by the caller) and the prompt's layout (empty when
// unknown), its entries in `pool` (borrowed: it must outlive the cache, which returns its pages
// when destroyed): Full, or a compressing cache applying the policy (docs/ARCHITECTURE.md). Any
// policy at budget 1 is exactly Full and gets the Full cache (no attention probabilities are
// materialised).
std::unique_ptr<KvCache> NewKvCache(KvPool* pool, const CacheParams& params,
                                    const PromptSegments& segments = {});

// Always the policy's compressing cache, even at budget 1 (tests and evaluation use it to check
// that budget 1 reproduces Full; Full itself gets the Full cache).
std::unique_ptr<KvCache> NewPolicyKvCache(KvPool* pool, const CacheParams& params,
                                          const PromptSegments& segments = {});

// The prompt merge of one layer's rows: rows [Hkv, T, hd] -> [Hkv, plan.kept.size(), hd], each
// kept entry the mean (plain, or weighted by plan.weight; computed in fp32) of its bucket
// (divided by the bucket's size instead of its weights with plan.divide_by_count).
at::Tensor MergeRows(const at::Tensor& rows, const MergePlan& plan);
// The same with tensor ops on any device (MergeRows uses it off the CPU; tests compare the two).
at::Tensor MergeRowsReference(const at::Tensor& rows, const MergePlan& plan);
// MergePlan::merge_by_key: every merged entry of `plan` (bucket >= 0, not kept) is re-assigned
// to the bucket of the kept, unpinned entry whose key in `keys` [Hkv, T, hd] is the most
// similar (cosine similarity summed over the heads; ties: the earlier entry), and weighted as
// plan->key_merge says (KeyMerge). Unchanged when no such entry is kept.
void AssignMergesByKey(const at::Tensor& keys, MergePlan* plan);

}  // namespace llava
