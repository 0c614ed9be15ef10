#include "engine/kv/cache_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "engine/kv/kv_policy.h"

namespace llava {
namespace {

template <typename E, size_t N>
StatusOr<E> ParseEnum(std::string_view name, const char* field, const E (&values)[N],
                      const char* (*to_name)(E)) {
  std::string known;
  for (E v : values) {
    if (name == to_name(v)) return v;
    known += (known.empty() ? "" : ", ") + std::string(to_name(v));
  }
  return InvalidArgument(std::string(field) + " '" + std::string(name) + "' is unknown (" + known +
                         ")");
}

}  // namespace

ElasticParams ElasticPreset(ElasticVariant v) {
  ElasticParams p;
  if (v == ElasticVariant::kPaper) return p;
  if (v == ElasticVariant::kLookM) {
    // LOOK-M (arXiv 2406.18139) with its averaged merging: text entries first, then image
    // entries by the attention every prompt query gave them; each dropped entry's key and value
    // averaged (plain mean) into the kept entry with the most similar key. LOOK-M compresses
    // once and lets the answer grow; at equal bytes the answer's entries are evicted as H2O
    // does (the least decode attention; docs/POLICIES.md, "LOOK-M"). Its pivotal and weighted
    // merges: `lookm+key_merge=pivotal` and `=weighted`.
    p.text_prior = true;
    p.importance = ImportanceMode::kSum;
    p.merge_scope = MergeScope::kKey;
    p.eviction = DecodeEviction::kScored;
    return p;
  }
  // The product default (docs/POLICIES.md, "Elastic Cache (default)"). Nothing but the sink is
  // pinned: the instruction's entries compete with the image's for anchors (pinned, they took
  // a third of the budget at 0.2 and cost descriptions 0.18 of ROUGE-L, image first), and
  // anchors are chosen by the attention of the instruction's queries plus the mean attention of
  // every query, which keeps the image's whole layout for long answers ("Long answers").
  p.protect_instruction = false;
  p.protect_system = false;
  p.importance = ImportanceMode::kHybrid;
  p.merge_scope = MergeScope::kSegment;
  p.weighted_merge = true;
  p.merge_keys = false;
  p.eviction = DecodeEviction::kScored;
  p.evict_age_exponent = 0.1f;
  // Long answers: the answer's own entries (but its newest 4) go before the image's anchors,
  // and a victim's value joins its more attended neighbour (docs/POLICIES.md, "Long answers").
  p.evict_answer_first = 4;
  p.decode_merge = true;
  // The prompt's last 4 entries (the question's last words and " ASSISTANT:") kept verbatim:
  // without them 31 of 500 descriptions at 0.3 fell into a loop after their first words ("There
  // are 6 objects6 objects..."), with them 6 (docs/POLICIES.md, "The prompt's tail").
  p.protect_tail = 4;
  return p;
}

const char* ElasticVariantName(ElasticVariant v) {
  switch (v) {
    case ElasticVariant::kProduct:
      return "product";
    case ElasticVariant::kPaper:
      return "paper";
    case ElasticVariant::kLookM:
      return "lookm";
  }
  return "?";
}

StatusOr<ElasticVariant> ParseElasticVariant(std::string_view name) {
  static constexpr ElasticVariant kAll[] = {ElasticVariant::kProduct, ElasticVariant::kPaper,
                                            ElasticVariant::kLookM};
  return ParseEnum(name, "kv_cache.elastic.variant", kAll, ElasticVariantName);
}

int CacheParams::sinks() const {
  return sink_tokens >= 0 ? sink_tokens : KvPolicyInfoOf(policy).default_sinks;
}

std::vector<int> PromptSegments::SegmentIds(int64_t length) const {
  std::vector<int> ids(length, 0);
  int next = 0;
  int64_t at = 0;
  for (const Span& img : images) {
    const int64_t b = std::min(img.begin, length), e = std::min(img.end, length);
    if (at < b) {
      std::fill(ids.begin() + at, ids.begin() + b, next);
      ++next;
    }
    std::fill(ids.begin() + b, ids.begin() + e, next);
    ++next;
    at = e;
  }
  std::fill(ids.begin() + std::min(at, length), ids.end(), next);
  return ids;
}

const char* CachePolicyName(CachePolicy p) { return KvPolicyInfoOf(p).name; }

StatusOr<CachePolicy> ParseCachePolicy(std::string_view name) {
  std::string known;
  for (const KvPolicyInfo& info : KvPolicyRegistry()) {
    if (name == info.name) return info.id;
    for (const char* alias : info.aliases) {
      if (alias != nullptr && name == alias) return info.id;
    }
    known += (known.empty() ? "" : ", ") + std::string(info.name);
  }
  return InvalidArgument("kv_cache.policy '" + std::string(name) + "' is unknown (" + known + ")");
}

const char* PositionModeName(PositionMode m) {
  return m == PositionMode::kOriginal ? "original" : "compressed";
}

StatusOr<PositionMode> ParsePositionMode(std::string_view name) {
  static constexpr PositionMode kAll[] = {PositionMode::kOriginal, PositionMode::kCompressed};
  return ParseEnum(name, "kv_cache.position_mode", kAll, PositionModeName);
}

const char* ImportanceModeName(ImportanceMode m) {
  switch (m) {
    case ImportanceMode::kSum:
      return "sum";
    case ImportanceMode::kMean:
      return "mean";
    case ImportanceMode::kInstruction:
      return "instruction";
    case ImportanceMode::kHybrid:
      return "hybrid";
  }
  return "?";
}

StatusOr<ImportanceMode> ParseImportanceMode(std::string_view name) {
  static constexpr ImportanceMode kAll[] = {ImportanceMode::kSum, ImportanceMode::kMean,
                                            ImportanceMode::kInstruction, ImportanceMode::kHybrid};
  return ParseEnum(name, "kv_cache.elastic.importance", kAll, ImportanceModeName);
}

const char* MergeScopeName(MergeScope s) {
  switch (s) {
    case MergeScope::kNearest:
      return "nearest";
    case MergeScope::kSegment:
      return "segment";
    case MergeScope::kKey:
      return "key";
  }
  return "?";
}

StatusOr<MergeScope> ParseMergeScope(std::string_view name) {
  static constexpr MergeScope kAll[] = {MergeScope::kNearest, MergeScope::kSegment,
                                        MergeScope::kKey};
  return ParseEnum(name, "kv_cache.elastic.merge_scope", kAll, MergeScopeName);
}

const char* KeyMergeName(KeyMerge m) {
  switch (m) {
    case KeyMerge::kAveraged:
      return "averaged";
    case KeyMerge::kPivotal:
      return "pivotal";
    case KeyMerge::kWeighted:
      return "weighted";
  }
  return "?";
}

StatusOr<KeyMerge> ParseKeyMerge(std::string_view name) {
  static constexpr KeyMerge kAll[] = {KeyMerge::kAveraged, KeyMerge::kPivotal, KeyMerge::kWeighted};
  return ParseEnum(name, "kv_cache.elastic.key_merge", kAll, KeyMergeName);
}

StatusOr<CacheParams> ParseCacheSpec(std::string_view spec, const CacheParams& base) {
  if (spec == "elastic_drop") return ParseCacheSpec("elastic+paper+merge=0", base);
  if (spec == "elastic_mean") return ParseCacheSpec("elastic+paper+importance=mean", base);
  // LOOK-M is a preset of Elastic's knobs; `lookm+x=y` takes Elastic's options on top.
  if (spec == "lookm" || spec.substr(0, 6) == "lookm+") {
    return ParseCacheSpec("elastic+lookm" + std::string(spec.substr(5)), base);
  }
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t plus = spec.find('+', at);
    parts.emplace_back(spec.substr(at, plus == std::string_view::npos ? plus : plus - at));
    if (plus == std::string_view::npos) break;
    at = plus + 1;
  }
  CacheParams p = base;
  LLAVA_ASSIGN_OR_RETURN(p.policy, ParseCachePolicy(parts[0]));
  auto flag = [](const std::string& key, const std::string& v) -> StatusOr<bool> {
    if (v == "1" || v == "true") return true;
    if (v == "0" || v == "false") return false;
    return InvalidArgument("kv_cache option " + key + " must be 0 or 1, got '" + v + "'");
  };
  auto number = [](const std::string& key, const std::string& v) -> StatusOr<int> {
    char* end = nullptr;
    const long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < -1 || x > 1 << 20) {
      return InvalidArgument("kv_cache option " + key + " must be an integer, got '" + v + "'");
    }
    return static_cast<int>(x);
  };
  ElasticParams& e = p.elastic;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& opt = parts[i];
    const size_t eq = opt.find('=');
    if (eq == std::string::npos && p.policy == CachePolicy::kSnapKV) {
      if (opt == "paper") {
        p.snapkv = SnapKvParams();
      } else if (opt == "kvpress") {
        p.snapkv = SnapKvParams{64, 5};
      } else {
        return InvalidArgument("kv_cache.snapkv preset '" + opt + "' is unknown (paper, kvpress)");
      }
      continue;
    }
    if (eq == std::string::npos && p.policy == CachePolicy::kH2O) {
      if (opt != "paper") {
        return InvalidArgument("kv_cache.h2o preset '" + opt + "' is unknown (paper)");
      }
      p.h2o = H2OParams{false, true};
      if (p.sink_tokens < 0) p.sink_tokens = 1;
      continue;
    }
    if (eq == std::string::npos) {
      LLAVA_ASSIGN_OR_RETURN(p.elastic_variant, ParseElasticVariant(opt));
      e = ElasticPreset(p.elastic_variant);
      continue;
    }
    const std::string key = opt.substr(0, eq), v = opt.substr(eq + 1);
    if (key == "protect_instruction") {
      LLAVA_ASSIGN_OR_RETURN(e.protect_instruction, flag(key, v));
    } else if (key == "protect_system") {
      LLAVA_ASSIGN_OR_RETURN(e.protect_system, flag(key, v));
    } else if (key == "importance") {
      LLAVA_ASSIGN_OR_RETURN(e.importance, ParseImportanceMode(v));
    } else if (key == "merge_scope") {
      LLAVA_ASSIGN_OR_RETURN(e.merge_scope, ParseMergeScope(v));
    } else if (key == "key_merge") {
      LLAVA_ASSIGN_OR_RETURN(e.key_merge, ParseKeyMerge(v));
    } else if (key == "merge_keys") {
      LLAVA_ASSIGN_OR_RETURN(e.merge_keys, flag(key, v));
    } else if (key == "weighted") {
      LLAVA_ASSIGN_OR_RETURN(e.weighted_merge, flag(key, v));
    } else if (key == "evict") {
      LLAVA_ASSIGN_OR_RETURN(e.eviction, ParseDecodeEviction(v));
    } else if (key == "age_exp") {
      char* end = nullptr;
      e.evict_age_exponent = std::strtof(v.c_str(), &end);
      if (v.empty() || *end != '\0') {
        return InvalidArgument("kv_cache option age_exp must be a number, got '" + v + "'");
      }
    } else if (key == "text_prior") {
      LLAVA_ASSIGN_OR_RETURN(e.text_prior, flag(key, v));
    } else if (key == "merge") {
      LLAVA_ASSIGN_OR_RETURN(e.merge, flag(key, v));
    } else if (key == "tail") {
      LLAVA_ASSIGN_OR_RETURN(e.protect_tail, number(key, v));
    } else if (key == "answer_first") {
      LLAVA_ASSIGN_OR_RETURN(e.evict_answer_first, number(key, v));
    } else if (key == "decode_merge") {
      LLAVA_ASSIGN_OR_RETURN(e.decode_merge, flag(key, v));
    } else if (key == "recent") {
      LLAVA_ASSIGN_OR_RETURN(e.recent_distance, number(key, v));
    } else if (key == "window") {
      LLAVA_ASSIGN_OR_RETURN(p.snapkv.window, number(key, v));
    } else if (key == "kernel") {
      LLAVA_ASSIGN_OR_RETURN(p.snapkv.kernel, number(key, v));
    } else if (key == "sinks") {
      LLAVA_ASSIGN_OR_RETURN(p.sink_tokens, number(key, v));
    } else if (key == "position") {
      LLAVA_ASSIGN_OR_RETURN(p.position_mode, ParsePositionMode(v));
    } else {
      return InvalidArgument("kv_cache option '" + key + "' is unknown in '" + std::string(spec) +
                             "'");
    }
  }
  LLAVA_RETURN_IF_ERROR(ValidateCacheParams(p));
  return p;
}

const char* DecodeEvictionName(DecodeEviction e) {
  switch (e) {
    case DecodeEviction::kFixedPoint:
      return "fixed_point";
    case DecodeEviction::kScored:
      return "scored";
  }
  return "?";
}

StatusOr<DecodeEviction> ParseDecodeEviction(std::string_view name) {
  static constexpr DecodeEviction kAll[] = {DecodeEviction::kFixedPoint, DecodeEviction::kScored};
  return ParseEnum(name, "kv_cache.elastic.eviction", kAll, DecodeEvictionName);
}

Status ValidateCacheParams(const CacheParams& p, int64_t max_sink_tokens) {
  if (!(p.budget > 0.0 && p.budget <= 1.0)) {  // also rejects NaN
    return InvalidArgument("kv_cache.budget must be in (0, 1], got " + std::to_string(p.budget));
  }
  if (p.sink_tokens < -1 || p.sink_tokens > max_sink_tokens) {
    return InvalidArgument("kv_cache.sink_tokens must be in [0, " +
                           std::to_string(max_sink_tokens) + "], got " +
                           std::to_string(p.sink_tokens));
  }
  return KvPolicyInfoOf(p.policy).validate(p);
}

int64_t CeilBudget(double gamma, int64_t n) {
  const double x = gamma * static_cast<double>(n);
  const double r = std::round(x);
  if (std::abs(x - r) < 1e-9 * std::max(1.0, x)) return static_cast<int64_t>(r);
  return static_cast<int64_t>(std::ceil(x));
}

int64_t EntryTarget(double gamma, int64_t n, int64_t protected_entries) {
  return std::min(n, std::max(protected_entries, CeilBudget(gamma, n)));
}

}  // namespace llava
