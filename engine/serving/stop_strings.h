// Stop-string detection over streamed text. Torch-free.
#pragma once

#include <string>
#include <vector>

namespace llava {

// Text arrives in pieces; text that could still be the start of a stop string is held back
// so a client never sees part of a stop string.
class StopStringFilter {
 public:
  explicit StopStringFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Adds `text`; returns what may be emitted now. Sets `*stopped` once a stop string has
  // appeared (the returned text then ends right before it, and later calls return "").
  std::string Push(const std::string& text, bool* stopped);
  // Releases the held-back text at the end of generation (no stop matched).
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace llava
