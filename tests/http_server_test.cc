// The HTTP servers' connection handling (server/http_server.h, Boost.Beast) with small limits
// and plain routes: idle, slow, oversized, compressed and unauthenticated clients, written as the
// attacks they are, against a request that must still be answered at once.
#include "server/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace llava::server {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

void Send(int fd, const std::string& text) {
  ASSERT_EQ(::send(fd, text.data(), text.size(), MSG_NOSIGNAL), static_cast<ssize_t>(text.size()));
}

// Everything the server sends until it closes, `timeout` passes or `until` has come.
std::string ReadAll(int fd, std::chrono::milliseconds timeout, const std::string& until = "") {
  std::string out;
  const auto end = Clock::now() + timeout;
  char buf[4096];
  while (Clock::now() < end && (until.empty() || out.find(until) == std::string::npos)) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left.count()))) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// True if the server closed `fd` within `timeout` (reads to the end of the stream).
bool ClosedWithin(int fd, std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  char buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;
  }
  return false;
}

// Routes: GET /ping (answered from the head), POST /echo (the body back), GET /stream (three
// chunks), GET /held (a stream whose end waits for `release_`), GET /hold (never answered;
// counts OnGone), POST /secret (needs "Authorization: Bearer ok" in the head).
class TestRoutes final : public HttpHandler {
 public:
  std::optional<HttpResponse> Screen(const HttpRequestHead& head) override {
    if (head.path == "/ping") return Text(200, "pong");
    if (head.path == "/secret" && head.Header("authorization") != "Bearer ok") {
      return Text(401, "no");
    }
    if (head.path == "/echo" || head.path == "/stream" || head.path == "/held" ||
        head.path == "/hold" || head.path == "/secret") {
      return std::nullopt;
    }
    return Text(404, "not found");
  }
  void Handle(HttpRequestHead head, std::string body,
              std::shared_ptr<HttpExchange> exchange) override {
    handled += 1;
    body_bytes += static_cast<int64_t>(body.size());
    if (head.path == "/echo" || head.path == "/secret") return exchange->Reply(Text(200, body));
    if (head.path == "/stream") {
      auto sent = std::make_shared<int>(0);
      return exchange->Stream(Text(200, ""), [sent](bool* end) {
        *end = *sent == 2;
        return "part" + std::to_string((*sent)++) + ";";
      });
    }
    if (head.path == "/held") {
      auto step = std::make_shared<int>(0);
      {
        std::lock_guard<std::mutex> lock(mu);
        held = exchange;
      }
      return exchange->Stream(Text(200, ""), [this, step](bool* end) -> std::string {
        if (*step == 0) {
          *step = 1;
          return "first;";
        }
        if (!release) return "";
        *end = true;
        return "last;";
      });
    }
    // /hold
    exchange->OnGone([this] { gone += 1; });
    std::lock_guard<std::mutex> lock(mu);
    holds.push_back(exchange);
  }
  static HttpResponse Text(int status, std::string body) {
    HttpResponse r;
    r.status = status;
    r.content_type = "text/plain";
    r.body = std::move(body);
    return r;
  }
  void Release() {
    release = true;
    std::lock_guard<std::mutex> lock(mu);
    if (held) held->Notify();
  }

  std::atomic<int> handled{0}, gone{0};
  std::atomic<int64_t> body_bytes{0};
  std::atomic<bool> release{false};
  std::mutex mu;
  std::shared_ptr<HttpExchange> held;                // guarded by mu
  std::vector<std::shared_ptr<HttpExchange>> holds;  // guarded by mu
};

// A self-signed certificate (openssl's command line) in a server context, for the TLS tests.
SSL_CTX* TestTlsContext() {
  const std::string dir = ::testing::TempDir() + "/llava-http-tls";
  const std::string make = "mkdir -p " + dir + " && openssl req -x509 -newkey ec -pkeyopt " +
                           "ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=localhost " +
                           "-keyout " + dir + "/key.pem -out " + dir + "/cert.pem 2> /dev/null";
  if (std::system(make.c_str()) != 0) return nullptr;
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (SSL_CTX_use_certificate_chain_file(ctx, (dir + "/cert.pem").c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx, (dir + "/key.pem").c_str(), SSL_FILETYPE_PEM) != 1) {
    SSL_CTX_free(ctx);
    return nullptr;
  }
  return ctx;
}

// A blocking TLS client on a new connection (the certificate is not verified: the tests are
// about what the server sends, not whom to trust).
class TlsClient {
 public:
  explicit TlsClient(int port)
      : ctx_(SSL_CTX_new(TLS_client_method())), fd_(Connect(port)), ssl_(SSL_new(ctx_)) {
    timeval t{5, 0};  // no read blocks a test for longer
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
    SSL_set_fd(ssl_, fd_);
    handshaken_ = SSL_connect(ssl_) == 1;
  }
  ~TlsClient() {
    SSL_free(ssl_);
    ::close(fd_);
    SSL_CTX_free(ctx_);
  }
  bool handshaken() const { return handshaken_; }
  void Send(const std::string& text) {
    ASSERT_EQ(SSL_write(ssl_, text.data(), static_cast<int>(text.size())),
              static_cast<int>(text.size()));
  }
  // Everything until the server closes, or `until` has come, or a read waits 5 s.
  std::string ReadAll(const std::string& until = "") {
    std::string out;
    char buf[4096];
    while (until.empty() || out.find(until) == std::string::npos) {
      const int n = SSL_read(ssl_, buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  int fd() const { return fd_; }

 private:
  SSL_CTX* ctx_;
  int fd_;
  SSL* ssl_;
  bool handshaken_ = false;
};

class HttpServerTest : public ::testing::Test {
 protected:
  void StartWith(HttpServer::Limits limits, SSL_CTX* tls = nullptr) {
    HttpServer::Events events;
    events.connections = [this](int open) { open_ = open; };
    events.closed = [this](const char* reason) {
      std::lock_guard<std::mutex> lock(mu_);
      ++closed_[reason];
    };
    server_ = std::make_unique<HttpServer>(&routes_, tls, limits, std::move(events));
    port_ = server_->Start("127.0.0.1:0");
    ASSERT_GT(port_, 0);
  }
  // GET /ping on a new connection: the time to the answer, or a minute if none came.
  std::chrono::milliseconds PingTime() {
    const auto t0 = Clock::now();
    const int fd = Connect(port_);
    Send(fd, "GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    const std::string reply = ReadAll(fd, 5000ms);
    ::close(fd);
    if (reply.find("\r\n\r\npong") == std::string::npos) return 60000ms;
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  int Closed(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_[reason];
  }

  TestRoutes routes_;
  std::unique_ptr<HttpServer> server_;
  int port_ = -1;
  std::atomic<int> open_{-1};  // the server's last report
  std::mutex mu_;
  std::map<std::string, int> closed_;  // guarded by mu_
};

TEST_F(HttpServerTest, KeepsConnectionsAliveAndAnswersPipelinedRequestsInOrder) {
  StartWith(HttpServer::Limits());
  const int fd = Connect(port_);
  Send(fd,
       "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirstGET /ping HTTP/1.1\r\n"
       "Host: x\r\n\r\n");
  std::string reply = ReadAll(fd, 5000ms, "\r\n\r\npong");
  const size_t first = reply.find("\r\n\r\nfirst"), second = reply.find("\r\n\r\npong");
  EXPECT_NE(first, std::string::npos) << reply;
  EXPECT_NE(second, std::string::npos) << reply;
  EXPECT_LT(first, second);
  // The connection is still open for a third request.
  Send(fd, "GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  reply = ReadAll(fd, 5000ms);
  EXPECT_NE(reply.find("\r\n\r\npong"), std::string::npos) << reply;
  ::close(fd);
}

// Two streams, one after the other on one kept-alive connection: each whole.
TEST_F(HttpServerTest, StreamsChunkedResponses) {
  StartWith(HttpServer::Limits());
  const int fd = Connect(port_);
  for (const char* connection : {"keep-alive", "close"}) {
    Send(fd,
         std::string("GET /stream HTTP/1.1\r\nHost: x\r\nConnection: ") + connection + "\r\n\r\n");
    const std::string reply = ReadAll(fd, 2000ms, "\r\n0\r\n\r\n");
    EXPECT_NE(reply.find("Transfer-Encoding: chunked"), std::string::npos) << reply;
    for (const char* part : {"part0;", "part1;", "part2;"}) {
      EXPECT_NE(reply.find(part), std::string::npos) << connection << ": " << reply;
    }
    EXPECT_NE(reply.find("\r\n0\r\n\r\n"), std::string::npos) << "no terminating chunk: " << reply;
  }
  EXPECT_TRUE(ClosedWithin(fd, 2000ms));
  ::close(fd);
}

// 40 idle connections against a cap of 8: each new one closes the oldest waiting one; the cap
// holds exactly.
TEST_F(HttpServerTest, IdleConnectionsHoldNothingAndTheOldestMakeRoom) {
  HttpServer::Limits limits;
  limits.workers = 1;
  limits.max_connections = 8;
  StartWith(limits);
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(Connect(port_));
  std::this_thread::sleep_for(200ms);  // all accepted
  EXPECT_EQ(open_.load(), 8) << "the cap is exact";
  EXPECT_LT(PingTime(), 2000ms);
  EXPECT_TRUE(ClosedWithin(idle.front(), 500ms));
  EXPECT_FALSE(ClosedWithin(idle.back(), 100ms));
  EXPECT_GE(Closed("cap"), 40 - 8);
  for (int fd : idle) ::close(fd);
}

// When every connection carries a request, a new one is answered 503 (not reset), and the
// ones under way are untouched.
TEST_F(HttpServerTest, PastTheCapWithEveryConnectionBusyANewOneGets503) {
  HttpServer::Limits limits;
  limits.max_connections = 4;
  StartWith(limits);
  std::vector<int> busy;
  for (int i = 0; i < 4; ++i) {
    busy.push_back(Connect(port_));
    Send(busy.back(), "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  }
  for (int i = 0; i < 100 && routes_.handled.load() < 4; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(routes_.handled.load(), 4);
  const int fd = Connect(port_);
  const std::string reply = ReadAll(fd, 2000ms);
  ::close(fd);
  EXPECT_NE(reply.find("HTTP/1.1 503"), std::string::npos) << reply;
  EXPECT_NE(reply.find("Retry-After"), std::string::npos) << reply;
  EXPECT_EQ(Closed("refused"), 1);
  for (int b : busy) EXPECT_FALSE(ClosedWithin(b, 50ms));
  for (int b : busy) ::close(b);
}

TEST_F(HttpServerTest, SlowHeadsEndAtTheDeadline) {
  HttpServer::Limits limits;
  limits.workers = 1;
  limits.head_timeout_ms = 3000;
  StartWith(limits);
  // Three clients that send a request head a byte every 50 ms.
  std::vector<int> slow;
  for (int i = 0; i < 3; ++i) slow.push_back(Connect(port_));
  // 100 bytes at 50 ms: 5 s, longer than the head's deadline.
  const std::string head = "GET /ping HTTP/1.1\r\nHost: " + std::string(72, 'h') + "\r\n";
  std::atomic<bool> trickling{true};
  std::thread trickle([&] {
    for (size_t i = 0; i < head.size() && trickling; ++i) {
      for (int fd : slow) ::send(fd, &head[i], 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(50ms);
    }
  });
  const auto connected = Clock::now();
  std::this_thread::sleep_for(150ms);
  EXPECT_LT(PingTime(), 1500ms);
  // The deadline counts from the connection, not from the last byte: each ends while its
  // bytes still come.
  for (int fd : slow) {
    const std::string reply = ReadAll(fd, 6000ms);
    EXPECT_NE(reply.find("408 Request Timeout"), std::string::npos) << reply;
  }
  EXPECT_LT(Clock::now() - connected, 4500ms);
  EXPECT_EQ(Closed("head_timeout"), 3);
  trickling = false;
  trickle.join();
  for (int fd : slow) ::close(fd);
}

// 200 clients that declare a 100,000-byte body and send a byte every 100 ms: they hold no
// thread, a normal request is answered at once beside them, and each ends at its body deadline
// (a deadline for the whole body: the trickle does not extend it).
TEST_F(HttpServerTest, TricklingBodiesHoldNoThreadAndEndAtTheirDeadline) {
  HttpServer::Limits limits;
  limits.workers = 2;
  limits.body_timeout_ms = 1500;
  StartWith(limits);
  std::vector<int> slow;
  for (int i = 0; i < 200; ++i) {
    slow.push_back(Connect(port_));
    Send(slow.back(), "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{");
  }
  std::atomic<bool> trickling{true};
  std::thread trickle([&] {
    while (trickling) {
      for (int fd : slow) ::send(fd, "a", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(100ms);
    }
  });
  const auto t0 = Clock::now();
  EXPECT_LT(PingTime(), 1000ms);
  const int fd = Connect(port_);
  Send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
  EXPECT_NE(ReadAll(fd, 2000ms).find("\r\n\r\nok"), std::string::npos);
  ::close(fd);
  int closed = 0;
  for (int s : slow) closed += ClosedWithin(s, 3000ms);
  EXPECT_EQ(closed, 200);
  EXPECT_LT(Clock::now() - t0, 6000ms);
  trickling = false;
  trickle.join();
  EXPECT_EQ(Closed("body_timeout"), 200);
  EXPECT_EQ(routes_.handled.load(), 1) << "only the whole body reached a handler";
  for (int s : slow) ::close(s);
}

TEST_F(HttpServerTest, AnOversizedHeadIsRefused) {
  HttpServer::Limits limits;
  limits.max_head_bytes = 1024;
  StartWith(limits);
  const int fd = Connect(port_);
  Send(fd, "GET /ping HTTP/1.1\r\nX-Big: " + std::string(4096, 'a') + "\r\n\r\n");
  const std::string reply = ReadAll(fd, 2000ms);
  ::close(fd);
  EXPECT_NE(reply.find("431"), std::string::npos) << reply;
  EXPECT_EQ(Closed("head_too_large"), 1);
  EXPECT_LT(PingTime(), 2000ms);
}

// The token is checked from the head: a client without one gets its 401 before it has sent a
// byte of its (declared 100 MB) body, and no handler runs.
TEST_F(HttpServerTest, AnUnauthenticatedClientIsAnsweredBeforeItsBodyIsRead) {
  StartWith(HttpServer::Limits());
  const int fd = Connect(port_);
  Send(fd, "POST /secret HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n");
  const std::string reply = ReadAll(fd, 2000ms, "\r\n\r\nno");
  EXPECT_NE(reply.find("HTTP/1.1 401"), std::string::npos) << reply;
  EXPECT_NE(reply.find("Connection: close"), std::string::npos) << reply;
  EXPECT_TRUE(ClosedWithin(fd, 3000ms));
  ::close(fd);
  EXPECT_EQ(routes_.handled.load(), 0);
  // With the token, the same route reads the body.
  const int ok = Connect(port_);
  Send(ok, "POST /secret HTTP/1.1\r\nAuthorization: Bearer ok\r\nContent-Length: 3\r\n\r\nabc");
  EXPECT_NE(ReadAll(ok, 2000ms, "\r\n\r\nabc").find("\r\n\r\nabc"), std::string::npos);
  ::close(ok);
}

// Bodies are never inflated: a gzip body (here 1 KB that would inflate to 256 MiB) is 415.
TEST_F(HttpServerTest, CompressedBodiesAreRefused) {
  StartWith(HttpServer::Limits());
  for (const char* encoding : {"gzip", "deflate", "br", "gzip, identity"}) {
    const int fd = Connect(port_);
    Send(fd, std::string("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: ") + encoding +
                 "\r\nContent-Length: 1024\r\n\r\n" + std::string(1024, '\x1f'));
    const std::string reply = ReadAll(fd, 2000ms);
    ::close(fd);
    EXPECT_NE(reply.find("HTTP/1.1 415"), std::string::npos) << encoding << ": " << reply;
  }
  EXPECT_EQ(routes_.handled.load(), 0);
}

// Over the limit, declared or streamed: 413 at once for a declared size (no body byte sent),
// as soon as the decoded chunks pass it for a chunked body; a negative length is a 400.
TEST_F(HttpServerTest, BodiesOverTheLimitAreRefused) {
  HttpServer::Limits limits;
  limits.max_body_bytes = 1 << 20;
  StartWith(limits);
  int fd = Connect(port_);
  const auto t0 = Clock::now();
  Send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1048577\r\n\r\n");
  std::string reply = ReadAll(fd, 2000ms, "\r\n\r\n");
  EXPECT_NE(reply.find("HTTP/1.1 413"), std::string::npos) << reply;
  EXPECT_LT(Clock::now() - t0, 1000ms);
  ::close(fd);

  fd = Connect(port_);
  Send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
  const std::string chunk = "10000\r\n" + std::string(0x10000, 'a') + "\r\n";  // 64 KiB each
  for (int i = 0; i < 20; ++i) ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
  reply = ReadAll(fd, 2000ms, "\r\n\r\n");
  EXPECT_NE(reply.find("HTTP/1.1 413"), std::string::npos) << reply;
  ::close(fd);

  fd = Connect(port_);
  Send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n");
  reply = ReadAll(fd, 2000ms, "\r\n\r\n");
  EXPECT_NE(reply.find("HTTP/1.1 400"), std::string::npos) << reply;
  ::close(fd);
  EXPECT_EQ(Closed("body_too_large"), 2);
  EXPECT_EQ(routes_.handled.load(), 0);
  EXPECT_LT(PingTime(), 2000ms);
}

// A chunk-size line that never ends (64 MiB of hex digits were buffered before): the parser's
// buffer is bounded, so the request is refused after a few KiB, long before its deadline.
TEST_F(HttpServerTest, AChunkSizeLineWithoutAnEndIsRefusedAtTheBufferBound) {
  HttpServer::Limits limits;
  limits.max_head_bytes = 8192;
  StartWith(limits);
  const int fd = Connect(port_);
  Send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
  const std::string digits(4096, '0');
  size_t sent = 0;
  const auto t0 = Clock::now();
  while (sent < (size_t{64} << 20) && Clock::now() - t0 < 5s) {
    const ssize_t n = ::send(fd, digits.data(), digits.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (errno == EAGAIN) {
      std::this_thread::sleep_for(1ms);
    } else {
      break;  // reset: the server closed
    }
  }
  const std::string reply = ReadAll(fd, 2000ms);
  ::close(fd);
  EXPECT_LT(sent, size_t{16} << 20) << "the server kept reading the line";
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_EQ(routes_.handled.load(), 0);
  EXPECT_LT(PingTime(), 2000ms);
}

// A client that leaves while its answer is awaited is reported to the handler (which cancels
// its request), at once, not when the answer comes.
TEST_F(HttpServerTest, AClientThatLeavesIsReportedWhileItsAnswerIsAwaited) {
  StartWith(HttpServer::Limits());
  const int fd = Connect(port_);
  Send(fd, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 100 && routes_.handled.load() < 1; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(routes_.handled.load(), 1);
  EXPECT_EQ(routes_.gone.load(), 0);
  ::close(fd);
  for (int i = 0; i < 200 && routes_.gone.load() < 1; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(routes_.gone.load(), 1);
}

// On a TLS port the same answers come through the encrypted stream: a head that misses its
// deadline gets 408, and a connection past the cap while every one is busy gets 503 with
// Retry-After after its handshake; the busy ones are untouched.
TEST_F(HttpServerTest, OverTlsASlowHeadGets408AndOneOverTheCap503) {
  SSL_CTX* tls = TestTlsContext();
  ASSERT_NE(tls, nullptr) << "openssl could not make a certificate";
  HttpServer::Limits limits;
  limits.max_connections = 2;
  limits.head_timeout_ms = 1000;
  StartWith(limits, tls);
  SSL_CTX_free(tls);  // the server holds its own reference
  {
    TlsClient slow(port_);
    ASSERT_TRUE(slow.handshaken());
    slow.Send("GET /ping HTTP/1.1\r\nHost");
    const auto t0 = Clock::now();
    const std::string reply = slow.ReadAll();
    EXPECT_NE(reply.find("HTTP/1.1 408"), std::string::npos) << reply;
    EXPECT_LT(Clock::now() - t0, 3000ms);
  }
  EXPECT_EQ(Closed("head_timeout"), 1);
  std::vector<std::unique_ptr<TlsClient>> busy;
  for (int i = 0; i < 2; ++i) {
    busy.push_back(std::make_unique<TlsClient>(port_));
    ASSERT_TRUE(busy.back()->handshaken());
    busy.back()->Send("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
  }
  for (int i = 0; i < 100 && routes_.handled.load() < 2; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(routes_.handled.load(), 2);
  {
    TlsClient extra(port_);
    ASSERT_TRUE(extra.handshaken());
    const std::string reply = extra.ReadAll();
    EXPECT_NE(reply.find("HTTP/1.1 503"), std::string::npos) << reply;
    EXPECT_NE(reply.find("Retry-After: 1"), std::string::npos) << reply;
  }
  EXPECT_EQ(Closed("refused"), 1);
  for (auto& b : busy) EXPECT_FALSE(ClosedWithin(b->fd(), 50ms));
  EXPECT_EQ(routes_.gone.load(), 0);
}

// The server drains its engine, then stops: a stream whose last chunks are still being written
// must reach the client whole (its terminating chunk included), not be cut short.
TEST_F(HttpServerTest, StopLetsARunningStreamFinishWithinTheGrace) {
  StartWith(HttpServer::Limits());
  const int fd = Connect(port_);
  Send(fd, "GET /held HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string reply = ReadAll(fd, 5000ms, "first;");
  ASSERT_NE(reply.find("first;"), std::string::npos) << reply;
  std::thread stopper([this] { server_->Stop(5000ms); });
  std::this_thread::sleep_for(200ms);  // Stop is waiting for the stream
  routes_.Release();
  reply += ReadAll(fd, 5000ms);
  stopper.join();
  ::close(fd);
  EXPECT_NE(reply.find("last;"), std::string::npos) << reply;
  EXPECT_NE(reply.find("\r\n0\r\n\r\n"), std::string::npos) << "no terminating chunk: " << reply;
}

}  // namespace
}  // namespace llava::server
