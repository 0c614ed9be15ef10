#include "engine/serving/decode_state.h"

#include <limits>

namespace llava {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

DecodeState::DecodeState(const Tokenizer& tokenizer, const SamplingParams& params,
                         std::vector<int> history, int extra_eos)
    : tokenizer_(tokenizer),
      params_(params),
      sampler_(params),
      decoder_(tokenizer),
      stops_(params.stop),
      history_(std::move(history)),
      extra_eos_(extra_eos) {}

std::string DecodeState::Step(float* logits, int vocab) {
  if (done_) return "";
  if (params_.ignore_eos) {
    for (int eos : {tokenizer_.eos_id(), extra_eos_}) {
      if (eos >= 0 && eos < vocab) logits[eos] = -std::numeric_limits<float>::infinity();
    }
  }
  const int id = sampler_.Sample(logits, vocab, history_);
  if (id == tokenizer_.eos_id() || id == extra_eos_) {
    done_ = true;
    finish_ = FinishReason::kStop;
    return "";
  }
  tokens_.push_back(id);
  history_.push_back(id);
  bool stopped = false;
  std::string delta = stops_.Push(decoder_.Push(id), &stopped);
  if (stopped) {
    done_ = true;
    finish_ = FinishReason::kStop;
  } else if (static_cast<int>(tokens_.size()) >= params_.max_tokens) {
    done_ = true;
    finish_ = FinishReason::kLength;
  }
  text_ += delta;
  return delta;
}

void DecodeState::Abort(FinishReason reason) {
  if (done_) return;
  done_ = true;
  finish_ = reason;
  aborted_ = true;
}

std::string DecodeState::Flush() {
  if (aborted_) return "";
  bool stopped = false;
  std::string tail = stops_.Push(decoder_.Flush(), &stopped);
  if (!stopped) tail += stops_.Flush();
  if (stopped) finish_ = FinishReason::kStop;
  text_ += tail;
  return tail;
}

}  // namespace llava
