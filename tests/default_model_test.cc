// The shipped default model (models/shapes-llava, trained by build/llava-train) loads with the
// regular loader and answers fixed held-out questions, greedy and exact. Questions and answers
// come from the data generator's held-out split (tests/data/default_model/questions.jsonl,
// images beside it), not from the model. The model is far from perfect (docs/TRAINING.md has
// its accuracy per question kind), so these eight are the first held-out item of each kind that
// this checkpoint gets right (scripts/pick_default_questions.py): the test guards loading,
// preprocessing and inference of the shipped model against regressions; it does not measure
// its quality.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "engine/eval/eval_metrics.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"
#include "tests/test_util.h"

namespace llava {
namespace {

using Kind = ContentPart::Kind;

std::string Trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \n"), e = s.find_last_not_of(" \n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// --threads 0 reads the folder's parameter count: the shipped model is small enough for one.
TEST(DefaultModel, AutoThreadsPickOne) {
  std::string why;
  const std::string dir = ::llava::testing::SourceDir() + "/models/shapes-llava";
  EXPECT_EQ(ResolveModelThreads(0, dir, &why), 1) << why;
  EXPECT_NE(why.find("parameters"), std::string::npos) << why;
  EXPECT_EQ(ResolveModelThreads(2, dir, &why), 2) << why;
  // A folder without a checkpoint: the count is unknown, so one thread per core.
  EXPECT_EQ(ResolveModelThreads(0, dir + "/no-such-folder", &why),
            std::max(1, static_cast<int>(std::thread::hardware_concurrency())))
      << why;
}

// Also with an int8 KV cache (--kv-cache-dtype int8): the same answers.
TEST(DefaultModel, AnswersHeldOutQuestions) {
  InitTorchThreads(2);
  const std::string dir = ::llava::testing::SourceDir() + "/models/shapes-llava";
  for (const KvDtype kv : {KvDtype::kModel, KvDtype::kInt8}) {
    SCOPED_TRACE(KvDtypeName(kv));
    ModelOptions options;  // bf16, as served
    options.kv_dtype = kv;
    auto loaded = LoadModel(dir, options);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_GE((*loaded)->model().config().image_tokens(), 100);
    EXPECT_EQ((*loaded)->kv_layout().int8(), kv == KvDtype::kInt8);
    Generator gen(**loaded, EngineLimits{});

    const std::string data = ::llava::testing::SourceDir() + "/tests/data/default_model";
    std::istringstream lines(::llava::testing::ReadFile(data + "/questions.jsonl"));
    std::string line;
    int questions = 0;
    while (std::getline(lines, line)) {
      if (line.empty()) continue;
      const auto j = nlohmann::json::parse(line);
      GenerationRequest req;
      req.images = {::llava::testing::ReadFile(data + "/" + j["image"].get<std::string>())};
      req.messages = {{"user", {{Kind::kImage, "", 0}, {Kind::kText, j["prompt"], 0}}}};
      req.sampling.max_tokens = 96;
      req.kv_cache.policy = CachePolicy::kFull;
      auto r = gen.Generate(req, nullptr);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      const std::string expected = j["answer"];
      if (j["kind"] == "describe") {
        EXPECT_GE(RougeL(r->text, expected), 0.8) << r->text << "\nvs\n" << expected;
      } else {
        EXPECT_EQ(Trimmed(r->text), expected) << j["prompt"];
      }
      if (kv == KvDtype::kInt8) {
        EXPECT_EQ(r->kv.bytes_kept * (*loaded)->kv_layout().model_bytes_per_entry(),
                  r->kv.full_equivalent_bytes * (*loaded)->kv_layout().bytes_per_entry());
      }
      ++questions;
    }
    EXPECT_GE(questions, 8);
  }
}

// sampling.ignore_eos (for benchmarks): the same short question that ends after a few tokens
// runs to exactly max_tokens, with no EOS among them.
TEST(DefaultModel, IgnoreEosGeneratesExactlyMaxTokens) {
  InitTorchThreads(2);
  auto loaded = LoadModel(::llava::testing::SourceDir() + "/models/shapes-llava", ModelOptions{});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  Generator gen(**loaded, EngineLimits{});
  GenerationRequest req;
  req.images = {::llava::testing::ReadFile(::llava::testing::SourceDir() +
                                           "/tests/data/default_model/00003.png")};
  req.messages = {
      {"user", {{Kind::kImage, "", 0}, {Kind::kText, "How many objects are there?", 0}}}};
  req.sampling.max_tokens = 30;
  auto natural = gen.Generate(req, nullptr);
  ASSERT_TRUE(natural.ok()) << natural.status().ToString();
  ASSERT_EQ(natural->finish, FinishReason::kStop);
  ASSERT_LT(natural->completion_tokens, 30);
  req.sampling.ignore_eos = true;
  auto forced = gen.Generate(req, nullptr);
  ASSERT_TRUE(forced.ok()) << forced.status().ToString();
  EXPECT_EQ(forced->completion_tokens, 30);
  EXPECT_EQ(forced->finish, FinishReason::kLength);
  for (int id : forced->tokens) EXPECT_NE(id, (*loaded)->tokenizer().eos_id());
}

}  // namespace
}  // namespace llava
