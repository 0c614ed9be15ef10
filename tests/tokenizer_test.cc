#include "engine/io/tokenizer.h"

#include <gtest/gtest.h>

#include <sstream>

#include "engine/io/utf8.h"
#include "tests/test_util.h"

namespace llava {
namespace {

using ::llava::testing::ReadFile;
using ::llava::testing::RunCommand;
using ::llava::testing::SourceDir;
using ::llava::testing::TestData;

std::string ModelPath() { return TestData() + "/tiny-new/tokenizer.model"; }
std::string CorpusPath() { return SourceDir() + "/tests/data/tokenizer_corpus.txt"; }

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

std::vector<int> ParseIds(const std::string& line) {
  std::istringstream in(line);
  std::vector<int> ids;
  int id;
  while (in >> id) ids.push_back(id);
  return ids;
}

class TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::Load(ModelPath());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(t).value();
  }
  std::unique_ptr<Tokenizer> tok_;
};

// The reference is sentencepiece itself, run as a separate process.
TEST_F(TokenizerTest, MatchesSpmEncodeTokenForToken) {
  const std::vector<std::string> corpus = Lines(ReadFile(CorpusPath()));
  ASSERT_GT(corpus.size(), 10u);
  const std::vector<std::string> expected = Lines(RunCommand(
      "spm_encode --model='" + ModelPath() + "' --output_format=id < '" + CorpusPath() + "'"));
  ASSERT_EQ(expected.size(), corpus.size()) << "spm_encode failed or is not installed";
  for (size_t i = 0; i < corpus.size(); ++i) {
    EXPECT_EQ(tok_->Encode(corpus[i]), ParseIds(expected[i])) << "line " << i << ": " << corpus[i];
  }
}

TEST_F(TokenizerTest, MatchesSpmDecode) {
  const std::vector<std::string> corpus = Lines(ReadFile(CorpusPath()));
  const std::string ids_path = ::testing::TempDir() + "/ids.txt";
  std::string ids_text;
  for (const auto& line : corpus) {
    std::vector<int> ids = tok_->Encode(line);
    for (size_t k = 0; k < ids.size(); ++k) ids_text += (k ? " " : "") + std::to_string(ids[k]);
    ids_text += "\n";
  }
  ::llava::testing::WriteFile(ids_path, ids_text);
  const std::vector<std::string> expected = Lines(RunCommand(
      "spm_decode --model='" + ModelPath() + "' --input_format=id < '" + ids_path + "'"));
  ASSERT_EQ(expected.size(), corpus.size());
  for (size_t i = 0; i < corpus.size(); ++i) {
    EXPECT_EQ(tok_->Decode(tok_->Encode(corpus[i])), expected[i]) << "line " << i;
  }
}

TEST_F(TokenizerTest, DecodeInvertsEncode) {
  std::vector<std::string> texts = Lines(ReadFile(CorpusPath()));
  texts.push_back("line one\nline two\n\nline four\r\n");
  texts.push_back("\xF0\x9F\x98\x80\xF0\x9F\x98\x80 double emoji");
  for (const auto& t : texts) {
    EXPECT_EQ(tok_->Decode(tok_->Encode(t)), t);
  }
}

TEST_F(TokenizerTest, StreamingNeverSplitsACharacter) {
  const std::string text = "東京 😀🎉 Zürich ☃ done";
  const std::vector<int> ids = tok_->Encode(text);
  StreamDecoder dec(*tok_);
  std::string joined;
  int byte_pieces = 0;
  for (int id : ids) {
    if (tok_->IdToPiece(id).rfind("<0x", 0) == 0) ++byte_pieces;
    std::string part = dec.Push(id);
    EXPECT_TRUE(IsValidUtf8(part)) << "partial character emitted after id " << id;
    joined += part;
  }
  joined += dec.Flush();
  EXPECT_GT(byte_pieces, 0) << "the text should need byte fallback in a tiny vocabulary";
  EXPECT_EQ(joined, text);
}

TEST_F(TokenizerTest, SpecialTokensOnlyWhenAllowed) {
  const int image_id = tok_->PieceToId("<image>");
  ASSERT_GE(image_id, 0);
  std::vector<int> with = tok_->Encode("a<image>b");
  EXPECT_NE(std::find(with.begin(), with.end(), image_id), with.end());
  Tokenizer::EncodeOptions untrusted;
  untrusted.parse_special = false;
  std::vector<int> without = tok_->Encode("a<image>b", untrusted);
  EXPECT_EQ(std::find(without.begin(), without.end(), image_id), without.end());
  EXPECT_EQ(tok_->Decode(without), "a<image>b");
}

TEST_F(TokenizerTest, BosAndDummyPrefixOptions) {
  Tokenizer::EncodeOptions o;
  o.add_bos = true;
  std::vector<int> ids = tok_->Encode("hello", o);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], tok_->bos_id());
  EXPECT_EQ(tok_->IdToPiece(tok_->bos_id()), "<s>");
  EXPECT_EQ(tok_->IdToPiece(tok_->eos_id()), "</s>");
  o.add_bos = false;
  o.dummy_prefix = false;
  std::vector<int> bare = tok_->Encode("hello", o);
  // Without the dummy prefix the first piece does not start with U+2581.
  EXPECT_NE(tok_->IdToPiece(bare[0]).rfind("\xE2\x96\x81", 0), 0u);
}

TEST(TokenizerLoad, RejectsGarbage) {
  auto t = Tokenizer::FromProtoBytes("this is not a protobuf \xff\xff", "garbage.model");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("garbage.model"), std::string::npos);
  auto missing = Tokenizer::Load("/nonexistent/tokenizer.model");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace llava
