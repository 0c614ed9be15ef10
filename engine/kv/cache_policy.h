// What a request asks of its KV cache: the policy, the budget and each policy's own knobs, plus
// the prompt's layout that the policies may use. Torch-free: parsing and validation are tested
// exactly, and the server converts the API's KvCacheConfig into these types.
//
// Notation (DESIGN.md section 4): T prompt tokens, n tokens fed so far, gamma the budget ratio.
// After every step a compressed cache holds EntryTarget(gamma, n, P) = min(n, max(P,
// ceil(gamma * n))) entries per layer, where P is what the policy protects (kv_policy.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/io/status.h"

namespace llava {

enum class CachePolicy { kFull, kElastic, kH2O, kStreamingLLM, kSnapKV };
enum class PositionMode {
  kOriginal,    // a new token's rotary position is its true index n (default)
  kCompressed,  // ... is the compressed cache length (the Elastic Cache reference code)
};

// Which prompt queries score a position for Elastic's anchors.
enum class ImportanceMode {
  kSum,          // column sum over every prompt query (the paper)
  kMean,         // ... divided by the number of prompt queries that can see the position
  kInstruction,  // mean over the instruction's queries only (the text after the last image)
  kHybrid,       // kMean + kInstruction
};
// Which anchors an unkept prompt entry may be merged into.
enum class MergeScope {
  kNearest,  // the nearest anchor by position, anywhere in the prompt (the paper)
  kSegment,  // the nearest anchor of its own segment (the same image, or the same text run);
             // dropped when its segment has no anchor
  kKey,      // the kept, unpinned entry whose key is the most similar (cosine, summed over the
             // KV heads; LOOK-M): the cache assigns it from the keys (MergePlan::merge_by_key)
};
// How MergeScope::kKey combines a kept entry (the pivot) with the n dropped entries assigned to
// it, LOOK-M's three merges (its code's formulas; s_e is e's cosine similarity to the pivot's
// key, the mean over the KV heads):
enum class KeyMerge {
  kAveraged,  // (pivot + sum e) / (n + 1)
  kPivotal,   // the mean of the pivot and each (e + pivot) / 2: weights 1 + n/2 and 1/2 each
  kWeighted,  // (pivot + sum s_e * e) / (n + 1): not renormalised by the weights
};

// How Elastic picks a victim while decoding.
enum class DecodeEviction {
  kFixedPoint,  // the entry at N_tl, a queue from there on (the paper)
  kScored,      // the unpinned entry, other than the newest, that received the least attention
                // from the decode steps so far (H2O's scores, after the merge)
};

// Elastic Cache's knobs (DESIGN.md section 4.2). The named presets are ElasticPreset's.
struct ElasticParams {
  int recent_distance = 25;  // the fixed point sits this far from the merged end
  // Keep the instruction (the prompt text after the last image, and a question placed before
  // the image: PromptSegments::instruction and ::question) verbatim:
  // never merged, never an anchor of other entries, never evicted. Counts against the budget,
  // of which the protected spans take at most half (ElasticPinned).
  bool protect_instruction = false;
  bool protect_system = false;  // the same for the system prompt
  // The prompt's last N entries (the instruction's last words and the assistant turn's opening,
  // " ASSISTANT:") are pinned like the sink: the observation window that SnapKV keeps verbatim.
  // Not counted in the protected spans' half of the budget. In [0, 4096].
  int protect_tail = 0;
  ImportanceMode importance = ImportanceMode::kSum;
  MergeScope merge_scope = MergeScope::kNearest;
  // Anchors become the importance-weighted mean of their bucket instead of the plain mean.
  bool weighted_merge = false;
  // Keys are averaged with the values (the paper). false: an anchor keeps its own key (its
  // rotary position and what queries match), and only its value becomes the bucket's mean.
  bool merge_keys = true;
  DecodeEviction eviction = DecodeEviction::kFixedPoint;
  // kScored ranks an entry by its decode attention divided by (the decode steps it has been in
  // the cache)^evict_age_exponent: 0 is the plain sum, under which what was just written has
  // had the least time to collect attention and goes first; 1 is the mean per step.
  float evict_age_exponent = 0.f;
  // kScored, N > 0: a decode step's victim is the lowest-ranked of the unpinned entries that are
  // neither the image's (its kept anchors) nor the answer's newest N; the image's go only when
  // no such entry is left. 0: every unpinned entry competes.
  int evict_answer_first = 0;
  // kScored: a victim's value is averaged into its neighbour (by position, not pinned) that has
  // received more decode attention, weighted by both entries' attention, instead of dropped; the
  // neighbour keeps its key and adds the victim's attention to its own.
  bool decode_merge = false;
  // LOOK-M's text prior: when anchors are chosen, every text entry ranks before every image
  // entry (by importance within each group).
  bool text_prior = false;
  KeyMerge key_merge = KeyMerge::kAveraged;  // with MergeScope::kKey
  // An ablation (llava-eval only): false keeps the same anchors and drops the other entries.
  bool merge = true;
};

// SnapKV's knobs (snapkv_policy.h): the observation window (the prompt's last queries, which
// vote) and the pooling kernel. Defaults: the paper's (32, 7); `snapkv+kvpress` is NVIDIA
// kvpress's SnapKVPress (64, 5).
struct SnapKvParams {
  int window = 32;
  int kernel = 7;
};

// H2O's variants. Default: the H2O paper's (half heavy hitters, half the most recent entries,
// scores per layer). `h2o+paper` is the baseline as the Elastic Cache paper's code runs it: no
// recent window (the heavy hitters take the whole budget, the newest entry kept), one score per
// position summed over every layer (so every layer keeps the same positions), 1 sink.
struct H2OParams {
  bool recent_window = true;
  bool shared_scores = false;
};

// "paper": the method exactly as published (docs/ARCHITECTURE.md), the reference.
// "product": the service's default, measured in docs/POLICIES.md. The plain name `elastic`
// means "product". "lookm": LOOK-M (arXiv 2406.18139) expressed in these knobs, a baseline
// (the policy name `lookm`): text prior, summed attention, every dropped entry averaged into the
// kept entry with the most similar key; while decoding, the least-attended entry goes.
enum class ElasticVariant { kProduct, kPaper, kLookM };
ElasticParams ElasticPreset(ElasticVariant v);
const char* ElasticVariantName(ElasticVariant v);  // "product", "paper", "lookm"

struct CacheParams {
  CachePolicy policy = CachePolicy::kElastic;
  double budget = 1.0;   // gamma in (0, 1]; ignored by Full
  int sink_tokens = -1;  // -1: the policy's default (Elastic 1, StreamingLLM 4, H2O 0)
  PositionMode position_mode = PositionMode::kOriginal;
  ElasticVariant elastic_variant = ElasticVariant::kProduct;  // the preset `elastic` started from
  ElasticParams elastic = ElasticPreset(ElasticVariant::kProduct);  // Elastic only
  SnapKvParams snapkv;                                              // SnapKV only
  H2OParams h2o;                                                    // H2O only

  int sinks() const;
  // True when the cache keeps every entry: Full, or any policy at budget 1.
  bool KeepsEverything() const { return policy == CachePolicy::kFull || budget >= 1.0; }
};

// Where the prompt's parts lie, in prompt positions [begin, end). Built from the chat template's
// output (chat_template.h); empty spans when unknown (raw token ids in tests and benchmarks).
struct PromptSegments {
  struct Span {
    int64_t begin = 0, end = 0;
    int64_t size() const { return end - begin; }
  };
  std::vector<Span> images;  // in prompt order
  Span system;               // the system prompt's text, if any
  Span instruction;          // the last user turn's text after its images, " ASSISTANT:" included
  Span question;             // the last user turn's text before its image (the paper's layout)
  // The segment id of every position < length for segment-scoped merging: each image is its own
  // segment, and so is each text run between images (the instruction included).
  std::vector<int> SegmentIds(int64_t length) const;
};

// Parsing by name. Errors name the field ("kv_cache.policy 'x' is unknown (full, ...)").
const char* CachePolicyName(CachePolicy p);  // "full", "elastic", "h2o", "streaming_llm"
StatusOr<CachePolicy> ParseCachePolicy(std::string_view name);
const char* PositionModeName(PositionMode m);  // "original", "compressed"
StatusOr<PositionMode> ParsePositionMode(std::string_view name);
const char* ImportanceModeName(ImportanceMode m);  // "sum", "mean", "instruction", "hybrid"
StatusOr<ImportanceMode> ParseImportanceMode(std::string_view name);
const char* MergeScopeName(MergeScope s);  // "nearest", "segment", "key"
const char* KeyMergeName(KeyMerge m);      // "averaged", "pivotal", "weighted"
StatusOr<KeyMerge> ParseKeyMerge(std::string_view name);
const char* DecodeEvictionName(DecodeEviction e);  // "fixed_point", "scored"
StatusOr<DecodeEviction> ParseDecodeEviction(std::string_view name);
StatusOr<MergeScope> ParseMergeScope(std::string_view name);
StatusOr<ElasticVariant> ParseElasticVariant(std::string_view name);

// A policy with its knobs in one string, for command lines: `name[+option...]`, where an
// option is a preset (`paper`, `product`) or key=value: protect_instruction=0|1,
// protect_system=0|1, importance=sum|mean|instruction, merge_scope=nearest|segment,
// weighted=0|1, evict=fixed_point|scored, merge=0|1, recent=N, sinks=N, tail=N,
// position=original|compressed; for snapkv the presets `paper` and `kvpress`, window=N and
// kernel=N. Options apply in order on top of `base` (whose budget is kept),
// e.g. "elastic+paper+importance=mean". `elastic_drop` and `elastic_mean` are the older ablation
// names (paper + merge=0, paper + importance=mean).
StatusOr<CacheParams> ParseCacheSpec(std::string_view spec, const CacheParams& base = {});

// Checks ranges; errors name the field ("kv_cache.budget must be in (0, 1], got 0").
Status ValidateCacheParams(const CacheParams& params, int64_t max_sink_tokens = 1024);

// ceil(gamma * n), robust to binary rounding (0.2 * 10 is exactly 2).
int64_t CeilBudget(double gamma, int64_t n);
// min(n, max(protected_entries, ceil(gamma * n))): what a compressed cache holds after n tokens.
int64_t EntryTarget(double gamma, int64_t n, int64_t protected_entries);

}  // namespace llava
