// The service's HTTP servers (the OpenAI-compatible API and the metrics/health endpoint) on
// Boost.Beast over Asio: one I/O thread multiplexes every connection, so an idle or slow client
// costs a socket and a buffer, never a thread. What a client sends is bounded before it costs
// anything:
// - the request head (request line and headers) must be complete within `head_timeout_ms` of
//   the connection opening or of the previous response, and is at most `max_head_bytes`;
// - the handler screens the head (route, method, bearer token) before any body byte is read: a
//   refusal is answered at once, and the body is never read;
// - `Content-Encoding` other than identity is refused (415): bodies are never inflated;
// - a declared `Content-Length` over `max_body_bytes` is refused (413) before reading, and a
//   chunked body is refused once its decoded bytes pass the limit; the parser's buffer is bounded,
//   so a chunk-size line without an end costs at most that buffer;
// - the whole body must arrive within `body_timeout_ms` of the complete head (a deadline, not a
//   per-read timeout that a byte a second extends), and each response write within
//   `write_timeout_ms`;
// - at most `max_connections` are open: a new connection closes the oldest one that is waiting
//   for a request head, and when none is, it is answered 503 and closed (with TLS after its
//   handshake, for at most 16 such connections at once, each within 2 s; more are closed
//   without a word). A head that misses its deadline is answered 408, on TLS too.
// Handlers run on a pool of `workers` threads (JSON parsing and image decoding happen there);
// waiting for the engine holds no thread: the answer is handed to the HttpExchange from any
// thread, and a streamed answer is pulled by the I/O thread as the client takes it. A client
// that closes its connection before its answer ends is reported to the handler (OnGone), which
// cancels the request.
//
// Thread safety: Start and Stop from one thread; HttpExchange from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct ssl_ctx_st;

namespace llava::server {

using HttpFields = std::vector<std::pair<std::string, std::string>>;

struct HttpRequestHead {
  std::string method;  // as sent: "GET", "POST", ...
  std::string target;  // as sent, query included
  std::string path;    // the target without its query
  HttpFields headers;  // as sent, in order
  // The first header named `name` (case-insensitive), or "".
  std::string Header(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type;  // empty: no Content-Type
  std::string body;
  HttpFields headers;  // extra headers (Content-Length and Connection are the server's)
};

// One request's answer. Exactly one of Reply or Stream, once; any thread.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual void Reply(HttpResponse response) = 0;
  // A chunked response (`head`'s body is ignored). `next` runs on the I/O thread, after the
  // head and after each write, and whenever Notify is called while no write is under way: it
  // returns the bytes to send now ("" for none yet) and sets *end when nothing follows them. It
  // must not block.
  virtual void Stream(HttpResponse head, std::function<std::string(bool* end)> next) = 0;
  virtual void Notify() = 0;
  // `gone` runs once, on the I/O thread, if the connection closes (the client left, a write
  // failed or timed out, the server stopped) before the answer has been sent in full. Set it
  // before Reply or Stream.
  virtual void OnGone(std::function<void()> gone) = 0;
};

class HttpHandler {
 public:
  virtual ~HttpHandler() = default;
  // On the I/O thread, with the head only (no body byte read yet): an answer that stands for
  // the request (unknown route, wrong method, missing token, a bodiless GET) or nullopt to read
  // the body and call Handle. Must be cheap.
  virtual std::optional<HttpResponse> Screen(const HttpRequestHead& head) = 0;
  // On a worker thread, with the whole body; answers through `exchange`.
  virtual void Handle(HttpRequestHead head, std::string body,
                      std::shared_ptr<HttpExchange> exchange) = 0;
};

class HttpServer {
 public:
  struct Limits {
    int workers = 8;                   // Handle calls at once
    int max_connections = 1024;        // open at once
    int head_timeout_ms = 10000;       // from accept or the last response to a complete head
    int body_timeout_ms = 60000;       // from the complete head to the whole body
    int write_timeout_ms = 30000;      // each write of a response
    size_t max_head_bytes = 64 << 10;  // request line and headers; more is a 431
    size_t max_body_bytes = 64 << 20;  // decoded body; more is a 413
    int max_requests_per_connection = 1000;
  };
  // What the server reports, for metrics; called on the I/O thread.
  struct Events {
    std::function<void(int open)> connections;  // connections open, after each change
    // A connection the server closed for a limit: "cap" (waiting for a head, closed for a new
    // one), "refused" (a new one at the cap, answered 503), "head_timeout", "head_too_large",
    // "body_timeout", "body_too_large", "write_timeout", "bad_request", "tls_handshake".
    std::function<void(const char* reason)> closed;
  };
  // Borrows `handler` and `tls` (null: plain HTTP; the server takes its own reference), which
  // must outlive the server.
  HttpServer(HttpHandler* handler, ::ssl_ctx_st* tls, Limits limits, Events events = {});
  ~HttpServer();  // Stop()
  // Binds "host:port" ("" host = all interfaces, "[::1]" for IPv6, port 0 = ephemeral) and
  // starts serving; the bound port, or -1.
  int Start(const std::string& address);
  // Stops accepting, closes the connections waiting for a request, lets the answers under way
  // finish for up to `grace` (then their connections close: a stream is cut short), waits for
  // the running handlers and joins every thread.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  class Impl;  // http_server.cc (its connections hold a pointer to it)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace llava::server
