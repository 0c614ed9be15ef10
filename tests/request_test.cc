// PrepareRequest without a model: the tiny preset's config and the tiny fixture's tokenizer.
#include "engine/serving/request.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "tests/test_util.h"

namespace llava {
namespace {

using Kind = ContentPart::Kind;

class PrepareRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::Load(::llava::testing::TestData() + "/tiny-new/tokenizer.model");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(t).value();
    config_ = PresetConfig(ModelPreset::kTiny, tok_->vocab_size(), tok_->PieceToId("<image>"));
    std::ifstream in(std::string(LLAVA_SOURCE_DIR) + "/models/examples/scene1.png",
                     std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    png_ = bytes.str();
    ASSERT_FALSE(png_.empty());
  }
  GenerationRequest ImageQuestion(const std::string& question) const {
    GenerationRequest r;
    r.messages = {{"user", {{Kind::kImage, "", 0}, {Kind::kText, question, 0}}}};
    r.images = {png_};
    return r;
  }
  std::unique_ptr<Tokenizer> tok_;
  LlavaConfig config_;
  std::string png_;
};

TEST_F(PrepareRequestTest, ImageRowsPixelsAndSegments) {
  auto p = PrepareRequest(ImageQuestion("How many objects?"), config_, *tok_, EngineLimits(), 8);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const int rows = config_.image_tokens();  // 16: (32 / 8)^2
  const int64_t len = static_cast<int64_t>(p->prompt.ids.size());
  EXPECT_EQ(p->num_images, 1);
  ASSERT_EQ(p->images.size(), 1u);
  EXPECT_EQ(p->images[0].rgb.size(), size_t{3} * 32 * 32) << "bytes, not floats, while it waits";
  // What the vision tower gets: the processor's output for the decoded image.
  EXPECT_EQ(NormalizeImage(p->images[0], config_.image_processor),
            PreprocessImage(*DecodeImage(png_, {}, "image"), config_.image_processor));
  ASSERT_EQ(p->prompt.image_offsets.size(), 1u);
  const int offset = p->prompt.image_offsets[0];
  for (int r = 0; r < rows; ++r) EXPECT_EQ(p->prompt.ids[offset + r], config_.image_token_index);
  ASSERT_EQ(p->segments.images.size(), 1u);
  EXPECT_EQ(p->segments.images[0].begin, offset);
  EXPECT_EQ(p->segments.images[0].end, offset + rows);
  // The instruction is the text after the image, up to the end of the prompt.
  EXPECT_EQ(p->segments.instruction.begin, offset + rows);
  EXPECT_EQ(p->segments.instruction.end, len);
  // What the repetition penalty sees: the prompt without its image rows.
  EXPECT_EQ(PromptTextIds(p->prompt, config_.image_token_index).size(),
            static_cast<size_t>(len - rows));
}

TEST_F(PrepareRequestTest, ErrorsNameTheField) {
  GenerationRequest bad_image = ImageQuestion("What is this?");
  bad_image.images[0] = "not an image";
  bad_image.image_fields = {"messages[0].content[0].image"};
  auto r = PrepareRequest(bad_image, config_, *tok_, EngineLimits(), 8);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("messages[0].content[0].image"), std::string::npos)
      << r.status().message();

  r = PrepareRequest(ImageQuestion("What is this?"), config_, *tok_, EngineLimits(),
                     config_.text.max_position_embeddings);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exceeds the context length 512"), std::string::npos)
      << r.status().message();

  EngineLimits short_prompts;
  short_prompts.max_prompt_tokens = 10;  // fewer than the image's 16 rows
  r = PrepareRequest(ImageQuestion("What is this?"), config_, *tok_, short_prompts, 8);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("messages: the prompt has"), std::string::npos)
      << r.status().message();

  GenerationRequest bad_budget = ImageQuestion("What is this?");
  bad_budget.kv_cache.budget = -0.5;
  r = PrepareRequest(bad_budget, config_, *tok_, EngineLimits(), 8);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("kv_cache.budget"), std::string::npos)
      << r.status().message();
}

// A PNG whose header says `width` x `height` and whose data is garbage: refused as corrupt only
// if something tries to decode it.
std::string UndecodablePng(uint32_t width, uint32_t height) {
  std::string b("\x89PNG\r\n\x1a\n", 8);
  b += std::string("\0\0\0\x0d", 4) + "IHDR";
  for (uint32_t v : {width, height}) {
    for (int shift = 24; shift >= 0; shift -= 8) b += static_cast<char>((v >> shift) & 0xFF);
  }
  b += std::string("\x08\x02\0\0\0", 5) + "crc!" + std::string(64, 'x');
  return b;
}

// Every cheap check comes before any decode: too many images are refused by their count, and a
// later image's header is checked before an earlier image is decoded (an attacker's 12 images of
// 40 megapixels were once decoded for 21 s before the count refused them).
TEST_F(PrepareRequestTest, ImagesAreCountedAndTheirHeadersCheckedBeforeAnyDecode) {
  EngineLimits limits;
  GenerationRequest many = ImageQuestion("How many?");
  many.messages[0].content.clear();
  many.images.clear();
  for (int i = 0; i <= limits.prompt.max_images; ++i) {
    many.messages[0].content.push_back({Kind::kImage, "", i});
    many.images.push_back(UndecodablePng(32, 32));
  }
  many.messages[0].content.push_back({Kind::kText, "How many?", 0});
  auto p = PrepareRequest(many, config_, *tok_, limits, 8);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(
      p.status().message().find("more than the limit " + std::to_string(limits.prompt.max_images)),
      std::string::npos)
      << p.status().ToString();

  GenerationRequest two = ImageQuestion("How many?");
  two.messages[0].content.insert(two.messages[0].content.begin(), {Kind::kImage, "", 1});
  two.images = {UndecodablePng(32, 32), UndecodablePng(30000, 30000)};
  p = PrepareRequest(two, config_, *tok_, limits, 8);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("images[1]"), std::string::npos) << p.status().ToString();
  EXPECT_NE(p.status().message().find("pixels exceeds the limit"), std::string::npos)
      << p.status().ToString();
  // Alone, the first one is only refused once decoded.
  two.images = {UndecodablePng(32, 32), png_};
  p = PrepareRequest(two, config_, *tok_, limits, 8);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("corrupt"), std::string::npos) << p.status().ToString();
}

TEST_F(PrepareRequestTest, TextThatCannotFitIsRefusedBeforeTokenizing) {
  // The tiny config's context is 512 tokens: at 32 bytes a token, 16 KiB of text at most.
  const std::string huge(50 << 20, 'a');  // tokenizing this would take seconds and gigabytes
  // What copying the text costs on this build and load (sanitizers make it slow): refusing it
  // may scan and copy it a few times, never tokenize it.
  auto start = std::chrono::steady_clock::now();
  GenerationRequest request = ImageQuestion(huge);
  const double copy_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  start = std::chrono::steady_clock::now();
  auto r = PrepareRequest(request, config_, *tok_, EngineLimits(), 8);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("bytes of text cannot fit a prompt of at most 512 tokens"),
            std::string::npos)
      << r.status().message();
  EXPECT_LT(seconds, 0.5 + 10 * copy_seconds) << "the text was tokenized before the check";
  // Just under the byte limit the request is tokenized and the token count decides.
  r = PrepareRequest(ImageQuestion(std::string(512 * 32 - 32, 'a')), config_, *tok_, EngineLimits(),
                     8);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find("bytes of text"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace llava
