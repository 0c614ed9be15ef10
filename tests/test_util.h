// Helpers shared by the tests.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace llava::testing {

// Folder the ctest fixture `make_tiny_checkpoints` fills (tiny-new, tiny-old).
inline std::string TestData() {
  const char* d = std::getenv("LLAVA_TEST_DATA");
  return d != nullptr ? d : "build/test-data";
}

inline std::string SourceDir() { return LLAVA_SOURCE_DIR; }

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Resident anonymous memory of this process, from /proc/self/status (-1 where there is none).
inline int64_t RssAnonBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  return -1;
}

// Runs a shell command, returns its stdout.
inline std::string RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

}  // namespace llava::testing
