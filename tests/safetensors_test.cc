#include "engine/io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "tests/test_util.h"

namespace llava {
namespace {

using ::llava::testing::ReadFile;
using ::llava::testing::WriteFile;

std::string TmpPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

// Raw file: header length, header JSON, data bytes.
std::string RawFile(const std::string& header, size_t data_bytes) {
  std::string s(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s + header + std::string(data_bytes, '\x01');
}

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  const float a[6] = {1, 2, 3, 4, 5, 6};
  const uint16_t b[3] = {0x3F80, 0x4000, 0xC040};  // bf16 1, 2, -3
  const std::string path = TmpPath("rt.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"a", DType::kF32, {2, 3}, a}, {"b", DType::kBF16, {3}, b}},
                               {{"format", "pt"}})
                  .ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const TensorInfo* ta = (*f)->Find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, DType::kF32);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ta->data, a, sizeof(a)), 0);
  const TensorInfo* tb = (*f)->Find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(tb->nbytes, 6u);
  EXPECT_EQ(std::memcmp(tb->data, b, sizeof(b)), 0);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->Find("c"), nullptr);
}

// U8: the raw bytes of quantized weights (engine/model/quantized_checkpoint.h).
TEST(Safetensors, RoundTripsBytes) {
  const uint8_t q[4] = {0x00, 0x7f, 0x80, 0xff};
  const std::string path = TmpPath("u8.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"q", DType::kU8, {2, 2}, q}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const TensorInfo* t = (*f)->Find("q");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kU8);
  EXPECT_EQ(t->nbytes, 4u);
  EXPECT_EQ(std::memcmp(t->data, q, sizeof(q)), 0);
  EXPECT_NE(ReadFile(path).find(R"("dtype":"U8")"), std::string::npos);
}

int64_t RssFileBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssFile:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  return -1;
}

// A tensor's released pages leave the process's resident memory, and still read the same.
TEST(Safetensors, ReleasedPagesLeaveResidentMemoryAndReadTheSame) {
  std::vector<float> a(4 << 20);  // 16 MiB
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 1000);
  const std::string path = TmpPath("release.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"a", DType::kF32, {4, 1 << 20}, a.data()}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  const TensorInfo* t = (*f)->Find("a");
  ASSERT_NE(t, nullptr);
  auto sum = [&] {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      float v;
      std::memcpy(&v, t->data + 4 * i, 4);
      s += v;
    }
    return s;
  };
  const double before = sum();
  const int64_t touched = RssFileBytes();
  (*f)->ReleasePages(*t);
  const int64_t released = RssFileBytes();
  if (touched >= 0) {
    EXPECT_LT(released, touched - (12 << 20)) << touched << " -> " << released;
  }
  EXPECT_EQ(sum(), before);
}

struct BadCase {
  const char* name;
  std::string file;
  StatusCode code;
  const char* message_part;
};

TEST(Safetensors, RejectsMalformedFilesWithClearMessages) {
  const std::vector<BadCase> cases = {
      {"tiny", "abc", StatusCode::kDataLoss, "truncated"},
      {"header_past_end",
       RawFile(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4).substr(0, 30),
       StatusCode::kDataLoss, "header needs"},
      {"not_json", RawFile("{not json", 0), StatusCode::kDataLoss, "not a JSON object"},
      {"bad_dtype", RawFile(R"({"w":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})", 4),
       StatusCode::kInvalidArgument, "tensor 'w': unsupported dtype"},
      {"size_mismatch", RawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
       StatusCode::kDataLoss, "tensor 'w': 4 bytes for shape [2]"},
      {"truncated_data", RawFile(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
       StatusCode::kDataLoss, "truncated file"},
      {"overlap",
       RawFile(
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12),
       StatusCode::kDataLoss, "overlap"},
      // 2^40 x 2^24 elements wrap a 64-bit product to 0, which 0 bytes of data would match.
      {"wrapping_shape",
       RawFile(R"({"w":{"dtype":"F32","shape":[1099511627776,16777216],"data_offsets":[0,0]}})", 0),
       StatusCode::kDataLoss, "shape too large"},
      {"negative_shape", RawFile(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       StatusCode::kDataLoss, "bad shape"},
      {"missing_fields", RawFile(R"({"w":{"dtype":"F32"}})", 0), StatusCode::kDataLoss,
       "needs dtype, shape and data_offsets"},
      {"huge_header_len", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",
       StatusCode::kDataLoss, "implausible"},
  };
  for (const auto& c : cases) {
    const std::string path = TmpPath(std::string(c.name) + ".safetensors");
    WriteFile(path, c.file);
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << c.name;
    EXPECT_EQ(f.status().code(), c.code) << c.name << ": " << f.status().ToString();
    EXPECT_NE(f.status().message().find(c.message_part), std::string::npos)
        << c.name << ": " << f.status().message();
    EXPECT_NE(f.status().message().find(path), std::string::npos) << "names the file";
  }
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open(TmpPath("does-not-exist.safetensors"));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
}

// The buffer form (the fuzz target's way in) applies the file's checks and keeps the caller's
// bytes: tensors point into them.
TEST(Safetensors, FromBufferParsesInPlace) {
  const std::string bytes =
      RawFile(R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", 4);
  auto f = SafetensorsFile::FromBuffer(bytes.data(), bytes.size(), "in-memory");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ((*f)->tensors().size(), 1u);
  EXPECT_EQ((*f)->Find("w")->data,
            reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size() - 4);
  auto short_buffer = SafetensorsFile::FromBuffer(bytes.data(), 7, "in-memory");
  ASSERT_FALSE(short_buffer.ok());
  EXPECT_NE(short_buffer.status().message().find("in-memory: truncated"), std::string::npos);
  auto past_end = SafetensorsFile::FromBuffer(bytes.data(), bytes.size() - 1, "in-memory");
  EXPECT_FALSE(past_end.ok());
}

TEST(Safetensors, IndexYieldsEachPlainShardOnce) {
  auto shards = ParseSafetensorsIndex(
      R"({"weight_map":{"a":"m-1.safetensors","b":"m-2.safetensors","c":"m-1.safetensors"}})",
      "index.json");
  ASSERT_TRUE(shards.ok()) << shards.status().ToString();
  EXPECT_EQ(*shards, (std::vector<std::string>{"m-1.safetensors", "m-2.safetensors"}));
  for (const char* bad : {"../x.safetensors", "..", ".", "", "sub/x.safetensors"}) {
    const std::string json = std::string(R"({"weight_map":{"a":")") + bad + R"("}})";
    auto r = ParseSafetensorsIndex(json, "index.json");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(ParseSafetensorsIndex("[]", "index.json").ok());
  EXPECT_FALSE(ParseSafetensorsIndex(R"({"weight_map":{"a":1}})", "index.json").ok());
}

}  // namespace
}  // namespace llava
