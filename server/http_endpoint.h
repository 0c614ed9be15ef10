// The service's plain HTTP endpoint: GET /metrics (Prometheus text) and GET /healthz (the
// Kubernetes probes). prometheus-cpp's own exposer (civetweb) cannot start its threads in a
// libtorch + OpenBLAS process (DESIGN.md section 6), hence this small server on one thread.
//
// Thread safety: Start and Stop from one thread; the callbacks run on the endpoint's thread.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

namespace llava::server {

// GET /metrics (Prometheus text) and GET /healthz on a plain TCP port, one thread.
class MetricsHttpServer {
 public:
  // `metrics` is called per scrape and returns the body; `healthy` for /healthz.
  MetricsHttpServer(std::function<std::string()> metrics, std::function<bool()> healthy);
  ~MetricsHttpServer();
  // Binds "host:port" (port 0 = ephemeral); returns the bound port or -1.
  int Start(const std::string& address);
  void Stop();

 private:
  void Serve();
  std::function<std::string()> metrics_;
  std::function<bool()> healthy_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace llava::server
