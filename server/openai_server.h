// The OpenAI-compatible HTTP API beside gRPC, on a port of its own:
//   POST /v1/chat/completions  (JSON, or server-sent events with "stream": true)
//   GET  /v1/models, GET /v1/models/{id}
// Requests are parsed and routed by cpp-httplib (Debian's libcpp-httplib-dev); connections,
// TLS included, are held by HttpFront (http_front.h: idle and slow clients cost no thread,
// every request has deadlines, open connections are capped). Requests go through the same
// RequestGate as the gRPC API (request_gate.h): same engine, limits, metrics and log lines. The
// wire format lives in openai_api.h.
//
// A client that disconnects cancels its request (the engine frees its cache on its next turn):
// the worker watches its connection for a hang-up while it waits for the engine.
//
// Thread safety: Start and Stop from one thread; handlers run on the pool's threads.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "server/request_gate.h"
#include "server/tls.h"

struct ssl_ctx_st;

namespace llava::server {

class HttpRoutes;
class HttpFront;

struct OpenAiServerConfig {
  RequestDefaults defaults;
  std::string model_id;              // the served model's id in /v1/models and responses
  size_t max_body_bytes = 64 << 20;  // larger bodies: 413
  int threads = 32;                  // worker threads = requests served at once
  int max_connections = 1024;        // open at once; a new one closes the oldest idle one
  TlsFiles tls;                      // cert and key set: HTTPS (server/tls.h), else plain HTTP
};

class OpenAiServer {
 public:
  // Borrows `gate`, which must outlive the server.
  OpenAiServer(RequestGate* gate, OpenAiServerConfig config);
  ~OpenAiServer();  // Stop()
  // Binds "host:port" (port 0 = ephemeral) and starts serving; returns the bound port or -1.
  int Start(const std::string& address);
  // Stops accepting and joins the listener; running responses get `grace` to finish (streams
  // still open after it are cut short; HttpFront::Stop).
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));
  // With TLS: re-reads the certificate and key now (SIGHUP); true if a new pair is served.
  bool ReloadTls();

 private:
  RequestGate* gate_;
  OpenAiServerConfig config_;
  int64_t created_;                      // Unix seconds at construction: /v1/models' "created"
  std::unique_ptr<HttpsContext> https_;  // with TLS; outlives front_
  ::ssl_ctx_st* ssl_ctx_ = nullptr;      // with TLS; outlives front_
  std::unique_ptr<HttpRoutes> http_;
  std::unique_ptr<HttpFront> front_;
};

}  // namespace llava::server
