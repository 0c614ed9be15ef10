// The service's metrics endpoint: GET /metrics (Prometheus text) and GET /healthz (the
// Kubernetes probes), served by one thread of its own that multiplexes every connection with
// poll(2), so that idle or slow clients cannot hold the probe: each connection has one deadline
// for its whole request and response (not a per-read timeout that a byte a second resets), the
// number of open connections is capped and a new one closes the oldest, and only the exact
// paths are served. prometheus-cpp's own exposer (civetweb) cannot start its threads in a
// libtorch + OpenBLAS process (DESIGN.md section 6); a std::thread with the default stack can.
//
// Thread safety: Start and Stop from one thread; the callbacks run on the endpoint's thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

namespace llava::server {

class MetricsHttpServer {
 public:
  struct Limits {
    int max_connections = 128;        // open at once; a new one closes the oldest
    int request_timeout_ms = 5000;    // from accept to the last byte of the response
    size_t max_request_bytes = 8192;  // request line and headers; more is a 431
  };
  // `metrics` is called per scrape and returns the body; `healthy` for /healthz.
  MetricsHttpServer(std::function<std::string()> metrics, std::function<bool()> healthy,
                    Limits limits);
  MetricsHttpServer(std::function<std::string()> metrics, std::function<bool()> healthy)
      : MetricsHttpServer(std::move(metrics), std::move(healthy), Limits()) {}
  ~MetricsHttpServer();
  // Binds "host:port" (port 0 = ephemeral); returns the bound port or -1.
  int Start(const std::string& address);
  void Stop();

 private:
  struct Connection;
  void Loop();
  // The whole response to the request head in `head` (without the blank line).
  std::string Respond(const std::string& head) const;

  std::function<std::string()> metrics_;
  std::function<bool()> healthy_;
  const Limits limits_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a pipe: Stop writes, the loop wakes and returns
  std::thread thread_;
};

// Binds a non-blocking listening socket to "host:port" ("" host = all interfaces, "[::1]" for
// IPv6, port 0 = ephemeral); returns the socket and sets `bound_port`, or -1.
int ListenOn(const std::string& address, int* bound_port);

}  // namespace llava::server
