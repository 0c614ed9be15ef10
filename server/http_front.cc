#include "server/http_front.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "server/http_endpoint.h"

namespace llava::server {
namespace {

thread_local int t_current_socket = -1;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Waits until `fd` has `events` or `deadline_ms` passes; false on the deadline or an error.
bool WaitFor(int fd, short events, int64_t deadline_ms) {
  for (;;) {
    const int64_t left = deadline_ms - NowMs();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// The end of the request head in `in` from `from` (the index after the blank line), or npos.
size_t HeadEnd(const std::string& in, size_t from) {
  const size_t crlf = in.find("\r\n\r\n", from);
  const size_t lf = in.find("\n\n", from);
  if (crlf != std::string::npos && (lf == std::string::npos || crlf < lf)) return crlf + 4;
  return lf == std::string::npos ? std::string::npos : lf + 2;
}

// A short answer before closing, written if the socket takes it at once.
void SendAndForget(int fd, ssl_st* ssl, const char* text) {
  const int size = static_cast<int>(std::strlen(text));
  if (ssl != nullptr) {
    ERR_clear_error();
    SSL_write(ssl, text, size);
  } else {
    ::send(fd, text, static_cast<size_t>(size), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
}

void Address(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  const int rc = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
                      : ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ip.clear();
  port = 0;
  if (rc != 0) return;
  char text[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    ::inet_ntop(AF_INET, &in.sin_addr, text, sizeof(text));
    port = ntohs(in.sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto& in = reinterpret_cast<const sockaddr_in6&>(a);
    ::inet_ntop(AF_INET6, &in.sin6_addr, text, sizeof(text));
    port = ntohs(in.sin6_port);
  }
  ip = text;
}

}  // namespace

struct HttpFront::Connection {
  Connection(int socket, ssl_st* tls, std::atomic<int>* counter)
      : fd(socket), ssl(tls), open(counter) {}
  ~Connection() {
    if (ssl != nullptr) {
      if (handshaken) SSL_shutdown(ssl);  // close_notify, if the socket takes it
      SSL_free(ssl);
    }
    ::close(fd);
    open->fetch_sub(1);
  }
  const int fd;
  ssl_st* const ssl;  // null: plain HTTP
  std::atomic<int>* const open;
  bool handshaken = false;
  short want = POLLIN;  // what the poller waits for (a TLS handshake may need to write)
  std::string in;       // bytes read and not yet taken by httplib, from `taken`
  size_t taken = 0;
  int64_t deadline_ms = 0;  // for the head
  int served = 0;
};

// httplib's view of a connection: the bytes the poller read first, then the socket, reads
// bounded by one deadline for the rest of the request, each write by the write timeout.
class HttpFront::Stream final : public httplib::Stream {
 public:
  Stream(Connection* c, int64_t read_deadline_ms, int write_timeout_ms)
      : c_(c), read_deadline_ms_(read_deadline_ms), write_timeout_ms_(write_timeout_ms) {}

  bool is_readable() const override {
    return c_->taken < c_->in.size() || (c_->ssl != nullptr && SSL_pending(c_->ssl) > 0) ||
           WaitFor(c_->fd, POLLIN, read_deadline_ms_);
  }
  bool is_writable() const override {
    return WaitFor(c_->fd, POLLOUT, NowMs() + write_timeout_ms_);
  }
  ssize_t read(char* ptr, size_t size) override {
    if (c_->taken < c_->in.size()) {
      const size_t n = std::min(size, c_->in.size() - c_->taken);
      std::memcpy(ptr, c_->in.data() + c_->taken, n);
      c_->taken += n;
      return static_cast<ssize_t>(n);
    }
    for (;;) {
      short wait = POLLIN;
      if (c_->ssl != nullptr) {
        ERR_clear_error();
        const int n = SSL_read(c_->ssl, ptr, static_cast<int>(std::min<size_t>(size, 1 << 30)));
        if (n > 0) return n;
        const int e = SSL_get_error(c_->ssl, n);
        if (e == SSL_ERROR_ZERO_RETURN) return Broken(0);
        if (e == SSL_ERROR_WANT_WRITE) {
          wait = POLLOUT;
        } else if (e != SSL_ERROR_WANT_READ) {
          return Broken(-1);
        }
      } else {
        const ssize_t n = ::recv(c_->fd, ptr, size, 0);
        if (n > 0) return n;
        if (n == 0) return Broken(0);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return Broken(-1);
      }
      if (!WaitFor(c_->fd, wait, read_deadline_ms_)) return Broken(-1);
    }
  }
  ssize_t write(const char* ptr, size_t size) override {
    const int64_t deadline = NowMs() + write_timeout_ms_;
    for (;;) {
      short wait = POLLOUT;
      if (c_->ssl != nullptr) {
        ERR_clear_error();
        const int n = SSL_write(c_->ssl, ptr, static_cast<int>(std::min<size_t>(size, 1 << 30)));
        if (n > 0) return n;
        const int e = SSL_get_error(c_->ssl, n);
        if (e == SSL_ERROR_WANT_READ) {
          wait = POLLIN;
        } else if (e != SSL_ERROR_WANT_WRITE) {
          return Broken(-1);
        }
      } else {
        const ssize_t n = ::send(c_->fd, ptr, size, MSG_NOSIGNAL);
        if (n >= 0) return n;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return Broken(-1);
      }
      if (!WaitFor(c_->fd, wait, deadline)) return Broken(-1);
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    Address(c_->fd, true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    Address(c_->fd, false, ip, port);
  }
  socket_t socket() const override { return c_->fd; }
  // A read or write failed or timed out, or the client closed: the connection is not reused
  // (httplib may still have answered the request, e.g. 400 for a body cut short).
  bool broken() const { return broken_; }

 private:
  ssize_t Broken(ssize_t result) {
    broken_ = true;
    return result;
  }
  Connection* c_;
  const int64_t read_deadline_ms_;
  const int write_timeout_ms_;
  bool broken_ = false;
};

HttpFront::HttpFront(HttpRoutes* http, ssl_ctx_st* tls, Limits limits, Events events)
    : http_(http), tls_(tls), limits_(limits), events_(std::move(events)) {}

HttpFront::~HttpFront() { Stop(); }

int HttpFront::CurrentSocket() { return t_current_socket; }

int HttpFront::Start(const std::string& address) {
  int port = -1;
  listen_fd_ = ListenOn(address, &port);
  if (listen_fd_ < 0) return -1;
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    return -1;
  }
  // httplib streams a chunked response only while its listening socket looks open.
  http_->MarkServing(listen_fd_);
  poller_ = std::thread([this] { PollLoop(); });
  const int workers = std::max(1, limits_.workers);
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  return port;
}

void HttpFront::Wake() {
  const char byte = 0;
  while (::write(wake_[1], &byte, 1) < 0 && errno == EINTR) {
  }
}

void HttpFront::Stop(std::chrono::milliseconds grace) {
  if (!poller_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  Wake();
  poller_.join();  // closes the listener and the idle connections
  ready_cv_.notify_all();
  {
    // httplib ends a chunked response once the listening socket looks closed, before its
    // terminating chunk: running streams get `grace` to finish first.
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait_for(lock, grace, [this] { return busy_ == 0 && ready_.empty(); });
  }
  http_->MarkServing(-1);
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  returned_.clear();
  for (int* fd : {&wake_[0], &wake_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

bool HttpFront::ReadHead(Connection* c) {
  if (c->ssl != nullptr && !c->handshaken) {
    ERR_clear_error();
    const int rc = SSL_accept(c->ssl);
    if (rc != 1) {
      const int e = SSL_get_error(c->ssl, rc);
      if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        c->want = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
        return true;
      }
      Closed("tls_handshake");  // not TLS, a protocol the context refuses, no client certificate
      return false;
    }
    c->handshaken = true;
  }
  c->want = POLLIN;
  char buf[16384];
  for (;;) {
    size_t n = 0;
    if (c->ssl != nullptr) {
      ERR_clear_error();
      const int rc = SSL_read(c->ssl, buf, sizeof(buf));
      if (rc <= 0) {
        const int e = SSL_get_error(c->ssl, rc);
        if (e == SSL_ERROR_WANT_READ) return true;
        if (e == SSL_ERROR_WANT_WRITE) {
          c->want = POLLOUT;
          return true;
        }
        return false;
      }
      n = static_cast<size_t>(rc);
    } else {
      const ssize_t rc = ::recv(c->fd, buf, sizeof(buf), 0);
      if (rc == 0) return false;
      if (rc < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK;
      }
      n = static_cast<size_t>(rc);
    }
    const size_t from = c->in.size() < c->taken + 3 ? c->taken : c->in.size() - 3;
    c->in.append(buf, n);
    const size_t end = HeadEnd(c->in, from);
    if (end != std::string::npos && end - c->taken <= limits_.max_head_bytes) return true;
    if (c->in.size() - c->taken > limits_.max_head_bytes) {
      SendAndForget(c->fd, c->ssl,
                    "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
                    "Connection: close\r\n\r\n");
      Closed("head_too_large");
      return false;
    }
  }
}

void HttpFront::PollLoop() {
  std::vector<std::unique_ptr<Connection>> idle;  // oldest first
  std::vector<pollfd> fds;
  std::atomic<int>& open = open_;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      for (auto& c : returned_) idle.push_back(std::move(c));
      returned_.clear();
    }
    int64_t now = NowMs(), next = now + 1000;
    fds.assign({{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    for (const auto& c : idle) {
      fds.push_back({c->fd, c->want, 0});
      next = std::min(next, c->deadline_ms);
    }
    if (events_.connections) events_.connections(open.load());
    const int n =
        ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, next - now)));
    if (n < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) {
      char drain[64];
      while (::read(wake_[0], drain, sizeof(drain)) > 0) {
      }
    }
    now = NowMs();
    std::vector<std::unique_ptr<Connection>> complete;
    for (size_t i = idle.size(); i-- > 0;) {
      Connection* c = idle[i].get();
      const short ev = fds[i + 2].revents;
      bool keep = (ev & (POLLERR | POLLNVAL)) == 0;
      if (keep && ev != 0) keep = ReadHead(c);
      if (keep && HeadEnd(c->in, c->taken) != std::string::npos) {
        complete.push_back(std::move(idle[i]));
        idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (keep && now >= c->deadline_ms) {
        // A request begun but not finished in time is told so; an idle one just closes.
        if (c->in.size() > c->taken) {
          SendAndForget(c->fd, c->ssl,
                        "HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                        "Connection: close\r\n\r\n");
        }
        Closed("head_timeout");
        keep = false;
      }
      if (!keep) idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (!complete.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      // `complete` was filled newest first.
      for (auto it = complete.rbegin(); it != complete.rend(); ++it)
        ready_.push_back(std::move(*it));
      ready_cv_.notify_all();
    }
    if (fds[1].revents & POLLIN) {
      for (;;) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // EAGAIN, or out of descriptors: retried on the next poll
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // one event per token
        ssl_st* ssl = nullptr;
        if (tls_ != nullptr) {
          ssl = SSL_new(tls_);
          if (ssl == nullptr || SSL_set_fd(ssl, fd) != 1) {
            if (ssl != nullptr) SSL_free(ssl);
            ::close(fd);
            continue;
          }
          SSL_set_accept_state(ssl);
          SSL_set_mode(ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
        }
        open.fetch_add(1);
        auto c = std::make_unique<Connection>(fd, ssl, &open);
        c->deadline_ms = now + limits_.head_timeout_ms;
        if (open.load() > limits_.max_connections) {
          Closed("cap");
          if (idle.empty()) continue;  // every connection has a request in hand: refuse this one
          idle.erase(idle.begin());    // the oldest idle one makes room
        }
        idle.push_back(std::move(c));
      }
    }
  }
  ::close(listen_fd_);
  listen_fd_ = -1;
  idle.clear();
}

void HttpFront::WorkerLoop() {
  for (;;) {
    std::unique_ptr<Connection> c;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_cv_.wait(lock, [this] { return !ready_.empty() || stopping_; });
      if (ready_.empty()) return;  // stopping, and every complete request was served
      c = std::move(ready_.front());
      ready_.pop_front();
      ++busy_;
    }
    Serve(std::move(c));
    {
      std::lock_guard<std::mutex> lock(mu_);
      --busy_;
    }
    idle_cv_.notify_all();
  }
}

void HttpFront::Serve(std::unique_ptr<Connection> c) {
  for (;;) {
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = stopping_ || ++c->served >= limits_.max_requests_per_connection;
    }
    Stream stream(c.get(), NowMs() + limits_.body_timeout_ms, limits_.write_timeout_ms);
    bool closed = false;
    t_current_socket = c->fd;
    const bool ok = http_->process_request(stream, last, closed, [](httplib::Request&) {});
    t_current_socket = -1;
    if (!ok || closed || last || stream.broken()) return;  // closes it
    c->in.erase(0, c->taken);
    c->taken = 0;
    c->deadline_ms = NowMs() + limits_.head_timeout_ms;
    // A client on a kept-alive connection usually sends its next request at once: waiting a
    // little for it here saves the hand-offs to the poller and back to a worker, two thread
    // wake-ups that cost ~20 ms of TTFT at 8 streams on a busy 2-core host. Only what has
    // arrived is read; a head still incomplete goes to the poller like an idle connection.
    if (HeadEnd(c->in, 0) == std::string::npos &&
        ((c->ssl != nullptr && SSL_pending(c->ssl) > 0) ||
         WaitFor(c->fd, POLLIN, NowMs() + limits_.linger_ms))) {
      if (!ReadHead(c.get())) return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    if (HeadEnd(c->in, 0) != std::string::npos) continue;  // serve the next one here
    returned_.push_back(std::move(c));
    Wake();
    return;
  }
}

}  // namespace llava::server
