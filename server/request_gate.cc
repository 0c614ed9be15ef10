#include "server/request_gate.h"

#include <spdlog/spdlog.h>

namespace llava::server {

void LogRequest(const RequestLog& log, const StatusOr<GenerationResult>& result, double queue_s) {
  if (!result.ok()) {
    spdlog::warn("request id={} api={} client={} status={}", log.id, log.api, log.client,
                 result.status().ToString());
    return;
  }
  const GenerationResult& r = *result;
  const double saved = r.kv.full_equivalent_bytes > 0
                           ? 1.0 - double(r.kv.bytes_kept) / r.kv.full_equivalent_bytes
                           : 0.0;
  spdlog::info(
      "request id={} api={} client={} finish={} prompt_tokens={} image_tokens={} "
      "completion_tokens={} "
      "policy={} budget={:.2f} kv_bytes={} kv_full_bytes={} kv_saved={:.1f}% queue_s={:.3f} "
      "ttft_s={:.3f} total_s={:.3f}",
      log.id, log.api, log.client, FinishReasonName(r.finish), r.prompt_tokens, r.image_tokens,
      r.completion_tokens, CachePolicyName(log.policy), log.budget, r.kv.bytes_kept,
      r.kv.full_equivalent_bytes, 100 * saved, queue_s, r.ttft_seconds, r.total_seconds);
}

void InterTokenClock::Tick(ServingMetrics* metrics) {
  const auto now = std::chrono::steady_clock::now();
  if (last && metrics)
    metrics->RecordInterToken(std::chrono::duration<double>(now - *last).count());
  last = now;
}

Status RequestGate::Submit(const GenerationRequest& request, const std::string& client_id,
                           const std::string& api,
                           std::optional<std::chrono::steady_clock::time_point> deadline,
                           std::shared_ptr<RequestObserver> observer, uint64_t* engine_id,
                           RequestLog* log) {
  *engine_id = next_id_.fetch_add(1);
  log->id = client_id.empty() ? "req-" + std::to_string(*engine_id) : client_id;
  log->api = api;
  log->policy = request.kv_cache.policy;
  log->budget = request.kv_cache.budget;
  Status s = engine_->Submit(*engine_id, request, std::move(observer), deadline);
  if (!s.ok()) Refused(s, api);
  return s;
}

std::optional<std::string> RequestGate::Authenticate(std::string_view authorization,
                                                     const std::string& api) {
  if (tokens_ == nullptr) return std::string("-");
  std::optional<std::string> name = tokens_->Authenticate(authorization);
  if (!name) {
    spdlog::warn("request rejected: api={} UNAUTHENTICATED: {} bearer token", api,
                 authorization.empty() ? "no" : "an unknown");
    if (metrics_ != nullptr) metrics_->RecordUnauthenticated(api);
  }
  return name;
}

void RequestGate::Refused(const Status& status, const std::string& api) {
  spdlog::warn("request rejected: api={} {}", api, status.ToString());
  if (metrics_ != nullptr) metrics_->RecordRejected(status, api);
}

}  // namespace llava::server
