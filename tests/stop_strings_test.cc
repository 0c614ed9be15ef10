#include "engine/serving/stop_strings.h"

#include <gtest/gtest.h>

#include "engine/io/utf8.h"

namespace llava {
namespace {

TEST(StopStrings, HoldsBackPartialMatchAndCutsAtStop) {
  StopStringFilter f({"STOP", "END"});
  bool stopped = false;
  EXPECT_EQ(f.Push("Hel", &stopped), "Hel");
  EXPECT_EQ(f.Push("lo ST", &stopped), "lo ");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(f.Push("OP more", &stopped), "");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(f.Push("after", &stopped), "");
  EXPECT_EQ(f.Flush(), "");
}

TEST(StopStrings, ReleasesHeldTextWhenNoStopFollows) {
  StopStringFilter f({"STOP"});
  bool stopped = false;
  EXPECT_EQ(f.Push("a ST", &stopped), "a ");
  EXPECT_EQ(f.Push("ILL", &stopped), "STILL");
  EXPECT_EQ(f.Push(" S", &stopped), " ");
  EXPECT_EQ(f.Flush(), "S");
  EXPECT_FALSE(stopped);
}

TEST(StopStrings, EarliestStopWins) {
  StopStringFilter f({"cd", "b"});
  bool stopped = false;
  EXPECT_EQ(f.Push("abcd", &stopped), "a");
  EXPECT_TRUE(stopped);
}

TEST(Utf8, IncompleteTailAndValidity) {
  const std::string euro = "\xE2\x82\xAC";
  EXPECT_EQ(Utf8IncompleteTail("ab" + euro), 0u);
  EXPECT_EQ(Utf8IncompleteTail("ab" + euro.substr(0, 2)), 2u);
  EXPECT_EQ(Utf8IncompleteTail("ab" + euro.substr(0, 1)), 1u);
  EXPECT_TRUE(IsValidUtf8("ab" + euro));
  EXPECT_FALSE(IsValidUtf8("ab" + euro.substr(0, 2)));
  EXPECT_FALSE(IsValidUtf8("\x80"));
  EXPECT_FALSE(IsValidUtf8("\xC0\x80"));          // overlong NUL
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));      // surrogate U+D800
  EXPECT_FALSE(IsValidUtf8("\xF4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xE0\x80\xAF"));      // overlong '/'
  EXPECT_TRUE(IsValidUtf8("\xF4\x8F\xBF\xBF"));   // U+10FFFF
  EXPECT_TRUE(IsValidUtf8("\xED\x9F\xBF"));       // U+D7FF
}

}  // namespace
}  // namespace llava
