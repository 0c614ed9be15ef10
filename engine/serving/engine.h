// The serving engine: one thread owns the model, every request's KV cache and the scheduler,
// and runs continuous batching (llama.cpp's server loop, vLLM's scheduler split):
//
//   loop: apply cancellations and deadlines -> admit waiting requests while the KV byte budget
//         allows (Scheduler) -> one forward pass: the next rows of the prompts still being fed
//         (at most `prefill_chunk` rows a turn, oldest request first: chunked prefill) and one
//         decode token of every request whose prompt is complete, linear layers batched
//         across all rows, attention per request -> stream each new piece of text to its
//         observer -> free finished requests' caches at once.
//
// The model is reached through ModelRunner (model_runner.h): LoadedModel in service, a scripted
// runner in tests/engine_loop_test.cc. Network threads only call Submit/Cancel and read
// snapshots; everything else happens on the engine thread (or, with own_thread false, on the
// thread that calls RunUntilIdle). Requests are validated and their images
// decoded on the submitting thread, so bad input never reaches the loop.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/kv/kv_pool.h"
#include "engine/serving/model_runner.h"
#include "engine/serving/prepare_gate.h"
#include "engine/serving/request.h"
#include "engine/serving/scheduler.h"

namespace llava {

struct EngineOptions {
  EngineLimits limits;
  // The KV pool, allocated at start on the model's device and shared by all requests: whole
  // pages of this many bytes at most (kv_pool.h).
  int64_t kv_cache_bytes = int64_t{4} << 30;
  int max_batch = 8;   // running requests at most
  int max_queue = 64;  // waiting requests at most, counting those still being prepared
  // Requests whose images are decoded at once (Submit waits for a turn); 0: one per core.
  int max_preparing = 0;
  // Decode memory between them (PrepareGate, prepare_gate.h): each claims what its largest
  // image takes to decode, from the headers. -1: what one image at the limits takes
  // (limits.image.max_pixels at 16-bit RGBA, plus its RGB copy), so that concurrent image
  // bombs cost no more than one.
  int64_t decode_budget_bytes = -1;
  // Prompt rows fed per loop turn, over all requests still prefilling (chunked prefill, as
  // vLLM's max_num_batched_tokens); 0 = every prompt whole in its admission turn. A turn with
  // a long prompt otherwise delays every running stream's next token by its whole prefill.
  int64_t prefill_chunk = 0;
  // The share of the running requests' remaining growth that admission keeps free: where it
  // starts and its floor (SchedulerConfig, scheduler.h). 0 and 0: admit by prompts alone.
  double initial_growth_ratio = 1.0;
  double min_growth_ratio = 0.1;
  // Free heap memory kept between passes (TrimFreeHeap, runtime.h): above it, the free pages go
  // back to the system after the pass. -1: 1% of kv_cache_bytes, at least 4 MiB (the large
  // tensors live in the activation allocator's blocks, activation_memory.h); 0: never.
  int64_t free_heap_max_bytes = -1;
  // false: no loop thread; the caller runs the loop on its own thread with RunUntilIdle (the
  // one-shot Generator). A thread made per request costs more than its pass on a small model:
  // libtorch rebuilds its thread pools for each new thread that runs a parallel op.
  bool own_thread = true;
};

// Receives one request's output, on the engine thread: it must not block.
class RequestObserver {
 public:
  virtual ~RequestObserver() = default;
  // The request left the queue; `queue_seconds` since Submit.
  virtual void OnAdmitted(double queue_seconds) {}
  // New final text (never half a UTF-8 character).
  virtual void OnText(const std::string& delta) = 0;
  // Called exactly once, last: the result (finish reason, usage) or the error that ended it
  // (DEADLINE_EXCEEDED, INTERNAL).
  virtual void OnFinished(const StatusOr<GenerationResult>& result) = 0;
};

struct EngineSnapshot {
  int waiting = 0;
  int running = 0;
  int64_t kv_bytes_used = 0;             // pool pages in use, all requests (physical)
  int64_t kv_bytes_kept = 0;             // entries actually held, all requests (logical)
  int64_t kv_bytes_full_equivalent = 0;  // what Full would hold for the same requests
  int64_t kv_bytes_reserved = 0;         // handed out by admission: the pages in use
  int64_t kv_budget_bytes = 0;           // what admission hands out: the pool's bytes
  int64_t kv_pool_bytes = 0;             // the pool, allocated at start
  int last_batch_size = 0;
  int max_batch = 0;        // EngineOptions::max_batch: the most sequences one decode step runs
  int64_t preemptions = 0;  // requests that gave their pages back to be recomputed, ever
  // The forward pass's CPU tensors (activation_memory.h; zeros unless its allocator is
  // installed): blocks mapped now (in use and kept for the next pass), the most bytes live at
  // once since start.
  int64_t activation_mapped_bytes = 0;
  int64_t activation_peak_bytes = 0;
};

// What the network layer needs from an engine; lets the gRPC layer be tested against a
// scripted fake without a model.
class EngineApi {
 public:
  virtual ~EngineApi() = default;
  // Contract as Engine::Submit below.
  virtual Status Submit(uint64_t id, const GenerationRequest& request,
                        std::shared_ptr<RequestObserver> observer,
                        std::optional<std::chrono::steady_clock::time_point> deadline) = 0;
  virtual void Cancel(uint64_t id) = 0;
  virtual EngineSnapshot Snapshot() const = 0;
};

class Engine final : public EngineApi {
 public:
  // Borrows `model` (must outlive the engine) and starts the loop thread.
  Engine(const ModelRunner& model, const EngineOptions& options);
  ~Engine() override;  // Shutdown(0)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates, decodes images and tokenizes on the calling thread, then queues the request.
  // Errors (INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED for a full queue or a request
  // that can never fit, UNAVAILABLE after shutdown) are returned here and the observer is never
  // called; on OK the observer gets OnFinished exactly once. `id` must be unique among live
  // requests.
  Status Submit(uint64_t id, const GenerationRequest& request,
                std::shared_ptr<RequestObserver> observer,
                std::optional<std::chrono::steady_clock::time_point> deadline) override;
  Status Submit(uint64_t id, const GenerationRequest& request,
                std::shared_ptr<RequestObserver> observer) {
    return Submit(id, request, std::move(observer), std::nullopt);
  }
  // The same for a request the caller has already prepared (PrepareRequest with this engine's
  // limits): its images are not decoded again.
  Status Submit(uint64_t id, const GenerationRequest& request, PreparedRequest prepared,
                std::shared_ptr<RequestObserver> observer);

  // Ends a request with finish reason "cancelled" and frees its cache on the next loop turn.
  // Unknown or finished ids are ignored.
  void Cancel(uint64_t id) override;

  // Stops accepting, lets running and waiting requests finish for up to `grace`, cancels the
  // rest, and joins the loop. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

  EngineSnapshot Snapshot() const override;  // thread-safe

  // Without a loop thread (EngineOptions::own_thread false): runs loop turns on the calling
  // thread until no request is waiting or running, or those waiting cannot be admitted.
  // Observers are called on this thread.
  void RunUntilIdle();

 private:
  struct Pending;
  struct Sequence;
  // Queues a prepared request (the second half of Submit).
  Status Enqueue(uint64_t id, const GenerationRequest& request, PreparedRequest prepared,
                 std::shared_ptr<RequestObserver> observer,
                 std::optional<std::chrono::steady_clock::time_point> deadline,
                 std::chrono::steady_clock::time_point submitted);
  void Loop();
  // One loop turn (see the top of this file); `wait`: block up to 50 ms for work when idle.
  // Returns false once the engine is stopped and empty.
  bool Turn(bool wait);
  // One forward pass: the next prompt rows of sequences still prefilling (within the
  // prefill_chunk budget) and one decode token of every other running sequence, linear layers
  // over all rows at once.
  void Step();
  void Finish(Sequence* seq, StatusOr<GenerationResult> result);
  // Frees `seq`'s pages and sends it back to the queue, first in line, to be recomputed from its
  // prompt and the tokens it generated (which stay streamed; it continues after them).
  void Preempt(Sequence* seq);
  Status CheckIdFreeLocked(uint64_t id) const;  // INVALID_ARGUMENT if `id` is live
  void UpdateSnapshotLocked();

  const ModelRunner& model_;
  const EngineOptions options_;
  const int64_t free_heap_max_bytes_;  // resolved from options_; 0: never trim
  // Every running request's cache lives in it; declared before running_, so it outlives them.
  const std::unique_ptr<KvPool> pool_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Scheduler scheduler_;                                               // guarded by mu_
  std::unordered_map<uint64_t, std::unique_ptr<Pending>> pending_;    // guarded by mu_
  std::unordered_set<uint64_t> cancelled_;                            // guarded by mu_
  bool accepting_ = true;                                             // guarded by mu_
  bool stop_ = false;                                                 // guarded by mu_
  std::optional<std::chrono::steady_clock::time_point> drain_until_;  // guarded by mu_
  EngineSnapshot snapshot_;                                           // guarded by mu_

  std::vector<std::unique_ptr<Sequence>> running_;  // engine thread only
  std::vector<uint64_t> running_ids_;               // guarded by mu_ (for Submit's id check)
  int preparing_ = 0;  // guarded by mu_: submitted, not yet queued (decoding, tokenizing)
  // Turns and decode memory to prepare requests (max_preparing, decode_budget_bytes).
  std::unique_ptr<PrepareGate> prepare_gate_;
  int64_t preemptions_ = 0;  // guarded by mu_
  // Ends recorded this loop turn, delivered after caches are freed. Engine thread only.
  std::vector<std::pair<std::shared_ptr<RequestObserver>, StatusOr<GenerationResult>>> completions_;
  std::chrono::steady_clock::time_point
      last_trim_;  // the epoch: the first pass trims. Engine thread only.
  std::thread thread_;
};

}  // namespace llava
