#include "server/openai_server.h"

#include <openssl/ssl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>

#include "server/http_front.h"
#include "server/openai_api.h"

namespace llava::server {
namespace {

using namespace std::chrono_literals;

// How often a waiting worker looks at its connection for a hang-up.
constexpr auto kHangupPoll = 50ms;

// True once the client has closed its end (or the connection broke).
bool PeerGone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void SendError(httplib::Response& res, const Status& status) {
  res.status = HttpStatusOf(status);
  res.set_content(ErrorJson(status), "application/json");
}

// 401 in OpenAI's shape (what its API answers for a wrong key).
void SendUnauthenticated(httplib::Response& res) {
  res.status = 401;
  res.set_header("WWW-Authenticate", "Bearer");
  res.set_content(
      "{\"error\":{\"message\":\"this server needs a bearer token: header \\\"Authorization: "
      "Bearer <token>\\\" (the OpenAI SDKs send their api_key so)\",\"type\":"
      "\"invalid_request_error\",\"param\":null,\"code\":\"invalid_api_key\"}}",
      "application/json");
}

// One request's output, written by the engine thread and read by the connection's worker.
struct HttpCall : RequestObserver {
  explicit HttpCall(ServingMetrics* m) : metrics(m) {}
  void OnAdmitted(double q) override {
    std::lock_guard<std::mutex> l(mu);
    queue_seconds = q;
  }
  void OnText(const std::string& delta) override {
    gaps.Tick(metrics);
    std::lock_guard<std::mutex> l(mu);
    text += delta;
    cv.notify_all();
  }
  void OnFinished(const StatusOr<GenerationResult>& r) override {
    double q;
    {
      std::lock_guard<std::mutex> l(mu);
      q = queue_seconds;
    }
    LogRequest(log, r, q);
    if (metrics) metrics->RecordFinished(r, q, log.policy, log.api);
    std::lock_guard<std::mutex> l(mu);
    result = r;
    cv.notify_all();
  }

  ServingMetrics* metrics;
  InterTokenClock gaps;  // engine thread only
  RequestLog log;        // written before the engine can call back
  std::mutex mu;
  std::condition_variable cv;
  std::string text;                                  // guarded by mu: text not yet taken
  std::optional<StatusOr<GenerationResult>> result;  // guarded by mu
  double queue_seconds = 0;                          // guarded by mu
};

}  // namespace

OpenAiServer::OpenAiServer(RequestGate* gate, OpenAiServerConfig config)
    : gate_(gate),
      config_(std::move(config)),
      created_(std::chrono::duration_cast<std::chrono::seconds>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count()) {}

bool OpenAiServer::ReloadTls() { return https_ != nullptr && https_->Reload(); }

int OpenAiServer::Start(const std::string& address) {
  if (!config_.tls.cert.empty()) {
    auto https = HttpsContext::Create(config_.tls);
    if (!https.ok()) {
      spdlog::error("HTTP API TLS: {}", https.status().message());
      return -1;
    }
    https_ = std::move(*https);
    ssl_ctx_ = SSL_CTX_new(TLS_server_method());
    if (ssl_ctx_ == nullptr || !https_->Configure(*ssl_ctx_)) {
      spdlog::error("HTTP API TLS: cannot set up the TLS context");
      return -1;
    }
    SSL_CTX_set_options(ssl_ctx_, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  }
  http_ = std::make_unique<HttpRoutes>();
  HttpRoutes& http = *http_;
  HttpFront::Limits limits;
  limits.workers = std::max(2, config_.threads);
  limits.max_connections = std::max(config_.max_connections, limits.workers + 1);
  http.set_payload_max_length(config_.max_body_bytes);
  // For the Keep-Alive header httplib writes (HttpFront enforces both).
  http.set_keep_alive_timeout(limits.head_timeout_ms / 1000);
  http.set_keep_alive_max_count(static_cast<size_t>(limits.max_requests_per_connection));

  // Errors httplib answers itself (unknown path, wrong method, body too large) in OpenAI's shape.
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message;
    if (res.status == 413) {
      message = "the request body is larger than the server's limit (--http-max-body-bytes)";
    } else if (res.status == 404) {
      message = "no route for " + req.method + " " + req.path;
    } else {
      message = "HTTP " + std::to_string(res.status);
    }
    res.set_content("{\"error\":{\"message\":" + nlohmann::json(message).dump() +
                        ",\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}",
                    "application/json");
  });

  const std::string models_json = [&] {
    nlohmann::json m = {{"id", config_.model_id},
                        {"object", "model"},
                        {"created", created_},
                        {"owned_by", "llava-server"}};
    return m.dump();
  }();
  // Every route needs the bearer token when the server has any: the client's token name, or
  // nullopt after answering 401.
  auto client = [this](const httplib::Request& req, httplib::Response& res) {
    std::optional<std::string> name =
        gate_->Authenticate(req.get_header_value("Authorization"), "openai");
    if (!name) SendUnauthenticated(res);
    return name;
  };
  http.Get(
      "/v1/models", [client, models_json](const httplib::Request& req, httplib::Response& res) {
        if (!client(req, res)) return;
        res.set_content("{\"object\":\"list\",\"data\":[" + models_json + "]}", "application/json");
      });
  http.Get("/v1/models/(.+)", [this, client, models_json](const httplib::Request& req,
                                                          httplib::Response& res) {
    if (!client(req, res)) return;
    if (req.matches[1] != config_.model_id) {
      SendError(res, NotFound("The model '" + std::string(req.matches[1]) +
                              "' does not exist; this server serves '" + config_.model_id + "'"));
      return;
    }
    res.set_content(models_json, "application/json");
  });

  http.Post(
      "/v1/chat/completions", [this, client](const httplib::Request& req, httplib::Response& res) {
        const std::optional<std::string> name = client(req, res);
        if (!name) return;
        StatusOr<OpenAiRequest> parsed = ParseChatCompletion(req.body, config_.defaults);
        if (parsed.ok() && !parsed->model.empty() && parsed->model != config_.model_id) {
          parsed = NotFound("The model '" + parsed->model +
                            "' does not exist; this server serves '" + config_.model_id + "'");
        }
        if (!parsed.ok()) {
          gate_->Refused(parsed.status(), "openai");
          SendError(res, parsed.status());
          return;
        }
        std::optional<std::chrono::steady_clock::time_point> deadline;
        if (parsed->timeout_seconds) {
          deadline = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(*parsed->timeout_seconds));
        }
        auto call = std::make_shared<HttpCall>(gate_->metrics());
        call->log.client = *name;
        uint64_t id = 0;
        Status s = gate_->Submit(parsed->request, "", "openai", deadline, call, &id, &call->log);
        if (!s.ok()) {
          SendError(res, ToOpenAiFieldNames(s));
          return;
        }
        CompletionMeta meta;
        meta.id = "chatcmpl-" + call->log.id;
        meta.model = config_.model_id;
        meta.created = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
        const int fd = HttpFront::CurrentSocket();
        RequestGate* gate = gate_;

        if (!parsed->stream) {
          std::unique_lock<std::mutex> lock(call->mu);
          bool cancelled = false;
          while (!call->result) {
            call->cv.wait_for(lock, kHangupPoll);
            if (!cancelled && !call->result && PeerGone(fd)) {
              gate->Cancel(id);
              cancelled = true;
            }
          }
          const StatusOr<GenerationResult> result = *call->result;
          if (!result.ok()) {
            SendError(res, result.status());
            return;
          }
          res.set_content(CompletionJson(meta, call->text, *result, call->queue_seconds),
                          "application/json");
          return;
        }

        // Server-sent events: the role first, then text as the engine produces it (text produced
        // while a write was under way goes out as one event), the finish reason, usage when asked,
        // and [DONE].
        const bool include_usage = parsed->include_usage;
        auto started = std::make_shared<bool>(false);
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream",
            [call, meta, include_usage, fd, gate, id, started](size_t, httplib::DataSink& sink) {
              auto send = [&sink](const std::string& json) {
                const std::string event = "data: " + json + "\n\n";
                return sink.write(event.data(), event.size());
              };
              if (!*started) {
                *started = true;
                const std::string role = "assistant", empty;
                if (!send(ChunkJson(meta, &role, &empty, nullptr, include_usage))) return false;
              }
              std::unique_lock<std::mutex> lock(call->mu);
              while (call->text.empty() && !call->result) {
                call->cv.wait_for(lock, kHangupPoll);
                if (call->text.empty() && !call->result && PeerGone(fd)) return false;
              }
              if (!call->text.empty()) {
                const std::string text = std::move(call->text);
                call->text.clear();
                lock.unlock();
                return send(ChunkJson(meta, nullptr, &text, nullptr, include_usage));
              }
              const StatusOr<GenerationResult> result = *call->result;
              const double queue_seconds = call->queue_seconds;
              lock.unlock();
              if (!result.ok()) {
                send(ErrorJson(result.status()));
              } else {
                if (!send(ChunkJson(meta, nullptr, nullptr, FinishReasonName(result->finish),
                                    include_usage))) {
                  return false;
                }
                if (include_usage && !send(UsageChunkJson(meta, *result, queue_seconds)))
                  return false;
                static const char kDone[] = "data: [DONE]\n\n";
                if (!sink.write(kDone, sizeof(kDone) - 1)) return false;
              }
              sink.done();
              return true;
            },
            // Ends with the connection: a stream cut short (the client left, a write failed)
            // cancels the request; a finished one is unaffected (Cancel ignores finished ids).
            [gate, id](bool success) {
              if (!success) gate->Cancel(id);
            });
      });

  HttpFront::Events events;
  if (ServingMetrics* metrics = gate_->metrics()) {
    events.connections = [metrics](int open) { metrics->SetHttpConnections(open); };
    events.closed = [metrics](const char* reason) { metrics->RecordHttpConnectionClosed(reason); };
  }
  front_ = std::make_unique<HttpFront>(&http, ssl_ctx_, limits, std::move(events));
  return front_->Start(address);
}

void OpenAiServer::Stop(std::chrono::milliseconds grace) {
  if (front_) front_->Stop(grace);
}

OpenAiServer::~OpenAiServer() {
  Stop();
  front_.reset();
  if (ssl_ctx_ != nullptr) SSL_CTX_free(ssl_ctx_);
}

}  // namespace llava::server
