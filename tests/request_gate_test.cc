// What the request gate writes to the log: client strings cannot forge a line.
#include "server/request_gate.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>

namespace llava::server {
namespace {

TEST(LogSafe, EscapesWhatCouldForgeALineOrDriveATerminal) {
  EXPECT_EQ(LogSafe("plain text, UTF-8: élan 画像"), "plain text, UTF-8: élan 画像");
  EXPECT_EQ(LogSafe("a\nb\rc\td\\e"), "a\\nb\\rc\\td\\\\e");
  EXPECT_EQ(LogSafe(std::string("\x1b[31mred\x00", 9)), "\\x1b[31mred\\x00");
  EXPECT_EQ(LogSafe("del\x7f"), "del\\x7f");
  EXPECT_EQ(LogSafe("next line\xc2\x85x"), "next line\\xc2\\x85x");  // U+0085 (NEL)
  EXPECT_EQ(LogSafe("sep\xe2\x80\xa8x\xe2\x80\xa9"), "sep\\xe2\\x80\\xa8x\\xe2\\x80\\xa9");
  EXPECT_EQ(LogSafe("bad \xff\xfe utf-8 \xc3\xa9"), "bad \\xff\\xfe utf-8 \\xc3\\xa9");
  EXPECT_EQ(LogSafe(std::string(50, 'a'), 10), std::string(10, 'a') + "...");
  // A cut never leaves half a character.
  EXPECT_EQ(LogSafe("aaaaaaaaa\xc3\xa9", 10), "aaaaaaaaa...");
}

// A refusal whose message carries a client's string (here an OpenAI role) is one log line.
TEST(RequestGate, ARefusalCannotForgeALogLine) {
  std::ostringstream captured;
  auto logger = std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_st>(captured));
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);
  RequestGate gate(nullptr, nullptr);
  gate.Refused(InvalidArgument("messages[0].role 'x\n[2026-12-06 00:00:00.000] [info] request "
                               "id=forged api=openai finish=stop' is not supported"),
               "openai");
  RequestLog log;
  log.id = "req\r\n[info] forged";
  log.api = "grpc";
  LogRequest(log, StatusOr<GenerationResult>(InvalidArgument("image.mime_type 'a\nb'")), 0);
  spdlog::set_default_logger(previous);
  const std::string text = captured.str();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
  EXPECT_NE(text.find("role 'x\\n[2026-12-06"), std::string::npos) << text;
  EXPECT_NE(text.find("id=req\\r\\n[info] forged"), std::string::npos) << text;
}

}  // namespace
}  // namespace llava::server
