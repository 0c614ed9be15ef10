// TLS for the gRPC port: the server's certificate and key, optionally a CA whose clients must
// present certificates (mutual TLS). The files are watched (gRPC's FileWatcherCertificateProvider)
// and re-read every `reload_seconds`, so a renewed certificate (cert-manager rewrites the Secret's
// files) is served to new connections without a restart; running streams keep theirs.
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "engine/io/status.h"

namespace llava::server {

struct TlsFiles {
  std::string cert, key;  // PEM; both or neither
  std::string client_ca;  // PEM; set: clients must present a certificate it signed
  unsigned reload_seconds = 60;
};

// Insecure credentials when no file is given; an error naming the flag when the files are
// incomplete or unreadable.
StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(const TlsFiles& files);

}  // namespace llava::server
