// The HTTP server's connection handling (server/http_server.h) from a socket: each input is the
// bytes one client sends on one connection (heads, bodies, chunked framing, pipelined requests,
// anything), against a real server on a loopback port with small limits. Properties:
// - a handler runs only for a head that Screen let through, and never sees a body over the
//   limit;
// - what the server sends is a sequence of HTTP/1.1 responses with a valid status (Beast's
//   response parser reads every one), and the server ends or keeps the connection; it never
//   hangs a client past its deadlines (libFuzzer's -timeout catches that).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "server/http_server.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace http = boost::beast::http;
using llava::server::HttpExchange;
using llava::server::HttpHandler;
using llava::server::HttpRequestHead;
using llava::server::HttpResponse;
using llava::server::HttpServer;

constexpr size_t kMaxBody = 4096;

HttpResponse Text(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.content_type = "text/plain";
  r.body = std::move(body);
  return r;
}

// GET /get answered from the head; POST /echo the body back; /stream two chunks; /deny 401
// from the head (as a missing token is); anything else 404.
class Routes final : public HttpHandler {
 public:
  std::optional<HttpResponse> Screen(const HttpRequestHead& head) override {
    if (head.path == "/get") return Text(200, "got");
    if (head.path == "/deny") return Text(401, "no");
    if (head.path == "/echo" || head.path == "/stream") return std::nullopt;
    return Text(404, "not found");
  }
  void Handle(HttpRequestHead head, std::string body,
              std::shared_ptr<HttpExchange> exchange) override {
    LLAVA_FUZZ_CHECK(head.path == "/echo" || head.path == "/stream");
    LLAVA_FUZZ_CHECK(body.size() <= kMaxBody);
    if (head.path == "/echo") return exchange->Reply(Text(200, std::move(body)));
    auto sent = std::make_shared<int>(0);
    exchange->Stream(Text(200, ""), [sent](bool* end) {
      *end = *sent == 1;
      return "part" + std::to_string((*sent)++);
    });
  }
};

int ServerPort() {
  static const int port = [] {
    HttpServer::Limits limits;
    limits.workers = 2;
    limits.max_connections = 8;
    limits.head_timeout_ms = 1000;
    limits.body_timeout_ms = 1000;
    limits.write_timeout_ms = 1000;
    limits.max_head_bytes = 2048;
    limits.max_body_bytes = kMaxBody;
    limits.max_requests_per_connection = 16;
    static HttpServer* server = new HttpServer(new Routes, nullptr, limits);  // for the process
    return server->Start("127.0.0.1:0");
  }();
  LLAVA_FUZZ_CHECK(port > 0);
  return port;
}

// Sends `input` on a new connection, then reads until the server closes or is quiet for
// `quiet_ms` (an answer under way comes within that on loopback).
std::string Exchange(std::string_view input, int quiet_ms) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  LLAVA_FUZZ_CHECK(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(ServerPort()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // A refused or unavailable connect is retried for a while: the server must accept again.
  int tries = 0;
  while (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (++tries == 100) {
      std::perror("fuzz_http_server: connect");
      LLAVA_FUZZ_CHECK(false);
    }
    ::usleep(10000);
  }
  std::string out;
  char buf[8192];
  size_t sent = 0;
  bool open = true;
  while (open) {
    pollfd p{fd, static_cast<short>(POLLIN | (sent < input.size() ? POLLOUT : 0)), 0};
    if (::poll(&p, 1, quiet_ms) <= 0) break;  // quiet: nothing more is coming now
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) {
        out.append(buf, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        open = false;  // closed (or reset) by the server
      }
    }
    if (open && sent < input.size() && (p.revents & POLLOUT)) {
      const ssize_t n =
          ::send(fd, input.data() + sent, input.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) sent += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN && errno != EINTR) open = false;
    }
  }
  // Closed with a reset, as a client that leaves may: no TIME_WAIT left behind per input.
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(fd);
  return out;
}

// Every response in `out` (only the first when `first_only`) parses, with a status of 100-599;
// the last one may be cut short where the quiet period came first.
void CheckResponses(const std::string& out, bool first_only) {
  boost::beast::flat_buffer buffer;
  buffer.commit(boost::asio::buffer_copy(buffer.prepare(out.size()),
                                         boost::asio::buffer(out.data(), out.size())));
  while (buffer.size() > 0) {
    http::response_parser<http::string_body> parser;
    parser.eager(true);
    parser.body_limit(1 << 20);
    boost::beast::error_code ec;
    const size_t used = parser.put(buffer.data(), ec);
    if (ec == http::error::need_more) return;  // the quiet period came first
    LLAVA_FUZZ_CHECK(!ec);
    LLAVA_FUZZ_CHECK(parser.is_header_done());
    const unsigned status = parser.get().result_int();
    LLAVA_FUZZ_CHECK(status >= 100 && status < 600);
    buffer.consume(used);
    if (first_only || !parser.is_done()) return;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::string out = Exchange(input, 20);
  // A response to HEAD declares a length it does not send, so the responses after it cannot
  // be told apart: then only the first is read.
  CheckResponses(out, input.find("HEAD") != std::string_view::npos);
  return 0;
}
