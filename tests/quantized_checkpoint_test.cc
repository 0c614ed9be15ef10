// Checkpoints with quantized weights (engine/model/quantized_checkpoint.h): written from both
// naming generations, loaded to exactly the model that quantizing at load gives, and every
// malformed file refused with the tensor named.
#include "engine/model/quantized_checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "engine/io/safetensors.h"
#include "engine/model/llava_model.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

namespace fs = std::filesystem;
using ::llava::testing::ReadFile;
using ::llava::testing::TestData;
using ::llava::testing::WriteFile;

std::string Fresh(const std::string& name) {
  const std::string dir = TestData() + "/quantized-" + name;
  fs::remove_all(dir);
  return dir;
}

StatusOr<std::unique_ptr<LlavaModel>> Load(const std::string& dir, DType dtype,
                                           WeightFormat weights = WeightFormat::kBf16) {
  ModelOptions o;
  o.dtype = dtype;
  o.weights = weights;
  return LlavaModel::Load(dir, o);
}

// Logits of an 80-token prefill (the dequantized panels), then of 3 decoded tokens (the GEMV).
at::Tensor Logits(const LlavaModel& m) {
  at::manual_seed(5);
  const at::Tensor ids = at::randint(3, m.config().text.vocab_size, {83}, at::kLong);
  auto cache = m.NewFullCache();
  std::vector<at::Tensor> out = {Pass(m, {{m.Embed(ids.narrow(0, 0, 80)), 0, cache.get(), true}})};
  for (int64_t t = 80; t < 83; ++t) {
    out.push_back(
        Pass(m, {{m.Embed(ids.narrow(0, t, 1)), cache->NextPosition(), cache.get(), false}}));
  }
  return at::cat(out, 0);
}

// Copies checkpoint folder `src` (one model.safetensors) to `dst`, its tensors passed through
// `edit` first (which may change, drop or add entries; `keep` holds new data alive).
void Rewrite(const std::string& src, const std::string& dst,
             const std::function<void(std::vector<TensorToWrite>*,
                                      std::deque<std::vector<uint8_t>>*)>& edit) {
  fs::remove_all(dst);
  fs::copy(src, dst);
  auto f = SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::vector<TensorToWrite> tensors;
  for (const TensorInfo& t : (*f)->tensors()) tensors.push_back({t.name, t.dtype, t.shape, t.data});
  std::deque<std::vector<uint8_t>> keep;
  edit(&tensors, &keep);
  fs::remove(dst + "/model.safetensors");
  ASSERT_TRUE(WriteSafetensors(dst + "/model.safetensors", tensors, (*f)->metadata()).ok());
}

TensorToWrite* Named(std::vector<TensorToWrite>* tensors, const std::string& name) {
  for (TensorToWrite& t : *tensors) {
    if (t.name == name) return &t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return nullptr;
}

TEST(QuantizedCheckpoint, LoadsToExactlyTheModelThatQuantizingAtLoadGives) {
  // tiny-new: f32, one file, new names; tiny-old: bf16, 3 shards and an index, old names.
  for (const std::string name : {"tiny-new", "tiny-old"}) {
    for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
      SCOPED_TRACE(name + " " + WeightFormatName(f));
      const std::string dir = Fresh(name + "-" + WeightFormatName(f));
      std::string summary;
      ASSERT_TRUE(WriteQuantizedCheckpoint(TestData() + "/" + name, dir, f, &summary).ok());
      EXPECT_NE(summary.find("linear layers in"), std::string::npos) << summary;
      EXPECT_TRUE(fs::exists(dir + "/config.json"));
      EXPECT_TRUE(fs::exists(dir + "/tokenizer.model"));
      EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));

      auto file = SafetensorsFile::Open(dir + "/model.safetensors");
      ASSERT_TRUE(file.ok());
      const std::string layer = name == "tiny-old" ? "language_model.model.layers.1.mlp.down_proj"
                                                   : "model.language_model.layers.1.mlp.down_proj";
      const TensorInfo* q = (*file)->Find(layer + ".qweight");
      ASSERT_NE(q, nullptr);
      EXPECT_EQ(q->dtype, DType::kU8);
      EXPECT_EQ((*file)->Find(layer + ".weight"), nullptr);
      EXPECT_EQ((*file)->Find(layer + ".mins") != nullptr, f == WeightFormat::kInt4);
      EXPECT_EQ((*file)->metadata().at("llava.weights"), WeightFormatName(f));
      // The vision tower is copied as it was.
      EXPECT_NE((*file)->Find(name == "tiny-old" ? "multi_modal_projector.linear_1.weight"
                                                 : "model.multi_modal_projector.linear_1.weight"),
                nullptr);

      auto saved = Load(dir, DType::kF32);  // --weights left at its default: the file decides
      ASSERT_TRUE(saved.ok()) << saved.status().ToString();
      EXPECT_EQ((*saved)->options().weights, f);
      auto same = Load(dir, DType::kF32, f);
      ASSERT_TRUE(same.ok()) << same.status().ToString();
      auto at_load = Load(TestData() + "/" + name, DType::kF32, f);
      ASSERT_TRUE(at_load.ok()) << at_load.status().ToString();
      const at::Tensor a = Logits(**saved), b = Logits(**at_load);
      EXPECT_TRUE(at::equal(a, b)) << (a - b).abs().max().item<float>();
      auto plain = Load(TestData() + "/" + name, DType::kF32);
      ASSERT_TRUE(plain.ok());
      EXPECT_FALSE(at::equal(a, Logits(**plain))) << "the saved weights were not quantized";
    }
  }
}

TEST(QuantizedCheckpoint, TiedEmbeddingsStayAndTheOutputProjectionIsQuantized) {
  // tiny-new without its lm_head and with tied embeddings.
  const std::string tied = Fresh("tied-src");
  Rewrite(TestData() + "/tiny-new", tied, [](auto* tensors, auto*) {
    tensors->erase(
        std::remove_if(tensors->begin(), tensors->end(),
                       [](const TensorToWrite& t) { return t.name == "lm_head.weight"; }),
        tensors->end());
  });
  nlohmann::json config = nlohmann::json::parse(ReadFile(tied + "/config.json"));
  config["text_config"]["tie_word_embeddings"] = true;
  config["tie_word_embeddings"] = true;
  WriteFile(tied + "/config.json", config.dump());

  const std::string dir = Fresh("tied-int4");
  ASSERT_TRUE(WriteQuantizedCheckpoint(tied, dir, WeightFormat::kInt4).ok());
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  EXPECT_NE((*file)->Find("model.language_model.embed_tokens.weight"), nullptr);
  const TensorInfo* head = (*file)->Find("lm_head.qweight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->shape[1] % 32, 0) << "the output projection is int8: a byte per weight";
  EXPECT_EQ((*file)->Find("lm_head.mins"), nullptr);

  auto saved = Load(dir, DType::kF32);
  auto at_load = Load(tied, DType::kF32, WeightFormat::kInt4);
  ASSERT_TRUE(saved.ok()) << saved.status().ToString();
  ASSERT_TRUE(at_load.ok()) << at_load.status().ToString();
  EXPECT_TRUE(at::equal(Logits(**saved), Logits(**at_load)));
}

TEST(QuantizedCheckpoint, WriterRefusesWhatItCannotWrite) {
  const std::string src = TestData() + "/tiny-new";
  const std::string dir = Fresh("refusals");
  Status s = WriteQuantizedCheckpoint(src, dir, WeightFormat::kBf16);
  EXPECT_NE(s.message().find("int8 or int4"), std::string::npos) << s.ToString();
  s = WriteQuantizedCheckpoint(src, src, WeightFormat::kInt8);
  EXPECT_NE(s.message().find("another folder"), std::string::npos) << s.ToString();
  ASSERT_TRUE(WriteQuantizedCheckpoint(src, dir, WeightFormat::kInt8).ok());
  s = WriteQuantizedCheckpoint(src, dir, WeightFormat::kInt8);
  EXPECT_NE(s.message().find("already holds model.safetensors"), std::string::npos) << s.ToString();
  s = WriteQuantizedCheckpoint(dir, Fresh("twice"), WeightFormat::kInt4);
  EXPECT_NE(s.message().find("already quantized"), std::string::npos) << s.ToString();
}

TEST(QuantizedCheckpoint, MalformedFilesAreRefusedWithTheTensorNamed) {
  const std::string int4 = Fresh("malformed-int4");
  ASSERT_TRUE(WriteQuantizedCheckpoint(TestData() + "/tiny-new", int4, WeightFormat::kInt4).ok());
  auto refused = [](const std::string& dir, WeightFormat w, const std::string& part) {
    auto m = Load(dir, DType::kF32, w);
    ASSERT_FALSE(m.ok()) << "loaded " << dir;
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find(part), std::string::npos) << m.status().ToString();
  };
  refused(int4, WeightFormat::kInt8, "the checkpoint holds int4 weights");

  const std::string p = "model.language_model.layers.0.self_attn.k_proj";
  const std::string c = "lm.layers.0.self_attn.k_proj";  // its canonical name, in errors
  const std::string bad = TestData() + "/quantized-malformed-edit";
  // Scales of the wrong shape.
  Rewrite(int4, bad, [&](auto* tensors, auto*) { Named(tensors, p + ".scales")->shape[1] -= 1; });
  // (WriteSafetensors writes numel * size bytes: the shorter tensor is a valid file.)
  refused(bad, WeightFormat::kBf16, c + ".scales");
  // A NaN scale.
  Rewrite(int4, bad, [&](auto* tensors, auto* keep) {
    TensorToWrite* t = Named(tensors, p + ".scales");
    const size_t n = t->shape[0] * t->shape[1] * 2;
    std::vector<uint8_t>& copy = keep->emplace_back(static_cast<const uint8_t*>(t->data),
                                                    static_cast<const uint8_t*>(t->data) + n);
    copy[2] = 0x00;
    copy[3] = 0x7e;  // fp16 NaN
    t->data = copy.data();
  });
  refused(bad, WeightFormat::kBf16, c + ".scales' holds a NaN");
  // int4 values without their minimums.
  Rewrite(int4, bad, [&](auto* tensors, auto*) {
    tensors->erase(Named(tensors, p + ".mins") - tensors->data() + tensors->begin());
  });
  refused(bad, WeightFormat::kBf16, c + ".mins' is missing");
  // Values of neither format's width.
  Rewrite(int4, bad, [&](auto* tensors, auto*) { Named(tensors, p + ".qweight")->shape[1] -= 4; });
  refused(bad, WeightFormat::kBf16, c + ".qweight");
  // One projection plain beside quantized ones.
  auto src = SafetensorsFile::Open(TestData() + "/tiny-new/model.safetensors");
  ASSERT_TRUE(src.ok());
  const TensorInfo* plain = (*src)->Find(p + ".weight");
  ASSERT_NE(plain, nullptr);
  Rewrite(int4, bad, [&](auto* tensors, auto*) {
    for (const char* suffix : {".qweight", ".scales", ".mins"}) {
      tensors->erase(Named(tensors, p + suffix) - tensors->data() + tensors->begin());
    }
    tensors->push_back({plain->name, plain->dtype, plain->shape, plain->data});
  });
  refused(bad, WeightFormat::kBf16, "mixes formats, or quantized and plain parts");
}

}  // namespace
}  // namespace llava
