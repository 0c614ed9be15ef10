#include "server/http_endpoint.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>

#include "server/http_server.h"

namespace llava::server {

int ListenOn(const std::string& address, int* bound_port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return -1;
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0) {
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 512) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return -1;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  *bound_port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return fd;
}

class MetricsHttpServer::Routes final : public HttpHandler {
 public:
  Routes(std::function<std::string()> metrics, std::function<bool()> healthy)
      : metrics_(std::move(metrics)), healthy_(std::move(healthy)) {}

  // Every request is answered from its head (whole paths only: /metrics/../x is a 404).
  std::optional<HttpResponse> Screen(const HttpRequestHead& head) override {
    HttpResponse r;
    r.content_type = "text/plain";
    if (head.method != "GET" && head.method != "HEAD") {
      r.status = 405;
      r.body = "GET or HEAD only\n";
      r.headers = {{"Allow", "GET, HEAD"}};
    } else if (head.path == "/metrics") {
      r.content_type = "text/plain; version=0.0.4; charset=utf-8";
      r.body = metrics_();
    } else if (head.path == "/healthz") {
      const bool ok = healthy_();
      r.status = ok ? 200 : 503;
      r.body = ok ? "ok\n" : "not serving\n";
    } else {
      r.status = 404;
      r.body = "not found\n";
    }
    return r;
  }
  void Handle(HttpRequestHead, std::string, std::shared_ptr<HttpExchange> exchange) override {
    HttpResponse r;  // not reached: Screen answers everything
    r.status = 500;
    exchange->Reply(std::move(r));
  }

 private:
  std::function<std::string()> metrics_;
  std::function<bool()> healthy_;
};

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> metrics,
                                     std::function<bool()> healthy, Limits limits)
    : routes_(std::make_unique<Routes>(std::move(metrics), std::move(healthy))), limits_(limits) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

int MetricsHttpServer::Start(const std::string& address) {
  HttpServer::Limits l;
  l.workers = 1;
  l.max_connections = limits_.max_connections;
  l.head_timeout_ms = limits_.request_timeout_ms;
  l.body_timeout_ms = limits_.request_timeout_ms;
  l.write_timeout_ms = limits_.request_timeout_ms;
  l.max_head_bytes = limits_.max_request_bytes;
  l.max_body_bytes = 0;
  l.max_requests_per_connection = 1;
  server_ = std::make_unique<HttpServer>(routes_.get(), nullptr, l);
  return server_->Start(address);
}

void MetricsHttpServer::Stop() {
  if (server_) server_->Stop();
}

}  // namespace llava::server
