// POST /v1/chat/completions bodies (server/openai_api.h): JSON of any shape, data URIs, the
// kv_cache extension. An accepted request then goes through the engine's admission (admission.h).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "server/openai_api.h"
#include "tests/fuzz/admission.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  llava::server::RequestDefaults defaults;
  auto parsed = llava::server::ParseChatCompletion(body, defaults);
  if (!parsed.ok()) {
    // Every refusal maps to an OpenAI error body with a 4xx/5xx status.
    const int status = llava::server::HttpStatusOf(parsed.status());
    LLAVA_FUZZ_CHECK(status >= 400 && status < 600);
    LLAVA_FUZZ_CHECK(!llava::server::ErrorJson(parsed.status()).empty());
    return 0;
  }
  llava::fuzz::CheckAdmission(parsed->request);
  return 0;
}
