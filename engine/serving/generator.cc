#include "engine/serving/generator.h"

#include <chrono>
#include <cmath>

#include "engine/kernels/cpu_features.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"

namespace llava {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

LoadedModel::~LoadedModel() = default;

std::vector<int> PromptTextIds(const PromptTokens& prompt, int image_token_id) {
  std::vector<int> ids;
  for (int id : prompt.ids) {
    if (id != image_token_id) ids.push_back(id);
  }
  return ids;
}

const LlavaConfig& LoadedModel::config() const { return model->config(); }
KvLayout LoadedModel::kv_layout() const { return model->kv_layout(); }
const ModelOptions& LoadedModel::options() const { return model->options(); }

StatusOr<std::unique_ptr<LoadedModel>> LoadModel(const std::string& dir,
                                                 const ModelOptions& options) {
  auto loaded = std::make_unique<LoadedModel>();
  LLAVA_ASSIGN_OR_RETURN(loaded->tokenizer, Tokenizer::Load(dir + "/tokenizer.model"));
  LLAVA_ASSIGN_OR_RETURN(loaded->model, LlavaModel::Load(dir, options));
  const LlavaConfig& c = loaded->model->config();
  if (loaded->tokenizer->vocab_size() > c.text.vocab_size) {
    return InvalidArgument(
        dir + ": tokenizer has " + std::to_string(loaded->tokenizer->vocab_size()) +
        " tokens but text_config.vocab_size is " + std::to_string(c.text.vocab_size));
  }
  if (c.image_token_index < 0) return InvalidArgument(dir + ": image_token_index is negative");
  return loaded;
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

double AnswerScore::Perplexity() const { return tokens > 0 ? std::exp(nll_sum / tokens) : 0.0; }

StatusOr<PreparedRequest> Generator::Prepare(const GenerationRequest& req, int64_t reserve) const {
  const LlavaConfig& cfg = m_.model->config();
  LLAVA_RETURN_IF_ERROR(ValidateCacheParams(req.kv_cache));
  PreparedRequest out;
  out.num_images = static_cast<int>(req.images.size());
  // Images: decode and preprocess before touching the model, so bad input fails fast.
  for (size_t i = 0; i < req.images.size(); ++i) {
    const std::string field =
        i < req.image_fields.size() ? req.image_fields[i] : "images[" + std::to_string(i) + "]";
    LLAVA_ASSIGN_OR_RETURN(RgbImage img, DecodeImage(req.images[i], limits_.image, field));
    std::vector<float> p = PreprocessImage(img, cfg.image_processor);
    out.pixels.insert(out.pixels.end(), p.begin(), p.end());
  }
  LLAVA_ASSIGN_OR_RETURN(
      out.prompt, BuildPrompt(*m_.tokenizer, req.messages, out.num_images, cfg.image_token_index,
                              cfg.image_tokens(), limits_.prompt));
  const int64_t prompt_tokens = static_cast<int64_t>(out.prompt.ids.size());
  for (int offset : out.prompt.image_offsets) {
    out.segments.images.push_back({offset, offset + out.prompt.image_rows});
  }
  out.segments.instruction = {out.prompt.instruction_begin, prompt_tokens};
  if (out.prompt.system_end > 0) out.segments.system = {1, out.prompt.system_end};
  out.segments.question = {out.prompt.question_begin, out.prompt.question_end};
  if (limits_.max_prompt_tokens > 0 && prompt_tokens > limits_.max_prompt_tokens) {
    return InvalidArgument("messages: the prompt has " + std::to_string(prompt_tokens) +
                           " tokens (image rows included), more than this server's limit of " +
                           std::to_string(limits_.max_prompt_tokens));
  }
  const int64_t context = cfg.text.max_position_embeddings;
  if (static_cast<int64_t>(out.prompt.ids.size()) + reserve > context) {
    return InvalidArgument("the prompt (" + std::to_string(out.prompt.ids.size()) +
                           " tokens) plus sampling.max_tokens (" + std::to_string(reserve) +
                           ") exceeds the context length " + std::to_string(context));
  }
  return out;
}

at::Tensor EmbedPreparedPrompt(const LlavaModel& model, const PreparedRequest& prepared,
                               double* vision_seconds) {
  const int crop = model.config().vision.image_size;
  at::Tensor features;
  if (prepared.num_images > 0) {
    const auto tv = std::chrono::steady_clock::now();
    at::Tensor px = at::from_blob(const_cast<float*>(prepared.pixels.data()),
                                  {prepared.num_images, 3, crop, crop}, at::kFloat);
    features = model.EncodeImages(px);
    if (vision_seconds != nullptr) *vision_seconds = SecondsSince(tv);
  }
  return model.EmbedPrompt(prepared.prompt.ids, prepared.prompt.image_offsets, features);
}

namespace {

// One decode row: `token` at the cache's next position.
SequenceChunk DecodeChunk(const LlavaModel& model, int token, KvCache* cache) {
  SequenceChunk chunk;
  chunk.embeds = model.Embed(at::tensor({static_cast<int64_t>(token)}, at::kLong));
  chunk.start_position = cache->NextPosition();
  chunk.cache = cache;
  return chunk;
}

}  // namespace

at::Tensor Generator::Prefill(const PreparedRequest& prepared, KvCache* cache,
                              double* vision_seconds) const {
  const LlavaModel& model = *m_.model;
  SequenceChunk chunk;
  chunk.embeds = EmbedPreparedPrompt(model, prepared, vision_seconds);
  chunk.start_position = cache->NextPosition();
  chunk.cache = cache;
  return model.Forward({chunk});
}

StatusOr<AnswerScore> Generator::ScoreAnswer(const GenerationRequest& req,
                                             const std::string& answer) {
  const LlavaModel& model = *m_.model;
  const Tokenizer& tok = *m_.tokenizer;
  Tokenizer::EncodeOptions opt;
  opt.dummy_prefix = false;
  opt.parse_special = false;
  std::vector<int> ids = tok.Encode(" " + answer, opt);
  ids.push_back(tok.eos_id());
  LLAVA_ASSIGN_OR_RETURN(PreparedRequest prepared, Prepare(req, static_cast<int64_t>(ids.size())));
  AnswerScore score;
  try {
    std::unique_ptr<KvCache> cache = NewKvCache(model.kv_layout(), req.kv_cache, prepared.segments);
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
  const LlavaModel& model = *m_.model;
  const Tokenizer& tok = *m_.tokenizer;
  const LlavaConfig& cfg = model.config();
  LLAVA_RETURN_IF_ERROR(ValidateSamplingParams(req.sampling, limits_.max_tokens_limit));
  LLAVA_ASSIGN_OR_RETURN(PreparedRequest prepared, Prepare(req, req.sampling.max_tokens));
  const PromptTokens& prompt = prepared.prompt;

  GenerationResult result;
  result.prompt_tokens = static_cast<int>(prompt.ids.size());
  result.image_tokens = static_cast<int>(prompt.image_offsets.size()) * prompt.image_rows;
  try {
    std::unique_ptr<KvCache> cache = NewKvCache(model.kv_layout(), req.kv_cache, prepared.segments);
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
