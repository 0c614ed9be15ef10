#include "engine/serving/stop_strings.h"

#include <algorithm>

namespace llava {

std::string StopStringFilter::Push(const std::string& text, bool* stopped) {
  *stopped = stopped_;
  if (stopped_) return "";
  held_ += text;
  // Earliest complete stop string wins.
  size_t cut = std::string::npos;
  for (const auto& s : stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    stopped_ = *stopped = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > hold; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStringFilter::Flush() {
  std::string out;
  out.swap(held_);
  return stopped_ ? "" : out;
}

}  // namespace llava
