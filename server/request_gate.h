// The one way a request reaches the engine from either API (gRPC in llava_service.cc, the
// OpenAI-compatible HTTP API in openai_server.cc): engine ids from one counter, the request's
// log facts, refusals logged and counted once, and the log line at the end. Both front ends
// convert their wire format to a GenerationRequest first; everything after that is shared.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "engine/serving/engine.h"
#include "server/auth.h"
#include "server/metrics.h"

namespace llava::server {

// Server-side defaults for fields the client leaves unset (both APIs).
struct RequestDefaults {
  int max_tokens = 256;
  CacheParams kv;  // policy and budget used when kv_cache.policy / budget are unset
};

// What a call keeps of its request for the log line at the end: the converted request itself
// (image bytes included) is handed to the engine and not kept by the call.
struct RequestLog {
  std::string id;            // the client's request id, or "req-<engine id>"
  std::string api;           // "grpc" or "openai"
  std::string client = "-";  // the bearer token's name; "-" without authentication
  CachePolicy policy = CachePolicy::kFull;
  double budget = 1.0;
};

// `text` as it may go into a log line: a client's bytes cannot forge a line or drive a
// terminal. Control characters (C0, DEL, C1, U+2028/9), backslashes and bytes that are not
// UTF-8 are escaped (\n, \\, \xNN); more than `max_bytes` are cut, marked "...". Every
// client-supplied string in the request log lines goes through it.
std::string LogSafe(std::string_view text, size_t max_bytes = 1024);

// The log line of a finished request (or of its error).
void LogRequest(const RequestLog& log, const StatusOr<GenerationResult>& result, double queue_s);

// Measures the time between consecutive pieces of text of one request (engine thread).
struct InterTokenClock {
  std::optional<std::chrono::steady_clock::time_point> last;
  void Tick(ServingMetrics* metrics);
};

class RequestGate {
 public:
  // Borrows all three; `metrics` may be null, `tokens` null for a server without authentication.
  RequestGate(EngineApi* engine, ServingMetrics* metrics, TokenStore* tokens = nullptr)
      : engine_(engine), metrics_(metrics), tokens_(tokens) {}

  // The client's name from its `authorization` value ("Bearer <token>"): "-" when the server
  // needs no token, nullopt (logged and counted as UNAUTHENTICATED, the token never written)
  // when it is missing or unknown.
  std::optional<std::string> Authenticate(std::string_view authorization, const std::string& api);

  // Submits `request` under a fresh engine id. Fills `engine_id` and, before the engine can
  // call `observer`, `log` (its id is `client_id`, or "req-<engine id>" when empty). On error
  // nothing was submitted, and the refusal is logged and counted.
  Status Submit(const GenerationRequest& request, const std::string& client_id,
                const std::string& api,
                std::optional<std::chrono::steady_clock::time_point> deadline,
                std::shared_ptr<RequestObserver> observer, uint64_t* engine_id, RequestLog* log);
  // Counts and logs a request refused before it could be converted (bad JSON, bad proto).
  void Refused(const Status& status, const std::string& api);

  void Cancel(uint64_t engine_id) { engine_->Cancel(engine_id); }
  EngineApi* engine() { return engine_; }
  ServingMetrics* metrics() { return metrics_; }

 private:
  EngineApi* engine_;
  ServingMetrics* metrics_;
  TokenStore* tokens_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace llava::server
