#include "server/request_gate.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "engine/io/utf8.h"

namespace llava::server {

std::string LogSafe(std::string_view text, size_t max_bytes) {
  static const char kHex[] = "0123456789abcdef";
  const bool utf8 = IsValidUtf8(text);
  std::string out;
  out.reserve(std::min(text.size(), max_bytes) + 8);
  for (size_t i = 0; i < text.size(); ++i) {
    if (out.size() >= max_bytes) {
      out.resize(out.size() - Utf8IncompleteTail(out));  // no half character before the mark
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(text[i]);
    const auto next = [&](size_t k) {
      return i + k < text.size() ? static_cast<unsigned char>(text[i + k]) : 0;
    };
    // C1 controls (U+0080-U+009F: C2 80-9F) and the line/paragraph separators (E2 80 A8-A9).
    const bool c1 = utf8 && c == 0xC2 && next(1) >= 0x80 && next(1) <= 0x9F;
    const bool separator =
        utf8 && c == 0xE2 && next(1) == 0x80 && (next(2) == 0xA8 || next(2) == 0xA9);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F || (c >= 0x80 && !utf8) || c1 || separator) {
      const size_t n = c1 ? 2 : separator ? 3 : 1;
      for (size_t k = 0; k < n; ++k, ++i) {
        const unsigned char b = static_cast<unsigned char>(text[i]);
        out += "\\x";
        out += kHex[b >> 4];
        out += kHex[b & 15];
      }
      --i;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

void LogRequest(const RequestLog& log, const StatusOr<GenerationResult>& result, double queue_s) {
  if (!result.ok()) {
    spdlog::warn("request id={} api={} client={} status={}", LogSafe(log.id), log.api,
                 LogSafe(log.client), LogSafe(result.status().ToString()));
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
      LogSafe(log.id), log.api, LogSafe(log.client), FinishReasonName(r.finish), r.prompt_tokens,
      r.image_tokens, r.completion_tokens, CachePolicyName(log.policy), log.budget, r.kv.bytes_kept,
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
  spdlog::warn("request rejected: api={} {}", api, LogSafe(status.ToString()));
  if (metrics_ != nullptr) metrics_->RecordRejected(status, api);
}

}  // namespace llava::server
