// Bounds what preparing requests (decoding their images) cost at once: at most `max_turns`
// requests, and at most `budget_bytes` of decode memory between them, each request claiming
// what its largest image takes to decode (ImageDecodeBytes, image_io.h). A request that claims
// more than the budget waits until it is alone. Waiting is bounded too: a claim that does not
// fit the budget now may wait only if nothing else waits for the budget, or if the claims that
// wait fit in one budget with it; else it is refused at once (`admitted()` false), so that a
// burst of image bombs cannot hold every thread that submits requests (a request whose claim
// fits goes ahead of the waiting ones). Torch-free; tests/prepare_gate_test.cc.
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

  // Waits for a turn with `bytes` of the budget, or is refused at once (see above); gives
  // what it took back when it goes out of scope.
  class Turn {
   public:
    Turn(PrepareGate* gate, int64_t bytes);
    ~Turn();
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    bool admitted() const { return admitted_; }

   private:
    PrepareGate* gate_;
    int64_t bytes_;
    bool admitted_ = false;
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
  int64_t in_use_ = 0;   // guarded by mu_
  int holders_ = 0;      // guarded by mu_
  int64_t waiting_ = 0;  // guarded by mu_: the claims waiting for the budget
  int waiters_ = 0;      // guarded by mu_: how many
};

inline PrepareGate::Turn::Turn(PrepareGate* gate, int64_t bytes) : gate_(gate), bytes_(bytes) {
  PrepareGate& g = *gate_;
  std::unique_lock<std::mutex> lock(g.mu_);
  const auto fits = [&] { return g.holders_ == 0 || g.in_use_ + bytes_ <= g.budget_; };
  const bool waits_for_budget = !fits();
  if (waits_for_budget) {
    if (g.waiters_ > 0 && g.waiting_ + bytes_ > g.budget_) return;  // refused
    g.waiting_ += bytes_;
    ++g.waiters_;
  }
  g.cv_.wait(lock, [&] { return g.turns_ > 0 && fits(); });
  if (waits_for_budget) {
    g.waiting_ -= bytes_;
    --g.waiters_;
  }
  --g.turns_;
  ++g.holders_;
  g.in_use_ += bytes_;
  admitted_ = true;
}

inline PrepareGate::Turn::~Turn() {
  if (!admitted_) return;
  {
    std::lock_guard<std::mutex> lock(gate_->mu_);
    ++gate_->turns_;
    --gate_->holders_;
    gate_->in_use_ -= bytes_;
  }
  gate_->cv_.notify_all();  // the bytes freed may let several smaller ones in
}

}  // namespace llava
