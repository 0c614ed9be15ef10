#include "engine/serving/scheduler.h"

#include <algorithm>

#include "engine/kv/kv_policy.h"

namespace llava {

int64_t SteadyEntries(int64_t prompt_tokens, int64_t max_tokens, const CacheParams& kv,
                      const PromptSegments& segments) {
  return ProjectedEntries(kv, segments, prompt_tokens + max_tokens);
}

int64_t Scheduler::PageBytes(int64_t entries) const {
  const int64_t p = std::max<int64_t>(1, config_.page_entries);
  return (entries + p - 1) / p * p * config_.num_layers * config_.bytes_per_entry;
}

int64_t Scheduler::SteadyBytes(const SchedRequest& r) const {
  // A compressing cache holds one entry more than its target between a decode step's append
  // and its eviction.
  const int64_t spare = r.kv.KeepsEverything() ? 0 : 1;
  return PageBytes(SteadyEntries(r.prompt_tokens, r.max_tokens, r.kv, r.segments) + spare);
}

int64_t Scheduler::PrefillBytes(const SchedRequest& r) const { return PageBytes(r.prompt_tokens); }

Status Scheduler::Enqueue(const SchedRequest& r) {
  if (static_cast<int>(waiting_.size()) >= config_.max_queue) {
    return ResourceExhausted("the request queue is full (" + std::to_string(config_.max_queue) +
                             " waiting)");
  }
  const int64_t need = std::max(SteadyBytes(r), PrefillBytes(r));
  if (need > config_.kv_budget_bytes) {
    return ResourceExhausted("the request needs " + std::to_string(need) +
                             " bytes of KV cache, more than the server's budget of " +
                             std::to_string(config_.kv_budget_bytes) +
                             " (lower sampling.max_tokens or kv_cache.budget)");
  }
  waiting_.push_back(r);
  return Status::Ok();
}

std::vector<uint64_t> Scheduler::Admit() {
  std::vector<uint64_t> admitted;
  // Held now: steady reservations plus the transients of earlier requests still prefilling.
  const int64_t held = reserved_ + prefill_extra_;
  int64_t prefill = 0;  // whole prompts of this round's requests, held while they prefill
  int64_t steady = 0;   // their reservations once compressed
  while (!waiting_.empty() && static_cast<int>(running_.size()) < config_.max_batch) {
    const SchedRequest& r = waiting_.front();
    const int64_t s = SteadyBytes(r), p = PrefillBytes(r);
    if (held + steady + s > config_.kv_budget_bytes ||
        held + prefill + p > config_.kv_budget_bytes) {
      break;  // FIFO: no overtaking
    }
    steady += s;
    prefill += p;
    running_[r.id] = {s, std::max<int64_t>(0, p - s)};
    prefill_extra_ += running_[r.id].prefill_extra;
    admitted.push_back(r.id);
    waiting_.pop_front();
  }
  reserved_ += steady;
  return admitted;
}

void Scheduler::PrefillDone(uint64_t id) {
  auto it = running_.find(id);
  if (it == running_.end()) return;
  prefill_extra_ -= it->second.prefill_extra;
  it->second.prefill_extra = 0;
}

bool Scheduler::Remove(uint64_t id) {
  auto it = running_.find(id);
  if (it != running_.end()) {
    reserved_ -= it->second.steady;
    prefill_extra_ -= it->second.prefill_extra;
    running_.erase(it);
    return true;
  }
  auto w = std::find_if(waiting_.begin(), waiting_.end(),
                        [id](const SchedRequest& r) { return r.id == id; });
  if (w == waiting_.end()) return false;
  waiting_.erase(w);
  return true;
}

}  // namespace llava
