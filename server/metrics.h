// Prometheus metrics of the service (vLLM-style names under the llava_ prefix), kept in
// prometheus-cpp's core registry and written with its text serializer; http_endpoint.h serves
// them.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <mutex>
#include <string>

#include "engine/serving/engine.h"

namespace llava::server {

class ServingMetrics {
 public:
  ServingMetrics();

  // A request ended (any outcome): latencies, tokens, KV savings (labelled with the request's
  // cache policy), outcome counters (labelled with the API it came by: "grpc", "openai").
  void RecordFinished(const StatusOr<GenerationResult>& result, double queue_seconds,
                      CachePolicy policy, const std::string& api);
  // A request was refused before it reached the engine (bad input, full queue, ...).
  void RecordRejected(const Status& status, const std::string& api);
  // A request refused for a missing or unknown bearer token.
  void RecordUnauthenticated(const std::string& api) {
    status_->Add({{"code", "UNAUTHENTICATED"}, {"api", api}}).Increment();
  }
  // The OpenAI-compatible port's connections (http_server.h): open now, and those the server
  // closed for a limit, by reason.
  void SetHttpConnections(int open) { http_connections_->Set(open); }
  // Seconds until the served certificate expires (negative once expired); the series exists
  // only once this is called (servers with TLS).
  void SetCertificateSecondsLeft(double seconds) {
    if (certificate_left_ == nullptr) certificate_left_ = &certificate_family_->Add({});
    certificate_left_->Set(seconds);
  }
  void RecordHttpConnectionClosed(const char* reason) {
    http_closed_->Add({{"reason", reason}}).Increment();
  }
  // Time between two streamed pieces of one request.
  void RecordInterToken(double seconds) { inter_token_->Observe(seconds); }
  // Refreshes the gauges from the engine (called before each scrape).
  void UpdateFromEngine(const EngineSnapshot& s);
  // Refreshes the process metrics from /proc and the cgroup (called before each scrape).
  void UpdateProcess();
  // Prometheus text exposition format.
  std::string Serialize() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge* running_;
  prometheus::Gauge* waiting_;
  prometheus::Gauge* kv_usage_ratio_;
  prometheus::Gauge* kv_used_bytes_;
  prometheus::Gauge* kv_full_bytes_;
  prometheus::Gauge* kv_reserved_bytes_;
  prometheus::Gauge* kv_budget_bytes_;
  prometheus::Gauge* kv_pool_bytes_;
  prometheus::Gauge* activation_bytes_;
  prometheus::Gauge* activation_peak_bytes_;
  prometheus::Counter* preemptions_;
  std::mutex preemptions_mu_;
  int64_t preemptions_seen_ = 0;  // guarded by preemptions_mu_
  prometheus::Gauge* batch_size_;
  prometheus::Gauge* max_batch_;
  // By policy ("full", "elastic", "h2o", "streaming_llm"):
  prometheus::Family<prometheus::Histogram>* compression_ratio_;
  prometheus::Family<prometheus::Counter>* merged_;
  prometheus::Family<prometheus::Counter>* evicted_;
  // The Prometheus client conventions' process_* series, and the container's memory limit.
  prometheus::Gauge* resident_bytes_;
  prometheus::Gauge* virtual_bytes_;
  prometheus::Gauge* open_fds_;
  prometheus::Gauge* start_time_;
  prometheus::Counter* cpu_seconds_;
  prometheus::Gauge* memory_limit_;
  std::mutex process_mu_;
  double cpu_seconds_seen_ = 0;  // guarded by process_mu_
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* generation_tokens_;
  prometheus::Histogram* ttft_;
  prometheus::Histogram* inter_token_;
  prometheus::Histogram* e2e_;
  prometheus::Histogram* queue_time_;
  prometheus::Histogram* vision_;
  prometheus::Family<prometheus::Counter>* finished_;  // by finish_reason
  prometheus::Family<prometheus::Counter>* status_;    // by gRPC status code and API
  prometheus::Gauge* http_connections_;
  prometheus::Family<prometheus::Counter>* http_closed_;  // by reason
  prometheus::Family<prometheus::Gauge>* certificate_family_;
  prometheus::Gauge* certificate_left_ = nullptr;  // with TLS
};

}  // namespace llava::server
