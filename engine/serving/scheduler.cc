#include "engine/serving/scheduler.h"

#include <algorithm>
#include <cmath>

#include "engine/kv/kv_policy.h"

namespace llava {

int64_t SteadyEntries(int64_t prompt_tokens, int64_t max_tokens, const CacheParams& kv,
                      const PromptSegments& segments) {
  return ProjectedEntries(kv, segments, prompt_tokens + max_tokens);
}

int64_t Scheduler::PagesFor(int64_t entries) const {
  const int64_t p = std::max<int64_t>(1, config_.page_entries);
  return (entries + p - 1) / p;
}

int64_t Scheduler::SteadyPages(const SchedRequest& r) const {
  // A compressing cache holds one entry more than its target between a decode step's append
  // and its eviction.
  const int64_t spare = r.kv.KeepsEverything() ? 0 : 1;
  return PagesFor(SteadyEntries(r.prompt_tokens, r.max_tokens, r.kv, r.segments) + spare);
}

int64_t Scheduler::PeakPages(const SchedRequest& r) const {
  return std::max(PromptPages(r), SteadyPages(r));
}

int64_t Scheduler::GrowthPages(const SchedRequest& r) const {
  return std::max<int64_t>(0, SteadyPages(r) - PromptPages(r));
}

Status Scheduler::Enqueue(const SchedRequest& r) {
  if (static_cast<int>(waiting_.size()) >= config_.max_queue) {
    return ResourceExhausted("the request queue is full (" + std::to_string(config_.max_queue) +
                             " waiting)");
  }
  const int64_t pages = PeakPages(r);
  if (pages > config_.pool_pages) {
    return ResourceExhausted("the request needs " + std::to_string(pages * config_.page_bytes) +
                             " bytes of KV cache, more than the server's whole pool of " +
                             std::to_string(config_.pool_pages * config_.page_bytes) +
                             " (lower sampling.max_tokens or kv_cache.budget)");
  }
  waiting_.push_back(r);
  waiting_.back().first_prompt = r.prompt_tokens;
  return Status::Ok();
}

std::vector<uint64_t> Scheduler::Admit(int64_t free_pages, int64_t growth_pages) {
  std::vector<uint64_t> admitted;
  int64_t promised = 0;  // prompt pages of this round's requests
  while (!waiting_.empty() && static_cast<int>(running_.size()) < config_.max_batch) {
    const SchedRequest& r = waiting_.front();
    // The watermark: a page for each running request to grow into.
    const int64_t watermark = static_cast<int64_t>(running_.size());
    const int64_t growth = growth_pages + GrowthPages(r);
    const auto share = static_cast<int64_t>(std::ceil(growth_ratio_ * static_cast<double>(growth)));
    if (promised + PromptPages(r) + watermark + share > free_pages) break;  // FIFO
    promised += PromptPages(r);
    growth_pages = growth;
    admitted.push_back(r.id);
    running_[r.id] = r;
    waiting_.pop_front();
  }
  return admitted;
}

bool Scheduler::Preempt(uint64_t id, int64_t prompt_tokens, int64_t max_tokens) {
  auto it = running_.find(id);
  if (it == running_.end()) return false;
  if (PagesFor(prompt_tokens) > config_.pool_pages) return false;  // could never come back
  SchedRequest r = it->second;
  running_.erase(it);
  r.prompt_tokens = prompt_tokens;
  r.max_tokens = max_tokens;
  waiting_.push_front(r);
  ++preemptions_;
  // The pool ran short: admit more cautiously for a while.
  growth_ratio_ = std::min(1.0, growth_ratio_ + 0.2);
  return true;
}

bool Scheduler::Finish(uint64_t id, int64_t generated) {
  auto it = running_.find(id);
  if (it == running_.end()) return false;
  // After a preemption max_tokens counts what was left; `generated` counts from the start.
  const int64_t asked =
      it->second.max_tokens + (it->second.prompt_tokens - it->second.first_prompt);
  if (asked > 0) {
    const double fraction = std::min(1.0, static_cast<double>(generated) / asked);
    const double w = config_.growth_ratio_weight;
    growth_ratio_ = std::max(config_.min_growth_ratio, (1 - w) * growth_ratio_ + w * fraction);
  }
  running_.erase(it);
  return true;
}

bool Scheduler::Remove(uint64_t id) {
  if (running_.erase(id) > 0) return true;
  auto w = std::find_if(waiting_.begin(), waiting_.end(),
                        [id](const SchedRequest& r) { return r.id == id; });
  if (w == waiting_.end()) return false;
  waiting_.erase(w);
  return true;
}

}  // namespace llava
