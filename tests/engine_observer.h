// A RequestObserver for engine tests: collects the streamed text and the final result, and
// lets the test thread wait for the end.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>

#include "engine/serving/engine.h"

namespace llava {
namespace testing {

class Collector : public RequestObserver {
 public:
  void OnAdmitted(double) override {
    std::lock_guard<std::mutex> l(mu_);
    admitted_ = true;
  }
  void OnText(const std::string& delta) override {
    std::lock_guard<std::mutex> l(mu_);
    text_ += delta;
    ++deltas_;
  }
  void OnFinished(const StatusOr<GenerationResult>& r) override {
    std::lock_guard<std::mutex> l(mu_);
    ++finished_;
    result_ = r.ok() ? std::optional<GenerationResult>(*r) : std::nullopt;
    status_ = r.status();
    cv_.notify_all();
  }
  bool Wait(std::chrono::seconds timeout = std::chrono::seconds(60)) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, timeout, [&] { return finished_ > 0; });
  }
  int deltas() {
    std::lock_guard<std::mutex> l(mu_);
    return deltas_;
  }
  // For a test that polls while the engine runs (the engine thread writes it under mu_;
  // ThreadSanitizer found the polls reading it unlocked). After Wait() the fields can be read.
  int finished() {
    std::lock_guard<std::mutex> l(mu_);
    return finished_;
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::string text_;
  int deltas_ = 0, finished_ = 0;
  bool admitted_ = false;
  std::optional<GenerationResult> result_;
  Status status_;
};

}  // namespace testing
}  // namespace llava
