#include "engine/generator.h"

#include <chrono>

#include "engine/llava_model.h"
#include "engine/stop_strings.h"

namespace llava {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

LoadedModel::~LoadedModel() = default;

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

StatusOr<GenerationResult> Generator::Generate(const GenerationRequest& req,
                                               const TextCallback& on_text) {
  const auto t0 = std::chrono::steady_clock::now();
  const LlavaModel& model = *m_.model;
  const Tokenizer& tok = *m_.tokenizer;
  const LlavaConfig& cfg = model.config();
  LLAVA_RETURN_IF_ERROR(ValidateSamplingParams(req.sampling, limits_.max_tokens_limit));

  // Images: decode and preprocess before touching the model, so bad input fails fast.
  std::vector<float> pixels;
  const int crop = cfg.vision.image_size;
  for (size_t i = 0; i < req.images.size(); ++i) {
    LLAVA_ASSIGN_OR_RETURN(RgbImage img, DecodeImage(req.images[i], limits_.image,
                                                     "images[" + std::to_string(i) + "]"));
    std::vector<float> p = PreprocessImage(img, cfg.image_processor);
    pixels.insert(pixels.end(), p.begin(), p.end());
  }
  LLAVA_ASSIGN_OR_RETURN(PromptTokens prompt,
                         BuildPrompt(tok, req.messages, static_cast<int>(req.images.size()),
                                     cfg.image_token_index, cfg.image_tokens(), limits_.prompt));
  const int64_t context = cfg.text.max_position_embeddings;
  if (static_cast<int64_t>(prompt.ids.size()) + req.sampling.max_tokens > context) {
    return InvalidArgument("the prompt (" + std::to_string(prompt.ids.size()) +
                           " tokens) plus sampling.max_tokens (" +
                           std::to_string(req.sampling.max_tokens) +
                           ") exceeds the context length " + std::to_string(context));
  }

  GenerationResult result;
  result.prompt_tokens = static_cast<int>(prompt.ids.size());
  result.image_tokens = static_cast<int>(prompt.image_offsets.size()) * prompt.image_rows;
  try {
    at::Tensor features;
    if (!req.images.empty()) {
      const auto tv = std::chrono::steady_clock::now();
      at::Tensor px = at::from_blob(
          pixels.data(), {static_cast<int64_t>(req.images.size()), 3, crop, crop}, at::kFloat);
      features = model.EncodeImages(px);
      result.vision_seconds = SecondsSince(tv);
    }
    std::unique_ptr<KvCache> cache = model.NewFullCache();
    SequenceChunk chunk;
    chunk.embeds = model.EmbedPrompt(prompt.ids, prompt.image_offsets, features);
    chunk.start_position = cache->NextPosition();
    chunk.cache = cache.get();
    at::Tensor logits = model.Forward({chunk});  // [1, V]

    // Repetition penalty applies to the prompt's text tokens and everything generated.
    std::vector<int> history;
    for (int id : prompt.ids) {
      if (id != cfg.image_token_index) history.push_back(id);
    }
    Sampler sampler(req.sampling);
    StreamDecoder decoder(tok);
    StopStringFilter stops(req.sampling.stop);
    const int eos = tok.eos_id();
    result.finish = FinishReason::kLength;
    for (int step = 0; step < req.sampling.max_tokens; ++step) {
      at::Tensor row = logits[0].contiguous();
      const int id = sampler.Sample(row.data_ptr<float>(), static_cast<int>(row.size(0)), history);
      if (step == 0) result.ttft_seconds = SecondsSince(t0);
      if (id == eos || id == cfg.text.eos_token_id) {
        result.finish = FinishReason::kStop;
        break;
      }
      result.tokens.push_back(id);
      history.push_back(id);
      bool stopped = false;
      std::string delta = stops.Push(decoder.Push(id), &stopped);
      result.text += delta;
      if (!delta.empty() && on_text && !on_text(delta)) {
        result.finish = FinishReason::kCancelled;
        break;
      }
      if (stopped) {
        result.finish = FinishReason::kStop;
        break;
      }
      if (step + 1 == req.sampling.max_tokens) break;
      chunk.embeds = model.Embed(at::tensor({static_cast<int64_t>(id)}, at::kLong));
      chunk.start_position = cache->NextPosition();
      logits = model.Forward({chunk});
    }
    if (result.finish != FinishReason::kCancelled) {
      bool stopped = false;
      std::string tail = stops.Push(decoder.Flush(), &stopped);
      if (!stopped) tail += stops.Flush();
      result.text += tail;
      if (!tail.empty() && on_text) on_text(tail);
    }
    result.completion_tokens = static_cast<int>(result.tokens.size());
    result.kv = cache->Stats();
  } catch (const c10::Error& e) {
    return Internal(std::string("model failure: ") + e.what_without_backtrace());
  }
  result.total_seconds = SecondsSince(t0);
  return result;
}

}  // namespace llava
