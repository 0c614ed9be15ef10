// The OpenAI-compatible HTTP API beside gRPC, on a port of its own:
//   POST /v1/chat/completions  (JSON, or server-sent events with "stream": true)
//   GET  /v1/models, GET /v1/models/{id}
// Connections, TLS included, are held by HttpServer (http_server.h, Boost.Beast): idle and slow
// clients cost no thread, the bearer token and the route are checked from the head before any
// body byte is read, bodies are bounded in bytes and time. Requests go through the same
// RequestGate as the gRPC API (request_gate.h): same engine, limits, metrics and log lines. The
// wire format lives in openai_api.h.
//
// A client that disconnects cancels its request (the engine frees its cache on its next turn).
// Waiting for the engine holds no thread: answers are written by the server's I/O thread.
//
// Thread safety: Start and Stop from one thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "server/request_gate.h"
#include "server/tls.h"

struct ssl_ctx_st;

namespace llava::server {

class HttpServer;

struct OpenAiServerConfig {
  RequestDefaults defaults;
  std::string model_id;              // the served model's id in /v1/models and responses
  size_t max_body_bytes = 64 << 20;  // larger bodies: 413
  int threads = 8;                   // requests parsed and submitted at once (JSON, images)
  int max_connections = 1024;  // open at once; a new one closes the oldest waiting one, else 503
  TlsFiles tls;                // cert and key set: HTTPS (server/tls.h), else plain HTTP
};

class OpenAiServer {
 public:
  // Borrows `gate`, which must outlive the server.
  OpenAiServer(RequestGate* gate, OpenAiServerConfig config);
  ~OpenAiServer();  // Stop()
  // Binds "host:port" (port 0 = ephemeral) and starts serving; returns the bound port or -1.
  int Start(const std::string& address);
  // Stops accepting; running responses get `grace` to finish (streams still open after it are
  // cut short and their requests cancelled; HttpServer::Stop).
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));
  // With TLS: re-reads the certificate and key now (SIGHUP); true if a new pair is served.
  bool ReloadTls();

 private:
  class Routes;
  RequestGate* gate_;
  OpenAiServerConfig config_;
  std::unique_ptr<HttpsContext> https_;  // with TLS; outlives server_
  ::ssl_ctx_st* ssl_ctx_ = nullptr;      // with TLS; outlives server_
  std::unique_ptr<Routes> routes_;
  std::unique_ptr<HttpServer> server_;
};

}  // namespace llava::server
