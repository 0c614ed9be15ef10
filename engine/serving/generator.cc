#include "engine/serving/generator.h"

#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

#include "engine/kernels/cpu_features.h"
#include "engine/kernels/runtime.h"
#include "engine/kv/kv_pool.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "engine/serving/decode_state.h"
#include "engine/serving/engine.h"
#include "engine/serving/scheduler.h"

namespace llava {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

LoadedModel::LoadedModel(std::unique_ptr<LlavaModel> model, std::unique_ptr<Tokenizer> tokenizer)
    : model_(std::move(model)), tokenizer_(std::move(tokenizer)) {}
LoadedModel::~LoadedModel() = default;

const LlavaModel& LoadedModel::model() const { return *model_; }
const LlavaConfig& LoadedModel::config() const { return model_->config(); }
KvLayout LoadedModel::kv_layout() const { return model_->kv_layout(); }
const ModelOptions& LoadedModel::options() const { return model_->options(); }

at::Tensor LoadedModel::EmbedPrompt(const PreparedRequest& prepared, double* vision_seconds) const {
  const int crop = model_->config().vision.image_size;
  at::Tensor features;
  if (prepared.num_images > 0) {
    const auto tv = std::chrono::steady_clock::now();
    // Normalised here, as the tower reads them: the floats live only for this call.
    at::Tensor px = at::empty({prepared.num_images, 3, crop, crop}, at::kFloat);
    for (int i = 0; i < prepared.num_images; ++i) {
      const CroppedImage& image = prepared.images[static_cast<size_t>(i)];
      TORCH_CHECK(image.height == crop && image.width == crop, "image ", i, " is cropped to ",
                  image.height, "x", image.width, ", the vision tower reads ", crop, "x", crop);
      const std::vector<float> p = NormalizeImage(image, model_->config().image_processor);
      std::copy(p.begin(), p.end(), px.data_ptr<float>() + static_cast<int64_t>(i) * p.size());
    }
    features = model_->EncodeImages(px);
    if (vision_seconds != nullptr) *vision_seconds = SecondsSince(tv);
  }
  return model_->EmbedPrompt(prepared.prompt.ids, prepared.prompt.image_offsets, features);
}

at::Tensor LoadedModel::EmbedTokens(const std::vector<int64_t>& ids) const {
  return model_->Embed(at::tensor(ids, at::kLong));
}

at::Tensor LoadedModel::Forward(const std::vector<SequenceChunk>& chunks) const {
  return model_->Forward(chunks).to(at::kCPU).contiguous();
}

StatusOr<std::unique_ptr<LoadedModel>> LoadModel(const std::string& dir,
                                                 const ModelOptions& options) {
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                         Tokenizer::Load(dir + "/tokenizer.model"));
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<LlavaModel> model, LlavaModel::Load(dir, options));
  const LlavaConfig& c = model->config();
  if (tokenizer->vocab_size() > c.text.vocab_size) {
    return InvalidArgument(dir + ": tokenizer has " + std::to_string(tokenizer->vocab_size()) +
                           " tokens but text_config.vocab_size is " +
                           std::to_string(c.text.vocab_size));
  }
  if (c.image_token_index < 0) return InvalidArgument(dir + ": image_token_index is negative");
  return std::make_unique<LoadedModel>(std::move(model), std::move(tokenizer));
}

bool ResolveModelDType(const std::string& name, const std::string& dir, ModelOptions* options,
                       std::string* why) {
  int64_t parameters = -1;
  if (name == "auto") {
    auto counted = CheckpointParameterCount(dir);
    if (counted.ok()) parameters = *counted;
  }
  return ResolveDType(name, options->device, ActiveCpuPath(), parameters, &options->dtype, why);
}

int ResolveModelThreads(int requested, const std::string& dir, std::string* why) {
  int64_t parameters = -1;
  if (requested <= 0) {
    auto counted = CheckpointParameterCount(dir);
    if (counted.ok()) parameters = *counted;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return AutoThreadCount(requested, parameters, cores, why);
}

double AnswerScore::Perplexity() const { return tokens > 0 ? std::exp(nll_sum / tokens) : 0.0; }

namespace {

// The bytes of a KV pool that holds one request: its prompt, or the most entries its policy
// keeps for `new_tokens` more plus the one a decode step appends before evicting.
int64_t RequestPoolBytes(const ModelRunner& model, const PreparedRequest& prepared,
                         const CacheParams& kv, int64_t new_tokens) {
  const KvLayout layout = model.kv_layout();
  const int64_t t = static_cast<int64_t>(prepared.prompt.ids.size());
  const int64_t entries = std::max(t, SteadyEntries(t, new_tokens, kv, prepared.segments) + 1);
  const int64_t pages = (entries + kKvPageRows - 1) / kKvPageRows;
  return pages * kKvPageRows * layout.num_layers * layout.bytes_per_entry();
}

// One pass of `embeds` rows through `cache`: reserve, forward, commit.
at::Tensor RunPass(const ModelRunner& model, const at::Tensor& embeds, KvCache* cache) {
  TORCH_CHECK(cache->Reserve(embeds.size(0)), "the request's KV pool is full");
  SequenceChunk chunk;
  chunk.embeds = embeds;
  chunk.start_position = cache->NextPosition();
  chunk.kv = cache;
  at::Tensor logits = model.Forward({chunk});
  cache->Commit(embeds.size(0), /*prompt_continues=*/false);
  return logits;
}

}  // namespace

at::Tensor Generator::Prefill(const PreparedRequest& prepared, KvCache* cache,
                              double* vision_seconds) const {
  return RunPass(m_, m_.EmbedPrompt(prepared, vision_seconds), cache);
}

StatusOr<AnswerScore> Generator::ScoreAnswer(const GenerationRequest& req,
                                             const std::string& answer) {
  const ModelRunner& model = m_;
  const Tokenizer& tok = m_.tokenizer();
  Tokenizer::EncodeOptions opt;
  opt.dummy_prefix = false;
  opt.parse_special = false;
  std::vector<int> ids = tok.Encode(" " + answer, opt);
  ids.push_back(tok.eos_id());
  LLAVA_ASSIGN_OR_RETURN(
      PreparedRequest prepared,
      PrepareRequest(req, model.config(), tok, limits_, static_cast<int64_t>(ids.size())));
  AnswerScore score;
  try {
    const auto pool = std::make_unique<KvPool>(
        model.kv_layout(),
        RequestPoolBytes(model, prepared, req.kv_cache, static_cast<int64_t>(ids.size())));
    std::unique_ptr<KvCache> cache = NewKvCache(pool.get(), req.kv_cache, prepared.segments);
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor logits = Prefill(prepared, cache.get(), nullptr);
    score.prefill_seconds = SecondsSince(t0);
    t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < ids.size(); ++i) {
      at::Tensor logp = at::log_softmax(logits[0], -1);
      score.nll_sum -= logp[ids[i]].item<double>();
      ++score.tokens;
      if (i + 1 == ids.size()) break;
      logits = RunPass(model, model.EmbedTokens({ids[i]}), cache.get());
    }
    score.decode_seconds = SecondsSince(t0);
    score.kv = cache->Stats();
  } catch (const c10::Error& e) {
    return Internal(std::string("model failure: ") + e.what_without_backtrace());
  }
  return score;
}

namespace {

// The observer of Generate's one request, called on the caller's thread while RunUntilIdle
// runs the loop: text goes to the caller's callback (a false return cancels the request).
class OneShotObserver final : public RequestObserver {
 public:
  OneShotObserver(const TextCallback& on_text, Engine* engine, uint64_t id)
      : on_text_(on_text), engine_(engine), id_(id) {}
  void OnText(const std::string& delta) override {
    if (on_text_ && !on_text_(delta)) engine_->Cancel(id_);
  }
  void OnFinished(const StatusOr<GenerationResult>& result) override { result_ = result; }
  // After RunUntilIdle: the loop has ended the request.
  StatusOr<GenerationResult> Result() const {
    if (!result_) return Internal("the engine went idle before the request ended");
    return *result_;
  }

 private:
  const TextCallback& on_text_;
  Engine* engine_;
  const uint64_t id_;
  std::optional<StatusOr<GenerationResult>> result_;
};

}  // namespace

StatusOr<GenerationResult> Generator::Generate(const GenerationRequest& req,
                                               const TextCallback& on_text) {
  const auto t0 = std::chrono::steady_clock::now();
  LLAVA_RETURN_IF_ERROR(ValidateSamplingParams(req.sampling, limits_.max_tokens_limit));
  LLAVA_ASSIGN_OR_RETURN(
      PreparedRequest prepared,
      PrepareRequest(req, m_.config(), m_.tokenizer(), limits_, req.sampling.max_tokens));
  // The serving engine at batch 1, its pool sized for this request: one decode loop for the
  // server and the command-line tools.
  EngineOptions options;
  options.limits = limits_;
  options.max_batch = 1;
  options.max_queue = 1;
  options.prefill_chunk = 0;
  options.own_thread = false;  // the loop runs here, on the caller's thread
  // The caller's process owns its heap: trimming it after each pass would hand back pages that
  // the next pass (or the caller's own, e.g. llava-eval's scoring) faults in again.
  options.free_heap_max_bytes = 0;
  options.kv_cache_bytes = RequestPoolBytes(m_, prepared, req.kv_cache, req.sampling.max_tokens);
  std::unique_ptr<Engine> engine;
  try {  // (the pool is allocated here)
    engine = std::make_unique<Engine>(m_, options);
  } catch (const c10::Error& e) {
    return Internal(std::string("KV pool: ") + e.what_without_backtrace());
  }
  constexpr uint64_t kId = 1;
  auto observer = std::make_shared<OneShotObserver>(on_text, engine.get(), kId);
  LLAVA_RETURN_IF_ERROR(engine->Submit(kId, req, std::move(prepared), observer));
  engine->RunUntilIdle();
  LLAVA_ASSIGN_OR_RETURN(GenerationResult result, observer->Result());
  result.total_seconds = SecondsSince(t0);
  return result;
}

}  // namespace llava
