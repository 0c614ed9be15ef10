// Admission control for continuous batching, by KV pool pages actually free. Torch-free, so
// every decision is testable exactly (vLLM's habit: the scheduler decides, the cache manager
// accounts).
//
// Rules:
// - A request is refused at Enqueue when the queue is full or when the most pages it can hold
//   at once (PeakPages: its whole prompt while it prefills; then, for Full, prompt + max_tokens
//   entries, and for a compressing policy its target for prompt + max_tokens plus the entry a
//   decode step appends before it evicts) exceed the whole pool: it could never finish.
// - Waiting requests are admitted in FIFO order (no overtaking) while the batch has room and the
//   pool's free pages hold their prompts (PromptPages), a watermark of one page per running
//   request, and a share of the growth still ahead of every running request and of the new one
//   (the pages between what each holds and its steady-state peak, times growth_ratio()).
//   Nothing is reserved: a request that stops after 20 of 2,048 tokens only ever held 20
//   tokens' pages. The share is learnt from the answers themselves: it starts at
//   initial_growth_ratio and follows a moving average (weight growth_ratio_weight) of the
//   fraction of max_tokens that finished requests really generated, never below
//   min_growth_ratio, and every preemption raises it by 0.2; so a load whose answers stop early
//   admits several times the worst case, and one whose answers run to max_tokens (where
//   preemption would only recompute) admits as if every answer will.
// - Running requests grow page by page as their caches do. When a step finds the pool short,
//   the engine preempts the most recently admitted running request (Preempt): its pages go back
//   and it returns to the front of the queue, to be recomputed from its prompt and the tokens
//   it has generated so far (vLLM's recompute preemption).
//
// Thread safety: not thread-safe; the engine owns it (under its mutex).
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "engine/io/status.h"
#include "engine/kv/cache_policy.h"

namespace llava {

struct SchedulerConfig {
  int64_t pool_pages = 0;     // pages in the KV pool
  int64_t page_entries = 16;  // token slots per page (in every layer)
  int64_t page_bytes = 0;     // bytes of one page, all layers (for messages)
  int max_batch = 8;          // running requests at most
  int max_queue = 64;         // waiting requests at most
  double initial_growth_ratio = 1.0;
  double min_growth_ratio = 0.1;
  double growth_ratio_weight = 0.1;  // of each finished request in the moving average
};

struct SchedRequest {
  uint64_t id = 0;
  int64_t prompt_tokens = 0;
  int64_t max_tokens = 0;
  CacheParams kv;
  PromptSegments segments;   // what the policy may protect (empty: unknown)
  int64_t first_prompt = 0;  // prompt_tokens when enqueued (set by Enqueue; a preemption grows
                             // prompt_tokens by the answer so far)
};

// Entries per layer a request holds at most after its prefill: the policy's target for T + G
// tokens (ProjectedEntries), T + G for Full (and any policy at budget 1).
int64_t SteadyEntries(int64_t prompt_tokens, int64_t max_tokens, const CacheParams& kv,
                      const PromptSegments& segments = {});

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config) : config_(config) {}

  // Pages that hold `entries` slots.
  int64_t PagesFor(int64_t entries) const;
  int64_t PromptPages(const SchedRequest& r) const { return PagesFor(r.prompt_tokens); }
  int64_t PeakPages(const SchedRequest& r) const;
  // Pages of the most entries a request holds once its prompt is in (Full: prompt + max_tokens;
  // a compressing policy: its target for that plus the entry a step appends before it evicts).
  int64_t SteadyPages(const SchedRequest& r) const;
  // What the request still grows by after its prompt: SteadyPages - PromptPages, or 0.
  int64_t GrowthPages(const SchedRequest& r) const;

  // RESOURCE_EXHAUSTED when the queue is full or the request could never fit the pool alone.
  Status Enqueue(const SchedRequest& r);
  // Moves waiting requests to running, FIFO, while their prompts fit in `free_pages` (the
  // pool's free pages now) above the watermark and the running requests' share of growth;
  // `growth_pages`: the pages the running requests still grow by, summed (their SteadyPages
  // less what they hold). Returns their ids in order.
  std::vector<uint64_t> Admit(int64_t free_pages, int64_t growth_pages = 0);
  // A running request gave its pages back: it waits again, first in line, to be re-admitted
  // with a prompt of `prompt_tokens` (its own and the tokens generated so far) and
  // `max_tokens` left. False, and nothing changed, if `id` is not running or that prompt would
  // not fit the whole pool.
  bool Preempt(uint64_t id, int64_t prompt_tokens, int64_t max_tokens);
  // Drops a running or waiting request. False if unknown.
  bool Remove(uint64_t id);
  // A running request ended after generating `generated` tokens: dropped as by Remove, and its
  // answer's length (against its max_tokens) goes into the growth share. False if unknown.
  bool Finish(uint64_t id, int64_t generated);

  int waiting() const { return static_cast<int>(waiting_.size()); }
  int running() const { return static_cast<int>(running_.size()); }
  int64_t preemptions() const { return preemptions_; }
  double growth_ratio() const { return growth_ratio_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  SchedulerConfig config_;
  std::deque<SchedRequest> waiting_;
  std::unordered_map<uint64_t, SchedRequest> running_;
  int64_t preemptions_ = 0;
  double growth_ratio_ = config_.initial_growth_ratio;
};

}  // namespace llava
