// Parity with Hugging Face transformers on a fixture it produced
// (tests/fixtures/make_hf_reference.py, transformers 5.17 / torch 2.11, fp32 on CPU):
// a tiny random LlavaForConditionalGeneration saved by save_pretrained, the logits of every
// position for a prompt with one image, HF's greedy continuation, and CLIPImageProcessor's
// output for a test image. Nothing here was produced by our own code.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/io/image_io.h"
#include "engine/io/safetensors.h"
#include "engine/model/llava_model.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

std::string FixtureDir() { return ::llava::testing::SourceDir() + "/tests/data/hf_reference"; }

at::Tensor ReferenceTensor(const std::string& name) {
  auto file = SafetensorsFile::Open(FixtureDir() + "/reference.safetensors");
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  const TensorInfo* info = (*file)->Find(name);
  EXPECT_NE(info, nullptr) << name;
  EXPECT_EQ(info->dtype, DType::kF32);
  return at::from_blob(const_cast<uint8_t*>(info->data), info->shape, at::kFloat).clone();
}

nlohmann::json ReferenceJson() {
  return nlohmann::json::parse(::llava::testing::ReadFile(FixtureDir() + "/reference.json"));
}

std::unique_ptr<LlavaModel> LoadFixtureModel() {
  ModelOptions o;
  o.dtype = DType::kF32;
  auto m = LlavaModel::Load(FixtureDir() + "/model", o);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m).value() : nullptr;
}

TEST(HfParity, ConfigWrittenByTransformers5Loads) {
  auto model = LoadFixtureModel();
  ASSERT_NE(model, nullptr);
  const LlavaConfig& c = model->config();
  EXPECT_DOUBLE_EQ(c.text.rope_theta, 50000.0);  // from text_config.rope_parameters
  EXPECT_EQ(c.text.num_key_value_heads, 2);
  EXPECT_EQ(c.image_token_index, 319);
  EXPECT_EQ(c.image_tokens(), 25);
  EXPECT_EQ(c.image_processor.shortest_edge, 30);
}

TEST(HfParity, PromptLogitsMatchTransformers) {
  auto model = LoadFixtureModel();
  ASSERT_NE(model, nullptr);
  const nlohmann::json ref = ReferenceJson();
  const std::vector<int> ids = ref["input_ids"].get<std::vector<int>>();
  const int offset = ref["image_offset"].get<int>();
  at::Tensor features = model->EncodeImages(ReferenceTensor("pixel_values").unsqueeze(0));
  auto cache = model->NewFullCache();
  SequenceChunk chunk;
  chunk.embeds = model->EmbedPrompt(ids, {offset}, features);
  chunk.kv = cache.get();
  chunk.all_logits = true;
  at::Tensor logits = Pass(*model, {chunk});
  at::Tensor expected = ReferenceTensor("logits");
  ASSERT_EQ(logits.sizes(), expected.sizes());
  const double max_err = (logits - expected).abs().max().item<double>();
  EXPECT_LT(max_err, 1e-4) << "logit std " << expected.std().item<double>();
  EXPECT_TRUE(logits.argmax(-1).equal(expected.argmax(-1)));
}

TEST(HfParity, GreedyContinuationMatchesTransformersGenerate) {
  auto model = LoadFixtureModel();
  ASSERT_NE(model, nullptr);
  const nlohmann::json ref = ReferenceJson();
  const std::vector<int> ids = ref["input_ids"].get<std::vector<int>>();
  const auto expected = ref["greedy_continuation"].get<std::vector<int64_t>>();
  at::Tensor features = model->EncodeImages(ReferenceTensor("pixel_values").unsqueeze(0));
  auto cache = model->NewFullCache();
  SequenceChunk chunk;
  chunk.embeds = model->EmbedPrompt(ids, {ref["image_offset"].get<int>()}, features);
  chunk.kv = cache.get();
  std::vector<int64_t> got;
  int64_t position = static_cast<int64_t>(ids.size());
  at::Tensor logits = Pass(*model, {chunk});
  for (size_t i = 0; i < expected.size(); ++i) {
    const int64_t next = logits[0].argmax().item<int64_t>();
    got.push_back(next);
    chunk.embeds = model->Embed(at::tensor({next}, at::kLong));
    chunk.start_position = position++;
    logits = Pass(*model, {chunk});
  }
  EXPECT_EQ(got, expected);
}

// We resample as Pillow does (fixed-point weights, 8-bit rounding per pass), so at most one
// 8-bit level (1/255/std ~ 0.015 after normalisation) may differ; a one-pixel shift of the crop
// or OpenCV's own bicubic (tried first: mean 0.13 at size 30, a 2.8x downscale) fails this.
void CheckPreprocessing(int size) {
  const std::string bytes = ::llava::testing::ReadFile(FixtureDir() + "/image.png");
  auto image = DecodeImage(bytes, ImageLimits{}, "image");
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  ImageProcessorConfig config;
  config.shortest_edge = config.crop_height = config.crop_width = size;
  std::vector<float> ours = PreprocessImage(*image, config);
  at::Tensor expected = ReferenceTensor("image_" + std::to_string(size));
  ASSERT_EQ(static_cast<int64_t>(ours.size()), expected.numel());
  at::Tensor got = at::from_blob(ours.data(), expected.sizes(), at::kFloat);
  const double mean_err = (got - expected).abs().mean().item<double>();
  const double max_err = (got - expected).abs().max().item<double>();
  EXPECT_LT(mean_err, 0.002) << "size " << size;
  EXPECT_LT(max_err, 0.02) << "size " << size;
}

TEST(HfParity, ClipPreprocessingCloseToClipImageProcessor) {
  CheckPreprocessing(30);
  CheckPreprocessing(96);
}

}  // namespace
}  // namespace llava
