// TLS for the gRPC port and the HTTP API port: the server's certificate and key, optionally a CA
// whose clients must present certificates (mutual TLS). The files are watched (gRPC's
// FileWatcherCertificateProvider; HttpsContext for the HTTP API) and re-read every
// `reload_seconds`, so a renewed certificate (cert-manager rewrites the Secret's files) is served
// to new connections without a restart; running streams keep theirs.
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <mutex>
#include <string>

#include "engine/io/status.h"

// OpenSSL's SSL_CTX and SSL.
struct ssl_ctx_st;
struct ssl_st;

namespace llava::server {

struct TlsFiles {
  std::string cert, key;  // PEM; both or neither
  std::string client_ca;  // PEM; set: clients must present a certificate it signed
  unsigned reload_seconds = 60;
};

// Seconds until the first certificate in `cert_file` (PEM) expires; negative once it has.
StatusOr<int64_t> CertificateSecondsLeft(const std::string& cert_file);

// Insecure credentials when no file is given; an error naming the flag when the files are
// incomplete or unreadable.
StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(const TlsFiles& files);

// The HTTP API's side (OpenSSL, under Asio's TLS stream): Configure sets up the server's
// SSL_CTX with a certificate callback that serves the current pair, re-reading the files when
// they changed, at most every reload_seconds; a pair that does not load or whose key does not
// match the certificate is ignored and the previous one kept (gRPC's watcher does the same).
// The client CA is read once, at start. TLS 1.2 or later. Must outlive the server using it.
class HttpsContext {
 public:
  // Checks and loads the files now; errors name the flag.
  static StatusOr<std::unique_ptr<HttpsContext>> Create(const TlsFiles& files);
  ~HttpsContext();
  // Sets up `ctx` (SSL_CTX is OpenSSL's ssl_ctx_st) for HttpServer.
  bool Configure(::ssl_ctx_st& ctx);
  // Re-reads the pair now (SIGHUP); false if it does not load, and then the previous one stays.
  bool Reload();

 private:
  struct Identity;
  explicit HttpsContext(TlsFiles files);
  // The current pair for a handshake (SSL_CTX_set_cert_cb's callback).
  static int SelectCertificate(::ssl_st* ssl, void* self);
  bool ReloadLocked(bool force);

  TlsFiles files_;
  std::mutex mu_;
  std::unique_ptr<Identity> identity_;  // guarded by mu_
  int64_t checked_ns_ = 0;              // steady clock of the last look at the files; mu_
  std::string stamp_;                   // the files' sizes and mtimes at the last load; mu_
};

}  // namespace llava::server
