// End-to-end generation on the tiny checkpoint.
#include <gtest/gtest.h>

#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"
#include "tests/tiny_model.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

using Kind = ContentPart::Kind;

std::string TestPng() {
  cv::Mat img(48, 64, CV_8UC3, cv::Scalar(240, 240, 240));
  cv::circle(img, cv::Point(20, 20), 10, cv::Scalar(0, 0, 220), -1);
  cv::rectangle(img, cv::Rect(36, 24, 20, 18), cv::Scalar(200, 50, 0), -1);
  std::vector<uint8_t> buf;
  cv::imencode(".png", img, buf);
  return std::string(buf.begin(), buf.end());
}

GenerationRequest Request(int max_tokens) {
  GenerationRequest r;
  r.images = {TestPng()};
  r.messages = {{"user", {{Kind::kImage, "", 0}, {Kind::kText, "What is in the image?", 0}}}};
  r.sampling.max_tokens = max_tokens;
  return r;
}

class GenerationTest : public ::llava::testing::TinyModelTest {};

// Reference: greedy decoding that recomputes the whole sequence without reusing a cache.
std::vector<int> NaiveGreedy(const LoadedModel& m, const GenerationRequest& req, int steps) {
  const LlavaModel& model = m.model();
  const LlavaConfig& c = model.config();
  auto prompt = BuildPrompt(m.tokenizer(), req.messages, 1, c.image_token_index, c.image_tokens());
  std::vector<float> px =
      PreprocessImage(*DecodeImage(req.images[0], {}, "img"), c.image_processor);
  at::Tensor features = model.EncodeImages(
      at::from_blob(px.data(), {1, 3, c.vision.image_size, c.vision.image_size}, at::kFloat));
  at::Tensor seq = model.EmbedPrompt(prompt->ids, prompt->image_offsets, features);
  std::vector<int> out;
  for (int s = 0; s < steps; ++s) {
    auto cache = model.NewFullCache();
    at::Tensor logits = Pass(model, {{seq, 0, cache.get(), false}});
    const int id = static_cast<int>(logits[0].argmax().item<int64_t>());
    if (id == m.tokenizer().eos_id()) break;
    out.push_back(id);
    seq = at::cat({seq, model.Embed(at::tensor({static_cast<int64_t>(id)}, at::kLong))}, 0);
  }
  return out;
}

TEST_F(GenerationTest, GreedyMatchesRecomputingWithoutCache) {
  Generator gen(*loaded_, EngineLimits{});
  const GenerationRequest req = Request(12);
  std::string streamed;
  auto r = gen.Generate(req, [&](const std::string& d) {
    streamed += d;
    return true;
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tokens, NaiveGreedy(*loaded_, req, 12));
  EXPECT_EQ(streamed, r->text);
  EXPECT_EQ(r->text, loaded_->tokenizer().Decode(r->tokens));
  EXPECT_EQ(r->image_tokens, loaded_->model().config().image_tokens());
  EXPECT_EQ(r->completion_tokens, static_cast<int>(r->tokens.size()));
  if (r->finish == FinishReason::kLength) {
    EXPECT_EQ(r->completion_tokens, 12);
  }
  // The cache holds the prompt and every generated token but the last (never fed back).
  const int64_t fed =
      r->prompt_tokens + r->completion_tokens - (r->finish == FinishReason::kLength);
  EXPECT_EQ(r->kv.tokens_seen, fed);
  EXPECT_EQ(r->kv.bytes_kept, fed * loaded_->model().kv_layout().num_layers *
                                  loaded_->model().kv_layout().bytes_per_entry());
}

TEST_F(GenerationTest, SeededSamplingIsReproducible) {
  Generator gen(*loaded_, EngineLimits{});
  GenerationRequest req = Request(16);
  req.sampling.temperature = 1.0f;
  req.sampling.top_p = 0.9f;
  req.sampling.seed = 1234;
  auto a = gen.Generate(req, nullptr);
  auto b = gen.Generate(req, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  // Across several seeds the samples are not all the same sequence.
  bool any_differs = false;
  for (uint64_t seed = 1; seed <= 4 && !any_differs; ++seed) {
    req.sampling.seed = seed;
    any_differs = gen.Generate(req, nullptr)->tokens != a->tokens;
  }
  EXPECT_TRUE(any_differs);
}

TEST_F(GenerationTest, CancelStopsAfterTheFirstDelta) {
  Generator gen(*loaded_, EngineLimits{});
  int calls = 0;
  auto r = gen.Generate(Request(50), [&](const std::string&) { return ++calls < 1; });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->finish, FinishReason::kCancelled);
  EXPECT_EQ(calls, 1);
  EXPECT_LT(r->completion_tokens, 50);
}

TEST_F(GenerationTest, StopStringEndsTheAnswerBeforeIt) {
  Generator gen(*loaded_, EngineLimits{});
  auto full = gen.Generate(Request(30), nullptr);
  ASSERT_TRUE(full.ok());
  ASSERT_GE(full->text.size(), 6u);
  // Use a piece of the greedy answer as the stop string.
  GenerationRequest req = Request(30);
  const std::string stop = full->text.substr(3, 3);
  req.sampling.stop = {stop};
  auto r = gen.Generate(req, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->finish, FinishReason::kStop);
  EXPECT_EQ(r->text, full->text.substr(0, full->text.find(stop)));
}

TEST_F(GenerationTest, BadInputNamesTheField) {
  Generator gen(*loaded_, EngineLimits{});
  GenerationRequest bad_temp = Request(4);
  bad_temp.sampling.temperature = std::nanf("");
  GenerationRequest bad_image = Request(4);
  bad_image.images[0] = "not an image";
  GenerationRequest too_long = Request(4);
  too_long.sampling.max_tokens = 4000;  // tiny context is 512
  GenerationRequest no_messages = Request(4);
  no_messages.messages.clear();
  struct Case {
    GenerationRequest* req;
    const char* part;
  } cases[] = {{&bad_temp, "sampling.temperature"},
               {&bad_image, "images[0]"},
               {&too_long, "exceeds the context length 512"},
               {&no_messages, "messages must not be empty"}};
  for (const auto& c : cases) {
    auto r = gen.Generate(*c.req, nullptr);
    ASSERT_FALSE(r.ok()) << c.part;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.part), std::string::npos) << r.status().message();
  }
  // And the generator keeps working afterwards.
  EXPECT_TRUE(gen.Generate(Request(2), nullptr).ok());
}

TEST_F(GenerationTest, ServerPromptLimitsApply) {
  EngineLimits limits;
  limits.max_prompt_tokens = 20;  // the tiny model's image alone is 16 rows
  limits.prompt.max_messages = 1;
  Generator gen(*loaded_, limits);
  auto r = gen.Generate(Request(2), nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("more than this server's limit of 20"), std::string::npos)
      << r.status().message();
  GenerationRequest two = Request(2);
  two.messages.push_back({"assistant", {{Kind::kText, "A circle.", 0}}});
  two.messages.push_back({"user", {{Kind::kText, "And?", 0}}});
  limits.max_prompt_tokens = 0;
  Generator gen2(*loaded_, limits);
  r = gen2.Generate(two, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than the limit 1"), std::string::npos)
      << r.status().message();
  EXPECT_TRUE(gen2.Generate(Request(2), nullptr).ok());
}

}  // namespace
}  // namespace llava
