#include "engine/serving/generator.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "engine/kernels/cpu_features.h"
#include "engine/kernels/runtime.h"
#include "engine/kv/kv_pool.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "engine/serving/decode_state.h"
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
    at::Tensor px = at::from_blob(const_cast<float*>(prepared.pixels.data()),
                                  {prepared.num_images, 3, crop, crop}, at::kFloat);
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

// A pool that holds one request: its prompt, or the most entries its policy keeps for
// `new_tokens` more plus the one a decode step appends before evicting.
std::unique_ptr<KvPool> RequestPool(const ModelRunner& model, const PreparedRequest& prepared,
                                    const CacheParams& kv, int64_t new_tokens) {
  const KvLayout layout = model.kv_layout();
  const int64_t t = static_cast<int64_t>(prepared.prompt.ids.size());
  const int64_t entries = std::max(t, SteadyEntries(t, new_tokens, kv, prepared.segments) + 1);
  const int64_t pages = (entries + kKvPageRows - 1) / kKvPageRows;
  return std::make_unique<KvPool>(
      layout, pages * kKvPageRows * layout.num_layers * layout.bytes_per_entry());
}

// One decode row: `token` at the cache's next position, its page reserved.
SequenceChunk DecodeChunk(const ModelRunner& model, int token, KvCache* cache) {
  TORCH_CHECK(cache->Reserve(1), "the request's KV pool is full");
  SequenceChunk chunk;
  chunk.embeds = model.EmbedTokens({token});
  chunk.start_position = cache->NextPosition();
  chunk.cache = cache;
  return chunk;
}

}  // namespace

at::Tensor Generator::Prefill(const PreparedRequest& prepared, KvCache* cache,
                              double* vision_seconds) const {
  SequenceChunk chunk;
  chunk.embeds = m_.EmbedPrompt(prepared, vision_seconds);
  TORCH_CHECK(cache->Reserve(chunk.embeds.size(0)), "the request's KV pool is full");
  chunk.start_position = cache->NextPosition();
  chunk.cache = cache;
  return m_.Forward({chunk});
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
    const std::unique_ptr<KvPool> pool =
        RequestPool(model, prepared, req.kv_cache, static_cast<int64_t>(ids.size()));
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
      logits = model.Forward({DecodeChunk(model, ids[i], cache.get())});
    }
    score.decode_seconds = SecondsSince(t0);
    score.kv = cache->Stats();
  } catch (const c10::Error& e) {
    return Internal(std::string("model failure: ") + e.what_without_backtrace());
  }
  return score;
}

StatusOr<GenerationResult> Generator::Generate(const GenerationRequest& req,
                                               const TextCallback& on_text) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelRunner& model = m_;
  const Tokenizer& tok = m_.tokenizer();
  const LlavaConfig& cfg = model.config();
  LLAVA_RETURN_IF_ERROR(ValidateSamplingParams(req.sampling, limits_.max_tokens_limit));
  LLAVA_ASSIGN_OR_RETURN(PreparedRequest prepared, PrepareRequest(req, model.config(), tok, limits_,
                                                                  req.sampling.max_tokens));
  const PromptTokens& prompt = prepared.prompt;

  GenerationResult result;
  result.prompt_tokens = static_cast<int>(prompt.ids.size());
  result.image_tokens = static_cast<int>(prompt.image_offsets.size()) * prompt.image_rows;
  try {
    const std::unique_ptr<KvPool> pool =
        RequestPool(model, prepared, req.kv_cache, req.sampling.max_tokens);
    std::unique_ptr<KvCache> cache = NewKvCache(pool.get(), req.kv_cache, prepared.segments);
    at::Tensor logits = Prefill(prepared, cache.get(), &result.vision_seconds);
    DecodeState state(tok, req.sampling, PromptTextIds(prompt, cfg.image_token_index),
                      cfg.text.eos_token_id);
    for (bool first = true;; first = false) {
      at::Tensor row = logits[0].contiguous();
      const std::string delta = state.Step(row.data_ptr<float>(), static_cast<int>(row.size(0)));
      if (first) result.ttft_seconds = SecondsSince(t0);
      if (!delta.empty() && on_text && !on_text(delta)) state.Abort(FinishReason::kCancelled);
      if (state.done()) break;
      logits = model.Forward({DecodeChunk(model, state.last_token(), cache.get())});
    }
    const std::string tail = state.Flush();
    if (!tail.empty() && on_text) on_text(tail);
    result.text = state.text();
    result.tokens = state.tokens();
    result.finish = state.finish_reason();
    result.completion_tokens = static_cast<int>(result.tokens.size());
    result.kv = cache->Stats();
  } catch (const c10::Error& e) {
    return Internal(std::string("model failure: ") + e.what_without_backtrace());
  }
  result.total_seconds = SecondsSince(t0);
  return result;
}

}  // namespace llava
