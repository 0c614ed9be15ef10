#include "engine/serving/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace llava {

Status ValidateSamplingParams(const SamplingParams& p, int max_tokens_limit) {
  if (p.max_tokens < 1 || p.max_tokens > max_tokens_limit) {
    return InvalidArgument("sampling.max_tokens must be in [1, " +
                           std::to_string(max_tokens_limit) + "], got " +
                           std::to_string(p.max_tokens));
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return InvalidArgument("sampling.temperature must be a finite number >= 0, got " +
                           std::to_string(p.temperature));
  }
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) {
    return InvalidArgument("sampling.top_p must be in (0, 1], got " + std::to_string(p.top_p));
  }
  if (p.top_k < 0) {
    return InvalidArgument("sampling.top_k must be >= 0, got " + std::to_string(p.top_k));
  }
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0) {
    return InvalidArgument("sampling.repetition_penalty must be a finite number > 0, got " +
                           std::to_string(p.repetition_penalty));
  }
  if (p.stop.size() > 16) return InvalidArgument("sampling.stop has more than 16 strings");
  for (const auto& s : p.stop) {
    if (s.empty()) return InvalidArgument("sampling.stop contains an empty string");
    if (s.size() > 256) return InvalidArgument("sampling.stop string longer than 256 bytes");
  }
  return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int Sampler::Sample(float* logits, int vocab, const std::vector<int>& history) {
  if (params_.repetition_penalty != 1.f) {
    seen_.assign(vocab, 0);
    for (int id : history) {
      if (id < 0 || id >= vocab || seen_[id]) continue;
      seen_[id] = 1;
      float& l = logits[id];
      l = l > 0 ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    }
  }
  if (params_.temperature == 0.f) {
    return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
  }
  // Candidates sorted by logit, cut by top-k, then softmax with temperature, then top-p.
  order_.resize(vocab);
  std::iota(order_.begin(), order_.end(), 0);
  int k = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  auto by_logit = [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  if (k < vocab) {
    std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), by_logit);
    order_.resize(k);
  } else {
    std::sort(order_.begin(), order_.end(), by_logit);
  }
  const float max_logit = logits[order_[0]];
  std::vector<double> probs(order_.size());
  double sum = 0;
  for (size_t i = 0; i < order_.size(); ++i) {
    probs[i] = std::exp((logits[order_[i]] - max_logit) / params_.temperature);
    sum += probs[i];
  }
  size_t keep = order_.size();
  if (params_.top_p < 1.f) {
    double mass = 0;
    for (size_t i = 0; i < order_.size(); ++i) {
      mass += probs[i] / sum;
      if (mass >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept_sum = 0;
  for (size_t i = 0; i < keep; ++i) kept_sum += probs[i];
  std::uniform_real_distribution<double> uniform(0.0, kept_sum);
  double r = uniform(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= probs[i];
    if (r <= 0) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace llava
