#include "server/openai_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>

#include "server/http_endpoint.h"
#include "server/openai_api.h"

namespace llava::server {
namespace {

using namespace std::chrono_literals;

// How often a waiting worker looks at its connection for a hang-up.
constexpr auto kHangupPoll = 50ms;

// The socket of the connection `req` came on. httplib 0.11 (Debian 12) gives handlers no handle
// to it, so it is found by its two ends among the process's descriptors; -1 if not found (then
// a hang-up is noticed only when a write fails).
int ConnectionSocket(const httplib::Request& req) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    sockaddr_storage local{}, peer{};
    socklen_t llen = sizeof(local), plen = sizeof(peer);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0) continue;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) continue;
    auto port = [](const sockaddr_storage& a) {
      if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
      if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
      return uint16_t{0};
    };
    if (port(local) == req.local_port && port(peer) == req.remote_port) {
      found = fd;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

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

OpenAiServer::~OpenAiServer() { Stop(); }

bool OpenAiServer::ReloadTls() { return https_ != nullptr && https_->Reload(); }

int OpenAiServer::Start(const std::string& address) {
  if (config_.tls.cert.empty()) {
    http_ = std::make_unique<httplib::Server>();
  } else {
    auto https = HttpsContext::Create(config_.tls);
    if (!https.ok()) {
      spdlog::error("HTTP API TLS: {}", https.status().message());
      return -1;
    }
    https_ = std::move(*https);
    HttpsContext* context = https_.get();
    auto server = std::make_unique<httplib::SSLServer>(
        [context](SSL_CTX& ctx) { return context->Configure(ctx); });
    if (!server->is_valid()) {
      spdlog::error("HTTP API TLS: cannot set up the TLS context");
      return -1;
    }
    http_ = std::move(server);
  }
  httplib::Server& http = *http_;
  const int threads = std::max(2, config_.threads);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(config_.max_body_bytes);
  http.set_read_timeout(30, 0);
  http.set_write_timeout(30, 0);
  http.set_tcp_nodelay(true);  // one small event per token: no Nagle delay

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
        const int fd = ConnectionSocket(req);
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

  return StartHttpServer(&http, address, &thread_);
}

void OpenAiServer::Stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace llava::server
