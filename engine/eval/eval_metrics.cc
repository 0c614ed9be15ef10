#include "engine/eval/eval_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>

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

double Measure(const std::vector<ItemScore>& items, const std::vector<int>& indices,
               QualityMeasure measure) {
  double sum = 0;
  int64_t n = 0;
  for (int i : indices) {
    const ItemScore& it = items[i];
    switch (measure) {
      case QualityMeasure::kAccuracy:
        if (it.has_short) sum += it.score, ++n;
        break;
      case QualityMeasure::kRougeRef:
        if (!it.has_short) sum += it.score, ++n;
        break;
      case QualityMeasure::kReferencePpl:
        sum += it.nll, n += it.tokens;
        break;
    }
  }
  if (n == 0) return std::numeric_limits<double>::quiet_NaN();
  return measure == QualityMeasure::kReferencePpl ? std::exp(sum / n) : sum / n;
}

PairedInterval PairedBootstrap(const std::vector<ItemScore>& a, const std::vector<ItemScore>& b,
                               QualityMeasure measure, int resamples, double level, uint64_t seed) {
  if (a.size() != b.size()) throw std::invalid_argument("PairedBootstrap: unpaired item lists");
  const int n = static_cast<int>(a.size());
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  PairedInterval out;
  out.diff = Measure(a, all, measure) - Measure(b, all, measure);
  if (n == 0 || std::isnan(out.diff)) {
    out.lo = out.hi = out.diff;
    return out;
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(0, n - 1);
  std::vector<double> diffs;
  diffs.reserve(resamples);
  std::vector<int> draw(n);
  for (int r = 0; r < resamples; ++r) {
    for (int& i : draw) i = pick(rng);
    const double d = Measure(a, draw, measure) - Measure(b, draw, measure);
    if (!std::isnan(d)) diffs.push_back(d);
  }
  if (diffs.empty()) {
    out.lo = out.hi = out.diff;
    return out;
  }
  std::sort(diffs.begin(), diffs.end());
  auto quantile = [&](double q) {  // linear interpolation between order statistics
    const double pos = q * (diffs.size() - 1);
    const size_t k = static_cast<size_t>(pos);
    const double f = pos - k;
    return k + 1 < diffs.size() ? diffs[k] * (1 - f) + diffs[k + 1] * f : diffs[k];
  };
  out.lo = quantile((1 - level) / 2);
  out.hi = quantile((1 + level) / 2);
  return out;
}

}  // namespace llava
