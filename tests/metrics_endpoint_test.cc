// The metrics/health endpoint (server/http_endpoint.h) over raw TCP: exact paths, methods and
// limits, and that idle or slow connections cannot keep /healthz from answering.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "server/http_endpoint.h"

namespace llava::server {
namespace {

int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

// Everything the server sends on `fd` until it closes, or until `timeout_ms` passes.
std::string ReadAll(int fd, int timeout_ms) {
  std::string out;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          end - std::chrono::steady_clock::now())
                          .count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return out;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

// One request on a new connection; the whole response ("" if none within the timeout).
std::string Exchange(int port, const std::string& request, int timeout_ms = 5000) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out = ReadAll(fd, timeout_ms);
  ::close(fd);
  return out;
}

std::string Get(int port, const std::string& target, const std::string& method = "GET") {
  return Exchange(port, method + " " + target + " HTTP/1.1\r\nHost: x\r\n\r\n");
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

TEST(MetricsEndpoint, ServesTheExactPathsOnly) {
  std::atomic<bool> healthy{true};
  MetricsHttpServer http([] { return std::string("llava_up 1\n"); },
                         [&] { return healthy.load(); });
  const int port = http.Start("127.0.0.1:0");
  ASSERT_GT(port, 0);

  const std::string metrics = Get(port, "/metrics");
  EXPECT_TRUE(StartsWith(metrics, "HTTP/1.1 200 OK\r\n")) << metrics;
  EXPECT_NE(metrics.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(metrics.find("Content-Length: 11\r\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\r\n\r\nllava_up 1\n"), std::string::npos) << metrics;
  EXPECT_TRUE(StartsWith(Get(port, "/metrics?name[]=llava_up"), "HTTP/1.1 200"));
  EXPECT_TRUE(StartsWith(Get(port, "/healthz"), "HTTP/1.1 200"));
  healthy = false;
  const std::string down = Get(port, "/healthz");
  EXPECT_TRUE(StartsWith(down, "HTTP/1.1 503")) << down;
  EXPECT_NE(down.find("not serving"), std::string::npos);

  for (const char* path : {"/metrics/../../etc/passwd", "/metricsx", "/", "/healthz/", "x"}) {
    EXPECT_TRUE(StartsWith(Get(port, path), "HTTP/1.1 404")) << path;
  }
  const std::string post = Get(port, "/metrics", "POST");
  EXPECT_TRUE(StartsWith(post, "HTTP/1.1 405")) << post;
  EXPECT_NE(post.find("Allow: GET, HEAD"), std::string::npos);
  const std::string head = Get(port, "/metrics", "HEAD");
  EXPECT_TRUE(StartsWith(head, "HTTP/1.1 200")) << head;
  EXPECT_EQ(head.find("llava_up"), std::string::npos) << "HEAD sent a body";
  EXPECT_TRUE(StartsWith(Exchange(port, "nonsense\r\n\r\n"), "HTTP/1.1 400"));
  const std::string huge =
      Exchange(port, "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(20000, 'a') + "\r\n\r\n");
  EXPECT_TRUE(StartsWith(huge, "HTTP/1.1 431")) << huge.substr(0, 80);
  // A request split over several writes is assembled.
  const int fd = Connect(port);
  ASSERT_GE(fd, 0);
  for (const char* part : {"GET /hea", "lthz HTTP/1.1\r\n", "Host: x\r\n", "\r\n"}) {
    ::send(fd, part, std::char_traits<char>::length(part), MSG_NOSIGNAL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(StartsWith(ReadAll(fd, 5000), "HTTP/1.1 503"));
  ::close(fd);
}

// 1,000 idle connections and a client that sends its request a byte every 100 ms: the idle
// ones beyond the cap are closed at once, the slow one at its request deadline, and /healthz
// answers beside them. (With a pool of a few threads and a per-read timeout, as before, the
// probe waited behind every idle connection and the slow client held a thread for good.)
TEST(MetricsEndpoint, IdleAndSlowClientsDoNotHoldTheProbe) {
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  const rlim_t want = std::min<rlim_t>(lim.rlim_max, 4096);
  if (lim.rlim_cur < want) {
    lim.rlim_cur = want;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  ::getrlimit(RLIMIT_NOFILE, &lim);
  // The server's cap and this test's own sockets must fit under the descriptor limit.
  const int idle_count = static_cast<int>(std::min<rlim_t>(1000, lim.rlim_cur - 200));
  ASSERT_GE(idle_count, 500) << "RLIMIT_NOFILE " << lim.rlim_cur;

  MetricsHttpServer::Limits limits;
  limits.max_connections = 64;
  limits.request_timeout_ms = 2000;
  MetricsHttpServer http([] { return std::string("m 1\n"); }, [] { return true; }, limits);
  const int port = http.Start("127.0.0.1:0");
  ASSERT_GT(port, 0);

  std::vector<int> idle;
  for (int i = 0; i < idle_count; ++i) {
    const int fd = Connect(port);
    ASSERT_GE(fd, 0) << "connection " << i;
    idle.push_back(fd);
  }
  // Within a second (half the deadline) all but the newest 64 are closed by the server.
  int closed = 0;
  for (int round = 0; round < 10 && closed < idle_count - 64; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    closed = 0;
    for (int fd : idle) {
      pollfd p{fd, POLLIN, 0};
      closed += ::poll(&p, 1, 0) > 0;
    }
  }
  EXPECT_GE(closed, idle_count - 64) << "the connection cap did not hold";

  const std::string request = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  const int slow = Connect(port);
  ASSERT_GE(slow, 0);
  const auto t0 = std::chrono::steady_clock::now();
  bool slow_cut = false;
  for (size_t i = 0; i < request.size() && !slow_cut; ++i) {
    slow_cut = ::send(slow, &request[i], 1, MSG_NOSIGNAL) != 1;
    pollfd p{slow, POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) {
      char buf[256];
      const ssize_t n = ::recv(slow, buf, sizeof(buf), 0);
      // Closed, or told 408 before the close.
      slow_cut = n <= 0 || std::string(buf, static_cast<size_t>(n)).rfind("HTTP/1.1 408", 0) == 0;
    }
  }
  const double slow_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The deadline is 2 s; the whole request takes ~3.5 s at this pace.
  EXPECT_TRUE(slow_cut) << "a byte every 100 ms kept the connection open for " << slow_s << " s";
  ::close(slow);

  const auto p0 = std::chrono::steady_clock::now();
  const std::string probe = Exchange(port, request, 3000);
  const double probe_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
  EXPECT_TRUE(StartsWith(probe, "HTTP/1.1 200"))
      << "no answer to the probe in " << probe_s << " s beside " << idle.size() << " idle";
  for (int fd : idle) ::close(fd);
  EXPECT_TRUE(StartsWith(Get(port, "/metrics"), "HTTP/1.1 200"));
}

}  // namespace
}  // namespace llava::server
