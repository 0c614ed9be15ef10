// The clients' gRPC channel: requests spread round-robin over every address the target
// resolves to. A Kubernetes ClusterIP Service balances connections, not requests, so a client
// that opens one channel reaches one pod; with the headless Service's name
// ("dns:///llava-server-headless.llava:50051") or an address list ("ipv4:10.0.0.1:50051,
// 10.0.0.2:50051") each request goes to the next server.
#pragma once

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <memory>
#include <optional>
#include <string>

namespace llava::client {

inline std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetLoadBalancingPolicyName("round_robin");
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
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
