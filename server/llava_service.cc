#include "server/llava_service.h"

#include <google/protobuf/stubs/common.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/proto_buffer_writer.h>
#if GOOGLE_PROTOBUF_VERSION < 4022000
#include <google/protobuf/stubs/logging.h>
#endif

#include <deque>
#include <mutex>

#include "engine/kernels/cpu_features.h"
#include "server/tsan.h"

namespace llava::server {
namespace {

constexpr char kUnauthenticated[] =
    "this server needs a bearer token: metadata \"authorization: Bearer <token>\"";

// The request's bytes as `message` (convert.h, ParseRequest). Protobuf reads the buffer's slices
// in place; only a request that fails is copied into one piece to say why.
Status ParseBuffer(const grpc::ByteBuffer& buffer, google::protobuf::Message* message) {
  grpc::ByteBuffer reading(buffer);  // shares the slices
  grpc::ProtoBufferReader reader(&reading);
#if GOOGLE_PROTOBUF_VERSION < 4022000
  google::protobuf::LogSilencer quiet;  // no log line per bad string (convert.cc, ParseRequest)
#endif
  if (message->ParseFromZeroCopyStream(&reader)) return Status();
  grpc::Slice whole;
  if (!buffer.DumpToSingleSlice(&whole).ok()) return InvalidArgument("unreadable request");
  return WhyUnparsable(std::string_view(reinterpret_cast<const char*>(whole.begin()), whole.size()),
                       *message->GetDescriptor());
}

// `message` written into `buffer` for the reply.
void Serialize(const google::protobuf::Message& message, grpc::ByteBuffer* buffer) {
  bool own_buffer = false;
  buffer->Clear();  // the writer wants an empty buffer (the stream reuses one)
  grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, buffer, &own_buffer);
}

// Converts the call's deadline (system clock) for the engine (steady clock).
std::optional<std::chrono::steady_clock::time_point> EngineDeadline(
    grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return std::nullopt;
  const auto left = deadline - std::chrono::system_clock::now();
  if (left > std::chrono::hours(24 * 365)) return std::nullopt;
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
}

// gRPC cancels a call whose deadline passes; the engine then ends it as "cancelled" unless it
// noticed the deadline first. Either way the outcome is DEADLINE_EXCEEDED (log, metrics, status).
// gRPC's timer may run the cancellation a little before the deadline as the system clock reads
// it (seen in CI), hence the tolerance; a client cancelling that close to its own deadline is
// counted as expired.
bool DeadlinePassed(grpc::CallbackServerContext* context) {
  return context->deadline() <= std::chrono::system_clock::now() + std::chrono::milliseconds(100);
}
StatusOr<GenerationResult> Outcome(const StatusOr<GenerationResult>& result, bool deadline_passed) {
  if (result.ok() && result->finish == FinishReason::kCancelled && deadline_passed) {
    return DeadlineExceeded("the deadline passed");
  }
  return result;
}

// Unary Chat: collects the answer, finishes the call when the engine is done.
class ChatReactor final : public grpc::ServerUnaryReactor {
 public:
  ChatReactor(LlavaServiceImpl* service, grpc::CallbackServerContext* context,
              const grpc::ByteBuffer* request, grpc::ByteBuffer* response)
      : service_(service), context_(context) {
    observer_ = std::make_shared<Observer>(this, response);
    uint64_t id = 0;
    grpc::Status s = service->Start(context, *request, observer_, &id, &observer_->log);
    if (!s.ok()) {
      LLAVA_HANDED_TO_GRPC(this);
      Finish(s);
      return;
    }
    engine_id_ = id;
    started_ = true;
    LLAVA_HANDED_TO_GRPC(this);  // gRPC's threads call OnCancel and OnDone once this returns
  }
  void OnCancel() override {
    LLAVA_CALLED_BY_GRPC(this);
    observer_->deadline_passed = DeadlinePassed(context_);
    if (started_) service_->gate()->Cancel(engine_id_);
  }
  void OnDone() override {
    LLAVA_CALLED_BY_GRPC(this);
    delete this;
  }

 private:
  struct Observer : RequestObserver {
    Observer(ChatReactor* r, grpc::ByteBuffer* resp) : reactor(r), response(resp) {
      metrics = r->service_->metrics();
    }
    void OnAdmitted(double q) override { queue_seconds = q; }
    void OnText(const std::string& delta) override {
      text += delta;
      gaps.Tick(metrics);
    }
    void OnFinished(const StatusOr<GenerationResult>& engine_result) override {
      const StatusOr<GenerationResult> result = Outcome(engine_result, deadline_passed);
      LogRequest(log, result, queue_seconds);
      if (metrics) metrics->RecordFinished(result, queue_seconds, log.policy, log.api);
      if (!result.ok()) {
        LLAVA_HANDED_TO_GRPC(reactor);
        reactor->Finish(ToGrpcStatus(result.status()));  // the reactor may be gone after this
        return;
      }
      v1::ChatResponse reply;
      reply.set_request_id(log.id);
      reply.set_text(text);
      reply.set_finish_reason(ToProto(result->finish));
      FillUsage(*result, queue_seconds, reply.mutable_usage());
      Serialize(reply, response);
      LLAVA_HANDED_TO_GRPC(reactor);
      reactor->Finish(grpc::Status::OK);
    }
    ChatReactor* reactor;
    grpc::ByteBuffer* response;
    std::atomic<bool> deadline_passed{false};
    ServingMetrics* metrics;
    InterTokenClock gaps;
    std::string text;
    RequestLog log;
    double queue_seconds = 0;
  };

  LlavaServiceImpl* service_;
  grpc::CallbackServerContext* context_;
  std::shared_ptr<Observer> observer_;
  uint64_t engine_id_ = 0;
  bool started_ = false;
};

// Streaming Chat: one write in flight at a time; text produced meanwhile is queued.
class ChatStreamReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  ChatStreamReactor(LlavaServiceImpl* service, grpc::CallbackServerContext* context,
                    const grpc::ByteBuffer* request)
      : service_(service), context_(context) {
    observer_ = std::make_shared<Observer>(this);
    uint64_t id = 0;
    grpc::Status s = service->Start(context, *request, observer_, &id, &observer_->log);
    if (!s.ok()) {
      LLAVA_HANDED_TO_GRPC(this);
      Finish(s);
      return;
    }
    engine_id_ = id;
    started_ = true;
    LLAVA_HANDED_TO_GRPC(this);  // gRPC's threads call OnCancel and OnDone once this returns
  }
  void OnWriteDone(bool ok) override {
    LLAVA_CALLED_BY_GRPC(this);
    std::unique_lock<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) broken_ = true;  // the client went away; OnCancel cancels the engine request
    Pump(std::move(lock));
  }
  void OnCancel() override {
    LLAVA_CALLED_BY_GRPC(this);
    observer_->deadline_passed = DeadlinePassed(context_);
    if (started_) service_->gate()->Cancel(engine_id_);
  }
  void OnDone() override {
    LLAVA_CALLED_BY_GRPC(this);
    delete this;
  }

 private:
  struct Observer : RequestObserver {
    explicit Observer(ChatStreamReactor* r) : reactor(r), metrics(r->service_->metrics()) {}
    void OnAdmitted(double q) override { queue_seconds = q; }
    void OnText(const std::string& delta) override {
      gaps.Tick(metrics);
      v1::ChatChunk chunk;
      chunk.set_request_id(log.id);
      chunk.set_text_delta(delta);
      reactor->Enqueue(std::move(chunk), std::nullopt);
    }
    void OnFinished(const StatusOr<GenerationResult>& engine_result) override {
      const StatusOr<GenerationResult> result = Outcome(engine_result, deadline_passed);
      LogRequest(log, result, queue_seconds);
      if (metrics) metrics->RecordFinished(result, queue_seconds, log.policy, log.api);
      if (!result.ok()) {
        reactor->Enqueue(std::nullopt, ToGrpcStatus(result.status()));
        return;
      }
      v1::ChatChunk last;
      last.set_request_id(log.id);
      last.set_finish_reason(ToProto(result->finish));
      FillUsage(*result, queue_seconds, last.mutable_usage());
      reactor->Enqueue(std::move(last), grpc::Status::OK);
    }
    ChatStreamReactor* reactor;
    ServingMetrics* metrics;
    std::atomic<bool> deadline_passed{false};
    InterTokenClock gaps;
    RequestLog log;
    double queue_seconds = 0;
  };

  // Queues a chunk and/or the final status (engine thread). Text that arrives while earlier
  // text still waits for its write joins that chunk: a client that reads slower than the
  // engine produces (or a busy machine) gets fewer, longer deltas instead of a backlog of
  // one-token messages, each costing a write on both ends.
  void Enqueue(std::optional<v1::ChatChunk> chunk, std::optional<grpc::Status> final_status) {
    std::unique_lock<std::mutex> lock(mu_);
    if (chunk && !queue_.empty() && IsTextOnly(queue_.back()) && IsTextOnly(*chunk)) {
      queue_.back().mutable_text_delta()->append(chunk->text_delta());
    } else if (chunk) {
      queue_.push_back(std::move(*chunk));
    }
    if (final_status) final_status_ = std::move(final_status);
    Pump(std::move(lock));
  }
  static bool IsTextOnly(const v1::ChatChunk& c) {
    return c.finish_reason() == v1::FINISH_REASON_UNSPECIFIED && !c.has_usage();
  }
  // Starts the next write, or finishes once everything is written. StartWrite and Finish run
  // after the lock is released: a reaction may run inline, and OnDone (which deletes this
  // reactor) may run as soon as Finish returns.
  void Pump(std::unique_lock<std::mutex> lock) {
    if (writing_ || finished_) return;
    if (!queue_.empty() && !broken_) {
      const v1::ChatChunk next = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;  // only this thread touches current_ until OnWriteDone
      lock.unlock();
      Serialize(next, &current_);  // outside the lock the engine thread takes for every token
      LLAVA_HANDED_TO_GRPC(this);
      StartWrite(&current_);
      return;
    }
    if (!final_status_) return;
    finished_ = true;
    const grpc::Status status =
        broken_ && final_status_->ok() ? grpc::Status::CANCELLED : *final_status_;
    lock.unlock();
    LLAVA_HANDED_TO_GRPC(this);
    Finish(status);
  }

  LlavaServiceImpl* service_;
  grpc::CallbackServerContext* context_;
  std::shared_ptr<Observer> observer_;
  uint64_t engine_id_ = 0;
  bool started_ = false;
  std::mutex mu_;
  std::deque<v1::ChatChunk> queue_;           // guarded by mu_
  grpc::ByteBuffer current_;                  // the write in flight (owned while writing_)
  std::optional<grpc::Status> final_status_;  // guarded by mu_
  bool writing_ = false, broken_ = false, finished_ = false;  // guarded by mu_
};

}  // namespace

LlavaServiceImpl::LlavaServiceImpl(RequestGate* gate, ServiceConfig config)
    : gate_(gate), config_(std::move(config)) {}

std::optional<std::string> LlavaServiceImpl::Authenticate(grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  const auto it = metadata.find("authorization");
  const std::string_view value = it == metadata.end()
                                     ? std::string_view()
                                     : std::string_view(it->second.data(), it->second.size());
  return gate_->Authenticate(value, "grpc");
}

grpc::Status LlavaServiceImpl::Start(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer& raw,
                                     std::shared_ptr<RequestObserver> observer, uint64_t* engine_id,
                                     RequestLog* log) {
  std::optional<std::string> client = Authenticate(context);
  if (!client) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kUnauthenticated);
  log->client = *client;
  v1::ChatRequest request;
  if (Status parsed = ParseBuffer(raw, &request); !parsed.ok()) {
    gate_->Refused(parsed, "grpc");
    return ToGrpcStatus(parsed);
  }
  StatusOr<GenerationRequest> converted = ToGenerationRequest(request, config_.defaults);
  if (!converted.ok()) {
    gate_->Refused(converted.status(), "grpc");
    return ToGrpcStatus(converted.status());
  }
  return ToGrpcStatus(gate_->Submit(*converted, request.request_id(), "grpc",
                                    EngineDeadline(context), std::move(observer), engine_id, log));
}

grpc::ServerUnaryReactor* LlavaServiceImpl::Chat(grpc::CallbackServerContext* context,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  return new ChatReactor(this, context, request, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LlavaServiceImpl::ChatStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new ChatStreamReactor(this, context, request);
}

grpc::ServerUnaryReactor* LlavaServiceImpl::GetModelInfo(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  auto* reactor = context->DefaultReactor();
  if (!Authenticate(context)) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kUnauthenticated));
    return reactor;
  }
  v1::GetModelInfoRequest parsed;
  if (Status s = ParseBuffer(*request, &parsed); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  v1::ModelInfo info;
  const ModelFacts& m = config_.model;
  info.set_model_path(m.model_path);
  info.set_vocab_size(m.vocab_size);
  info.set_context_length(m.context_length);
  info.set_image_size(m.image_size);
  info.set_image_tokens(m.image_tokens);
  info.set_num_layers(m.num_layers);
  info.set_kv_bytes_per_token(m.kv_bytes_per_token);
  info.set_kv_cache_budget_bytes(config_.kv_cache_bytes);
  info.set_default_policy(ToProto(config_.defaults.kv.policy));
  info.set_default_budget(config_.defaults.kv.budget);
  info.set_max_tokens_limit(config_.max_tokens_limit);
  info.set_dtype(m.dtype);
  info.set_cpu_path(m.cpu_path);
  info.set_max_batch(config_.max_batch);
  Serialize(info, response);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

class TokenGuard final : public grpc::experimental::Interceptor {
 public:
  TokenGuard(grpc::experimental::ServerRpcInfo* info, RequestGate* gate)
      : info_(info), gate_(gate) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      std::string authorization;
      if (const auto* metadata = methods->GetRecvInitialMetadata()) {
        const auto it = metadata->find("authorization");
        if (it != metadata->end()) authorization.assign(it->second.data(), it->second.size());
      }
      if (!gate_->Authenticate(authorization, "grpc")) info_->server_context()->TryCancel();
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  RequestGate* const gate_;
};

class ReflectionGuards final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReflectionGuards(RequestGate* gate) : gate_(gate) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const std::string_view method = info->method() != nullptr ? info->method() : "";
    if (method.rfind("/grpc.reflection.", 0) != 0) return nullptr;
    return new TokenGuard(info, gate_);
  }

 private:
  RequestGate* const gate_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> ReflectionNeedsToken(
    RequestGate* gate) {
  return std::make_unique<ReflectionGuards>(gate);
}

}  // namespace llava::server
