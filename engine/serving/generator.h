// Loading a model folder and running one request end to end (the command-line tools): Generate
// runs it through the serving engine (engine.h) at batch 1; ScoreAnswer feeds a given answer
// token by token (teacher forcing) for the evaluation's perplexity.
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
#include "engine/serving/model_runner.h"
#include "engine/serving/request.h"

namespace at {
class Tensor;
}

namespace llava {

class LlavaModel;

// A model folder, loaded: weights + tokenizer, checked against each other. The model runner of
// the one-shot generator and of the serving engine.
class LoadedModel final : public ModelRunner {
 public:
  LoadedModel(std::unique_ptr<LlavaModel> model, std::unique_ptr<Tokenizer> tokenizer);
  ~LoadedModel() override;

  const LlavaModel& model() const;
  const ModelOptions& options() const;

  const LlavaConfig& config() const override;
  const Tokenizer& tokenizer() const override { return *tokenizer_; }
  KvLayout kv_layout() const override;
  at::Tensor EmbedPrompt(const PreparedRequest& prepared, double* vision_seconds) const override;
  at::Tensor EmbedTokens(const std::vector<int64_t>& ids) const override;
  at::Tensor Forward(const std::vector<SequenceChunk>& chunks) const override;

 private:
  std::unique_ptr<LlavaModel> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
};
StatusOr<std::unique_ptr<LoadedModel>> LoadModel(const std::string& dir,
                                                 const ModelOptions& options);
// Sets options->dtype from a --dtype name (ResolveDType in cpu_features.h) for the folder `dir`
// on options->device and the active CPU path, with the folder's parameter count (-1 when its
// headers cannot be read: LoadModel then says why). False for an unknown name.
bool ResolveModelDType(const std::string& name, const std::string& dir, ModelOptions* options,
                       std::string* why);
// The intra-op thread count for --threads `requested` (0: auto) and the folder `dir`: the
// folder's parameter count and this machine's cores through AutoThreadCount (runtime.h).
int ResolveModelThreads(int requested, const std::string& dir, std::string* why);

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

class Generator {
 public:
  // Borrows `model`; it must outlive the Generator.
  Generator(const ModelRunner& model, EngineLimits limits) : m_(model), limits_(limits) {}

  // Runs the whole request and returns when it has ended: the serving engine (engine.h) at
  // batch 1 with a KV pool sized for this request, so the tools decode exactly as the server
  // does. `on_text` is called on the calling thread. Errors name the request field at fault;
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

  const ModelRunner& m_;
  EngineLimits limits_;
};

}  // namespace llava
