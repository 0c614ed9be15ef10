#include "server/http_server.h"

#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <future>
#include <list>
#include <mutex>
#include <thread>
#include <type_traits>

#include "server/http_endpoint.h"  // ListenOn

namespace llava::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;

std::string HttpRequestHead::Header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (beast::iequals(key, name)) return value;
  }
  return "";
}

namespace {

// A connection as the server's registry sees it (all calls on the I/O thread).
class Connection {
 public:
  virtual ~Connection() = default;
  // Waiting for a request head (or its TLS handshake), with no answer under way: the one to close
  // for a new connection at the cap, or at once when the server stops.
  virtual bool WaitingForHead() const = 0;
  // Closes the socket now; an answer under way is cut short and its handler told (OnGone).
  virtual void Close(const char* reason) = 0;
  // The server stops: no further request on this connection.
  virtual void Stopping() = 0;
};

// Where exchanges post their answers: the I/O context until the server stops, then nothing.
struct Link {
  std::mutex mu;
  net::io_context* io = nullptr;  // guarded by mu
  template <class F>
  void Post(F&& f) {
    std::lock_guard<std::mutex> lock(mu);
    if (io != nullptr) net::post(*io, std::forward<F>(f));
  }
};

// The session side of an exchange (implemented by Session<Stream>; I/O thread only).
class Answerer {
 public:
  virtual ~Answerer() = default;
  virtual void Reply(HttpResponse response) = 0;
  virtual void BeginStream(HttpResponse head, std::function<std::string(bool*)> next) = 0;
  virtual void Pump() = 0;
};

class Exchange final : public HttpExchange {
 public:
  Exchange(std::weak_ptr<Answerer> session, std::shared_ptr<Link> link)
      : session_(std::move(session)), link_(std::move(link)) {}

  void Reply(HttpResponse response) override {
    link_->Post([s = session_, r = std::move(response)]() mutable {
      if (auto p = s.lock()) p->Reply(std::move(r));
    });
  }
  void Stream(HttpResponse head, std::function<std::string(bool*)> next) override {
    link_->Post([s = session_, h = std::move(head), n = std::move(next)]() mutable {
      if (auto p = s.lock()) p->BeginStream(std::move(h), std::move(n));
    });
  }
  void Notify() override {
    link_->Post([s = session_] {
      if (auto p = s.lock()) p->Pump();
    });
  }
  void OnGone(std::function<void()> gone) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!gone_happened_) {
        gone_ = std::move(gone);
        return;
      }
    }
    if (!done_ && gone) gone();  // the client left before the handler asked
  }
  // The session's side: the answer was sent in full, or the connection closed before.
  void Done() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    gone_ = nullptr;
  }
  void Gone() {
    std::function<void()> gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      gone_happened_ = true;
      gone = std::move(gone_);
      gone_ = nullptr;
    }
    if (gone) gone();
  }

 private:
  const std::weak_ptr<Answerer> session_;
  const std::shared_ptr<Link> link_;
  std::mutex mu_;
  std::function<void()> gone_;  // guarded by mu_
  bool gone_happened_ = false;  // guarded by mu_
  bool done_ = false;           // guarded by mu_
};

HttpResponse Refusal(int status, const std::string& message) {
  HttpResponse r;
  r.status = status;
  r.content_type = "text/plain";
  r.body = message + "\n";
  return r;
}

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpHandler* handler, ssl_ctx_st* tls, Limits limits, Events events)
      : handler(handler), limits(limits), events(std::move(events)) {
    if (tls != nullptr) {
      SSL_CTX_up_ref(tls);  // the context below frees its reference
      tls_context.emplace(tls);
    }
  }

  void Accept();
  void Admit(tcp::socket socket);
  // Runs the handler on a worker; a handler that throws answers 500.
  void Dispatch(HttpRequestHead head, std::string body, std::shared_ptr<HttpExchange> exchange) {
    net::post(*workers,
              [this, h = std::move(head), b = std::move(body), e = std::move(exchange)]() mutable {
                try {
                  handler->Handle(std::move(h), std::move(b), e);
                } catch (const std::exception& error) {
                  e->Reply(Refusal(500, std::string("internal error: ") + error.what()));
                }
              });
  }
  void Closed(const char* reason) const {
    if (reason != nullptr && events.closed) events.closed(reason);
  }
  // `refusing`: a connection past the cap that is only being answered 503 (TLS); it is open,
  // and closed when the server stops, but not counted against the cap.
  void Register(Connection* c, bool refusing) {
    connections.push_back(c);
    refusing_now += refusing ? 1 : 0;
    if (events.connections) events.connections(static_cast<int>(connections.size()));
  }
  void Unregister(Connection* c, bool refusing) {
    connections.remove(c);
    refusing_now -= refusing ? 1 : 0;
    if (events.connections) events.connections(static_cast<int>(connections.size()));
  }

  net::io_context io{1};
  HttpHandler* const handler;
  const Limits limits;
  const Events events;
  std::optional<ssl::context> tls_context;
  tcp::acceptor acceptor{io};
  std::optional<net::executor_work_guard<net::io_context::executor_type>> guard;
  std::unique_ptr<net::thread_pool> workers;
  std::shared_ptr<Link> link = std::make_shared<Link>();
  std::thread io_thread;
  // I/O thread only:
  std::list<Connection*> connections;  // open, oldest first
  int refusing_now = 0;                // of which are being refused (TLS past the cap)
  bool stopping = false;
  // Answers under way (a request read, its answer not yet sent in full); read by Stop.
  std::atomic<int> answering{0};
};

namespace {

// A TLS connection past the cap is answered 503 only after a handshake, which the server does
// for at most this many at once, each within this time; beyond that such a connection is closed
// without a word.
constexpr int kMaxRefusing = 16;
constexpr int kRefusalHandshakeMs = 2000;

// One connection: reads heads and bodies, hands requests to the handler, writes answers.
// Everything runs on the I/O thread; pending operations hold a reference.
template <class Stream>
class Session final : public Connection,
                      public Answerer,
                      public std::enable_shared_from_this<Session<Stream>> {
 public:
  static constexpr bool kTls = !std::is_same_v<Stream, tcp::socket>;

  // `refusing`: a TLS connection past the cap, answered 503 after its handshake (a plain one is
  // answered by Admit without a session).
  Session(HttpServer::Impl* server, Stream stream, bool refusing = false)
      : server_(server),
        limits_(server->limits),
        stream_(std::move(stream)),
        buffer_(server->limits.max_head_bytes + 16384),
        timer_(server->io),
        refusing_(refusing) {}

  void Start() {
    server_->Register(this, refusing_);
    if (refusing_) {
      Arm(std::min(limits_.head_timeout_ms, kRefusalHandshakeMs), nullptr);
    } else {
      Arm(limits_.head_timeout_ms, "head_timeout");
    }
    if constexpr (kTls) {
      stream_.async_handshake(ssl::stream_base::server, [self = Self()](beast::error_code ec) {
        if (self->closed_) return;
        if (ec) return self->Close("tls_handshake");
        self->handshaken_ = true;
        if (self->refusing_) {
          self->Disarm();
          return self->Refuse(503, "the server is at its connection limit: retry later", nullptr);
        }
        self->ReadHead();
      });
    } else {
      ReadHead();
    }
  }

  ~Session() override {
    if (!closed_) server_->Unregister(this, refusing_);  // every path closes first
  }

  bool WaitingForHead() const override { return !refusing_ && !exchange_ && !writing_; }
  void Stopping() override { keep_alive_ = false; }

  void Close(const char* reason) override {
    if (closed_) return;
    const auto keep = Self();  // EndExchange may drop the last other reference
    closed_ = true;
    server_->Closed(reason);
    Disarm();
    beast::error_code ignored;
    Socket().shutdown(tcp::socket::shutdown_both, ignored);
    Socket().close(ignored);
    next_ = nullptr;
    EndExchange(/*gone=*/true);
    server_->Unregister(this, refusing_);
  }

  void Reply(HttpResponse response) override {
    if (closed_ || !exchange_ || answer_started_) return;
    answer_started_ = true;
    Write(std::move(response));
  }

  void BeginStream(HttpResponse head, std::function<std::string(bool*)> next) override {
    if (closed_ || !exchange_ || answer_started_) return;
    answer_started_ = true;
    stream_head_ = std::make_unique<http::response<http::empty_body>>(
        static_cast<http::status>(head.status), 11);
    SetHeaders(*stream_head_, head);
    KeepAlive(*stream_head_);
    stream_head_->chunked(true);
    serializer_ = std::make_unique<http::response_serializer<http::empty_body>>(*stream_head_);
    next_ = std::move(next);
    ending_ = false;
    writing_ = true;
    Arm(limits_.write_timeout_ms, "write_timeout");
    http::async_write_header(stream_, *serializer_,
                             [self = Self()](beast::error_code ec, size_t) { self->Wrote(ec); });
  }

  void Pump() override {
    if (closed_ || !next_ || writing_) return;
    if (!ending_) {
      chunk_ = next_(&ending_);
      if (!chunk_.empty()) {
        writing_ = true;
        Arm(limits_.write_timeout_ms, "write_timeout");
        net::async_write(stream_, http::make_chunk(net::buffer(chunk_)),
                         [self = Self()](beast::error_code ec, size_t) { self->Wrote(ec); });
        return;
      }
      if (!ending_) return;  // nothing yet: Notify calls again
    }
    next_ = nullptr;
    writing_ = true;
    Arm(limits_.write_timeout_ms, "write_timeout");
    net::async_write(stream_, http::make_chunk_last(),
                     [self = Self()](beast::error_code ec, size_t) { self->Answered(ec); });
  }

 private:
  std::shared_ptr<Session> Self() { return this->shared_from_this(); }
  tcp::socket& Socket() { return beast::get_lowest_layer(stream_); }

  // One deadline at a time: when it passes, the connection closes (for `reason`).
  void Arm(int ms, const char* reason) {
    const uint64_t generation = ++timer_generation_;
    timer_.expires_after(std::chrono::milliseconds(ms));
    timer_.async_wait([self = Self(), generation, reason](beast::error_code ec) {
      if (ec || self->closed_ || generation != self->timer_generation_) return;
      self->Expired(reason);
    });
  }
  void Disarm() {
    ++timer_generation_;
    timer_.cancel();
  }
  void Expired(const char* reason) {
    // A head begun but not finished in time is told so. A plain socket gets what the kernel
    // takes now; a TLS connection past its handshake gets the answer written through the stream
    // within the write deadline (the head read under way is dropped), then closes.
    if (std::string_view(reason == nullptr ? "" : reason) == "head_timeout" && !exchange_ &&
        !writing_ && !closing_ && buffer_.size() > 0) {
      if constexpr (kTls) {
        if (handshaken_) {
          return Refuse(408, "the request head did not arrive in time", reason);
        }
      } else {
        static const char k408[] =
            "HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        beast::error_code ignored;
        Socket().non_blocking(true, ignored);
        Socket().send(net::buffer(k408, sizeof(k408) - 1), 0, ignored);
      }
    }
    Close(reason);
  }

  void ReadHead() {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(limits_.max_head_bytes));
    parser_->body_limit(boost::none);  // set once the head has passed Screen (ServeHead)
    reading_head_ = true;
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = Self()](beast::error_code ec, size_t) { self->GotHead(ec); });
  }

  void GotHead(beast::error_code ec) {
    reading_head_ = false;
    if (closed_) return;
    if (closing_) return Close(nullptr);
    if (exchange_ || writing_) {
      // Read while an answer is under way: the client left, or sent its next request early.
      if (ec) return Close(nullptr);
      head_waiting_ = true;
      return;
    }
    if (ec) return ReadFailed(ec);
    ServeHead();
  }

  void ReadFailed(beast::error_code ec) {
    if (ec == http::error::header_limit ||
        (ec == http::error::buffer_overflow && !parser_->is_header_done())) {
      return Refuse(431, "request head over the server's limit", "head_too_large");
    }
    if (ec == http::error::body_limit) {
      return Refuse(413, "request body over the server's limit (--http-max-body-bytes)",
                    "body_too_large");
    }
    // A message that does not parse (a bad Content-Length, a chunk-size line longer than the
    // buffer, ...) is answered; a client that closed or reset, or a deadline that closed the
    // socket, is not.
    if (ec.category() == http::make_error_code(http::error::bad_method).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message) {
      return Refuse(400, "malformed request: " + ec.message(), "bad_request");
    }
    Close(nullptr);
  }

  void ServeHead() {
    const auto& req = parser_->get();
    head_ = HttpRequestHead();
    head_.method = std::string(req.method_string());
    head_.target = std::string(req.target());
    head_.path = head_.target.substr(0, head_.target.find('?'));
    for (const auto& field : req) {
      head_.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    }
    keep_alive_ = keep_alive_ && req.keep_alive() && !server_->stopping &&
                  ++served_ < limits_.max_requests_per_connection;
    head_only_ = req.method() == http::verb::head;
    Disarm();
    const bool has_body = !parser_->is_done();
    if (std::optional<HttpResponse> answer = server_->handler->Screen(head_)) {
      if (has_body) keep_alive_ = false;  // the body is never read: the connection ends
      return Write(std::move(*answer));
    }
    if (parser_->content_length().value_or(0) > limits_.max_body_bytes) {
      return ReadFailed(http::error::body_limit);
    }
    parser_->body_limit(static_cast<uint64_t>(limits_.max_body_bytes));  // chunked: as it comes
    // A declared length is reserved by the parser; a chunked body gets the limit reserved
    // (address space: pages become memory as bytes arrive), so that it is never copied as it
    // grows (growing by doubling held 2-3x the limit at its last copy).
    if (has_body && !parser_->content_length()) {
      parser_->get().body().reserve(limits_.max_body_bytes);
    }
    const std::string encoding = head_.Header("Content-Encoding");
    if (has_body && !encoding.empty() && !beast::iequals(encoding, "identity")) {
      keep_alive_ = false;
      return Write(Refusal(415, "Content-Encoding '" + encoding.substr(0, 64) +
                                    "' is not accepted: send the body uncompressed"));
    }
    Arm(limits_.body_timeout_ms, "body_timeout");
    if (has_body && beast::iequals(head_.Header("Expect"), "100-continue")) {
      continue_ = std::make_unique<http::response<http::empty_body>>(http::status::continue_, 11);
      http::async_write(stream_, *continue_, [self = Self()](beast::error_code ec, size_t) {
        if (self->closed_) return;
        if (ec) return self->Close(nullptr);
        self->ReadBody();
      });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    http::async_read(stream_, buffer_, *parser_, [self = Self()](beast::error_code ec, size_t) {
      if (self->closed_) return;
      if (ec) return self->ReadFailed(ec);
      self->GotRequest();
    });
  }

  void GotRequest() {
    Disarm();
    std::string body = std::move(parser_->get().body());
    exchange_ = std::make_shared<Exchange>(std::weak_ptr<Answerer>(Self()), server_->link);
    answering_self_ = Self();  // no operation may be pending while the handler works
    answer_started_ = false;
    server_->answering.fetch_add(1);
    server_->Dispatch(std::move(head_), std::move(body), exchange_);
    // The next head is read at once: a closed connection is seen (the answer is cancelled)
    // while the engine works, and a pipelined request waits here for its turn.
    ReadHead();
  }

  template <class Message>
  static void SetHeaders(Message& m, const HttpResponse& r) {
    if (!r.content_type.empty()) m.set(http::field::content_type, r.content_type);
    for (const auto& [key, value] : r.headers) m.insert(key, value);
  }

  // "Connection: close", or how long an idle connection is kept (clients that read the hint,
  // e.g. Node's agent, then do not send on a connection the server is about to close).
  template <class Message>
  void KeepAlive(Message& m) const {
    m.keep_alive(keep_alive_);
    if (keep_alive_) {
      m.set(http::field::keep_alive,
            "timeout=" + std::to_string(std::max(1, limits_.head_timeout_ms / 1000)));
    }
  }

  void Write(HttpResponse r) {
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(r.status), 11);
    SetHeaders(*res, r);
    res->body() = std::move(r.body);
    KeepAlive(*res);
    res->prepare_payload();
    if (head_only_) res->body().clear();  // Content-Length stays that of the GET
    writing_ = true;
    Arm(limits_.write_timeout_ms, "write_timeout");
    http::async_write(stream_, *res,
                      [self = Self(), res](beast::error_code ec, size_t) { self->Answered(ec); });
  }

  // A request refused from its head: answered, and the connection ends.
  void Refuse(int status, const std::string& message, const char* reason) {
    server_->Closed(reason);
    keep_alive_ = false;
    head_only_ = false;
    HttpResponse answer = Refusal(status, message);
    if (status == 503) answer.headers.emplace_back("Retry-After", "1");
    Write(std::move(answer));
  }

  void Wrote(beast::error_code ec) {
    writing_ = false;
    Disarm();
    if (closed_) return;
    if (ec) return Close(nullptr);
    Pump();
  }

  void EndExchange(bool gone) {
    if (!exchange_) return;
    if (gone) {
      exchange_->Gone();
    } else {
      exchange_->Done();
    }
    exchange_.reset();
    server_->answering.fetch_sub(1);
    answering_self_.reset();  // callers hold a reference of their own
  }

  // The answer was written (or failed).
  void Answered(beast::error_code ec) {
    writing_ = false;
    Disarm();
    if (closed_) return;
    if (ec) return Close(nullptr);
    EndExchange(/*gone=*/false);
    stream_head_.reset();
    serializer_.reset();
    if (!keep_alive_ || server_->stopping) return Linger();
    if (head_waiting_) {
      head_waiting_ = false;
      return ServeHead();
    }
    Arm(limits_.head_timeout_ms, "head_timeout");
    if (!reading_head_) ReadHead();
  }

  // After "Connection: close": stop sending, read and drop what the client still sends (a body
  // that was refused) for a moment, so that the close does not reset the answer away.
  void Linger() {
    closing_ = true;
    beast::error_code ignored;
    Socket().shutdown(tcp::socket::shutdown_send, ignored);
    Arm(1000, nullptr);
    if (!reading_head_) Drain();  // else the head read under way drops what comes
  }
  void Drain() {
    Socket().async_read_some(net::buffer(scratch_),
                             [self = Self()](beast::error_code ec, size_t n) {
                               if (self->closed_) return;
                               self->drained_ += n;
                               if (ec || self->drained_ > (size_t{1} << 20))
                                 return self->Close(nullptr);
                               self->Drain();
                             });
  }

  HttpServer::Impl* const server_;
  const HttpServer::Limits& limits_;
  Stream stream_;
  beast::flat_buffer buffer_;  // bounded: a head, or a chunk-size line, cannot grow it
  net::steady_timer timer_;
  uint64_t timer_generation_ = 0;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpRequestHead head_;
  std::shared_ptr<Exchange> exchange_;       // the request being answered
  std::shared_ptr<Session> answering_self_;  // while exchange_ is set: the session lives
  std::unique_ptr<http::response<http::empty_body>> continue_, stream_head_;
  std::unique_ptr<http::response_serializer<http::empty_body>> serializer_;
  std::function<std::string(bool*)> next_;  // a streamed answer's source
  std::string chunk_;                       // the chunk being written
  char scratch_[4096];
  size_t drained_ = 0;
  int served_ = 0;
  bool handshaken_ = false, reading_head_ = false, head_waiting_ = false, writing_ = false;
  bool answer_started_ = false, ending_ = false, closing_ = false, closed_ = false;
  bool keep_alive_ = true, head_only_ = false;
  const bool refusing_;
};

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) Admit(std::move(socket));
    Accept();  // after an error too (out of descriptors: the next try may succeed)
  });
}

void HttpServer::Impl::Admit(tcp::socket socket) {
  beast::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);  // one event per token
  bool refusing = false;
  if (static_cast<int>(connections.size()) - refusing_now >= limits.max_connections) {
    Connection* idle = nullptr;
    for (Connection* c : connections) {
      if (c->WaitingForHead()) {
        idle = c;
        break;
      }
    }
    if (idle != nullptr) {
      idle->Close("cap");
    } else {
      // Every connection carries a request: this one is answered 503 and closed. A plain
      // socket is told at once; a TLS one after its handshake, within the bounds above.
      Closed("refused");
      if (tls_context && refusing_now < kMaxRefusing) {
        refusing = true;
      } else {
        if (!tls_context) {
          static const char k503[] =
              "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
              "Connection: close\r\n\r\n";
          socket.non_blocking(true, ignored);
          socket.send(net::buffer(k503, sizeof(k503) - 1), 0, ignored);
        }
        socket.close(ignored);
        return;
      }
    }
  }
  if (tls_context) {
    std::make_shared<Session<ssl::stream<tcp::socket>>>(
        this, ssl::stream<tcp::socket>(std::move(socket), *tls_context), refusing)
        ->Start();
  } else {
    std::make_shared<Session<tcp::socket>>(this, std::move(socket))->Start();
  }
}

HttpServer::HttpServer(HttpHandler* handler, ssl_ctx_st* tls, Limits limits, Events events)
    : impl_(std::make_unique<Impl>(handler, tls, limits, std::move(events))) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::Start(const std::string& address) {
  Impl& s = *impl_;
  int port = -1;
  const int fd = ListenOn(address, &port);
  if (fd < 0) return -1;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  beast::error_code ec;
  s.acceptor.assign(bound.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), fd, ec);
  if (ec) {
    ::close(fd);
    return -1;
  }
  s.workers = std::make_unique<net::thread_pool>(std::max(1, s.limits.workers));
  {
    std::lock_guard<std::mutex> lock(s.link->mu);
    s.link->io = &s.io;
  }
  s.guard.emplace(s.io.get_executor());
  s.Accept();
  s.io_thread = std::thread([&s] { s.io.run(); });
  return port;
}

namespace {

// Runs `f` on the I/O thread and waits for it.
template <class F>
void OnIoThread(net::io_context& io, F f) {
  std::promise<void> ran;
  net::post(io, [&] {
    f();
    ran.set_value();
  });
  ran.get_future().wait();
}

}  // namespace

void HttpServer::Stop(std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  if (!s.io_thread.joinable()) return;
  OnIoThread(s.io, [&s] {
    s.stopping = true;
    beast::error_code ignored;
    s.acceptor.close(ignored);
    for (auto it = s.connections.begin(); it != s.connections.end();) {
      Connection* c = *it++;  // Close unregisters it
      c->Stopping();
      if (c->WaitingForHead()) c->Close(nullptr);
    }
  });
  const auto until = std::chrono::steady_clock::now() + grace;
  while (s.answering.load() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // What is still open now is cut short (its handlers are told, and cancel).
  OnIoThread(s.io, [&s] {
    while (!s.connections.empty()) s.connections.front()->Close(nullptr);
  });
  s.workers->join();  // running handlers finish; their answers find no connection
  {
    std::lock_guard<std::mutex> lock(s.link->mu);
    s.link->io = nullptr;
  }
  s.guard.reset();
  s.io.stop();
  s.io_thread.join();
}

}  // namespace llava::server
