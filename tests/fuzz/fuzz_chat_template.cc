// The conversation template with hostile messages: the input is split at NUL bytes into
// messages; each message's first byte picks its role (one in four is not a valid role) and
// 0x01 bytes in it stand for image parts. A prompt the template accepts must be consistent:
// image rows where the offsets say, spans inside the prompt, and no image token forged by text.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/io/chat_template.h"
#include "engine/io/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {
const llava::Tokenizer* tokenizer = nullptr;
constexpr int kImageTokens = 5;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tokenizer = llava::fuzz::ShippedModel().tokenizer.get();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* kRoles[] = {"system", "user", "assistant", "tool"};
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<llava::ChatMessage> messages;
  int images = 0;
  for (size_t begin = 0; begin < input.size();) {
    size_t end = input.find('\0', begin);
    if (end == std::string::npos) end = input.size();
    llava::ChatMessage m;
    m.role = kRoles[static_cast<uint8_t>(input[begin]) % 4];
    std::string text;
    for (size_t i = begin + 1; i <= end; ++i) {
      if (i == end || input[i] == '\x01') {
        if (!text.empty()) m.content.push_back({llava::ContentPart::Kind::kText, text, 0});
        text.clear();
        if (i < end) m.content.push_back({llava::ContentPart::Kind::kImage, "", images++});
      } else {
        text += input[i];
      }
    }
    messages.push_back(std::move(m));
    begin = end + 1;
  }
  const int image_token = tokenizer->vocab_size();  // outside the text vocabulary, as LLaVA's
  auto prompt = llava::BuildPrompt(*tokenizer, messages, images, image_token, kImageTokens);
  if (!prompt.ok()) return 0;
  const std::vector<int>& ids = prompt->ids;
  const int t = static_cast<int>(ids.size());
  LLAVA_FUZZ_CHECK(static_cast<int>(prompt->image_offsets.size()) == images);
  LLAVA_FUZZ_CHECK(prompt->text_tokens + images * kImageTokens == t);
  int image_rows = static_cast<int>(std::count(ids.begin(), ids.end(), image_token));
  LLAVA_FUZZ_CHECK(image_rows == images * kImageTokens);  // text cannot forge image rows
  for (int offset : prompt->image_offsets) {
    LLAVA_FUZZ_CHECK(offset >= 0 && offset + kImageTokens <= t);
    for (int i = 0; i < kImageTokens; ++i) LLAVA_FUZZ_CHECK(ids[offset + i] == image_token);
  }
  LLAVA_FUZZ_CHECK(prompt->instruction_begin >= 0 && prompt->instruction_begin <= t);
  LLAVA_FUZZ_CHECK(prompt->system_end >= 0 && prompt->system_end <= t);
  LLAVA_FUZZ_CHECK(prompt->question_begin >= 0 && prompt->question_begin <= prompt->question_end &&
                   prompt->question_end <= t);
  return 0;
}
