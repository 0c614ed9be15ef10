#include "server/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>

namespace llava::server {
namespace {

Status Readable(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  std::string first;
  if (!in || !std::getline(in, first)) return NotFound(flag + " " + path + ": cannot read");
  if (first.rfind("-----BEGIN ", 0) != 0) return InvalidArgument(flag + " " + path + ": not PEM");
  return Status::Ok();
}

// --tls-cert and --tls-key (both set) and --tls-client-ca (if set) are readable PEM files.
Status CheckTlsFiles(const TlsFiles& f) {
  if (f.cert.empty() || f.key.empty()) {
    return InvalidArgument("--tls-cert and --tls-key go together");
  }
  LLAVA_RETURN_IF_ERROR(Readable(f.cert, "--tls-cert"));
  LLAVA_RETURN_IF_ERROR(Readable(f.key, "--tls-key"));
  if (!f.client_ca.empty()) LLAVA_RETURN_IF_ERROR(Readable(f.client_ca, "--tls-client-ca"));
  return Status::Ok();
}

}  // namespace

StatusOr<int64_t> CertificateSecondsLeft(const std::string& cert_file) {
  X509* cert = nullptr;
  if (BIO* in = BIO_new_file(cert_file.c_str(), "r")) {
    cert = PEM_read_bio_X509(in, nullptr, nullptr, nullptr);
    BIO_free(in);
  }
  ERR_clear_error();
  if (cert == nullptr) return InvalidArgument("--tls-cert " + cert_file + ": no certificate");
  int days = 0, seconds = 0;
  const bool ok = ASN1_TIME_diff(&days, &seconds, nullptr, X509_get0_notAfter(cert)) == 1;
  X509_free(cert);
  if (!ok) return InvalidArgument("--tls-cert " + cert_file + ": unreadable expiry date");
  return int64_t{days} * 86400 + seconds;
}

StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(const TlsFiles& f) {
  if (f.cert.empty() && f.key.empty()) {
    if (!f.client_ca.empty())
      return InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key");
    return grpc::InsecureServerCredentials();
  }
  LLAVA_RETURN_IF_ERROR(CheckTlsFiles(f));
  auto provider = f.client_ca.empty()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            f.key, f.cert, f.reload_seconds)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            f.key, f.cert, f.client_ca, f.reload_seconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!f.client_ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

// A certificate chain and its key, as OpenSSL objects.
struct HttpsContext::Identity {
  X509* cert = nullptr;
  STACK_OF(X509) * chain = nullptr;  // the certificates after the first in --tls-cert
  EVP_PKEY* key = nullptr;
  ~Identity() {
    X509_free(cert);
    sk_X509_pop_free(chain, X509_free);
    EVP_PKEY_free(key);
  }
};

namespace {

// The files' sizes and modification times: a change of either file changes it.
std::string FileStamp(const TlsFiles& f) {
  std::string stamp;
  for (const std::string* path : {&f.cert, &f.key}) {
    struct stat st {};
    if (::stat(path->c_str(), &st) != 0) return "";
    stamp += std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
             std::to_string(st.st_mtim.tv_nsec) + ";";
  }
  return stamp;
}

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

HttpsContext::HttpsContext(TlsFiles files) : files_(std::move(files)) {}
HttpsContext::~HttpsContext() = default;

StatusOr<std::unique_ptr<HttpsContext>> HttpsContext::Create(const TlsFiles& f) {
  LLAVA_RETURN_IF_ERROR(CheckTlsFiles(f));
  std::unique_ptr<HttpsContext> context(new HttpsContext(f));
  std::lock_guard<std::mutex> lock(context->mu_);
  if (!context->ReloadLocked(/*force=*/true)) {
    return InvalidArgument("--tls-cert " + f.cert + " and --tls-key " + f.key +
                           ": not a certificate and its private key");
  }
  return context;
}

bool HttpsContext::ReloadLocked(bool force) {
  checked_ns_ = SteadyNanos();
  const std::string stamp = FileStamp(files_);
  if (stamp.empty() || (!force && stamp == stamp_)) return identity_ != nullptr;
  auto next = std::make_unique<Identity>();
  if (BIO* in = BIO_new_file(files_.cert.c_str(), "r")) {
    next->cert = PEM_read_bio_X509(in, nullptr, nullptr, nullptr);
    next->chain = sk_X509_new_null();
    while (X509* extra = PEM_read_bio_X509(in, nullptr, nullptr, nullptr))
      sk_X509_push(next->chain, extra);
    BIO_free(in);
  }
  if (BIO* in = BIO_new_file(files_.key.c_str(), "r")) {
    next->key = PEM_read_bio_PrivateKey(in, nullptr, nullptr, nullptr);
    BIO_free(in);
  }
  ERR_clear_error();  // the chain loop ends on an error by design
  // A half-written renewal (new certificate, old key) fails the match and waits for the next look.
  if (next->cert == nullptr || next->key == nullptr ||
      X509_check_private_key(next->cert, next->key) != 1) {
    ERR_clear_error();
    return identity_ != nullptr;
  }
  identity_ = std::move(next);
  stamp_ = stamp;
  return true;
}

bool HttpsContext::Reload() {
  std::lock_guard<std::mutex> lock(mu_);
  const Identity* before = identity_.get();
  return ReloadLocked(/*force=*/true) && identity_.get() != before;
}

int HttpsContext::SelectCertificate(::ssl_st* ssl, void* self) {
  auto* context = static_cast<HttpsContext*>(self);
  std::lock_guard<std::mutex> lock(context->mu_);
  const int64_t period = int64_t{context->files_.reload_seconds} * 1000000000;
  if (SteadyNanos() - context->checked_ns_ >= period) context->ReloadLocked(/*force=*/false);
  const Identity* id = context->identity_.get();
  if (id == nullptr) return 0;
  // Takes its own references: a reload may free `id` while this connection still uses them.
  return SSL_use_cert_and_key(ssl, id->cert, id->key, id->chain, /*override=*/1) == 1 ? 1 : 0;
}

bool HttpsContext::Configure(::ssl_ctx_st& ctx) {
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_cert_cb(&ctx, &HttpsContext::SelectCertificate, this);
  if (!files_.client_ca.empty()) {
    if (SSL_CTX_load_verify_locations(&ctx, files_.client_ca.c_str(), nullptr) != 1) return false;
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files_.client_ca.c_str());
    if (names == nullptr) return false;
    SSL_CTX_set_client_CA_list(&ctx, names);
    SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return true;
}

}  // namespace llava::server
