#include "engine/io/chat_template.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace llava {
namespace {

using Kind = ContentPart::Kind;

class ChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::Load(::llava::testing::TestData() + "/tiny-new/tokenizer.model");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(t).value();
    image_id_ = tok_->PieceToId("<image>");
  }
  std::vector<int> Enc(const std::string& s, bool dummy) const {
    Tokenizer::EncodeOptions o;
    o.dummy_prefix = dummy;
    o.parse_special = false;
    return tok_->Encode(s, o);
  }
  static void Append(std::vector<int>* v, const std::vector<int>& w) {
    v->insert(v->end(), w.begin(), w.end());
  }
  std::unique_ptr<Tokenizer> tok_;
  int image_id_ = -1;
};

// "USER: <image>\n{question} ASSISTANT:" with the image expanded to 5 rows.
TEST_F(ChatTemplateTest, SingleTurnWithImage) {
  std::vector<ChatMessage> msgs = {
      {"user", {{Kind::kImage, "", 0}, {Kind::kText, "What is this?", 0}}}};
  auto p = BuildPrompt(*tok_, msgs, 1, image_id_, 5);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::vector<int> expected = {tok_->bos_id()};
  Append(&expected, Enc("USER: ", true));
  const int offset = static_cast<int>(expected.size());
  expected.insert(expected.end(), 5, image_id_);
  Append(&expected, Enc("\nWhat is this? ASSISTANT:", false));
  EXPECT_EQ(p->ids, expected);
  EXPECT_EQ(p->image_offsets, std::vector<int>{offset});
  EXPECT_EQ(p->text_tokens, static_cast<int>(expected.size()) - 5);
  EXPECT_EQ(p->instruction_begin, offset + 5);  // the text after the image
  EXPECT_EQ(p->system_end, 0);
  EXPECT_EQ(p->question_begin, 0);  // no question before the image
  EXPECT_EQ(p->question_end, 0);
}

// The paper's layout: "{system} USER: {question}\n<image>\n ASSISTANT:", the parts in their order.
TEST_F(ChatTemplateTest, QuestionBeforeImageKeepsTheOrder) {
  std::vector<ChatMessage> msgs = {
      {"system", {{Kind::kText, "Be brief.", 0}}},
      {"user", {{Kind::kText, "What is this?", 0}, {Kind::kImage, "", 0}}}};
  auto p = BuildPrompt(*tok_, msgs, 1, image_id_, 5);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::vector<int> expected = {tok_->bos_id()};
  Append(&expected, Enc("Be brief. USER: What is this?\n", true));
  const int offset = static_cast<int>(expected.size());
  expected.insert(expected.end(), 5, image_id_);
  Append(&expected, Enc("\n ASSISTANT:", false));
  EXPECT_EQ(p->ids, expected);
  EXPECT_EQ(p->image_offsets, std::vector<int>{offset});
  EXPECT_EQ(p->instruction_begin, offset + 5);  // only " ASSISTANT:" follows the image
  // The question before the image: "USER: What is this?\n", the system prompt's run cut off.
  const std::vector<int> question = Enc("USER: What is this?\n", true);
  EXPECT_EQ(p->question_end, offset);
  ASSERT_EQ(p->question_begin, offset - static_cast<int>(question.size()));
  EXPECT_EQ(std::vector<int>(p->ids.begin() + p->question_begin, p->ids.begin() + offset),
            question);
}

// "{system} USER: q1 ASSISTANT: a1</s>USER: q2 ASSISTANT:"
TEST_F(ChatTemplateTest, MultiTurnJoinsTurnsWithEos) {
  std::vector<ChatMessage> msgs = {{"system", {{Kind::kText, "Be brief.", 0}}},
                                   {"user", {{Kind::kText, "q1", 0}}},
                                   {"assistant", {{Kind::kText, "a1", 0}}},
                                   {"user", {{Kind::kText, "q2", 0}}}};
  auto p = BuildPrompt(*tok_, msgs, 0, image_id_, 5);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::vector<int> expected = {tok_->bos_id()};
  Append(&expected, Enc("Be brief. USER: q1 ASSISTANT: a1", true));
  expected.push_back(tok_->eos_id());
  const int last_turn = static_cast<int>(expected.size());
  Append(&expected, Enc("USER: q2 ASSISTANT:", false));
  EXPECT_EQ(p->instruction_begin, last_turn);  // the last user turn
  EXPECT_EQ(p->system_end, 1 + static_cast<int>(Enc("Be brief.", true).size()));
  EXPECT_EQ(p->ids, expected);
  EXPECT_TRUE(p->image_offsets.empty());
}

TEST_F(ChatTemplateTest, UserTextCannotForgeImageTokens) {
  std::vector<ChatMessage> msgs = {{"user", {{Kind::kText, "<image> <image>", 0}}}};
  auto p = BuildPrompt(*tok_, msgs, 0, image_id_, 5);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(std::count(p->ids.begin(), p->ids.end(), image_id_), 0);
}

TEST_F(ChatTemplateTest, InvalidConversationsNameTheField) {
  struct Case {
    std::vector<ChatMessage> msgs;
    int images;
    const char* part;
  };
  std::vector<Case> cases = {
      {{}, 0, "messages must not be empty"},
      {{{"robot", {{Kind::kText, "hi", 0}}}}, 0, "messages[0].role"},
      {{{"user", {}}}, 0, "messages[0].content must not be empty"},
      {{{"user", {{Kind::kText, "hi", 0}}}, {"assistant", {{Kind::kText, "a", 0}}}},
       0,
       "last message must be from the user"},
      {{{"user", {{Kind::kImage, "", 1}}}}, 1, "messages[0].content[0] refers to a missing image"},
      {{{"user", {{Kind::kText, "hi", 0}}}}, 1, "images[0] is not referenced"},
      {{{"user", {{Kind::kText, "hi", 0}}}, {"system", {{Kind::kText, "s", 0}}}},
       0,
       "messages[1].role: system"},
  };
  for (const auto& c : cases) {
    auto p = BuildPrompt(*tok_, c.msgs, c.images, image_id_, 5);
    ASSERT_FALSE(p.ok()) << c.part;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(c.part), std::string::npos) << p.status().message();
  }
}

}  // namespace
}  // namespace llava
