#include "server/openai_server.h"

#include <openssl/ssl.h>
#include <spdlog/spdlog.h>

#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "server/http_server.h"
#include "server/openai_api.h"

namespace llava::server {
namespace {

constexpr char kJson[] = "application/json";

HttpResponse Json(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.content_type = kJson;
  r.body = std::move(body);
  return r;
}

HttpResponse Error(const Status& status) { return Json(HttpStatusOf(status), ErrorJson(status)); }

// An error the HTTP layer itself finds (unknown route, wrong method), in OpenAI's shape.
HttpResponse HttpError(int status, const std::string& message) {
  return Json(status, "{\"error\":{\"message\":" + nlohmann::json(message).dump() +
                          ",\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}");
}

// 401 in OpenAI's shape (what its API answers for a wrong key).
HttpResponse Unauthenticated() {
  HttpResponse r =
      Json(401,
           "{\"error\":{\"message\":\"this server needs a bearer token: header \\\"Authorization: "
           "Bearer <token>\\\" (the OpenAI SDKs send their api_key so)\",\"type\":"
           "\"invalid_request_error\",\"param\":null,\"code\":\"invalid_api_key\"}}");
  r.headers = {{"WWW-Authenticate", "Bearer"}};
  return r;
}

std::string Event(const std::string& json) { return "data: " + json + "\n\n"; }

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One request's output: written by the engine thread, answered through the exchange (a whole
// JSON body when the request ends, or server-sent events pulled by the I/O thread).
struct HttpCall : RequestObserver {
  HttpCall(ServingMetrics* m, std::shared_ptr<HttpExchange> e, CompletionMeta meta, bool stream,
           bool include_usage)
      : metrics(m),
        exchange(std::move(e)),
        meta(std::move(meta)),
        stream(stream),
        include_usage(include_usage) {}

  void OnAdmitted(double q) override {
    std::lock_guard<std::mutex> l(mu);
    queue_seconds = q;
  }
  void OnText(const std::string& delta) override {
    gaps.Tick(metrics);
    {
      std::lock_guard<std::mutex> l(mu);
      text += delta;
    }
    if (stream) exchange->Notify();
  }
  void OnFinished(const StatusOr<GenerationResult>& r) override {
    double q;
    {
      std::lock_guard<std::mutex> l(mu);
      q = queue_seconds;
      result = r;
    }
    LogRequest(log, r, q);
    if (metrics) metrics->RecordFinished(r, q, log.policy, log.api);
    if (stream) {
      exchange->Notify();
    } else if (!r.ok()) {
      exchange->Reply(Error(r.status()));
    } else {
      std::lock_guard<std::mutex> l(mu);
      exchange->Reply(Json(200, CompletionJson(Meta(), text, *r, q)));
    }
  }
  CompletionMeta Meta() const {
    CompletionMeta m = meta;
    m.id = "chatcmpl-" + log.id;  // the log is filled before the engine can call back
    return m;
  }

  // The events a stream has ready (on the I/O thread): the role first, then all the text
  // produced since the last write as one event, then the finish reason, usage when asked, and
  // [DONE].
  std::string NextEvents(bool* end) {
    const CompletionMeta m = Meta();
    std::string out;
    if (!role_sent) {
      role_sent = true;
      const std::string role = "assistant", empty;
      out += Event(ChunkJson(m, &role, &empty, nullptr, include_usage));
    }
    std::lock_guard<std::mutex> l(mu);
    if (!text.empty()) {
      out += Event(ChunkJson(m, nullptr, &text, nullptr, include_usage));
      text.clear();
    }
    if (!result) return out;
    *end = true;
    if (!result->ok()) return out + Event(ErrorJson(result->status()));
    out +=
        Event(ChunkJson(m, nullptr, nullptr, FinishReasonName((*result)->finish), include_usage));
    if (include_usage) out += Event(UsageChunkJson(m, **result, queue_seconds));
    return out + "data: [DONE]\n\n";
  }

  ServingMetrics* const metrics;
  const std::shared_ptr<HttpExchange> exchange;
  const CompletionMeta meta;  // without its id
  const bool stream, include_usage;
  InterTokenClock gaps;    // engine thread only
  RequestLog log;          // written before the engine can call back
  bool role_sent = false;  // I/O thread only
  std::mutex mu;
  std::string text;                                  // guarded by mu: text not yet sent
  std::optional<StatusOr<GenerationResult>> result;  // guarded by mu
  double queue_seconds = 0;                          // guarded by mu
};

}  // namespace

// The routes: the head decides everything but a chat completion, whose body is read only once
// the route and the bearer token are known good.
class OpenAiServer::Routes final : public HttpHandler {
 public:
  Routes(RequestGate* gate, const OpenAiServerConfig& config)
      : gate_(gate), config_(config), created_(UnixNow()) {
    nlohmann::json m = {{"id", config_.model_id},
                        {"object", "model"},
                        {"created", created_},
                        {"owned_by", "llava-server"}};
    model_json_ = m.dump();
  }

  std::optional<HttpResponse> Screen(const HttpRequestHead& head) override {
    static const std::string kModels = "/v1/models/";
    const bool chat = head.path == "/v1/chat/completions";
    const bool models = head.path == "/v1/models" || head.path.rfind(kModels, 0) == 0;
    if (!chat && !models) return HttpError(404, "no route for " + head.method + " " + head.path);
    if ((chat && head.method != "POST") ||
        (models && head.method != "GET" && head.method != "HEAD")) {
      HttpResponse r = HttpError(405, head.method + " is not allowed on " + head.path);
      r.headers = {{"Allow", chat ? "POST" : "GET, HEAD"}};
      return r;
    }
    if (!gate_->Authenticate(head.Header("Authorization"), "openai")) return Unauthenticated();
    if (chat) return std::nullopt;  // read the body
    if (head.path == "/v1/models") {
      return Json(200, "{\"object\":\"list\",\"data\":[" + model_json_ + "]}");
    }
    const std::string id = head.path.substr(kModels.size());
    if (id != config_.model_id) {
      return Error(NotFound("The model '" + id + "' does not exist; this server serves '" +
                            config_.model_id + "'"));
    }
    return Json(200, model_json_);
  }

  void Handle(HttpRequestHead head, std::string body,
              std::shared_ptr<HttpExchange> exchange) override {
    const std::optional<std::string> name =
        gate_->Authenticate(head.Header("Authorization"), "openai");
    if (!name) return exchange->Reply(Unauthenticated());  // the token went while the body came
    StatusOr<OpenAiRequest> parsed = ParseChatCompletion(body, config_.defaults);
    body = std::string();
    if (parsed.ok() && !parsed->model.empty() && parsed->model != config_.model_id) {
      parsed = NotFound("The model '" + parsed->model + "' does not exist; this server serves '" +
                        config_.model_id + "'");
    }
    if (!parsed.ok()) {
      gate_->Refused(parsed.status(), "openai");
      return exchange->Reply(Error(parsed.status()));
    }
    std::optional<std::chrono::steady_clock::time_point> deadline;
    if (parsed->timeout_seconds) {
      deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(*parsed->timeout_seconds));
    }
    CompletionMeta meta;
    meta.model = config_.model_id;
    meta.created = UnixNow();
    auto call = std::make_shared<HttpCall>(gate_->metrics(), exchange, meta, parsed->stream,
                                           parsed->include_usage);
    call->log.client = *name;
    uint64_t id = 0;
    const Status s = gate_->Submit(parsed->request, "", "openai", deadline, call, &id, &call->log);
    if (!s.ok()) return exchange->Reply(Error(ToOpenAiFieldNames(s)));
    // A client that leaves (or a write that fails) cancels the request; a finished one is
    // unaffected (Cancel ignores finished ids).
    RequestGate* gate = gate_;
    exchange->OnGone([gate, id] { gate->Cancel(id); });
    if (!parsed->stream) return;  // OnFinished replies
    HttpResponse events;
    events.content_type = "text/event-stream";
    events.headers = {{"Cache-Control", "no-cache"}};
    exchange->Stream(std::move(events), [call](bool* end) { return call->NextEvents(end); });
  }

 private:
  RequestGate* const gate_;
  const OpenAiServerConfig& config_;
  const int64_t created_;  // Unix seconds at start: /v1/models' "created"
  std::string model_json_;
};

OpenAiServer::OpenAiServer(RequestGate* gate, OpenAiServerConfig config)
    : gate_(gate), config_(std::move(config)) {}

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
  routes_ = std::make_unique<Routes>(gate_, config_);
  HttpServer::Limits limits;
  limits.workers = std::max(1, config_.threads);
  limits.max_connections = config_.max_connections;
  limits.max_body_bytes = config_.max_body_bytes;
  HttpServer::Events events;
  if (ServingMetrics* metrics = gate_->metrics()) {
    events.connections = [metrics](int open) { metrics->SetHttpConnections(open); };
    events.closed = [metrics](const char* reason) { metrics->RecordHttpConnectionClosed(reason); };
  }
  server_ = std::make_unique<HttpServer>(routes_.get(), ssl_ctx_, limits, std::move(events));
  return server_->Start(address);
}

void OpenAiServer::Stop(std::chrono::milliseconds grace) {
  if (server_) server_->Stop(grace);
}

OpenAiServer::~OpenAiServer() {
  Stop();
  server_.reset();
  if (ssl_ctx_ != nullptr) SSL_CTX_free(ssl_ctx_);
}

}  // namespace llava::server
