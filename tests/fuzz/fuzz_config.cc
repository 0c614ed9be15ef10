// config.json and preprocessor_config.json (split at the first NUL byte of the input): a
// config the parser accepts must describe a model the loader can size without overflow.
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/io/model_config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string config = input.substr(0, nul);
  const std::string preprocessor = nul == std::string::npos ? "{}" : input.substr(nul + 1);
  auto parsed = llava::ParseLlavaConfig(config, preprocessor, "fuzz/config.json");
  if (!parsed.ok()) return 0;
  LLAVA_FUZZ_CHECK(parsed->image_tokens() > 0);
  return 0;
}
