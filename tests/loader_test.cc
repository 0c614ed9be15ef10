#include <gtest/gtest.h>

#include <map>

#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "engine/serving/generator.h"
#include "tests/model_pass.h"
#include "tests/test_util.h"
#include "train/checkpoint_writer.h"

namespace llava {
using ::llava::testing::Pass;
namespace {

using ::llava::testing::ReadFile;
using ::llava::testing::TestData;
using ::llava::testing::WriteFile;

double Nmse(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).pow(2).sum().item<double>() / b.pow(2).sum().item<double>();
}

TEST(CanonicalNames, BothGenerationsMapToTheSameName) {
  const std::pair<const char*, const char*> pairs[] = {
      {"language_model.model.layers.3.mlp.up_proj.weight",
       "model.language_model.layers.3.mlp.up_proj.weight"},
      {"language_model.lm_head.weight", "lm_head.weight"},
      {"vision_tower.vision_model.pre_layrnorm.bias",
       "model.vision_tower.vision_model.pre_layrnorm.bias"},
      {"multi_modal_projector.linear_2.weight", "model.multi_modal_projector.linear_2.weight"},
  };
  for (const auto& [old_name, new_name] : pairs) {
    auto a = CanonicalTensorName(old_name), b = CanonicalTensorName(new_name);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
    EXPECT_EQ(CheckpointTensorName(*a, TensorNaming::kOld), old_name);
    EXPECT_EQ(CheckpointTensorName(*a, TensorNaming::kNew), new_name);
  }
  EXPECT_FALSE(CanonicalTensorName("transformer.h.0.attn.weight").ok());
}

// tiny-new (f32, one file, new names) and tiny-old (bf16, 3 shards + index, old names) hold
// the same seeded weights: loaded as f32 both give the same logits up to bf16 rounding.
TEST(Loader, BothNamingGenerationsAndShardingLoad) {
  ModelOptions f32;
  f32.dtype = DType::kF32;
  auto a = LlavaModel::Load(TestData() + "/tiny-new", f32);
  auto b = LlavaModel::Load(TestData() + "/tiny-old", f32);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  at::Tensor ids = at::arange(3, 20, at::kLong);
  auto ca = (*a)->NewFullCache(), cb = (*b)->NewFullCache();
  at::Tensor la = Pass(**a, {{(*a)->Embed(ids), 0, ca.get(), true}});
  at::Tensor lb = Pass(**b, {{(*b)->Embed(ids), 0, cb.get(), true}});
  EXPECT_LT(Nmse(lb, la), 1e-3);
  EXPECT_GT(Nmse(lb, la), 0.0) << "tiny-old is stored in bf16, so some rounding must show";
}

// The trainer's parameter list (the model's tensors, q/k/v and gate/up stacked) is the
// manifest's used tensors: what a trainer updates is what a checkpoint writer saves.
TEST(Loader, TrainableParametersAreTheManifestsUsedTensors) {
  ModelOptions f32;
  f32.dtype = DType::kF32;
  auto m = LlavaModel::Load(TestData() + "/tiny-new", f32);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  std::map<std::string, int64_t> params;  // name -> elements, stacked ones split by name
  for (auto& [name, t] : (*m)->MutableParameters()) {
    const size_t qkv = name.find(".qkv_proj."), gate_up = name.find(".gate_up_proj.");
    if (qkv != std::string::npos) {
      for (const char* part : {".q_proj.", ".k_proj.", ".v_proj."}) {
        params[name.substr(0, qkv) + part + name.substr(qkv + 10)] = 0;
      }
      params[name] = t->numel();  // checked against the parts' sum below
    } else if (gate_up != std::string::npos) {
      for (const char* part : {".gate_proj.", ".up_proj."}) {
        params[name.substr(0, gate_up) + part + name.substr(gate_up + 14)] = 0;
      }
      params[name] = t->numel();
    } else {
      params[name] = t->numel();
    }
  }
  std::map<std::string, int64_t> stacked;
  for (const WeightSpec& s : LlavaWeightManifest((*m)->config())) {
    if (!s.used) continue;
    auto it = params.find(s.name);
    ASSERT_NE(it, params.end()) << "not trained: " << s.name;
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    if (it->second == 0) {  // a part of a stacked tensor
      std::string whole = s.name;
      for (auto [part, to] : {std::pair{".q_proj.", ".qkv_proj."},
                              {".k_proj.", ".qkv_proj."},
                              {".v_proj.", ".qkv_proj."},
                              {".gate_proj.", ".gate_up_proj."},
                              {".up_proj.", ".gate_up_proj."}}) {
        const size_t at = whole.find(part);
        if (at != std::string::npos) whole.replace(at, std::string(part).size(), to);
      }
      stacked[whole] += n;
    } else {
      EXPECT_EQ(it->second, n) << s.name;
    }
    params.erase(it);
  }
  for (const auto& [whole, n] : stacked) {
    EXPECT_EQ(params[whole], n) << whole;
    params.erase(whole);
  }
  EXPECT_TRUE(params.empty()) << "not in the manifest: " << params.begin()->first;
}

// The count comes from the headers of every shard: tiny-old (3 shards, bf16) and tiny-new (one
// file, f32) hold the same tensors, as many elements as the writer's weights for the config.
TEST(Loader, ParameterCountReadsEveryShardsHeader) {
  const std::string dir = TestData() + "/tiny-new";
  int64_t expected = 0;
  for (const auto& [name, t] : RandomLlavaWeights(*LoadLlavaConfig(dir), 1, at::kFloat)) {
    expected += t.numel();
  }
  auto a = CheckpointParameterCount(dir), b = CheckpointParameterCount(TestData() + "/tiny-old");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(*a, expected);
  EXPECT_EQ(*b, expected);
  EXPECT_FALSE(CheckpointParameterCount(TestData() + "/no-such-model").ok());
}

class BrokenCheckpointTest : public ::testing::Test {
 protected:
  // A fresh copy of tiny-new in its own folder.
  std::string Copy(const std::string& name) {
    const std::string dir = ::testing::TempDir() + "/" + name;
    std::system(
        ("rm -rf '" + dir + "' && cp -r '" + TestData() + "/tiny-new' '" + dir + "'").c_str());
    return dir;
  }
  static LlavaConfig Config(const std::string& dir) { return *LoadLlavaConfig(dir); }
  static Status LoadStatus(const std::string& dir) {
    auto m = LlavaModel::Load(dir, ModelOptions());
    return m.ok() ? Status::Ok() : m.status();
  }
  static std::vector<std::pair<std::string, at::Tensor>> Weights(const LlavaConfig& c) {
    return RandomLlavaWeights(c, 1, at::kFloat);
  }
};

TEST_F(BrokenCheckpointTest, MissingTensorIsNamed) {
  const std::string dir = Copy("missing");
  auto w = Weights(Config(dir));
  w.erase(std::remove_if(w.begin(), w.end(),
                         [](const auto& p) { return p.first == "lm.layers.1.mlp.up_proj.weight"; }),
          w.end());
  ASSERT_TRUE(WriteLlavaCheckpoint(dir, Config(dir), w, TensorNaming::kNew, 1).ok());
  Status s = LoadStatus(dir);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("missing tensor 'lm.layers.1.mlp.up_proj.weight'"), std::string::npos)
      << s.message();
}

TEST_F(BrokenCheckpointTest, UnexpectedTensorIsNamed) {
  const std::string dir = Copy("unexpected");
  auto w = Weights(Config(dir));
  w.emplace_back("lm.layers.7.mlp.up_proj.weight", at::zeros({2, 2}));
  ASSERT_TRUE(WriteLlavaCheckpoint(dir, Config(dir), w, TensorNaming::kNew, 1).ok());
  Status s = LoadStatus(dir);
  EXPECT_NE(s.message().find("model.language_model.layers.7.mlp.up_proj.weight"), std::string::npos)
      << s.message();
}

TEST_F(BrokenCheckpointTest, ShapeMismatchNamesTensorAndShapes) {
  const std::string dir = Copy("shape");
  std::string cfg = ReadFile(dir + "/config.json");
  const std::string from = "\"intermediate_size\": 128";
  ASSERT_NE(cfg.find(from), std::string::npos);
  cfg.replace(cfg.find(from), from.size(), "\"intermediate_size\": 96");
  WriteFile(dir + "/config.json", cfg);
  Status s = LoadStatus(dir);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("mlp.gate_proj.weight' has shape [128, 64], config implies [96, 64]"),
            std::string::npos)
      << s.message();
}

TEST_F(BrokenCheckpointTest, TruncatedShardIsNamed) {
  const std::string dir = Copy("truncated");
  const std::string bytes = ReadFile(dir + "/model.safetensors");
  WriteFile(dir + "/model.safetensors", bytes.substr(0, bytes.size() - 1000));
  Status s = LoadStatus(dir);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find(dir + "/model.safetensors"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
}

TEST_F(BrokenCheckpointTest, MissingConfigAndFolder) {
  const std::string dir = Copy("noconfig");
  std::remove((dir + "/config.json").c_str());
  EXPECT_EQ(LoadStatus(dir).code(), StatusCode::kNotFound);
  EXPECT_EQ(LoadStatus("/nonexistent/model").code(), StatusCode::kNotFound);
}

TEST_F(BrokenCheckpointTest, TokenizerLargerThanModelVocabIsRejected) {
  const std::string dir = Copy("vocab");
  std::string cfg = ReadFile(dir + "/config.json");
  auto c = Config(dir);
  c.text.vocab_size = 300;  // below the tokenizer's 400 pieces
  ASSERT_TRUE(WriteLlavaCheckpoint(dir, c, Weights(c), TensorNaming::kNew, 1).ok());
  auto loaded = LoadModel(dir, ModelOptions());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("text_config.vocab_size"), std::string::npos);
}

}  // namespace
}  // namespace llava
