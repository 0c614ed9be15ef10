// The LLaVA-1.5 conversation template and prompt tokenization. Torch-free.
//
//   [system + " "] "USER: " <image>"\n" ... text " ASSISTANT:" [" " answer "</s>" "USER: " ...]
//
// Each <image> expands to `image_tokens` copies of the image token id; the model replaces those
// rows with the image's projected features.
#pragma once

#include <string>
#include <vector>

#include "engine/status.h"
#include "engine/tokenizer.h"

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
};

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
