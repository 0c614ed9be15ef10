// Loading a model folder and running one request end to end: validate, decode images, build
// the prompt, prefill, decode token by token with sampling, stop strings and EOS, stream text.
// The continuous-batching engine (engine.h) prepares its requests through Generator::Prepare
// and runs the prefill and decode steps itself, for many requests at once.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/io/chat_template.h"
#include "engine/io/image_io.h"
#include "engine/io/model_config.h"
#include "engine/io/status.h"
#include "engine/io/tokenizer.h"
#include "engine/kv/cache_policy.h"
#include "engine/kv/kv_cache.h"
#include "engine/model/model_options.h"
#include "engine/serving/decode_state.h"
#include "engine/serving/sampler.h"

namespace at {
class Tensor;
}

namespace llava {

class LlavaModel;

// A model folder, loaded: weights + tokenizer, checked against each other.
struct LoadedModel {
  std::unique_ptr<LlavaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  ~LoadedModel();
  // The model's facts for callers that do not include its header (the server).
  const LlavaConfig& config() const;
  KvLayout kv_layout() const;
  const ModelOptions& options() const;
};
StatusOr<std::unique_ptr<LoadedModel>> LoadModel(const std::string& dir,
                                                 const ModelOptions& options);
// Sets options->dtype from a --dtype name (ResolveDType in cpu_features.h) for the folder `dir`
// on options->device and the active CPU path, with the folder's parameter count (-1 when its
// headers cannot be read: LoadModel then says why). False for an unknown name.
bool ResolveModelDType(const std::string& name, const std::string& dir, ModelOptions* options,
                       std::string* why);

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

// The prompt's text token ids (image rows left out): what the repetition penalty sees.
std::vector<int> PromptTextIds(const PromptTokens& prompt, int image_token_id);

// Returns false to cancel generation.
using TextCallback = std::function<bool(const std::string& delta)>;

// Teacher-forced score of a reference answer under the request's cache policy.
struct AnswerScore {
  double nll_sum = 0;  // sum of -log p(token) over the answer tokens and the final EOS
  int tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  KvStats kv;  // after the last answer token
  double Perplexity() const;
};

// A request checked and turned into model input.
struct PreparedRequest {
  PromptTokens prompt;
  PromptSegments segments;    // the prompt's images, instruction and system prompt
  std::vector<float> pixels;  // [images, 3, S, S] preprocessed
  int num_images = 0;
};

// The prompt's embeddings [T, D]: the images through the vision tower and the projector,
// spliced into the token embeddings at their image rows. `vision_seconds` (may be null) gets
// the vision tower's time. Both the one-shot generator and the batching engine start a request
// here.
at::Tensor EmbedPreparedPrompt(const LlavaModel& model, const PreparedRequest& prepared,
                               double* vision_seconds);

class Generator {
 public:
  // Borrows `loaded`; it must outlive the Generator.
  Generator(const LoadedModel& loaded, EngineLimits limits) : m_(loaded), limits_(limits) {}

  // Runs the whole request on the calling thread. Errors name the request field at fault;
  // model failures (c10::Error) come back as INTERNAL, never as exceptions.
  StatusOr<GenerationResult> Generate(const GenerationRequest& request,
                                      const TextCallback& on_text);

  // Prefills the prompt (compressed by request.kv_cache), then feeds `answer` token by token
  // as decode steps with the policy active, summing the negative log-likelihood of each answer
  // token and of the closing EOS: the paper's PPL protocol.
  StatusOr<AnswerScore> ScoreAnswer(const GenerationRequest& request, const std::string& answer);

  // Validation, image decoding and prompt building; `reserve` tokens must fit after the
  // prompt in the context.
  StatusOr<PreparedRequest> Prepare(const GenerationRequest& request, int64_t reserve) const;

 private:
  // Vision encoder + prefill into `cache`; returns the last row's logits [1, V] (fp32).
  at::Tensor Prefill(const PreparedRequest& prepared, KvCache* cache, double* vision_seconds) const;

  const LoadedModel& m_;
  EngineLimits limits_;
};

}  // namespace llava
