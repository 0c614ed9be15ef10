// The shipped tokenizer on arbitrary input. The first byte picks the direction:
//   even: the rest is text; Encode (with and without special-token matching) must give ids in
//         the vocabulary, and decoding them must give valid UTF-8;
//   odd:  the rest is little-endian int32 ids, any value (negative, past the vocabulary);
//         Decode and the streaming decoder must give the same valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/io/tokenizer.h"
#include "engine/io/utf8.h"
#include "tests/fuzz/fuzz_util.h"

namespace {
const llava::Tokenizer* tokenizer = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tokenizer = llava::fuzz::ShippedModel().tokenizer.get();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int vocab = tokenizer->vocab_size();
  if ((data[0] & 1) == 0) {
    const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
    for (bool special : {false, true}) {
      llava::Tokenizer::EncodeOptions options;
      options.parse_special = special;
      const std::vector<int> ids = tokenizer->Encode(text, options);
      for (int id : ids) LLAVA_FUZZ_CHECK(id >= 0 && id < vocab);
      LLAVA_FUZZ_CHECK(llava::IsValidUtf8(tokenizer->Decode(ids)));
    }
  } else {
    std::vector<int> ids((size - 1) / 4);
    if (!ids.empty()) std::memcpy(ids.data(), data + 1, ids.size() * 4);
    const std::string whole = tokenizer->Decode(ids);
    LLAVA_FUZZ_CHECK(llava::IsValidUtf8(whole));
    llava::StreamDecoder stream(*tokenizer);
    std::string pieces;
    for (int id : ids) pieces += stream.Push(id);
    pieces += stream.Flush();
    LLAVA_FUZZ_CHECK(pieces == whole);
  }
  return 0;
}
