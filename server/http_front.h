// The HTTP API's connections: cpp-httplib parses and routes each request, but its connection
// handling is ours. httplib 0.11 (Debian 12) gives every connection a pool thread from accept to
// close, with a timeout per read: 1,000 idle connections, or a few clients sending a byte a
// second, held every thread and the API answered nobody (the metrics port had the same fault;
// http_endpoint.h). Here:
// - one thread polls every connection and reads each request's head itself (plain or TLS, the
//   handshake included), so an idle or slow client costs a descriptor and a buffer, not a
//   thread; the head must be complete within `head_timeout_ms` of the connection opening (or of
//   the previous response, for a kept-alive connection), else the connection is closed;
// - only a request whose head is complete takes a worker, which reads the body (whole body
//   within `body_timeout_ms`), runs httplib's routing and handler and writes the response (each
//   write within `write_timeout_ms`: a stream to a client that stopped reading ends), then
//   waits up to `linger_ms` for the connection's next request before handing it back;
// - at most `max_connections` are open; a new one closes the oldest idle one.
// Requests wait for a worker in arrival order; the handlers' own limits (RequestGate's queue)
// apply as before.
//
// Thread safety: Start and Stop from one thread; handlers run on the worker threads, where
// CurrentSocket() names the connection being served.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct ssl_ctx_st;

namespace llava::server {

// httplib's routes and handlers, with what HttpFront needs of its internals.
class HttpRoutes : public httplib::Server {
 public:
  using httplib::Server::process_request;
  // httplib writes a chunked response only while its listening socket looks open (it checks
  // svr_sock_ to end streams at shutdown); HttpFront owns the socket, so it says so here.
  void MarkServing(int fd) { svr_sock_ = fd; }
};

class HttpFront {
 public:
  struct Limits {
    int workers = 32;                  // requests served at once
    int max_connections = 1024;        // open at once (> workers); a new one closes the oldest idle
    int head_timeout_ms = 10000;       // from accept or the last response to a complete head
    int body_timeout_ms = 60000;       // from a complete head to the whole body
    int write_timeout_ms = 30000;      // each write of the response
    size_t max_head_bytes = 64 << 10;  // request line and headers; more is a 431
    int max_requests_per_connection = 1000;
    int linger_ms = 50;  // after a response, a worker waits this long for the next request
  };
  // What the front reports, for metrics; either may be empty; called from the front's threads.
  struct Events {
    std::function<void(int open)> connections;  // connections open, at least once a second
    // A connection the server closed for a limit: "cap" (the oldest idle one, for a new one),
    // "head_timeout", "head_too_large", "tls_handshake" (failed: not TLS, no client certificate).
    std::function<void(const char* reason)> closed;
  };
  // Borrows `http` (routes and handlers; its listen functions are not used) and `tls` (null:
  // plain HTTP), which must outlive the front.
  HttpFront(HttpRoutes* http, ::ssl_ctx_st* tls, Limits limits, Events events = {});
  ~HttpFront();  // Stop()
  // Binds "host:port" (port 0 = ephemeral) and starts serving; the bound port, or -1.
  int Start(const std::string& address);
  // Stops accepting, closes idle connections, lets the workers finish the requests that have a
  // complete head (answered with "Connection: close"), and joins every thread. A streamed
  // response runs to its end for up to `grace`; after that it ends at its next chunk, without
  // the terminating chunk (a client sees the stream cut short). The server drains its engine
  // before it stops the front, so a grace of a few seconds only has to flush what was produced.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  // On a worker thread, the socket of the request being served (for a handler that watches its
  // client for a hang-up); -1 on any other thread.
  static int CurrentSocket();

 private:
  struct Connection;
  class Stream;
  void PollLoop();
  void WorkerLoop();
  // Reads what the socket has into the connection's buffer (the TLS handshake first). False:
  // close it (end of stream, error, or a head over the limit, which was answered 431).
  bool ReadHead(Connection* c);
  void Serve(std::unique_ptr<Connection> c);
  void Wake();
  void Closed(const char* reason) const {
    if (events_.closed) events_.closed(reason);
  }

  HttpRoutes* http_;
  ::ssl_ctx_st* tls_;
  const Limits limits_;
  const Events events_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a pipe: workers hand connections back, Stop ends the poll
  std::thread poller_;
  std::vector<std::thread> workers_;

  std::mutex mu_;
  std::condition_variable ready_cv_;
  std::condition_variable idle_cv_;                    // a worker finished a connection
  std::deque<std::unique_ptr<Connection>> ready_;      // guarded by mu_: heads complete
  std::vector<std::unique_ptr<Connection>> returned_;  // guarded by mu_: kept alive, to poll
  std::atomic<int> open_{0};                           // connections open
  bool stopping_ = false;                              // guarded by mu_
  int busy_ = 0;                                       // guarded by mu_: workers serving
};

}  // namespace llava::server
