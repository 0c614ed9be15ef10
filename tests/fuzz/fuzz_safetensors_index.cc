// model.safetensors.index.json: every shard name it yields must be a plain file name in the
// model folder (no path separator, not "." or ".."), each once.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/io/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto shards = llava::ParseSafetensorsIndex(json, "fuzz.index.json");
  if (!shards.ok()) return 0;
  for (size_t i = 0; i < shards->size(); ++i) {
    const std::string& s = (*shards)[i];
    LLAVA_FUZZ_CHECK(!s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos);
    LLAVA_FUZZ_CHECK(std::find(shards->begin(), shards->begin() + i, s) == shards->begin() + i);
  }
  return 0;
}
