#include "server/http_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <vector>

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

struct MetricsHttpServer::Connection {
  int fd = -1;
  int64_t deadline_ms = 0;
  std::string in, out;  // the request so far; the response once the head is complete
  size_t sent = 0;
};

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string HttpResponse(int status, const char* reason, const char* type, const std::string& body,
                         bool head_only, const char* extra_header = "") {
  std::string r = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                  "\r\nContent-Type: " + type +
                  "\r\nContent-Length: " + std::to_string(body.size()) +
                  "\r\nConnection: close\r\n" + extra_header + "\r\n";
  if (!head_only) r += body;
  return r;
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> metrics,
                                     std::function<bool()> healthy, Limits limits)
    : metrics_(std::move(metrics)), healthy_(std::move(healthy)), limits_(limits) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

int MetricsHttpServer::Start(const std::string& address) {
  int bound_port = -1;
  const int fd = ListenOn(address, &bound_port);
  if (fd < 0) return -1;
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(fd);
    return -1;
  }
  listen_fd_ = fd;
  thread_ = std::thread([this] { Loop(); });
  return bound_port;
}

void MetricsHttpServer::Stop() {
  if (thread_.joinable()) {
    const char byte = 0;
    while (::write(wake_[1], &byte, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  for (int* fd : {&listen_fd_, &wake_[0], &wake_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

std::string MetricsHttpServer::Respond(const std::string& head) const {
  // Request line: METHOD SP TARGET SP VERSION.
  const size_t line_end = head.find("\r\n");
  const std::string line = head.substr(0, line_end);
  const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string::npos || sp2 == sp1 || line.compare(sp2 + 1, 5, "HTTP/") != 0) {
    return HttpResponse(400, "Bad Request", "text/plain", "bad request line\n", false);
  }
  const std::string method = line.substr(0, sp1);
  const std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string path = target.substr(0, target.find('?'));
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    return HttpResponse(405, "Method Not Allowed", "text/plain", "GET or HEAD only\n", false,
                        "Allow: GET, HEAD\r\n");
  }
  // Whole paths only: /metrics/../x is a 404.
  if (path == "/metrics") {
    return HttpResponse(200, "OK", "text/plain; version=0.0.4; charset=utf-8", metrics_(),
                        head_only);
  }
  if (path == "/healthz") {
    const bool ok = healthy_();
    return HttpResponse(ok ? 200 : 503, ok ? "OK" : "Service Unavailable", "text/plain",
                        ok ? "ok\n" : "not serving\n", head_only);
  }
  return HttpResponse(404, "Not Found", "text/plain", "not found\n", head_only);
}

void MetricsHttpServer::Loop() {
  std::vector<Connection> conns;  // in the order they were accepted: the oldest first
  std::vector<pollfd> fds;
  auto close_at = [&](size_t i) {
    ::close(conns[i].fd);
    conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
  };
  for (;;) {
    fds.assign({{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    int64_t now = NowMs(), next_deadline = now + 1000;
    for (const Connection& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      next_deadline = std::min(next_deadline, c.deadline_ms);
    }
    const int ready =
        ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, next_deadline - now)));
    if (ready < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) return;  // Stop
    now = NowMs();
    // Serve the connections polled (indices shift as they close: walk backwards).
    for (size_t i = conns.size(); i-- > 0;) {
      Connection& c = conns[i];
      const short ev = fds[i + 2].revents;
      bool done = false;
      if (ev & (POLLERR | POLLNVAL)) {
        done = true;
      } else if (c.out.empty() && (ev & (POLLIN | POLLHUP))) {
        char buf[4096];
        for (;;) {
          const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
          if (n > 0) {
            c.in.append(buf, static_cast<size_t>(n));
            if (c.in.size() > limits_.max_request_bytes) break;
            continue;
          }
          if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) done = true;
          if (n < 0 && errno == EINTR) continue;
          break;
        }
        const size_t end = c.in.find("\r\n\r\n");
        if (end != std::string::npos && end <= limits_.max_request_bytes) {
          c.out = Respond(c.in.substr(0, end));
          done = false;  // a client that half-closed after its request still gets the answer
        } else if (c.in.size() > limits_.max_request_bytes) {
          c.out = HttpResponse(431, "Request Header Fields Too Large", "text/plain",
                               "request head too large\n", false);
          done = false;
        }
      }
      if (!done && !c.out.empty() && (ev & POLLOUT || fds[i + 2].events == POLLIN)) {
        while (c.sent < c.out.size()) {
          const ssize_t n =
              ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
          if (n > 0) {
            c.sent += static_cast<size_t>(n);
          } else if (n < 0 && errno == EINTR) {
            continue;
          } else {
            if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) done = true;
            break;
          }
        }
        if (c.sent == c.out.size()) done = true;
      }
      if (done || now >= c.deadline_ms) close_at(i);
    }
    if (fds[1].revents & POLLIN) {
      for (;;) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // EAGAIN, or out of descriptors: retried on the next poll
        if (static_cast<int>(conns.size()) >= limits_.max_connections) close_at(0);
        conns.push_back({fd, NowMs() + limits_.request_timeout_ms, {}, {}, 0});
      }
    }
  }
}

}  // namespace llava::server
