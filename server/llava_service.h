// The gRPC service: a thin layer that converts requests, submits them to the Engine and
// streams the engine's output back. Each call is a small reactor that finishes itself; all
// generation state lives in the engine.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <memory>
#include <string>

#include "engine/serving/engine.h"
#include "llava/v1/llava.grpc.pb.h"
#include "server/convert.h"
#include "server/metrics.h"
#include "server/request_gate.h"

namespace llava::server {

// Facts about the served model for GetModelInfo.
struct ModelFacts {
  std::string model_path, dtype = "bf16";
  std::string cpu_path;  // CpuPathName of the kernels in use; empty on a GPU
  int vocab_size = 0, context_length = 0, image_size = 0, image_tokens = 0, num_layers = 0;
  int64_t kv_bytes_per_token = 0;
};

struct ServiceConfig {
  RequestDefaults defaults;
  ModelFacts model;
  int max_tokens_limit = 4096;
  int max_batch = 0;  // the engine's, after --max-batch auto
  int64_t kv_cache_bytes = 0;
};

// The methods take and give raw bytes and (de)serialize the messages themselves: gRPC's
// callback API answers a request that protobuf cannot parse (a string field that is not UTF-8,
// garbage bytes) UNIMPLEMENTED with an empty message; here it is INVALID_ARGUMENT naming the
// field (convert.h, ParseRequest).
using RawLlavaService =
    v1::LlavaService::WithRawCallbackMethod_Chat<v1::LlavaService::WithRawCallbackMethod_ChatStream<
        v1::LlavaService::WithRawCallbackMethod_GetModelInfo<v1::LlavaService::Service>>>;

class LlavaServiceImpl final : public RawLlavaService {
 public:
  // Borrows `gate`, which must outlive the service.
  LlavaServiceImpl(RequestGate* gate, ServiceConfig config);

  // A ChatRequest -> a ChatResponse.
  grpc::ServerUnaryReactor* Chat(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  // A ChatRequest -> ChatChunks.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ChatStream(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request) override;
  // A GetModelInfoRequest -> a ModelInfo.
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

  // Authenticates, parses, converts and submits through the gate (request_gate.h); on error
  // nothing was submitted. Thread-safe.
  grpc::Status Start(grpc::CallbackServerContext* context, const grpc::ByteBuffer& request,
                     std::shared_ptr<RequestObserver> observer, uint64_t* engine_id,
                     RequestLog* log);
  // The client's token name, or nullopt (UNAUTHENTICATED) when a needed token is missing or
  // unknown.
  std::optional<std::string> Authenticate(grpc::CallbackServerContext* context);

  RequestGate* gate() { return gate_; }
  ServingMetrics* metrics() { return gate_->metrics(); }

 private:
  RequestGate* gate_;
  ServiceConfig config_;
};

// With bearer tokens on, the gRPC server's reflection service (grpc.reflection.*) needs one too:
// a call without a known token is cancelled as it opens, before the service reads a message
// (the service is gRPC's own, so the check is an interceptor: the client sees CANCELLED; the
// refusal is logged and counted as UNAUTHENTICATED like the others).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> ReflectionNeedsToken(
    RequestGate* gate);

}  // namespace llava::server
