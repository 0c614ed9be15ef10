#include "server/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

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

}  // namespace

StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(const TlsFiles& f) {
  if (f.cert.empty() && f.key.empty()) {
    if (!f.client_ca.empty())
      return InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key");
    return grpc::InsecureServerCredentials();
  }
  if (f.cert.empty() || f.key.empty()) {
    return InvalidArgument("--tls-cert and --tls-key go together");
  }
  LLAVA_RETURN_IF_ERROR(Readable(f.cert, "--tls-cert"));
  LLAVA_RETURN_IF_ERROR(Readable(f.key, "--tls-key"));
  if (!f.client_ca.empty()) LLAVA_RETURN_IF_ERROR(Readable(f.client_ca, "--tls-client-ca"));
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

}  // namespace llava::server
