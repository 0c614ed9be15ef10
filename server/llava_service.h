// The gRPC service: a thin layer that converts requests, submits them to the Engine and
// streams the engine's output back. Each call is a small reactor that finishes itself; all
// generation state lives in the engine.
#pragma once

#include <atomic>
#include <string>

#include "engine/serving/engine.h"
#include "llava/v1/llava.grpc.pb.h"
#include "server/convert.h"
#include "server/metrics.h"

namespace llava::server {

// Facts about the served model for GetModelInfo.
struct ModelFacts {
  std::string model_path, dtype = "bf16";
  std::string cpu_path;  // CpuPathName of the kernels in use; empty on a GPU
  int vocab_size = 0, context_length = 0, image_size = 0, image_tokens = 0, num_layers = 0;
  int64_t kv_bytes_per_token = 0;
};
ModelFacts FactsOf(const LoadedModel& model, const std::string& path, const std::string& dtype);

// What a call keeps of its request for the log line at the end: the converted request itself
// (image bytes included) is handed to the engine and not kept by the call.
struct RequestLog {
  std::string id;  // the client's request_id, or "req-<engine id>"
  CachePolicy policy = CachePolicy::kFull;
  double budget = 1.0;
};

struct ServiceConfig {
  RequestDefaults defaults;
  ModelFacts model;
  int max_tokens_limit = 4096;
  int64_t kv_cache_bytes = 0;
  ServingMetrics* metrics = nullptr;  // not owned; may be null
};

class LlavaServiceImpl final : public v1::LlavaService::CallbackService {
 public:
  // Borrows `engine`, which must outlive the service.
  LlavaServiceImpl(EngineApi* engine, ServiceConfig config);

  grpc::ServerUnaryReactor* Chat(grpc::CallbackServerContext* context,
                                 const v1::ChatRequest* request,
                                 v1::ChatResponse* response) override;
  grpc::ServerWriteReactor<v1::ChatChunk>* ChatStream(grpc::CallbackServerContext* context,
                                                      const v1::ChatRequest* request) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;

  // Converts and submits; on error nothing was submitted, and the refusal is logged and
  // counted. Fills the engine id and, before the engine can call `observer`, the request's log
  // facts (its id included). Thread-safe.
  Status Start(grpc::CallbackServerContext* context, const v1::ChatRequest& request,
               std::shared_ptr<RequestObserver> observer, uint64_t* engine_id, RequestLog* log);

  EngineApi* engine() { return engine_; }
  ServingMetrics* metrics() { return config_.metrics; }

 private:
  Status Submit(grpc::CallbackServerContext* context, const v1::ChatRequest& request,
                std::shared_ptr<RequestObserver> observer, uint64_t* engine_id, RequestLog* log);

  EngineApi* engine_;
  ServiceConfig config_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace llava::server
