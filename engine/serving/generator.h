// Loading a model folder and running one request end to end: validate, decode images, build
// the prompt, prefill, decode token by token with sampling, stop strings and EOS, stream text.
// The request types and their preparation are in request.h, shared with the continuous-batching
// engine (engine.h), which runs the prefill and decode steps itself for many requests at once.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/status.h"
#include "engine/io/tokenizer.h"
#include "engine/kv/kv_cache.h"
#include "engine/model/model_options.h"
#include "engine/serving/request.h"

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

 private:
  // Vision encoder + prefill into `cache`; returns the last row's logits [1, V] (fp32).
  at::Tensor Prefill(const PreparedRequest& prepared, KvCache* cache, double* vision_seconds) const;

  const LoadedModel& m_;
  EngineLimits limits_;
};

}  // namespace llava
