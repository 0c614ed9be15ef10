// The LLaVA-1.5 conversation template and prompt tokenization. Torch-free.
//
//   [system + " "] "USER: " <image>"\n" ... text " ASSISTANT:" [" " answer "</s>" "USER: " ...]
//
// A user turn's parts keep their order: a question before its image gives the paper's layout,
// "USER: " text "\n" <image> "\n" " ASSISTANT:".
//
// Each <image> expands to `image_tokens` copies of the image token id; the model replaces those
// rows with the image's projected features.
#pragma once

#include <string>
#include <vector>

#include "engine/io/status.h"
#include "engine/io/tokenizer.h"

namespace llava {

struct ContentPart {
  enum class Kind { kText, kImage };
  Kind kind = Kind::kText;
  std::string text;     // kText
  int image_index = 0;  // kImage: index into the request's image list
};

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::vector<ContentPart> content;
};

struct PromptTokens {
  std::vector<int> ids;            // [T]; image rows hold the image token id
  std::vector<int> image_offsets;  // start of each image's rows in `ids`, in image-list order
  int image_rows = 0;              // rows per image
  int text_tokens = 0;             // T minus image rows
  // The instruction: [instruction_begin, T), the text after the last image or end-of-turn
  // marker (the last user turn's question and " ASSISTANT:"). KV policies may protect it.
  int instruction_begin = 0;
  // The system prompt: [1, system_end), counted as its text tokenized alone (0: none).
  int system_end = 0;
  // The question before the image (the paper's layout): [question_begin, question_end), the last
  // user turn's text before its first image, "USER: " included, counted as that text tokenized
  // alone; empty (0, 0) when the turn starts with its image or has none.
  int question_begin = 0, question_end = 0;
};

// The system prompt of LLaVA-1.5's `llava_v1` conversation, the one the Elastic Cache paper
// evaluated with (llava-eval --layout paper).
inline constexpr const char* kLlavaV1SystemPrompt =
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.";

struct PromptLimits {
  int max_messages = 64;
  int max_images = 4;
};

// Builds the prompt for `messages` (the last one must be from the user) with `num_images`
// images referenced by their image parts. Errors name the field, e.g.
// "messages[2].role must be user, assistant or system".
StatusOr<PromptTokens> BuildPrompt(const Tokenizer& tokenizer,
                                   const std::vector<ChatMessage>& messages, int num_images,
                                   int image_token_id, int image_tokens,
                                   const PromptLimits& limits = {});

}  // namespace llava
