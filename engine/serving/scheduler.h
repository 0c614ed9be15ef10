// Admission control for continuous batching, by KV pool pages. Torch-free, so every decision is
// testable exactly (vLLM's habit: the scheduler decides, the cache manager accounts).
//
// Each running request reserves the pool pages it can hold at once: its steady-state entries
// (EntryTarget(T + G) per layer for a compressing policy, plus the one entry a decode step
// appends before the policy evicts; T + G for Full), rounded up to whole pages of
// `page_entries` slots, x layers x bytes per entry. While a request prefills it holds its whole
// prompt (T entries per layer) before compressing: until the engine reports PrefillDone, its
// reservation is the larger of the two, and admission checks that this transient fits too.
// (Without chunked prefill a request's prompt is done in its admission turn; with it, over
// several turns.) Waiting requests are admitted in FIFO order while both fit and the batch has
// room; a request that could never fit alone is refused at enqueue time. No preemption. The
// reservations never exceed the pool, so a reserved cache always gets its pages.
//
// Thread safety: not thread-safe; the engine thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "engine/io/status.h"
#include "engine/kv/cache_policy.h"

namespace llava {

struct SchedulerConfig {
  int64_t kv_budget_bytes = int64_t{4} << 30;
  int64_t bytes_per_entry = 0;  // one entry of one layer (K and V)
  int64_t page_entries = 1;     // slots per pool page: reservations are whole pages
  int num_layers = 0;
  int max_batch = 8;   // running requests at most
  int max_queue = 64;  // waiting requests at most
};

struct SchedRequest {
  uint64_t id = 0;
  int64_t prompt_tokens = 0;
  int64_t max_tokens = 0;
  CacheParams kv;
  PromptSegments segments;  // what the policy may protect (empty: unknown)
};

// Entries per layer a request holds at most after its prefill: the policy's target for T + G
// tokens (ProjectedEntries), T + G for Full (and any policy at budget 1).
int64_t SteadyEntries(int64_t prompt_tokens, int64_t max_tokens, const CacheParams& kv,
                      const PromptSegments& segments = {});

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config) : config_(config) {}

  int64_t SteadyBytes(const SchedRequest& r) const;
  int64_t PrefillBytes(const SchedRequest& r) const;  // the whole prompt, before compression
  // Bytes of the whole pages that hold `entries` slots in every layer.
  int64_t PageBytes(int64_t entries) const;
  // RESOURCE_EXHAUSTED when the queue is full or the request alone exceeds the budget.
  Status Enqueue(const SchedRequest& r);
  // Moves waiting requests to running, FIFO, while they fit; returns their ids in order.
  std::vector<uint64_t> Admit();
  // The request's whole prompt has been fed and compressed: its reservation drops to the
  // steady-state bytes. Unknown ids and repeated calls are ignored.
  void PrefillDone(uint64_t id);
  // Frees a running request's reservation, or drops a waiting one. False if unknown.
  bool Remove(uint64_t id);

  int waiting() const { return static_cast<int>(waiting_.size()); }
  int running() const { return static_cast<int>(running_.size()); }
  // Steady-state reservations plus the prompt transients of requests still prefilling.
  int64_t reserved_bytes() const { return reserved_ + prefill_extra_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  SchedulerConfig config_;
  std::deque<SchedRequest> waiting_;
  struct Reservation {
    int64_t steady = 0;
    int64_t prefill_extra = 0;  // max(0, prompt - steady) until PrefillDone
  };
  std::unordered_map<uint64_t, Reservation> running_;
  int64_t reserved_ = 0;       // sum of steady
  int64_t prefill_extra_ = 0;  // sum of prefill_extra
};

}  // namespace llava
