// A request as the engine takes it, its limits, its result, and its preparation: validation,
// image decoding and preprocessing, the prompt. Torch-free: the one-shot generator and the
// batching engine prepare every request here before the model sees it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/io/chat_template.h"
#include "engine/io/image_io.h"
#include "engine/io/model_config.h"
#include "engine/io/status.h"
#include "engine/io/tokenizer.h"
#include "engine/kv/cache_policy.h"
#include "engine/kv/kv_cache.h"
#include "engine/serving/decode_state.h"
#include "engine/serving/sampler.h"

namespace llava {

struct GenerationRequest {
  std::vector<ChatMessage> messages;
  std::vector<std::string> images;  // encoded image bytes, referenced by ContentPart::image_index
  SamplingParams sampling;
  CacheParams kv_cache;  // default: Elastic at budget 1 (= Full)
  // How errors name each image (the API's field path); "images[i]" when absent.
  std::vector<std::string> image_fields;
};

struct EngineLimits {
  ImageLimits image;
  PromptLimits prompt;
  int max_tokens_limit = 4096;  // upper bound for sampling.max_tokens
  int max_prompt_tokens = 0;    // prompt length limit, image rows included (0: the context)
  // Text bytes per token of the prompt limit, checked before tokenizing: text longer than this
  // cannot fit (no token of our tokenizers is longer), so it is refused without the work.
  int max_text_bytes_per_token = 32;
};

struct GenerationResult {
  std::string text;
  std::vector<int> tokens;  // generated ids (EOS excluded)
  FinishReason finish = FinishReason::kStop;
  int prompt_tokens = 0;  // T, image rows included
  int image_tokens = 0;
  int completion_tokens = 0;
  double vision_seconds = 0, ttft_seconds = 0, total_seconds = 0;
  KvStats kv;
};

// A request checked and turned into model input.
struct PreparedRequest {
  PromptTokens prompt;
  PromptSegments segments;  // the prompt's images, instruction and system prompt
  // Each image resized and cropped, normalised only when the vision tower encodes it: a
  // request keeps 3 bytes per input pixel while it waits and runs (the prompt is encoded again
  // after a preemption), not 12.
  std::vector<CroppedImage> images;
  int num_images = 0;
};

// Checks `request` (cache parameters, images, messages, lengths) and turns it into model input
// for a model of `config` with `tokenizer`; `reserve` tokens must fit after the prompt in the
// context. Errors are INVALID_ARGUMENT naming the request field at fault.
StatusOr<PreparedRequest> PrepareRequest(const GenerationRequest& request,
                                         const LlavaConfig& config, const Tokenizer& tokenizer,
                                         const EngineLimits& limits, int64_t reserve);

// The prompt's text token ids (image rows left out): what the repetition penalty sees.
std::vector<int> PromptTextIds(const PromptTokens& prompt, int image_token_id);

}  // namespace llava
