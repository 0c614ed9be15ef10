#include "server/http_endpoint.h"

#include <httplib.h>

#include <cstdlib>

namespace llava::server {

int StartHttpServer(httplib::Server* http, const std::string& address, std::thread* thread) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return -1;
  std::string host = address.substr(0, colon);
  if (host.empty()) host = "0.0.0.0";
  char* end = nullptr;
  const long port = std::strtol(address.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port < 0 || port > 65535) return -1;
  const int bound =
      port == 0 ? http->bind_to_any_port(host)
                : (http->bind_to_port(host, static_cast<int>(port)) ? static_cast<int>(port) : -1);
  if (bound < 0) return -1;
  *thread = std::thread([http] { http->listen_after_bind(); });
  while (!http->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return bound;
}

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> metrics,
                                     std::function<bool()> healthy)
    : metrics_(std::move(metrics)),
      healthy_(std::move(healthy)),
      http_(std::make_unique<httplib::Server>()) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

int MetricsHttpServer::Start(const std::string& address) {
  httplib::Server& http = *http_;
  http.new_task_queue = [] { return new httplib::ThreadPool(4); };
  http.set_read_timeout(5, 0);
  http.set_write_timeout(5, 0);
  http.set_keep_alive_timeout(5);
  http.set_payload_max_length(64 << 10);
  // Routes match the whole path: /metrics/../x is a 404.
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Get("/healthz", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = healthy_();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ok\n" : "not serving\n", "text/plain");
  });
  return StartHttpServer(&http, address, &thread_);
}

void MetricsHttpServer::Stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace llava::server
