#include "engine/eval/eval_metrics.h"

#include <algorithm>

namespace llava {
namespace {

std::string Joined(const std::vector<std::string>& tokens) {
  std::string out;
  for (const auto& t : tokens) out += (out.empty() ? "" : " ") + t;
  return out;
}

}  // namespace

std::vector<std::string> RougeTokens(const std::string& text) {
  std::vector<std::string> tokens;
  std::string cur;
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) {
      cur.push_back(static_cast<char>(c));
    } else if (c >= 'A' && c <= 'Z') {
      cur.push_back(static_cast<char>(c - 'A' + 'a'));
    } else if (!cur.empty()) {
      tokens.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) tokens.push_back(std::move(cur));
  return tokens;
}

double RougeL(const std::string& candidate, const std::string& reference) {
  const std::vector<std::string> c = RougeTokens(candidate), r = RougeTokens(reference);
  if (c.empty() && r.empty()) return 1.0;
  if (c.empty() || r.empty()) return 0.0;
  // LCS by dynamic programming over one row.
  std::vector<int> prev(r.size() + 1, 0), cur(r.size() + 1, 0);
  for (size_t i = 1; i <= c.size(); ++i) {
    for (size_t j = 1; j <= r.size(); ++j) {
      cur[j] = c[i - 1] == r[j - 1] ? prev[j - 1] + 1 : std::max(prev[j], cur[j - 1]);
    }
    std::swap(prev, cur);
  }
  const double lcs = prev[r.size()];
  if (lcs == 0) return 0.0;
  const double precision = lcs / c.size(), recall = lcs / r.size();
  return 2 * precision * recall / (precision + recall);
}

bool ExactMatch(const std::string& answer, const std::string& short_answer) {
  const std::string a = Joined(RougeTokens(answer)), s = Joined(RougeTokens(short_answer));
  if (s.empty()) return false;
  return a == s || (a.size() > s.size() && a.compare(0, s.size(), s) == 0 && a[s.size()] == ' ');
}

}  // namespace llava
