// Helpers shared by the libFuzzer targets in this folder (tests/fuzz/README.md).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace llava::fuzz {

// A property of a parser's output that must hold for every input: prints and aborts, which
// libFuzzer reports as a crash with the input saved.
#define LLAVA_FUZZ_CHECK(cond)                                                         \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

// The shipped model's folder (tokenizer.model), from LLAVA_FUZZ_MODEL or the build's default.
inline std::string ModelDir() {
  const char* env = std::getenv("LLAVA_FUZZ_MODEL");
  return env != nullptr ? env : LLAVA_FUZZ_DEFAULT_MODEL;
}

}  // namespace llava::fuzz
