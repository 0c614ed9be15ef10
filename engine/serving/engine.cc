#include "engine/serving/engine.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "engine/io/image_io.h"
#include "engine/kernels/activation_memory.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"

namespace llava {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

// A validated request waiting for admission.
struct Engine::Pending {
  uint64_t id = 0;
  SamplingParams sampling;
  CacheParams kv;
  PreparedRequest prepared;
  std::shared_ptr<RequestObserver> observer;
  std::optional<Clock::time_point> deadline;
  Clock::time_point submitted;
  int64_t steady_pages = 0;  // Scheduler::SteadyPages: the most pages it holds after its prompt
};

// An admitted request: its cache and decoding state. Engine thread only.
struct Engine::Sequence {
  std::unique_ptr<Pending> req;
  std::unique_ptr<KvCache> cache;  // null while preempted
  std::unique_ptr<DecodeState> state;
  GenerationResult result;  // counters filled as it runs
  Clock::time_point admitted;
  bool first_token_seen = false;
  at::Tensor prompt_embeds;  // [rows, D] while the prompt is fed in chunks; released after
  int64_t prefilled = 0;     // prompt rows fed so far
  // Preemption (recompute): its pages went back to the pool and it waits to be re-admitted;
  // then its prompt rows are its own prompt and the `resume_tokens` tokens it had generated.
  bool preempted = false;
  int64_t resume_tokens = 0;
  KvStats kv_before_preemption;

  // Rows fed as the prompt: the request's own, plus the generated tokens after a preemption.
  int64_t PromptRows() const {
    return static_cast<int64_t>(req->prepared.prompt.ids.size()) + resume_tokens;
  }
};

Engine::Engine(const ModelRunner& model, const EngineOptions& options)
    : model_(model),
      options_(options),
      free_heap_max_bytes_(options.free_heap_max_bytes >= 0
                               ? options.free_heap_max_bytes
                               : std::max<int64_t>(int64_t{4} << 20, options.kv_cache_bytes / 100)),
      pool_(std::make_unique<KvPool>(model.kv_layout(), options.kv_cache_bytes)),
      scheduler_([&] {
        SchedulerConfig c;
        c.pool_pages = pool_->num_pages();
        c.page_entries = pool_->page_rows();
        c.page_bytes = pool_->page_bytes();
        c.initial_growth_ratio = options.initial_growth_ratio;
        c.min_growth_ratio = options.min_growth_ratio;
        c.max_batch = options.max_batch;
        c.max_queue = options.max_queue;
        return c;
      }()) {
  const int turns = options.max_preparing > 0
                        ? options.max_preparing
                        : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  ImageInfo largest;
  largest.format = ImageFormat::kPng;
  largest.width = static_cast<int>(std::min<int64_t>(options.limits.image.max_pixels, 1 << 30));
  largest.height = 1;
  largest.decoded_bytes_per_pixel = 8;  // 16-bit RGBA
  prepare_gate_ = std::make_unique<PrepareGate>(turns, options.decode_budget_bytes >= 0
                                                           ? options.decode_budget_bytes
                                                           : ImageDecodeBytes(largest));
  snapshot_.kv_budget_bytes = pool_->bytes();
  snapshot_.kv_pool_bytes = pool_->bytes();
  snapshot_.max_batch = options.max_batch;
  if (options.own_thread) thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() { Shutdown(std::chrono::milliseconds(0)); }

Status Engine::Submit(uint64_t id, const GenerationRequest& request,
                      std::shared_ptr<RequestObserver> observer,
                      std::optional<Clock::time_point> deadline) {
  const Clock::time_point now = Clock::now();
  LLAVA_RETURN_IF_ERROR(ValidateSamplingParams(request.sampling, options_.limits.max_tokens_limit));
  {
    // Refuse before decoding images and tokenizing when the answer is no anyway (checked again
    // at enqueue: another request may take the last place meanwhile).
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return Unavailable("the server is shutting down");
    LLAVA_RETURN_IF_ERROR(CheckIdFreeLocked(id));
    // Requests still being prepared count against the queue: a burst of image requests cannot
    // start more decodes than the queue has places.
    if (scheduler_.waiting() + preparing_ >= options_.max_queue) {
      return ResourceExhausted("the request queue is full (" +
                               std::to_string(scheduler_.waiting() + preparing_) + " waiting)");
    }
    ++preparing_;
  }
  // Until the request is queued or refused it holds a place counted against the queue and,
  // while it decodes, a turn with its largest image's decode memory (PrepareGate); both are
  // given back however this returns.
  struct Preparing {
    Engine* e;
    ~Preparing() {
      std::lock_guard<std::mutex> lock(e->mu_);
      --e->preparing_;
    }
  } place{this};
  int64_t decode_bytes = 0;
  for (const std::string& image : request.images) {
    StatusOr<ImageInfo> info = ProbeImage(image, "");  // a bad header is refused by Prepare
    if (info.ok()) decode_bytes = std::max(decode_bytes, ImageDecodeBytes(*info));
  }
  StatusOr<PreparedRequest> prepared = [&]() -> StatusOr<PreparedRequest> {
    PrepareGate::Turn turn(prepare_gate_.get(), decode_bytes);
    if (!turn.admitted()) {
      return ResourceExhausted(
          "images waiting to be decoded would need more than the decode "
          "budget (" +
          std::to_string(decode_bytes >> 20) +
          " MiB for this request's largest image): retry later");
    }
    return PrepareRequest(request, model_.config(), model_.tokenizer(), options_.limits,
                          request.sampling.max_tokens);
  }();
  if (!prepared.ok()) return prepared.status();
  return Enqueue(id, request, std::move(prepared).value(), std::move(observer), deadline, now);
}

Status Engine::Submit(uint64_t id, const GenerationRequest& request, PreparedRequest prepared,
                      std::shared_ptr<RequestObserver> observer) {
  LLAVA_RETURN_IF_ERROR(ValidateSamplingParams(request.sampling, options_.limits.max_tokens_limit));
  return Enqueue(id, request, std::move(prepared), std::move(observer), std::nullopt, Clock::now());
}

Status Engine::Enqueue(uint64_t id, const GenerationRequest& request, PreparedRequest prepared,
                       std::shared_ptr<RequestObserver> observer,
                       std::optional<Clock::time_point> deadline, Clock::time_point submitted) {
  auto p = std::make_unique<Pending>();
  p->id = id;
  p->sampling = request.sampling;
  p->kv = request.kv_cache;
  p->prepared = std::move(prepared);
  p->observer = std::move(observer);
  p->deadline = deadline;
  p->submitted = submitted;
  std::lock_guard<std::mutex> lock(mu_);
  if (!accepting_) return Unavailable("the server is shutting down");
  LLAVA_RETURN_IF_ERROR(CheckIdFreeLocked(id));
  SchedRequest sr;
  sr.id = id;
  sr.prompt_tokens = static_cast<int64_t>(p->prepared.prompt.ids.size());
  sr.max_tokens = request.sampling.max_tokens;
  sr.kv = request.kv_cache;
  sr.segments = p->prepared.segments;
  LLAVA_RETURN_IF_ERROR(scheduler_.Enqueue(sr));
  p->steady_pages = scheduler_.SteadyPages(sr);
  pending_[id] = std::move(p);
  snapshot_.waiting = scheduler_.waiting();
  cv_.notify_one();
  return Status::Ok();
}

Status Engine::CheckIdFreeLocked(uint64_t id) const {
  if (pending_.count(id) ||
      std::any_of(running_ids_.begin(), running_ids_.end(), [id](uint64_t r) { return r == id; })) {
    return InvalidArgument("request id " + std::to_string(id) + " is already in use");
  }
  return Status::Ok();
}

void Engine::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_.insert(id);
  cv_.notify_one();
}

void Engine::Shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = false;
    if (!stop_) {
      stop_ = true;
      drain_until_ = Clock::now() + grace;
    }
    cv_.notify_one();
  }
  if (thread_.joinable()) {
    thread_.join();
  } else if (!options_.own_thread) {
    while (Turn(/*wait=*/false)) {
    }
  }
}

EngineSnapshot Engine::Snapshot() const {
  const ActivationMemoryStats a = ActivationMemory();  // process-wide; zeros if not installed
  std::lock_guard<std::mutex> lock(mu_);
  EngineSnapshot s = snapshot_;
  s.activation_mapped_bytes = a.mapped_bytes;
  s.activation_peak_bytes = a.peak_live_bytes;
  return s;
}

void Engine::Loop() {
  while (Turn(/*wait=*/true)) {
  }
}

void Engine::RunUntilIdle() {
  while (true) {
    size_t waiting = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting = pending_.size();
      if (waiting == 0 && running_.empty() && cancelled_.empty()) return;
    }
    if (!Turn(/*wait=*/false)) return;
    // Nothing running and nothing admitted: no later turn would differ (nothing else feeds
    // this engine), so stop rather than spin.
    std::lock_guard<std::mutex> lock(mu_);
    if (running_.empty() && pending_.size() == waiting && cancelled_.empty()) return;
  }
}

bool Engine::Turn(bool wait) {
  std::vector<std::unique_ptr<Pending>> admitted, dropped;  // dropped: cancelled or expired
  std::vector<uint64_t> resumed;                            // preempted, admitted again
  std::vector<Status> dropped_status;
  std::unordered_set<uint64_t> cancel_running;
  bool drain_expired = false, exit_loop = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait) {
      cv_.wait_for(lock, std::chrono::milliseconds(running_.empty() ? 50 : 0), [&] {
        return stop_ || !cancelled_.empty() || scheduler_.waiting() > 0 || !running_.empty();
      });
    }
    const Clock::time_point now = Clock::now();
    drain_expired = stop_ && drain_until_ && now >= *drain_until_;
    // Waiting requests that were cancelled, expired, or are cut off by the shutdown.
    for (auto it = pending_.begin(); it != pending_.end();) {
      Pending& p = *it->second;
      Status why;
      if (cancelled_.count(p.id) || drain_expired) {
        why = Status(StatusCode::kCancelled, "cancelled");
      } else if (p.deadline && now >= *p.deadline) {
        why = DeadlineExceeded("the deadline passed while the request was queued");
      } else {
        ++it;
        continue;
      }
      cancelled_.erase(p.id);
      scheduler_.Remove(p.id);
      dropped_status.push_back(why);
      dropped.push_back(std::move(it->second));
      it = pending_.erase(it);
    }
    cancel_running.swap(cancelled_);
    if (!drain_expired) {
      // (The pool and the caches belong to the engine thread, which this is.)
      int64_t growth = 0;  // what the running requests still grow by
      for (const auto& seq : running_) {
        if (!seq->cache || seq->state->done()) continue;
        growth += std::max<int64_t>(0, seq->req->steady_pages - seq->cache->PagesHeld());
      }
      for (uint64_t id : scheduler_.Admit(pool_->pages().free_pages(), growth)) {
        auto it = pending_.find(id);
        if (it == pending_.end()) {  // a preempted request, re-admitted
          resumed.push_back(id);
          continue;
        }
        admitted.push_back(std::move(it->second));
        pending_.erase(it);
        running_ids_.push_back(id);
      }
    }
    exit_loop = stop_ && pending_.empty() && running_.empty() && admitted.empty();
  }

  for (size_t i = 0; i < dropped.size(); ++i) {
    Pending& p = *dropped[i];
    if (dropped_status[i].code() == StatusCode::kCancelled) {
      GenerationResult r;
      r.finish = FinishReason::kCancelled;
      r.prompt_tokens = static_cast<int>(p.prepared.prompt.ids.size());
      r.total_seconds = Seconds(p.submitted, Clock::now());
      p.observer->OnFinished(r);
    } else {
      p.observer->OnFinished(dropped_status[i]);
    }
  }
  if (exit_loop) return false;

  const Clock::time_point now = Clock::now();
  for (auto& seq : running_) {
    if (drain_expired || cancel_running.count(seq->req->id)) {
      seq->state->Abort(FinishReason::kCancelled);
    } else if (seq->req->deadline && now >= *seq->req->deadline) {
      seq->state->Abort(FinishReason::kError);
      seq->result.finish = FinishReason::kError;
      Finish(seq.get(), DeadlineExceeded("the deadline passed during generation"));
    }
  }

  if (!admitted.empty()) {
    for (auto& p : admitted) {
      auto seq = std::make_unique<Sequence>();
      seq->admitted = Clock::now();
      p->observer->OnAdmitted(Seconds(p->submitted, seq->admitted));
      seq->cache = NewKvCache(pool_.get(), p->kv, p->prepared.segments);
      seq->state = std::make_unique<DecodeState>(
          model_.tokenizer(), p->sampling,
          PromptTextIds(p->prepared.prompt, model_.config().image_token_index),
          model_.config().text.eos_token_id);
      seq->req = std::move(p);
      running_.push_back(std::move(seq));
    }
  }
  for (uint64_t id : resumed) {
    for (auto& seq : running_) {
      if (seq->req->id != id || !seq->preempted) continue;
      seq->preempted = false;
      seq->cache = NewKvCache(pool_.get(), seq->req->kv, seq->req->prepared.segments);
    }
  }
  // New prompts ride in the same forward pass as the running requests' next token: the
  // weights are read once per turn, and with a prompt-row budget (prefill_chunk) a long
  // prompt is spread over several turns instead of stalling every stream for its whole length.
  Step();
  // A 7B-wide pass's transients, freed, stay on the heap in fragments (docs/BENCHMARKS.md,
  // "The paged KV pool"); beyond the bound they go back to the system. At most every 100 ms:
  // reading the heap's statistics costs ~0.6 ms, 9% of a default-model decode step if done
  // after each, while a 7B-shaped pass, whose transients matter, takes longer than that.
  // The activation allocator's bound restarts with the same period: blocks a heavy pass kept
  // are unmapped once the passes after it need less (activation_memory.h).
  if (Clock::now() - last_trim_ >= std::chrono::milliseconds(100)) {
    if (free_heap_max_bytes_ > 0) TrimFreeHeap(free_heap_max_bytes_);
    StartActivationWindow();
    last_trim_ = Clock::now();
  }

  // Finished sequences: report and free their caches now. Answers that ran their course
  // (stop or length; not cancelled or failed, and not while preempted) teach admission how
  // long answers really are.
  std::vector<uint64_t> ended;
  std::vector<std::pair<uint64_t, int64_t>> answered;  // id, tokens generated
  for (auto& seq : running_) {
    if (seq->state->done()) {
      if (seq->req->observer) Finish(seq.get(), GenerationResult());
      const FinishReason why = seq->state->finish_reason();
      if (!seq->preempted && (why == FinishReason::kStop || why == FinishReason::kLength)) {
        answered.emplace_back(seq->req->id, static_cast<int64_t>(seq->state->tokens().size()));
      } else {
        ended.push_back(seq->req->id);
      }
      seq.reset();
    }
  }
  running_.erase(std::remove(running_.begin(), running_.end(), nullptr), running_.end());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, generated] : answered) {
      scheduler_.Finish(id, generated);
      ended.push_back(id);
    }
    for (uint64_t id : ended) {
      scheduler_.Remove(id);  // (a no-op for those Finish took)
      running_ids_.erase(std::remove(running_ids_.begin(), running_ids_.end(), id),
                         running_ids_.end());
    }
    UpdateSnapshotLocked();
  }
  for (auto& [observer, result] : completions_) observer->OnFinished(result);
  completions_.clear();
  return true;
}

void Engine::Step() {
  // Prompts first, in admission order, up to the turn's prompt-row budget; then one token for
  // every sequence whose prompt is complete.
  int64_t rows_left =
      options_.prefill_chunk > 0 ? options_.prefill_chunk : std::numeric_limits<int64_t>::max();
  struct PromptPart {
    Sequence* seq;
    int64_t begin, n;
  };
  std::vector<PromptPart> prompts;
  std::vector<Sequence*> decoding;
  std::vector<std::pair<Sequence*, int64_t>> needs;  // rows each writes, in admission order
  for (auto& seq : running_) {
    if (seq->state->done() || seq->preempted) continue;
    const int64_t len = seq->PromptRows();
    if (seq->prefilled < len) {
      // The oldest unfinished prompt always gets rows, so no prompt starves.
      const int64_t n = std::min(len - seq->prefilled, rows_left);  // rows_left >= 0
      if (n > 0) {
        prompts.push_back({seq.get(), seq->prefilled, n});
        needs.emplace_back(seq.get(), n);
      }
      rows_left -= n;
    } else {
      decoding.push_back(seq.get());
      needs.emplace_back(seq.get(), 1);
    }
  }
  // The pages this pass writes, oldest request first. When the pool is short, the most recently
  // admitted request still running gives its pages back (Preempt), possibly the one asking.
  for (const auto& [seq, n] : needs) {
    while (!seq->preempted && !seq->cache->Reserve(n)) {
      Sequence* victim = nullptr;
      for (auto it = running_.rbegin(); it != running_.rend() && victim == nullptr; ++it) {
        if (!(*it)->preempted && !(*it)->state->done()) victim = it->get();
      }
      Preempt(victim);  // never null: `seq` itself qualifies
    }
  }
  prompts.erase(std::remove_if(prompts.begin(), prompts.end(),
                               [](const PromptPart& p) { return p.seq->preempted; }),
                prompts.end());
  decoding.erase(
      std::remove_if(decoding.begin(), decoding.end(), [](Sequence* s) { return s->preempted; }),
      decoding.end());
  if (prompts.empty() && decoding.empty()) return;
  try {
    std::vector<SequenceChunk> chunks;
    for (const PromptPart& part : prompts) {
      Sequence* seq = part.seq;
      const PreparedRequest& p = seq->req->prepared;
      if (!seq->prompt_embeds.defined()) {  // first chunk: encode the images, embed the prompt
        seq->prompt_embeds = model_.EmbedPrompt(p, &seq->result.vision_seconds);
        if (seq->resume_tokens > 0) {  // recompute after a preemption: the answer so far too
          const std::vector<int>& t = seq->state->tokens();
          const at::Tensor answer =
              model_.EmbedTokens(std::vector<int64_t>(t.begin(), t.begin() + seq->resume_tokens));
          seq->prompt_embeds =
              at::cat({seq->prompt_embeds, answer.to(seq->prompt_embeds.device())});
        }
      }
      SequenceChunk c{seq->prompt_embeds.narrow(0, part.begin, part.n), seq->cache->NextPosition(),
                      seq->cache.get(), false};
      c.prompt_continues = part.begin + part.n < seq->prompt_embeds.size(0);
      chunks.push_back(c);
    }
    if (!decoding.empty()) {
      std::vector<int64_t> ids;
      for (Sequence* s : decoding) ids.push_back(s->state->last_token());
      at::Tensor embeds = model_.EmbedTokens(ids);  // [B, D]
      for (size_t i = 0; i < decoding.size(); ++i) {
        chunks.push_back({embeds.narrow(0, static_cast<int64_t>(i), 1),
                          decoding[i]->cache->NextPosition(), decoding[i]->cache.get(), false});
      }
    }
    at::Tensor logits = model_.Forward(chunks);  // [rows, V] fp32 on the CPU
    // The pass succeeded: commit it to every cache (the policies compress and evict here).
    for (size_t i = 0; i < chunks.size(); ++i) {
      Sequence* seq = i < prompts.size() ? prompts[i].seq : decoding[i - prompts.size()];
      seq->cache->Commit(chunks[i].embeds.size(0), chunks[i].prompt_continues);
    }
    const int vocab = static_cast<int>(logits.size(1));
    float* row = logits.data_ptr<float>();
    for (size_t i = 0; i < prompts.size(); ++i, row += vocab) {
      Sequence* seq = prompts[i].seq;
      seq->prefilled += prompts[i].n;
      if (chunks[i].prompt_continues) continue;  // the row of a partial prompt predicts nothing
      seq->prompt_embeds = at::Tensor();         // the cache holds the prompt now
      const std::string delta = seq->state->Step(row, vocab);
      if (!seq->first_token_seen) {
        seq->first_token_seen = true;
        seq->result.ttft_seconds = Seconds(seq->req->submitted, Clock::now());
      }
      if (!delta.empty()) seq->req->observer->OnText(delta);
    }
    for (Sequence* seq : decoding) {
      const std::string delta = seq->state->Step(row, vocab);
      row += vocab;
      if (!delta.empty()) seq->req->observer->OnText(delta);
    }
    std::lock_guard<std::mutex> lock(mu_);
    snapshot_.last_batch_size = static_cast<int>(chunks.size());
  } catch (const c10::Error& e) {
    // A failed pass is never committed (its rows may be half written): its requests end, and
    // their caches return every page when they are freed at the end of this turn.
    std::vector<Sequence*> failed = decoding;
    for (const PromptPart& part : prompts) failed.push_back(part.seq);
    for (Sequence* seq : failed) {
      seq->state->Abort(FinishReason::kError);
      Finish(seq, Internal(std::string("model failure: ") + e.what_without_backtrace()));
    }
  }
}

void Engine::Preempt(Sequence* seq) {
  seq->kv_before_preemption = seq->cache->Stats();
  seq->cache.reset();  // its pages go back to the pool now
  seq->prompt_embeds = at::Tensor();
  seq->prefilled = 0;
  seq->resume_tokens = static_cast<int64_t>(seq->state->tokens().size());
  seq->preempted = true;
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = scheduler_.Preempt(
        seq->req->id, seq->PromptRows(),
        std::max<int64_t>(0, seq->req->sampling.max_tokens - seq->resume_tokens));
    if (queued) ++preemptions_;
  }
  if (!queued) {  // its prompt and answer so far no longer fit the whole pool
    seq->state->Abort(FinishReason::kError);
    Finish(seq, ResourceExhausted("the request was preempted and its prompt and answer so far (" +
                                  std::to_string(seq->PromptRows()) +
                                  " tokens) no longer fit the KV pool"));
  }
}

// Records the end of `seq` once: `result` carries an error status, or is a placeholder that is
// filled from the sequence's state. Observers hear of it only after the cache is freed and the
// snapshot updated, so a client that sees the end also sees the memory returned.
void Engine::Finish(Sequence* seq, StatusOr<GenerationResult> result) {
  if (!seq->req->observer) return;  // already reported
  std::shared_ptr<RequestObserver> observer = std::move(seq->req->observer);
  if (!result.ok()) {
    completions_.emplace_back(std::move(observer), result.status());
    return;
  }
  const std::string tail = seq->state->Flush();
  if (!tail.empty()) observer->OnText(tail);
  GenerationResult& r = seq->result;
  r.text = seq->state->text();
  r.tokens = seq->state->tokens();
  r.finish = seq->state->finish_reason();
  r.prompt_tokens = static_cast<int>(seq->req->prepared.prompt.ids.size());
  r.image_tokens = static_cast<int>(seq->req->prepared.prompt.image_offsets.size()) *
                   seq->req->prepared.prompt.image_rows;
  r.completion_tokens = static_cast<int>(r.tokens.size());
  r.kv = seq->cache ? seq->cache->Stats() : seq->kv_before_preemption;
  r.total_seconds = Seconds(seq->req->submitted, Clock::now());
  completions_.emplace_back(std::move(observer), r);
}

void Engine::UpdateSnapshotLocked() {
  snapshot_.waiting = scheduler_.waiting();
  snapshot_.running = scheduler_.running();
  snapshot_.preemptions = preemptions_;
  int64_t kept = 0, full = 0;
  for (const auto& seq : running_) {
    if (!seq->cache) continue;
    const KvStats s = seq->cache->Stats();
    kept += s.bytes_kept;
    full += s.full_equivalent_bytes;
  }
  snapshot_.kv_bytes_used = pool_->used_bytes();
  snapshot_.kv_bytes_reserved = snapshot_.kv_bytes_used;  // nothing is reserved ahead
  snapshot_.kv_bytes_kept = kept;
  snapshot_.kv_bytes_full_equivalent = full;
}

}  // namespace llava
