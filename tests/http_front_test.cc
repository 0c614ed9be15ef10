// The HTTP API's connection handling (server/http_front.h) with small limits and plain routes:
// idle, slow and oversized clients against a request that must still be answered at once.
#include "server/http_front.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
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

class HttpFrontTest : public ::testing::Test {
 protected:
  void StartWith(HttpFront::Limits limits) {
    routes_.Get("/ping", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("pong", "text/plain");
    });
    routes_.Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(req.body, "text/plain");
    });
    routes_.Get("/stream", [](const httplib::Request&, httplib::Response& res) {
      auto sent = std::make_shared<int>(0);
      res.set_chunked_content_provider("text/plain", [sent](size_t, httplib::DataSink& sink) {
        if (*sent == 3) {
          sink.done();
          return true;
        }
        const std::string part = "part" + std::to_string((*sent)++) + ";";
        return sink.write(part.data(), part.size());
      });
    });
    // Writes "first;" at once, "last;" once `release_` is set, then ends: a stream whose producer
    // is still writing when the front is told to stop.
    routes_.Get("/held", [this](const httplib::Request&, httplib::Response& res) {
      auto step = std::make_shared<int>(0);
      res.set_chunked_content_provider("text/plain", [this, step](size_t, httplib::DataSink& sink) {
        switch ((*step)++) {
          case 0:
            return sink.write("first;", 6);
          case 1:
            while (!release_) std::this_thread::sleep_for(5ms);
            return sink.write("last;", 5);
          default:
            sink.done();
            return true;
        }
      });
    });
    HttpFront::Events events;
    events.connections = [this](int open) { open_ = open; };
    events.closed = [this](const char* reason) {
      std::lock_guard<std::mutex> lock(mu_);
      ++closed_[reason];
    };
    front_ = std::make_unique<HttpFront>(&routes_, nullptr, limits, std::move(events));
    port_ = front_->Start("127.0.0.1:0");
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
    if (front_) front_->Stop();
  }

  int Closed(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_[reason];
  }

  HttpRoutes routes_;
  std::unique_ptr<HttpFront> front_;
  int port_ = -1;
  std::atomic<int> open_{-1};         // the front's last report
  std::atomic<bool> release_{false};  // lets /held finish
  std::mutex mu_;
  std::map<std::string, int> closed_;  // guarded by mu_
};

TEST_F(HttpFrontTest, KeepsConnectionsAliveAndAnswersPipelinedRequestsInOrder) {
  StartWith(HttpFront::Limits());
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

TEST_F(HttpFrontTest, StreamsChunkedResponses) {
  StartWith(HttpFront::Limits());
  const int fd = Connect(port_);
  Send(fd, "GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string reply = ReadAll(fd, 2000ms);
  ::close(fd);
  EXPECT_NE(reply.find("Transfer-Encoding: chunked"), std::string::npos) << reply;
  for (const char* part : {"part0;", "part1;", "part2;"}) {
    EXPECT_NE(reply.find(part), std::string::npos) << reply;
  }
}

TEST_F(HttpFrontTest, IdleConnectionsHoldNoWorkerAndTheOldestMakeRoom) {
  HttpFront::Limits limits;
  limits.workers = 2;
  limits.max_connections = 8;
  StartWith(limits);
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(Connect(port_));
  std::this_thread::sleep_for(200ms);  // all accepted
  EXPECT_LT(PingTime(), 2000ms);
  // The cap closed the oldest; the newest (fewer than the cap) are still open.
  EXPECT_TRUE(ClosedWithin(idle.front(), 500ms));
  EXPECT_FALSE(ClosedWithin(idle.back(), 100ms));
  EXPECT_GE(Closed("cap"), 40 - 8);
  std::this_thread::sleep_for(1100ms);  // the open count is reported at least once a second
  EXPECT_LE(open_.load(), 8);
  EXPECT_GE(open_.load(), 1);
  for (int fd : idle) ::close(fd);
}

TEST_F(HttpFrontTest, SlowHeadsHoldNoWorkerAndEndAtTheDeadline) {
  HttpFront::Limits limits;
  limits.workers = 1;
  limits.head_timeout_ms = 3000;
  StartWith(limits);
  // Three clients that send a request head a byte every 50 ms: more than the workers.
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

TEST_F(HttpFrontTest, ASlowBodyEndsAtItsDeadlineAndFreesTheWorker) {
  HttpFront::Limits limits;
  limits.workers = 1;
  limits.body_timeout_ms = 500;
  StartWith(limits);
  const int fd = Connect(port_);
  Send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{");
  const auto t0 = Clock::now();
  EXPECT_TRUE(ClosedWithin(fd, 5000ms));
  EXPECT_LT(Clock::now() - t0, 3000ms);
  ::close(fd);
  EXPECT_LT(PingTime(), 2000ms);
}

TEST_F(HttpFrontTest, AnOversizedHeadIsRefused) {
  HttpFront::Limits limits;
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

// The server drains its engine, then stops the front: a stream whose last chunks are still being
// written must reach the client whole (its terminating chunk included), not be cut short.
TEST_F(HttpFrontTest, StopLetsARunningStreamFinishWithinTheGrace) {
  StartWith(HttpFront::Limits());
  const int fd = Connect(port_);
  Send(fd, "GET /held HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string reply = ReadAll(fd, 5000ms, "first;");
  ASSERT_NE(reply.find("first;"), std::string::npos) << reply;
  std::thread stopper([this] { front_->Stop(5000ms); });
  std::this_thread::sleep_for(200ms);  // Stop is waiting for the stream
  release_ = true;
  reply += ReadAll(fd, 5000ms);
  stopper.join();
  ::close(fd);
  EXPECT_NE(reply.find("last;"), std::string::npos) << reply;
  EXPECT_NE(reply.find("\r\n0\r\n\r\n"), std::string::npos) << "no terminating chunk: " << reply;
}

}  // namespace
}  // namespace llava::server
