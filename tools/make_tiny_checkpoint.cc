// llava-make-tiny: writes a tiny random LLaVA checkpoint in the exact llava-hf layout, with a
// tokenizer.model trained by the `spm_train` command on a generated corpus. Deterministic for
// a given --seed. Used by the tests; small enough to build in a second.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <random>

#include "engine/io/tokenizer.h"
#include "engine/kernels/runtime.h"
#include "train/checkpoint_writer.h"

namespace {

// Sentences over a fixed vocabulary plus accented, CJK and emoji words, so the tokenizer
// learns merges and still needs byte fallback for unseen characters.
void WriteCorpus(const std::string& path, uint64_t seed) {
  static const char* kWords[] = {
      "the",      "a",      "red",   "blue",  "green", "yellow", "circle",     "square",
      "triangle", "star",   "is",    "at",    "top",   "left",   "right",      "bottom",
      "center",   "of",     "image", "there", "are",   "two",    "three",      "objects",
      "what",     "colour", "shape", "how",   "many",  "USER:",  "ASSISTANT:", "describe",
      "picture",  "small",  "large", "café",  "naïve", "Zürich", "東京",       "日本語",
      "😀",        "hello",  "world", "yes",   "no",    "1",      "2",          "3",
      "42",       "and",    "in",    "on",    "with"};
  std::mt19937_64 rng(seed);
  std::ofstream out(path);
  const size_t n = sizeof(kWords) / sizeof(kWords[0]);
  for (int line = 0; line < 3000; ++line) {
    const int len = 3 + static_cast<int>(rng() % 12);
    for (int i = 0; i < len; ++i) out << (i ? " " : "") << kWords[rng() % n];
    out << (rng() % 4 == 0 ? "?" : ".") << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a tiny random LLaVA checkpoint in the llava-hf layout"};
  std::string out_dir, naming = "new", dtype = "f32";
  int shards = 1, vocab = 400;
  uint64_t seed = 1;
  app.add_option("--out", out_dir, "output folder (created)")->required();
  app.add_option("--naming", naming, "tensor naming generation: old | new")
      ->check(CLI::IsMember({"old", "new"}));
  app.add_option("--shards", shards, "number of safetensors shards (index written when > 1)");
  app.add_option("--dtype", dtype, "stored dtype: f32 | bf16 | f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  app.add_option("--seed", seed, "random seed");
  app.add_option("--vocab", vocab, "SentencePiece vocabulary size");
  std::string preset = "tiny";
  app.add_option("--preset", preset,
                 "tiny: a 2-layer toy for tests; bench: 4 decoder layers at LLaVA-1.5-7B shapes "
                 "(hidden 4096, FFN 11008, 32 heads; ~2 GB in bf16) for serving benchmarks")
      ->check(CLI::IsMember({"tiny", "bench"}));
  CLI11_PARSE(app, argc, argv);
  llava::InitTorchThreads(1);

  if (std::system(("mkdir -p '" + out_dir + "'").c_str()) != 0) return 1;
  const std::string corpus = out_dir + "/.corpus.txt";
  WriteCorpus(corpus, seed);
  auto tok = llava::TrainTokenizer(corpus, out_dir, vocab);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  const bool bench = preset == "bench";
  const llava::LlavaConfig c =
      llava::PresetConfig(bench ? llava::ModelPreset::kLlava7b : llava::ModelPreset::kTiny,
                          (*tok)->vocab_size(), (*tok)->PieceToId("<image>"));
  const double matrix_std = bench ? 0.02 : 0.2;

  const at::ScalarType st = dtype == "f32"    ? at::kFloat
                            : dtype == "bf16" ? at::kBFloat16
                                              : at::kHalf;
  auto weights = llava::RandomLlavaWeights(c, seed, st, matrix_std);
  llava::Status s = llava::WriteLlavaCheckpoint(
      out_dir, c, weights, naming == "old" ? llava::TensorNaming::kOld : llava::TensorNaming::kNew,
      shards);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s (%zu tensors, vocab %d, image token %d)\n", out_dir.c_str(), weights.size(),
              c.text.vocab_size, c.image_token_index);
  return 0;
}
