// The service's metrics endpoint: GET /metrics (Prometheus text) and GET /healthz (the
// Kubernetes probes), on an HttpServer of its own (http_server.h: one I/O thread, deadlines on
// every connection, a connection cap where a new one closes the oldest waiting one), one request
// per connection, exact paths only. prometheus-cpp's own exposer (civetweb) cannot start its
// threads in a libtorch + OpenBLAS process (docs/ARCHITECTURE.md); a std::thread can.
//
// Thread safety: Start and Stop from one thread; the callbacks run on the endpoint's I/O thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace llava::server {

class HttpServer;

class MetricsHttpServer {
 public:
  struct Limits {
    int max_connections = 128;        // open at once; a new one closes the oldest waiting one
    int request_timeout_ms = 5000;    // to the complete request head; each response write
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
  class Routes;
  std::unique_ptr<Routes> routes_;
  const Limits limits_;
  std::unique_ptr<HttpServer> server_;
};

// Binds a non-blocking listening socket to "host:port" ("" host = all interfaces, "[::1]" for
// IPv6, port 0 = ephemeral); returns the socket and sets `bound_port`, or -1.
int ListenOn(const std::string& address, int* bound_port);

}  // namespace llava::server
