// Helpers shared by the libFuzzer targets in this folder (tests/fuzz/README.md).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "engine/io/model_config.h"
#include "engine/io/tokenizer.h"

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

// The shipped model's config and tokenizer, loaded once; aborts if they cannot be read.
struct Model {
  LlavaConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
};

inline const Model& ShippedModel() {
  static const Model* model = [] {
    auto config = LoadLlavaConfig(ModelDir());
    auto tokenizer = Tokenizer::Load(ModelDir() + "/tokenizer.model");
    if (!config.ok() || !tokenizer.ok()) {
      std::fprintf(stderr, "fuzz: cannot load the model in %s\n", ModelDir().c_str());
      std::abort();
    }
    return new Model{*config, std::move(*tokenizer)};
  }();
  return *model;
}

}  // namespace llava::fuzz
