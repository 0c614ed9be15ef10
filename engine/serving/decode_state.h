// One sequence's token-level decoding state: sampling, EOS, detokenisation that never splits
// a UTF-8 character, stop strings, max tokens. Torch-free; shared by the single-request
// Generator and the batching Engine so both decode identically.
#pragma once

#include <string>
#include <vector>

#include "engine/io/tokenizer.h"
#include "engine/serving/sampler.h"
#include "engine/serving/stop_strings.h"

namespace llava {

enum class FinishReason { kStop, kLength, kCancelled, kError };
const char* FinishReasonName(FinishReason r);

class DecodeState {
 public:
  // `history`: the ids the repetition penalty sees (the prompt's text tokens). Sampling
  // params must be valid. `extra_eos` (or -1) ends generation like the tokenizer's EOS.
  DecodeState(const Tokenizer& tokenizer, const SamplingParams& params, std::vector<int> history,
              int extra_eos);

  // Samples the next token from `logits` [vocab] (modified in place) and returns the text that
  // became final. After it, done() tells whether the sequence ended (EOS, stop string, length).
  std::string Step(float* logits, int vocab);
  // Ends the sequence early (cancellation, deadline, error).
  void Abort(FinishReason reason);
  // Text still held back (a partial stop string or UTF-8 character) once the sequence is done;
  // empty after an abort. Call once.
  std::string Flush();

  bool done() const { return done_; }
  FinishReason finish_reason() const { return finish_; }
  // The token the model must be fed next (valid while !done()).
  int last_token() const { return tokens_.empty() ? -1 : tokens_.back(); }
  const std::vector<int>& tokens() const { return tokens_; }
  const std::string& text() const { return text_; }

 private:
  const Tokenizer& tokenizer_;
  SamplingParams params_;
  Sampler sampler_;
  StreamDecoder decoder_;
  StopStringFilter stops_;
  std::vector<int> history_;
  std::vector<int> tokens_;  // generated, EOS excluded
  std::string text_;         // emitted so far
  int extra_eos_;
  bool done_ = false;
  bool aborted_ = false;
  FinishReason finish_ = FinishReason::kLength;
};

}  // namespace llava
