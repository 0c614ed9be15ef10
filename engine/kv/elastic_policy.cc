#include "engine/kv/elastic_policy.h"

#include <algorithm>
#include <cmath>

namespace llava {
namespace {

// Marks the span's last positions (< t), at most *room of them, and takes them from *room.
void AddSpan(const PromptSegments::Span& s, int64_t t, int64_t* room, std::vector<bool>* mark) {
  const int64_t begin = std::max<int64_t>(0, s.begin);
  for (int64_t i = std::min(s.end, t) - 1; i >= begin && *room > 0; --i) {
    if (!(*mark)[i]) --*room;
    (*mark)[i] = true;
  }
}

// powers[age] = max(1, age)^exponent for every age up to `max_age`.
void ExtendAgePowers(std::vector<float>* powers, int64_t max_age, float exponent) {
  while (static_cast<int64_t>(powers->size()) <= max_age) {
    const int64_t age = std::max<int64_t>(1, static_cast<int64_t>(powers->size()));
    powers->push_back(std::pow(static_cast<float>(age), exponent));
  }
}

// ScoredVictim with entry i's age given by age_of(i) and ranked scores[i] / powers[age].
// The newest `newest_kept` entries (at least the newest one) and those `spared` marks are never
// chosen.
template <typename AgeOf>
int64_t LowestRanked(const std::vector<bool>& pinned, const std::vector<float>& scores,
                     const std::vector<float>& powers, AgeOf age_of, int64_t newest_kept = 1,
                     const std::vector<bool>* spared = nullptr) {
  const int64_t len = static_cast<int64_t>(pinned.size());
  int64_t victim = -1;
  float lowest = 0.f;
  for (int64_t i = 0; i < len - std::max<int64_t>(1, newest_kept); ++i) {
    if (pinned[i] || (spared != nullptr && (*spared)[i])) continue;
    const float r = scores[i] / powers[std::max<int64_t>(0, age_of(i))];
    if (victim < 0 || r < lowest) {
      victim = i;
      lowest = r;
    }
  }
  return victim;
}

// Invariant after PlanPrompt: every layer's `pinned_` is aligned with its entries.
class ElasticPolicy final : public KvPolicy {
 public:
  ElasticPolicy(const CacheParams& params, const PromptSegments& segments, int num_layers)
      : params_(params),
        segments_(segments),
        sums_(num_layers),
        instruction_sums_(num_layers),
        decode_scores_(num_layers),
        born_(num_layers),
        steps_(num_layers, 0),
        pinned_(num_layers),
        from_image_(num_layers) {
    ExtendAgePowers(&age_powers_, 0, params_.elastic.evict_age_exponent);
  }

  int64_t Target(int64_t n) const override {
    if (!prefilled_) {  // the prompt's merge: pinned positions and the last one
      const std::vector<int64_t> pin = ElasticPinned(params_, segments_, n);
      const bool last_pinned = !pin.empty() && pin.back() == n - 1;
      return EntryTarget(params_.budget, n, static_cast<int64_t>(pin.size()) + !last_pinned);
    }
    return EntryTarget(params_.budget, n, pinned_count_ + 1);  // + the newest entry
  }

  bool WantsScores(bool prefilled) const override { return !prefilled || scored_; }
  int64_t ScoreSplitRow() const override { return segments_.instruction.begin; }
  bool ScoresBeforeSplit() const override { return !instruction_only(); }
  void AddScores(int layer, int64_t first_row, const float* col, int64_t len) override {
    auto add = [&](std::vector<float>& s) {
      s.resize(std::max<int64_t>(len, s.size()), 0.f);
      for (int64_t j = 0; j < len; ++j) s[j] += col[j];
    };
    if (prefilled_) {
      ++steps_[layer];
      ExtendAgePowers(&age_powers_, steps_[layer], params_.elastic.evict_age_exponent);
      return add(decode_scores_[layer]);
    }
    if (!instruction_only()) add(sums_[layer]);
    if (first_row >= segments_.instruction.begin) add(instruction_sums_[layer]);
  }

  MergePlan PlanPrompt(int layer, int64_t len) override {
    sums_[layer].resize(len, 0.f);
    instruction_sums_[layer].resize(len, 0.f);
    const MergePlan plan =
        PlanElasticMerge(ElasticImportance(sums_[layer], instruction_sums_[layer],
                                           params_.elastic.importance, segments_.instruction.begin),
                         params_, segments_);
    if (scored_) {
      decode_scores_[layer].assign(plan.kept.size(), 0.f);
      born_[layer].assign(plan.kept.size(), 0);
    }
    for (auto* s : {&sums_[layer], &instruction_sums_[layer]}) {
      s->clear();  // importance is not used after the merge
      s->shrink_to_fit();
    }
    pinned_[layer] = plan.pinned;
    // The image's kept entries are spared by evict_answer_first; the prompt's text competes.
    from_image_[layer].assign(plan.kept.size(), false);
    for (size_t i = 0; i < plan.kept.size(); ++i) {
      for (const PromptSegments::Span& image : segments_.images) {
        if (plan.kept[i] >= image.begin && plan.kept[i] < image.end) from_image_[layer][i] = true;
      }
    }
    pinned_count_ = std::count(plan.pinned.begin(), plan.pinned.end(), true);
    if (layer == 0) fixed_point_ = ElasticFixedPoint(plan.kept.size(), params_);
    if (layer + 1 == static_cast<int>(pinned_.size())) prefilled_ = true;
    return plan;
  }

  void OnAppend(int layer, int64_t n_new) override {
    pinned_[layer].resize(pinned_[layer].size() + n_new, false);
    from_image_[layer].resize(pinned_[layer].size(), false);  // PlanPrompt marks the image's
    if (scored_) {
      decode_scores_[layer].resize(pinned_[layer].size(), 0.f);
      born_[layer].resize(pinned_[layer].size(), steps_[layer]);
    }
  }
  int64_t Victim(int layer, int64_t len, int64_t target) const override {
    if (scored_) {
      const std::vector<int64_t>& born = born_[layer];
      const int64_t now = steps_[layer];
      if (params_.elastic.evict_answer_first > 0) {
        const int64_t v = LowestRanked(
            pinned_[layer], decode_scores_[layer], age_powers_,
            [&](int64_t i) { return now - born[i]; }, params_.elastic.evict_answer_first,
            &from_image_[layer]);  // the image's entries spared too
        if (v >= 0) return v;
      }
      return LowestRanked(pinned_[layer], decode_scores_[layer], age_powers_,
                          [&](int64_t i) { return now - born[i]; });
    }
    return ElasticVictim(pinned_[layer], fixed_point_);
  }
  DecodeMerge MergeVictim(int layer, int64_t victim) override {
    DecodeMerge m;
    if (!scored_ || !params_.elastic.decode_merge) return m;
    const std::vector<bool>& pin = pinned_[layer];
    std::vector<float>& sc = decode_scores_[layer];
    const int64_t len = static_cast<int64_t>(pin.size());
    // The neighbour (by position) that has received more attention, pinned entries excluded.
    int64_t best = -1;
    for (int64_t j : {victim - 1, victim + 1}) {
      if (j < 0 || j >= len - 1 || pin[j]) continue;
      if (best < 0 || sc[j] > sc[best]) best = j;
    }
    if (best < 0) return m;
    m.into = best;
    m.victim_weight = sc[victim] + 1e-6f;
    m.into_weight = sc[best] + 1e-6f;
    sc[best] += sc[victim];
    return m;
  }

  void OnEvict(int layer, int64_t index) override {
    pinned_[layer].erase(pinned_[layer].begin() + index);
    from_image_[layer].erase(from_image_[layer].begin() + index);
    if (scored_) {
      decode_scores_[layer].erase(decode_scores_[layer].begin() + index);
      born_[layer].erase(born_[layer].begin() + index);
    }
  }

 private:
  // Importance from the instruction's queries alone: the other prompt rows' sums are not needed.
  bool instruction_only() const {
    return params_.elastic.importance == ImportanceMode::kInstruction;
  }

  const CacheParams params_;
  const PromptSegments segments_;
  const bool scored_ = params_.elastic.eviction == DecodeEviction::kScored;
  std::vector<std::vector<float>> sums_;  // per layer [T]: attention column sums (prefill)
  std::vector<std::vector<float>> instruction_sums_;  // ... of the instruction's rows only
  std::vector<std::vector<float>> decode_scores_;     // per layer, aligned: attention received
                                                      // while decoding (kScored only)
  std::vector<std::vector<int64_t>> born_;  // per layer, aligned: steps_ when the entry came
  std::vector<int64_t> steps_;              // per layer: decode steps observed (kScored only)
  std::vector<float> age_powers_;  // [age]: max(1, age)^evict_age_exponent, one pow per step
  std::vector<std::vector<bool>> pinned_;  // per layer, aligned with the entries
  int64_t pinned_count_ = 0;               // pinned entries per layer (the same in every layer)
  std::vector<std::vector<bool>>
      from_image_;           // per layer, aligned: an image entry the prompt's plan kept
  int64_t fixed_point_ = 0;  // N_tl
  bool prefilled_ = false;
};

}  // namespace

std::vector<int64_t> ElasticPinned(const CacheParams& params, const PromptSegments& segments,
                                   int64_t t) {
  std::vector<bool> mark(t, false);
  const int64_t sinks = std::min<int64_t>(params.sinks(), t);
  for (int64_t i = 0; i < sinks; ++i) mark[i] = true;
  const int64_t tail = std::min<int64_t>(params.elastic.protect_tail, t);
  for (int64_t i = t - tail; i < t; ++i) mark[i] = true;
  // The protected spans share half of the budget's entries, in this order and each from its
  // end: a long system prompt must not take the whole budget from the image.
  int64_t room = std::max<int64_t>(0, EntryTarget(params.budget, t, 0) / 2 - sinks);
  if (params.elastic.protect_instruction) {
    AddSpan(segments.instruction, t, &room, &mark);
    AddSpan(segments.question, t, &room, &mark);
  }
  if (params.elastic.protect_system) AddSpan(segments.system, t, &room, &mark);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < t; ++i) {
    if (mark[i]) out.push_back(i);
  }
  return out;
}

std::vector<float> ElasticImportance(const std::vector<float>& sums,
                                     const std::vector<float>& instruction_sums,
                                     ImportanceMode mode, int64_t instruction_begin) {
  const int64_t t = static_cast<int64_t>(sums.size());
  if (mode == ImportanceMode::kSum) return sums;
  // Queries that can see position j: t - j of all; t - max(j, begin) of the instruction's.
  std::vector<float> out(t, 0.f);
  for (int64_t j = 0; j < t; ++j) {
    const float all = sums[j] / static_cast<float>(t - j);
    const float instr = instruction_sums[j] / static_cast<float>(std::max<int64_t>(
                                                  1, t - std::max(j, instruction_begin)));
    out[j] = mode == ImportanceMode::kMean          ? all
             : mode == ImportanceMode::kInstruction ? instr
                                                    : all + instr;
  }
  return out;
}

MergePlan PlanElasticMerge(const std::vector<float>& importance, const CacheParams& params,
                           const PromptSegments& segments) {
  const ElasticParams& e = params.elastic;
  const int64_t t = static_cast<int64_t>(importance.size());
  MergePlan plan;
  plan.bucket.assign(t, -1);
  if (t == 0) return plan;
  std::vector<bool> is_pinned(t, false), is_kept(t, false);
  for (int64_t i : ElasticPinned(params, segments, t)) is_pinned[i] = is_kept[i] = true;
  is_kept[t - 1] = true;
  const int64_t n_protected = std::count(is_kept.begin(), is_kept.end(), true);
  const int64_t k = EntryTarget(params.budget, t, n_protected);

  std::vector<int64_t> candidates;
  for (int64_t i = 0; i < t; ++i) {
    if (!is_kept[i]) candidates.push_back(i);
  }
  const std::vector<int64_t> free_positions = candidates;
  const int64_t n_anchors =
      std::max<int64_t>(0, std::min<int64_t>(k - n_protected, candidates.size()));
  std::vector<bool> is_text(t, true);  // the text prior's groups
  if (e.text_prior) {
    for (const PromptSegments::Span& image : segments.images) {
      for (int64_t i = std::max<int64_t>(0, image.begin); i < std::min(image.end, t); ++i) {
        is_text[i] = false;
      }
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) {
    if (is_text[a] != is_text[b]) return static_cast<bool>(is_text[a]);
    return importance[a] > importance[b];  // stable: ties keep the earlier position first
  });
  std::vector<int64_t> anchors(candidates.begin(), candidates.begin() + n_anchors);
  std::sort(anchors.begin(), anchors.end());
  for (int64_t a : anchors) is_kept[a] = true;

  for (int64_t i = 0; i < t; ++i) {
    if (is_kept[i]) {
      plan.bucket[i] = static_cast<int64_t>(plan.kept.size());
      plan.kept.push_back(i);
      plan.pinned.push_back(is_pinned[i]);
    }
  }
  // Anchors each other position may join: all of them, or those of its own segment.
  const bool scoped = e.merge_scope == MergeScope::kSegment;
  const std::vector<int> seg = scoped ? segments.SegmentIds(t) : std::vector<int>(t, 0);
  std::vector<std::vector<int64_t>> anchors_of(1 + *std::max_element(seg.begin(), seg.end()));
  for (int64_t a : anchors) anchors_of[seg[a]].push_back(a);  // ascending

  for (int64_t i : free_positions) {
    if (is_kept[i]) continue;
    const std::vector<int64_t>& near = anchors_of[seg[i]];
    if (near.empty() || !e.merge) {
      ++plan.dropped;
      continue;
    }
    auto next = std::lower_bound(near.begin(), near.end(), i);
    int64_t best;
    if (next == near.end()) {
      best = near.back();
    } else if (next == near.begin()) {
      best = *next;
    } else {
      const int64_t after = *next, before = *(next - 1);
      best = (i - before <= after - i) ? before : after;
    }
    plan.bucket[i] = plan.bucket[best];
    ++plan.merged;
  }
  plan.merge_keys = e.merge_keys;
  plan.merge_by_key = e.merge_scope == MergeScope::kKey;
  plan.key_merge = e.key_merge;
  if (e.weighted_merge && plan.merged > 0) {
    plan.weight.resize(t);
    for (int64_t i = 0; i < t; ++i) plan.weight[i] = std::max(0.f, importance[i]) + 1e-6f;
  }
  return plan;
}

int64_t ElasticFixedPoint(int64_t merged_length, const CacheParams& params) {
  return std::max<int64_t>(params.sinks(), merged_length - params.elastic.recent_distance + 1);
}

int64_t ElasticVictim(const std::vector<bool>& pinned, int64_t fixed_point) {
  const int64_t len = static_cast<int64_t>(pinned.size());
  for (int64_t i = std::max<int64_t>(0, fixed_point); i < len - 1; ++i) {
    if (!pinned[i]) return i;
  }
  for (int64_t i = std::min(fixed_point, len - 1) - 1; i >= 0; --i) {
    if (!pinned[i]) return i;
  }
  return -1;
}

int64_t ScoredVictim(const std::vector<bool>& pinned, const std::vector<float>& scores,
                     const std::vector<int64_t>& ages, float age_exponent) {
  if (age_exponent == 0.f || ages.empty()) {
    return LowestRanked(pinned, scores, std::vector<float>{1.f}, [](int64_t) { return 0; });
  }
  std::vector<float> powers;
  ExtendAgePowers(&powers, *std::max_element(ages.begin(), ages.end()), age_exponent);
  return LowestRanked(pinned, scores, powers, [&](int64_t i) { return ages[i]; });
}

std::unique_ptr<KvPolicy> NewElasticPolicy(const CacheParams& params,
                                           const PromptSegments& segments, int num_layers) {
  return std::make_unique<ElasticPolicy>(params, segments, num_layers);
}

Status ValidateElasticParams(const CacheParams& p) {
  const float a = p.elastic.evict_age_exponent;
  if (!(a >= 0.f && a <= 2.f)) {  // also refuses NaN
    return InvalidArgument("kv_cache.elastic.evict_age_exponent must be in [0, 2], got " +
                           std::to_string(a));
  }
  if (p.elastic.recent_distance < 1) {
    return InvalidArgument("kv_cache.recent_distance must be >= 1, got " +
                           std::to_string(p.elastic.recent_distance));
  }
  if (p.elastic.protect_tail < 0 || p.elastic.protect_tail > 4096) {
    return InvalidArgument("kv_cache.elastic.protect_tail must be in [0, 4096], got " +
                           std::to_string(p.elastic.protect_tail));
  }
  if (p.elastic.evict_answer_first < 0 || p.elastic.evict_answer_first > 4096) {
    return InvalidArgument("kv_cache.elastic.evict_answer_first must be in [0, 4096], got " +
                           std::to_string(p.elastic.evict_answer_first));
  }
  return Status::Ok();
}

}  // namespace llava
