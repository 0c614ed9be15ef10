// The service's metrics endpoint: GET /metrics (Prometheus text) and GET /healthz (the
// Kubernetes probes), served by cpp-httplib on a few threads of its own, so a slow or idle
// client cannot hold the probe. prometheus-cpp's own exposer (civetweb) cannot start its threads
// in a libtorch + OpenBLAS process (DESIGN.md section 6); httplib's are std::threads with the
// default stack size, which can.
//
// Thread safety: Start and Stop from one thread; the callbacks run on the endpoint's threads.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace llava::server {

class MetricsHttpServer {
 public:
  // `metrics` is called per scrape and returns the body; `healthy` for /healthz.
  MetricsHttpServer(std::function<std::string()> metrics, std::function<bool()> healthy);
  ~MetricsHttpServer();
  // Binds "host:port" (port 0 = ephemeral); returns the bound port or -1.
  int Start(const std::string& address);
  void Stop();

 private:
  std::function<std::string()> metrics_;
  std::function<bool()> healthy_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
};

// Binds `http` to "host:port" ("" host = all interfaces, port 0 = ephemeral) and runs its
// listener on `thread`; returns the bound port, or -1 (then `thread` is not started).
int StartHttpServer(httplib::Server* http, const std::string& address, std::thread* thread);

}  // namespace llava::server
