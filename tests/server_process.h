// Runs build/llava-server as a child process on an ephemeral 127.0.0.1 port for end-to-end
// tests; reads the bound port from its log.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace llava::testing {

class ServerProcess {
 public:
  // Starts `binary` with `args` plus ephemeral ports for every listener; waits until it serves.
  ServerProcess(const std::string& binary, std::vector<std::string> args, const std::string& log)
      : log_(log) {
    args.insert(args.begin(), binary);
    args.push_back("--listen");
    args.push_back("127.0.0.1:0");
    args.push_back("--metrics-listen");
    args.push_back("127.0.0.1:0");
    args.push_back("--http-listen");
    args.push_back("127.0.0.1:0");
    std::ofstream(log, std::ios::trunc).close();  // no stale "serving on port" line
    pid_ = fork();
    if (pid_ == 0) {
      FILE* f = freopen(log.c_str(), "w", stdout);
      (void)f;
      dup2(fileno(stdout), fileno(stderr));
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    const std::regex re("serving on port ([0-9]+)"), mre("metrics on port ([0-9]+)");
    while (std::chrono::steady_clock::now() < until && (port_ == 0 || metrics_port_ == 0)) {
      std::smatch m;
      const std::string text = Log();
      if (std::regex_search(text, m, re)) port_ = std::stoi(m[1]);
      if (std::regex_search(text, m, mre)) metrics_port_ = std::stoi(m[1]);
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  // GET `path` from the metrics HTTP port; returns the whole response (headers and body).
  std::string HttpGet(const std::string& path) const {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(metrics_port_));
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    std::string out;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n";
      ::send(fd, req.data(), req.size(), 0);
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return out;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // The OpenAI-compatible API's port, from the log (-1 when it is off).
  int http_port() const {
    std::smatch m;
    const std::string text = Log();
    static const std::regex re("OpenAI-compatible API on port ([0-9]+)");
    return std::regex_search(text, m, re) ? std::stoi(m[1]) : -1;
  }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void Signal(int sig) const {
    if (pid_ > 0) kill(pid_, sig);
  }
  // Sends SIGTERM and waits; returns the exit status (or -1 on timeout / signal death).
  int Terminate(std::chrono::seconds timeout) {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace llava::testing
