// The clients' gRPC channel: requests spread round-robin over every address the target
// resolves to. A Kubernetes ClusterIP Service balances connections, not requests, so a client
// that opens one channel reaches one pod; with the headless Service's name
// ("dns:///llava-server-headless.llava:50051") or an address list ("ipv4:10.0.0.1:50051,
// 10.0.0.2:50051") each request goes to the next server.
#pragma once

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>

namespace llava::client {

// TLS settings of a client: all empty = plaintext.
struct TlsOptions {
  std::string ca;           // PEM file of the CA that signed the server's certificate
  std::string cert, key;    // PEM files of the client's own certificate (mutual TLS)
  std::string server_name;  // the name to verify instead of the target's host
};

inline std::string ReadPem(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                                  const TlsOptions& tls = {}) {
  grpc::ChannelArguments args;
  args.SetLoadBalancingPolicyName("round_robin");
  if (tls.ca.empty() && tls.cert.empty()) {
    return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  }
  grpc::SslCredentialsOptions ssl;
  if (!tls.ca.empty()) ssl.pem_root_certs = ReadPem(tls.ca);
  if (!tls.cert.empty()) ssl.pem_cert_chain = ReadPem(tls.cert);
  if (!tls.key.empty()) ssl.pem_private_key = ReadPem(tls.key);
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(ssl), args);
}

// Adds --tls-ca, --tls-cert, --tls-key and --tls-server-name to a client's flags.
template <typename App>
void AddTlsFlags(App* app, TlsOptions* tls) {
  app->add_option("--tls-ca", tls->ca, "PEM CA of the server's certificate (turns TLS on)");
  app->add_option("--tls-cert", tls->cert, "PEM client certificate (mutual TLS)");
  app->add_option("--tls-key", tls->key, "PEM key of --tls-cert");
  app->add_option("--tls-server-name", tls->server_name,
                  "name to verify in the server's certificate instead of the target's host");
}

// The bearer token in `path` (its first word; "" for an empty path), or nullopt if unreadable.
inline std::optional<std::string> ReadToken(const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  std::string token;
  if (!in || !(in >> token)) return std::nullopt;
  return token;
}

// Adds the token to a call's metadata (nothing for an empty token).
inline void Authorize(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

constexpr char kTokenFileHelp[] =
    "file holding the server's bearer token (llava-server --auth-tokens-file)";

constexpr char kTargetHelp[] =
    "gRPC target: host:port, dns:///name:port or ipv4:a:port,b:port (requests spread "
    "round-robin over every address)";

}  // namespace llava::client
