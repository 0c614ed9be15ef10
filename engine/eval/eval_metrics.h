// Text metrics of the quality evaluator (llava-eval). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace llava {

// rouge_score's default tokenisation: lowercase, every character outside [a-z0-9] is a
// separator (non-ASCII included).
std::vector<std::string> RougeTokens(const std::string& text);

// ROUGE-L F1 (beta = 1) from the longest common subsequence of the token lists; 1 when both
// are empty, 0 when exactly one is.
double RougeL(const std::string& candidate, const std::string& reference);

// Short-answer match: the normalised answer (RougeTokens joined by spaces) equals the
// normalised short answer or starts with it as whole words ("Red." matches "red"; "reddish"
// does not).
bool ExactMatch(const std::string& answer, const std::string& short_answer);

// One item's scores under one policy: exact match where the item has a short answer, ROUGE-L
// against the reference where it has none (a description), and the reference answer's summed
// negative log-likelihood over `tokens` teacher-forced tokens.
struct ItemScore {
  bool has_short = false;
  double score = 0;  // 0/1 match, or ROUGE-L against the reference
  double nll = 0;
  int64_t tokens = 0;
};

// The three quality measures over a set of items: accuracy over those with a short answer,
// perplexity of the reference answers (exp of the summed nll over the summed tokens) and
// ROUGE-L over the descriptions. NaN where the set has no item of the kind (or no token).
enum class QualityMeasure { kAccuracy, kReferencePpl, kRougeRef };
double Measure(const std::vector<ItemScore>& items, const std::vector<int>& indices,
               QualityMeasure measure);

// measure(a) - measure(b) over the same items, with a paired bootstrap interval: `resamples`
// draws of the item indices with replacement (the same draw for a and b), the interval's ends
// the (1 - level) / 2 and (1 + level) / 2 quantiles of the draws' differences (draws where
// either measure is NaN are skipped). Deterministic for a given seed. "a beats b" means the
// interval lies above zero (below for PPL, where lower is better).
struct PairedInterval {
  double diff = 0, lo = 0, hi = 0;
  bool Excludes0() const { return lo > 0 || hi < 0; }
};
PairedInterval PairedBootstrap(const std::vector<ItemScore>& a, const std::vector<ItemScore>& b,
                               QualityMeasure measure, int resamples = 1000, double level = 0.95,
                               uint64_t seed = 1);

}  // namespace llava
