#include "server/metrics.h"

#include <prometheus/text_serializer.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

namespace llava::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

Histogram::BucketBoundaries LatencyBuckets() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}

Histogram::BucketBoundaries CompressionBuckets() {
  return {0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0};
}

constexpr CachePolicy kPolicies[] = {CachePolicy::kFull, CachePolicy::kElastic, CachePolicy::kH2O,
                                     CachePolicy::kStreamingLLM, CachePolicy::kSnapKV};

// The container's memory limit in bytes (cgroup v2, then v1), or 0 when there is none.
double CgroupMemoryLimit() {
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string v;
    if (!(in >> v) || v == "max") continue;
    const double bytes = std::strtod(v.c_str(), nullptr);
    if (bytes > 0 && bytes < 9e18) return bytes;  // v1 writes ~2^63 for "no limit"
  }
  return 0;
}

}  // namespace

ServingMetrics::ServingMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto gauge = [&](const char* name, const char* help) {
    return &BuildGauge().Name(name).Help(help).Register(*registry_).Add({});
  };
  auto counter = [&](const char* name, const char* help) {
    return &BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
  };
  auto histogram = [&](const char* name, const char* help, Histogram::BucketBoundaries b) {
    return &BuildHistogram().Name(name).Help(help).Register(*registry_).Add({}, std::move(b));
  };
  running_ = gauge("llava_num_requests_running", "Requests in the running batch.");
  waiting_ = gauge("llava_num_requests_waiting", "Requests waiting for admission.");
  kv_usage_ratio_ = gauge("llava_kv_cache_usage_ratio", "KV pool pages in use / the pool (0-1).");
  kv_used_bytes_ = gauge("llava_kv_cache_used_bytes",
                         "KV pool bytes in pages held by running requests (physical).");
  kv_pool_bytes_ = gauge("llava_kv_cache_pool_bytes",
                         "The KV pool allocated at start (--kv-cache-bytes in whole pages).");
  kv_full_bytes_ = gauge("llava_kv_cache_full_equivalent_bytes",
                         "KV bytes the Full policy would hold for the running requests.");
  kv_reserved_bytes_ = gauge("llava_kv_cache_reserved_bytes",
                             "KV bytes handed out by admission: the pool pages in use (nothing is "
                             "reserved ahead).");
  kv_budget_bytes_ = gauge("llava_kv_cache_budget_bytes", "The KV byte budget for admission.");
  activation_bytes_ = gauge("llava_activation_bytes",
                            "Memory mapped for the forward pass's large CPU tensors: in use and "
                            "kept for the next pass (0 with --activation-allocator=false).");
  activation_peak_bytes_ = gauge("llava_activation_peak_bytes",
                                 "The most bytes of CPU tensors live at once since start: the "
                                 "activation workspace of the largest step.");
  batch_size_ = gauge("llava_batch_size", "Sequences in the last decode step.");
  max_batch_ = gauge("llava_max_batch",
                     "The most sequences one decode step runs (--max-batch, auto resolved).");
  compression_ratio_ =
      &BuildHistogram()
           .Name("llava_kv_compression_ratio")
           .Help("KV bytes kept / full-equivalent bytes at request end, by cache policy.")
           .Register(*registry_);
  merged_ = &BuildCounter()
                 .Name("llava_kv_tokens_merged_total")
                 .Help("Prompt entries merged into anchors (per layer), by cache policy.")
                 .Register(*registry_);
  evicted_ = &BuildCounter()
                  .Name("llava_kv_tokens_evicted_total")
                  .Help("KV entries evicted (per layer), by cache policy.")
                  .Register(*registry_);
  for (CachePolicy p : kPolicies) {
    compression_ratio_->Add({{"policy", CachePolicyName(p)}}, CompressionBuckets());
    merged_->Add({{"policy", CachePolicyName(p)}});
    evicted_->Add({{"policy", CachePolicyName(p)}});
  }
  prompt_tokens_ =
      counter("llava_prompt_tokens_total", "Prompt tokens processed, image tokens included.");
  generation_tokens_ = counter("llava_generation_tokens_total", "Tokens generated.");
  preemptions_ = counter("llava_preemptions_total",
                         "Running requests that gave their KV pages back when the pool ran "
                         "short, to be recomputed.");
  ttft_ =
      histogram("llava_time_to_first_token_seconds", "Arrival to first token.", LatencyBuckets());
  inter_token_ = histogram(
      "llava_inter_token_latency_seconds", "Time between streamed tokens.",
      {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0});
  e2e_ = histogram("llava_e2e_request_latency_seconds", "Arrival to the end of the request.",
                   LatencyBuckets());
  queue_time_ = histogram("llava_request_queue_time_seconds", "Time waiting for admission.",
                          LatencyBuckets());
  vision_ = histogram("llava_vision_encode_seconds", "Vision tower + projector per request.",
                      LatencyBuckets());
  finished_ = &BuildCounter()
                   .Name("llava_request_success_total")
                   .Help("Finished requests by finish reason.")
                   .Register(*registry_);
  status_ = &BuildCounter()
                 .Name("llava_request_status_total")
                 .Help(
                     "Requests by final status code (gRPC's names; the OpenAI API's HTTP "
                     "statuses map to them) and API (grpc, openai).")
                 .Register(*registry_);
  for (const char* r : {"stop", "length", "cancelled", "error"})
    finished_->Add({{"finish_reason", r}});
  for (const char* api : {"grpc", "openai"}) status_->Add({{"code", "OK"}, {"api", api}});
  http_connections_ =
      gauge("llava_http_connections", "Connections open on the OpenAI-compatible HTTP port.");
  certificate_family_ = &BuildGauge()
                             .Name("llava_tls_certificate_expiry_seconds")
                             .Help(
                                 "Seconds until the TLS certificate (--tls-cert, as on disk) "
                                 "expires; negative once it has. Only with TLS.")
                             .Register(*registry_);
  http_closed_ = &BuildCounter()
                      .Name("llava_http_connections_closed_total")
                      .Help(
                          "HTTP API connections the server closed for a limit, by reason: cap "
                          "(the oldest waiting for a request, for a new one), refused (a new "
                          "one at the cap, answered 503), head_timeout, head_too_large, "
                          "body_timeout, body_too_large, write_timeout, bad_request, "
                          "tls_handshake.")
                      .Register(*registry_);
  for (const char* r : {"cap", "refused", "head_timeout", "head_too_large", "body_timeout",
                        "body_too_large", "write_timeout", "bad_request", "tls_handshake"}) {
    http_closed_->Add({{"reason", r}});
  }

  resident_bytes_ = gauge("process_resident_memory_bytes", "Resident memory size in bytes.");
  virtual_bytes_ = gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.");
  open_fds_ = gauge("process_open_fds", "Number of open file descriptors.");
  start_time_ = gauge("process_start_time_seconds", "Start time of the process since the epoch.");
  cpu_seconds_ = counter("process_cpu_seconds_total", "User and system CPU time in seconds.");
  memory_limit_ = gauge("llava_memory_limit_bytes",
                        "The container's memory limit (cgroup), 0 when there is none.");
  start_time_->Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  UpdateProcess();
}

void ServingMetrics::UpdateProcess() {
  // /proc/self/stat: fields 14-15 are utime and stime in clock ticks, 23 vsize in bytes and 24
  // rss in pages (after the parenthesised command name, which may hold spaces).
  std::ifstream in("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close != std::string::npos) {
    std::istringstream fields(stat.substr(close + 2));
    std::vector<std::string> f{std::istream_iterator<std::string>(fields),
                               std::istream_iterator<std::string>()};
    if (f.size() > 21) {  // f[0] is field 3 (state)
      const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
      const double cpu = (std::stod(f[11]) + std::stod(f[12])) / ticks;
      virtual_bytes_->Set(std::stod(f[20]));
      resident_bytes_->Set(std::stod(f[21]) * static_cast<double>(::sysconf(_SC_PAGESIZE)));
      std::lock_guard<std::mutex> lock(process_mu_);
      if (cpu > cpu_seconds_seen_) cpu_seconds_->Increment(cpu - cpu_seconds_seen_);
      cpu_seconds_seen_ = std::max(cpu_seconds_seen_, cpu);
    }
  }
  std::error_code ec;
  int fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  open_fds_->Set(fds);
  memory_limit_->Set(CgroupMemoryLimit());
}

void ServingMetrics::RecordFinished(const StatusOr<GenerationResult>& result, double queue_s,
                                    CachePolicy policy, const std::string& api) {
  queue_time_->Observe(queue_s);
  if (!result.ok()) {
    RecordRejected(result.status(), api);
    finished_->Add({{"finish_reason", "error"}}).Increment();
    return;
  }
  const GenerationResult& r = *result;
  finished_->Add({{"finish_reason", FinishReasonName(r.finish)}}).Increment();
  status_->Add({{"code", r.finish == FinishReason::kCancelled ? "CANCELLED" : "OK"}, {"api", api}})
      .Increment();
  prompt_tokens_->Increment(r.prompt_tokens);
  generation_tokens_->Increment(r.completion_tokens);
  const prometheus::Labels by_policy = {{"policy", CachePolicyName(policy)}};
  merged_->Add(by_policy).Increment(static_cast<double>(r.kv.tokens_merged));
  evicted_->Add(by_policy).Increment(static_cast<double>(r.kv.tokens_evicted));
  if (r.kv.full_equivalent_bytes > 0) {
    compression_ratio_->Add(by_policy, CompressionBuckets())
        .Observe(double(r.kv.bytes_kept) / r.kv.full_equivalent_bytes);
  }
  if (r.completion_tokens > 0) ttft_->Observe(r.ttft_seconds);
  e2e_->Observe(r.total_seconds);
  if (r.vision_seconds > 0) vision_->Observe(r.vision_seconds);
}

void ServingMetrics::RecordRejected(const Status& status, const std::string& api) {
  status_->Add({{"code", StatusCodeName(status.code())}, {"api", api}}).Increment();
}

void ServingMetrics::UpdateFromEngine(const EngineSnapshot& s) {
  running_->Set(s.running);
  waiting_->Set(s.waiting);
  kv_used_bytes_->Set(static_cast<double>(s.kv_bytes_used));
  kv_full_bytes_->Set(static_cast<double>(s.kv_bytes_full_equivalent));
  kv_reserved_bytes_->Set(static_cast<double>(s.kv_bytes_reserved));
  kv_budget_bytes_->Set(static_cast<double>(s.kv_budget_bytes));
  kv_pool_bytes_->Set(static_cast<double>(s.kv_pool_bytes));
  activation_bytes_->Set(static_cast<double>(s.activation_mapped_bytes));
  activation_peak_bytes_->Set(static_cast<double>(s.activation_peak_bytes));
  {
    std::lock_guard<std::mutex> lock(preemptions_mu_);  // the snapshot's count only grows
    if (s.preemptions > preemptions_seen_) {
      preemptions_->Increment(static_cast<double>(s.preemptions - preemptions_seen_));
      preemptions_seen_ = s.preemptions;
    }
  }
  kv_usage_ratio_->Set(s.kv_budget_bytes > 0 ? double(s.kv_bytes_reserved) / s.kv_budget_bytes : 0);
  batch_size_->Set(s.last_batch_size);
  max_batch_->Set(s.max_batch);
}

std::string ServingMetrics::Serialize() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace llava::server
