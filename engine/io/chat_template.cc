#include "engine/io/chat_template.h"

#include <algorithm>

namespace llava {
namespace {

// Collects the prompt as text runs and markers, then tokenizes each run. Runs after a marker
// are encoded without sentencepiece's dummy prefix (Hugging Face non-legacy behaviour).
class PromptBuilder {
 public:
  PromptBuilder(const Tokenizer& tok, int image_token_id, int image_tokens)
      : tok_(tok), image_token_id_(image_token_id), image_tokens_(image_tokens) {
    out_.ids.push_back(tok.bos_id());
    out_.image_rows = image_tokens;
    out_.instruction_begin = 1;
  }
  void Text(const std::string& text) { pending_ += text; }
  // A user turn starts: its text so far is pending_ from here on.
  void UserTurn() {
    turn_text_ = pending_.size();
    turn_has_image_ = false;
    out_.question_begin = out_.question_end = 0;
  }
  void Image() {
    const bool question = !turn_has_image_ && turn_text_ != std::string::npos;
    const std::string turn_text = question ? pending_.substr(turn_text_) : "";
    const bool dummy_prefix = turn_text_ > 0 || !after_marker_;
    turn_has_image_ = true;
    FlushText();
    if (question) QuestionBeforeImage(turn_text, dummy_prefix);
    out_.image_offsets.push_back(static_cast<int>(out_.ids.size()));
    out_.ids.insert(out_.ids.end(), image_tokens_, image_token_id_);
    after_marker_ = true;
    out_.instruction_begin = static_cast<int>(out_.ids.size());
  }
  void Eos() {
    FlushText();
    out_.ids.push_back(tok_.eos_id());
    after_marker_ = true;
    out_.instruction_begin = static_cast<int>(out_.ids.size());
  }
  // The system prompt is the first text run; its tokens alone give its extent.
  void System(const std::string& text) {
    Tokenizer::EncodeOptions opt;
    opt.parse_special = false;
    out_.system_end = 1 + static_cast<int>(tok_.Encode(text, opt).size());
    Text(text);
  }
  // The turn's text before its first image (pending_ from turn_text_, now flushed), tokenized
  // alone: its first token may differ from the run's by a merge across the boundary, as
  // system_end's.
  void QuestionBeforeImage(const std::string& text, bool dummy_prefix) {
    const size_t words = text.rfind("USER: ", 0) == 0 ? 6 : 0;
    if (text.find_first_not_of(" \n", words) == std::string::npos) return;  // "USER: " only
    Tokenizer::EncodeOptions opt;
    opt.dummy_prefix = dummy_prefix;
    opt.parse_special = false;
    const int n = static_cast<int>(tok_.Encode(text, opt).size());
    out_.question_end = static_cast<int>(out_.ids.size());
    out_.question_begin = std::max(1, out_.question_end - n);
  }
  PromptTokens Finish() {
    FlushText();
    out_.text_tokens = static_cast<int>(out_.ids.size()) -
                       static_cast<int>(out_.image_offsets.size()) * image_tokens_;
    return std::move(out_);
  }

 private:
  void FlushText() {
    if (pending_.empty()) return;
    Tokenizer::EncodeOptions opt;
    opt.dummy_prefix = !after_marker_;
    opt.parse_special = false;  // user text can never produce image or control tokens
    std::vector<int> ids = tok_.Encode(pending_, opt);
    out_.ids.insert(out_.ids.end(), ids.begin(), ids.end());
    pending_.clear();
    after_marker_ = false;
  }

  const Tokenizer& tok_;
  const int image_token_id_;
  const int image_tokens_;
  PromptTokens out_;
  std::string pending_;
  bool after_marker_ = false;
  size_t turn_text_ = std::string::npos;  // where the current user turn starts in pending_
  bool turn_has_image_ = false;
};

}  // namespace

StatusOr<PromptTokens> BuildPrompt(const Tokenizer& tokenizer,
                                   const std::vector<ChatMessage>& messages, int num_images,
                                   int image_token_id, int image_tokens,
                                   const PromptLimits& limits) {
  if (messages.empty()) return InvalidArgument("messages must not be empty");
  if (static_cast<int>(messages.size()) > limits.max_messages) {
    return InvalidArgument("messages has " + std::to_string(messages.size()) +
                           " entries, more than the limit " + std::to_string(limits.max_messages));
  }
  if (num_images > limits.max_images) {
    return InvalidArgument("the request has " + std::to_string(num_images) +
                           " images, more than the limit " + std::to_string(limits.max_images));
  }
  PromptBuilder b(tokenizer, image_token_id, image_tokens);
  std::vector<bool> used(num_images, false);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const std::string field = "messages[" + std::to_string(i) + "]";
    if (m.role == "system") {
      if (i != 0) return InvalidArgument(field + ".role: system is only allowed first");
    } else if (m.role != "user" && m.role != "assistant") {
      return InvalidArgument(field + ".role must be user, assistant or system, got '" + m.role +
                             "'");
    }
    if (m.content.empty()) return InvalidArgument(field + ".content must not be empty");
    if (m.role == "system") {
      std::string system;
      for (const auto& part : m.content) {
        if (part.kind != ContentPart::Kind::kText) {
          return InvalidArgument(field + ".content: a system message holds text only");
        }
        system += part.text;
      }
      b.System(system);
      b.Text(" ");
      continue;
    }
    if (m.role == "user") {
      b.UserTurn();
      b.Text("USER: ");
      // The parts in their order: an image is followed by a newline, and so is text directly
      // before an image; consecutive text parts are joined by a space. Image-first gives
      // llava-hf's "<image>\n{question} "; question-first the paper's "{question}\n<image>\n ".
      bool text_before = false;
      for (size_t j = 0; j < m.content.size(); ++j) {
        const auto& part = m.content[j];
        if (part.kind == ContentPart::Kind::kText) {
          b.Text((text_before ? " " : "") + part.text);
          text_before = true;
          continue;
        }
        if (part.image_index < 0 || part.image_index >= num_images) {
          return InvalidArgument(field + ".content[" + std::to_string(j) +
                                 "] refers to a missing image");
        }
        if (used[part.image_index]) {
          return InvalidArgument(field + ".content[" + std::to_string(j) + "] repeats an image");
        }
        used[part.image_index] = true;
        if (text_before) b.Text("\n");
        b.Image();
        b.Text("\n");
        text_before = false;
      }
      b.Text(" ");
    } else {
      if (i == messages.size() - 1) {
        return InvalidArgument(field + ".role: the last message must be from the user");
      }
      b.Text("ASSISTANT: ");
      for (const auto& part : m.content) {
        if (part.kind != ContentPart::Kind::kText) {
          return InvalidArgument(field + ".content: an assistant message holds text only");
        }
        b.Text(part.text);
      }
      b.Eos();
    }
  }
  if (messages.back().role != "user") {
    return InvalidArgument("messages: the last message must be from the user");
  }
  for (int k = 0; k < num_images; ++k) {
    if (!used[k]) return InvalidArgument("images[" + std::to_string(k) + "] is not referenced");
  }
  b.Text("ASSISTANT:");
  PromptTokens p = b.Finish();
  // The image rows must be the only image-token ids (the tokenizer cannot make them from text).
  return p;
}

}  // namespace llava
