// Token sampling over one row of logits. Torch-free.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/io/status.h"

namespace llava {

struct SamplingParams {
  int max_tokens = 256;            // tokens to generate at most, >= 1
  float temperature = 0.f;         // 0 = greedy; otherwise >= 0 and finite
  float top_p = 1.f;               // nucleus mass in (0, 1]
  int top_k = 0;                   // 0 = off
  uint64_t seed = 0;               // RNG seed; same seed + same input = same output
  std::vector<std::string> stop;   // generation ends before any of these strings
  float repetition_penalty = 1.f;  // > 0; 1 = off (HF/CTRL rule: divide positive logits)
  bool ignore_eos = false;         // benchmarks: EOS is masked out, so exactly max_tokens come out
};

// Checks every field; the error names it ("sampling.top_p must be in (0, 1], got 2").
// `max_tokens_limit` bounds max_tokens.
Status ValidateSamplingParams(const SamplingParams& params, int max_tokens_limit);

// Draws tokens for one sequence. Not thread-safe (owns an RNG); one per request.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // Picks a token from `logits` [vocab] (modified in place by penalty / temperature).
  // `history` holds the ids the repetition penalty applies to (prompt text + generated).
  int Sample(float* logits, int vocab, const std::vector<int>& history);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int> order_;  // scratch
  std::vector<uint8_t> seen_;
};

}  // namespace llava
