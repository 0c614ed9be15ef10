#include "engine/serving/request.h"

namespace llava {

std::vector<int> PromptTextIds(const PromptTokens& prompt, int image_token_id) {
  std::vector<int> ids;
  for (int id : prompt.ids) {
    if (id != image_token_id) ids.push_back(id);
  }
  return ids;
}

StatusOr<PreparedRequest> PrepareRequest(const GenerationRequest& req, const LlavaConfig& cfg,
                                         const Tokenizer& tokenizer, const EngineLimits& limits,
                                         int64_t reserve) {
  LLAVA_RETURN_IF_ERROR(ValidateCacheParams(req.kv_cache));
  // Bound the work before doing it: text that cannot fit is refused before it is tokenized.
  const int64_t token_limit =
      limits.max_prompt_tokens > 0 ? limits.max_prompt_tokens : cfg.text.max_position_embeddings;
  int64_t text_bytes = 0;
  for (const ChatMessage& m : req.messages) {
    for (const ContentPart& p : m.content) text_bytes += static_cast<int64_t>(p.text.size());
  }
  if (text_bytes > token_limit * limits.max_text_bytes_per_token) {
    return InvalidArgument("messages: " + std::to_string(text_bytes) +
                           " bytes of text cannot fit a prompt of at most " +
                           std::to_string(token_limit) + " tokens");
  }
  PreparedRequest out;
  out.num_images = static_cast<int>(req.images.size());
  // Images: every cheap check (how many, each one's bytes and header) before any pixel is
  // decoded, then decode and crop before touching the model, so bad input fails fast.
  if (out.num_images > limits.prompt.max_images) {
    return InvalidArgument("the request has " + std::to_string(out.num_images) +
                           " images, more than the limit " +
                           std::to_string(limits.prompt.max_images));
  }
  auto field = [&req](size_t i) {
    return i < req.image_fields.size() ? req.image_fields[i] : "images[" + std::to_string(i) + "]";
  };
  for (size_t i = 0; i < req.images.size(); ++i) {
    LLAVA_RETURN_IF_ERROR(CheckImage(req.images[i], limits.image, field(i)).status());
  }
  for (size_t i = 0; i < req.images.size(); ++i) {
    LLAVA_ASSIGN_OR_RETURN(RgbImage img, DecodeImage(req.images[i], limits.image, field(i)));
    out.images.push_back(CropImage(img, cfg.image_processor));
  }
  LLAVA_ASSIGN_OR_RETURN(out.prompt,
                         BuildPrompt(tokenizer, req.messages, out.num_images, cfg.image_token_index,
                                     cfg.image_tokens(), limits.prompt));
  const int64_t prompt_tokens = static_cast<int64_t>(out.prompt.ids.size());
  for (int offset : out.prompt.image_offsets) {
    out.segments.images.push_back({offset, offset + out.prompt.image_rows});
  }
  out.segments.instruction = {out.prompt.instruction_begin, prompt_tokens};
  if (out.prompt.system_end > 0) out.segments.system = {1, out.prompt.system_end};
  out.segments.question = {out.prompt.question_begin, out.prompt.question_end};
  if (limits.max_prompt_tokens > 0 && prompt_tokens > limits.max_prompt_tokens) {
    return InvalidArgument("messages: the prompt has " + std::to_string(prompt_tokens) +
                           " tokens (image rows included), more than this server's limit of " +
                           std::to_string(limits.max_prompt_tokens));
  }
  const int64_t context = cfg.text.max_position_embeddings;
  if (static_cast<int64_t>(out.prompt.ids.size()) + reserve > context) {
    return InvalidArgument("the prompt (" + std::to_string(out.prompt.ids.size()) +
                           " tokens) plus sampling.max_tokens (" + std::to_string(reserve) +
                           ") exceeds the context length " + std::to_string(context));
  }
  return out;
}

}  // namespace llava
