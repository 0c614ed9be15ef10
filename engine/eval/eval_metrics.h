// Text metrics of the quality evaluator (llava-eval). Torch-free.
#pragma once

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

}  // namespace llava
