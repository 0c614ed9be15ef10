// Bounds what preparing requests (decoding their images) cost at once: at most `max_turns`
// requests, and at most `budget_bytes` of decode memory between them, each request claiming
// what its largest image takes to decode (ImageDecodeBytes, image_io.h). A request that claims
// more than the budget waits until it is alone. Torch-free; tests/prepare_gate_test.cc.
//
// Thread safety: any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace llava {

class PrepareGate {
 public:
  PrepareGate(int max_turns, int64_t budget_bytes)
      : turns_(max_turns > 0 ? max_turns : 1), budget_(budget_bytes) {}

  // Waits for a turn with `bytes` of the budget; gives both back when it goes out of scope.
  class Turn {
   public:
    Turn(PrepareGate* gate, int64_t bytes);
    ~Turn();
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

   private:
    PrepareGate* gate_;
    int64_t bytes_;
  };

  int64_t bytes_in_use() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int turns_;  // guarded by mu_: turns free
  const int64_t budget_;
  int64_t in_use_ = 0;  // guarded by mu_
  int holders_ = 0;     // guarded by mu_
};

inline PrepareGate::Turn::Turn(PrepareGate* gate, int64_t bytes) : gate_(gate), bytes_(bytes) {
  std::unique_lock<std::mutex> lock(gate_->mu_);
  gate_->cv_.wait(lock, [this] {
    return gate_->turns_ > 0 && (gate_->holders_ == 0 || gate_->in_use_ + bytes_ <= gate_->budget_);
  });
  --gate_->turns_;
  ++gate_->holders_;
  gate_->in_use_ += bytes_;
}

inline PrepareGate::Turn::~Turn() {
  {
    std::lock_guard<std::mutex> lock(gate_->mu_);
    ++gate_->turns_;
    --gate_->holders_;
    gate_->in_use_ -= bytes_;
  }
  gate_->cv_.notify_all();  // the bytes freed may let several smaller ones in
}

}  // namespace llava
