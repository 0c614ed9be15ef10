// The gRPC layer against a scripted fake engine: no model, exact control of what the engine
// says, so conversion, streaming order, usage mapping, status mapping and cancellation are
// checked on their own.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "llava/v1/llava.grpc.pb.h"
#include "server/llava_service.h"

namespace llava::server {
namespace {

using namespace std::chrono_literals;

class ScriptedEngine : public EngineApi {
 public:
  ~ScriptedEngine() override {
    for (auto& t : threads_) t.join();
  }
  Status Submit(uint64_t id, const GenerationRequest& request,
                std::shared_ptr<RequestObserver> observer,
                std::optional<std::chrono::steady_clock::time_point>) override {
    std::lock_guard<std::mutex> l(mu_);
    last_request = request;
    if (!submit_status.ok()) return submit_status;
    // The script as it is now: the test may change it for its next request while this one runs.
    threads_.emplace_back([this, id, observer, deltas = deltas, final_result = final_result,
                           wait_for_cancel = wait_for_cancel] {
      observer->OnAdmitted(0.5);
      for (const auto& d : deltas) observer->OnText(d);
      if (wait_for_cancel) {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return std::count(cancelled.begin(), cancelled.end(), id) > 0; });
        GenerationResult r;
        r.finish = FinishReason::kCancelled;
        l.unlock();
        observer->OnFinished(r);
        return;
      }
      observer->OnFinished(final_result);
    });
    return Status::Ok();
  }
  void Cancel(uint64_t id) override {
    std::lock_guard<std::mutex> l(mu_);
    cancelled.push_back(id);
    cv_.notify_all();
  }
  EngineSnapshot Snapshot() const override { return {}; }
  // Cancel() runs on gRPC's threads: read the list under the lock (ThreadSanitizer found the
  // test reading it unlocked while a cancellation grew it).
  size_t CancelledCount() {
    std::lock_guard<std::mutex> l(mu_);
    return cancelled.size();
  }
  // Submit() runs on gRPC's threads too; the answer reaching the client orders it before the
  // test's read only through gRPC, which TSan cannot see (it is not built with TSan).
  GenerationRequest LastRequest() {
    std::lock_guard<std::mutex> l(mu_);
    return last_request;
  }
  // The script for the next requests, set under the lock for the same reason.
  void SetSubmitStatus(Status s) {
    std::lock_guard<std::mutex> l(mu_);
    submit_status = std::move(s);
  }
  void SetFinalResult(StatusOr<GenerationResult> r) {
    std::lock_guard<std::mutex> l(mu_);
    final_result = std::move(r);
  }
  void SetWaitForCancel(bool wait) {
    std::lock_guard<std::mutex> l(mu_);
    wait_for_cancel = wait;
  }

  Status submit_status;  // the script: guarded by mu_ once requests run
  std::vector<std::string> deltas = {"Hel", "lo", " wor", "ld"};
  StatusOr<GenerationResult> final_result = [] {
    GenerationResult r;
    r.finish = FinishReason::kStop;
    r.prompt_tokens = 7;
    r.image_tokens = 4;
    r.completion_tokens = 3;
    r.kv.bytes_kept = 100;
    r.kv.full_equivalent_bytes = 400;
    r.kv.tokens_merged = 5;
    r.kv.tokens_evicted = 2;
    r.ttft_seconds = 0.25;
    r.total_seconds = 1.5;
    return r;
  }();
  bool wait_for_cancel = false;
  GenerationRequest last_request;   // guarded by mu_
  std::vector<uint64_t> cancelled;  // guarded by mu_

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
};

class FakeEngineServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServiceConfig config;
    config.defaults.max_tokens = 77;
    config.defaults.kv.policy = CachePolicy::kElastic;
    config.defaults.kv.budget = 0.3;
    config.model.image_tokens = 576;
    config.model.context_length = 4096;
    config.model.kv_bytes_per_token = 524288;
    config.kv_cache_bytes = 1 << 30;
    service_ = std::make_unique<LlavaServiceImpl>(&gate_, config);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_GT(port, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::LlavaService::NewStub(channel_);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + 5s); }

  static v1::ChatRequest Request() {
    v1::ChatRequest r;
    r.set_request_id("fake-1");
    auto* m = r.add_messages();
    m->set_role(v1::ROLE_USER);
    m->add_content()->mutable_image()->set_data(std::string("\x89PNG\r\n\x1a\n", 8) +
                                                std::string(16, '\0'));
    m->add_content()->set_text("what is it?");
    r.mutable_sampling()->set_temperature(0.7f);
    return r;
  }

  ScriptedEngine engine_;
  ServingMetrics metrics_;
  RequestGate gate_{&engine_, &metrics_};
  std::unique_ptr<LlavaServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LlavaService::Stub> stub_;

  // Sends `bytes` as the request of a unary `method` ("/llava.v1.LlavaService/Chat").
  grpc::Status RawUnaryCall(const std::string& method, const std::string& bytes) {
    grpc::GenericStub generic(channel_);
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    std::mutex mu;
    std::condition_variable cv;
    std::optional<grpc::Status> status;
    generic.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
      std::lock_guard<std::mutex> l(mu);
      status = s;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return status.has_value(); });
    return *status;
  }
};

TEST_F(FakeEngineServiceTest, StreamsDeltasInOrderThenUsage) {
  grpc::ClientContext ctx;
  auto reader = stub_->ChatStream(&ctx, Request());
  std::vector<v1::ChatChunk> chunks;
  v1::ChatChunk c;
  while (reader->Read(&c)) chunks.push_back(c);
  ASSERT_TRUE(reader->Finish().ok());
  // The engine's deltas are "Hel", "lo", " wor", "ld", all at once: deltas produced while a
  // write is in flight join the next chunk, so there are 1 to 4 text chunks, in order, each
  // made of whole deltas, then the usage chunk.
  ASSERT_GE(chunks.size(), 2u);
  ASSERT_LE(chunks.size(), 5u);
  std::string text;
  const std::set<size_t> delta_ends = {3, 5, 9, 11};
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    EXPECT_FALSE(chunks[i].text_delta().empty());
    text += chunks[i].text_delta();
    EXPECT_TRUE(delta_ends.count(text.size())) << "chunk " << i << " ends inside a delta";
    EXPECT_EQ(chunks[i].request_id(), "fake-1");
    EXPECT_EQ(chunks[i].finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_FALSE(chunks[i].has_usage());
  }
  EXPECT_EQ(text, "Hello world");
  const v1::ChatChunk& last = chunks.back();
  EXPECT_EQ(last.text_delta(), "");
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(last.usage().prompt_tokens(), 7);
  EXPECT_EQ(last.usage().image_tokens(), 4);
  EXPECT_EQ(last.usage().completion_tokens(), 3);
  EXPECT_EQ(last.usage().kv_bytes_used(), 100);
  EXPECT_EQ(last.usage().kv_bytes_full(), 400);
  EXPECT_EQ(last.usage().tokens_merged(), 5);
  EXPECT_EQ(last.usage().tokens_evicted(), 2);
  EXPECT_DOUBLE_EQ(last.usage().time_to_first_token_seconds(), 0.25);
  EXPECT_DOUBLE_EQ(last.usage().queue_seconds(), 0.5);
}

TEST_F(FakeEngineServiceTest, UnaryCollectsTheTextAndConvertsTheRequest) {
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  ASSERT_TRUE(stub_->Chat(&ctx, Request(), &resp).ok());
  EXPECT_EQ(resp.text(), "Hello world");
  EXPECT_EQ(resp.request_id(), "fake-1");
  EXPECT_EQ(resp.usage().completion_tokens(), 3);
  const GenerationRequest g = engine_.LastRequest();
  ASSERT_EQ(g.messages.size(), 1u);
  EXPECT_EQ(g.messages[0].role, "user");
  ASSERT_EQ(g.images.size(), 1u);
  EXPECT_EQ(g.image_fields[0], "messages[0].content[0].image.data");
  EXPECT_EQ(g.sampling.max_tokens, 77);  // the server default
  EXPECT_FLOAT_EQ(g.sampling.temperature, 0.7f);
  EXPECT_EQ(g.kv_cache.policy, CachePolicy::kElastic);
  EXPECT_DOUBLE_EQ(g.kv_cache.budget, 0.3);
  EXPECT_EQ(g.kv_cache.elastic_variant, ElasticVariant::kProduct);  // the server default
  EXPECT_EQ(g.kv_cache.elastic.importance, ImportanceMode::kHybrid);
  EXPECT_FALSE(g.kv_cache.elastic.protect_instruction);
}

// LOOK-M is an Elastic variant over gRPC; H2O's options pick the Elastic Cache paper's H2O.
TEST_F(FakeEngineServiceTest, LookMAndTheH2OOptionsReachTheEngine) {
  v1::ChatRequest req = Request();
  auto* kv = req.mutable_kv_cache();
  kv->set_policy(v1::CACHE_POLICY_ELASTIC);
  kv->mutable_elastic()->set_variant(v1::ELASTIC_VARIANT_LOOK_M);
  v1::ChatResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Chat(&ctx, req, &resp).ok());
  CacheParams p = engine_.LastRequest().kv_cache;
  EXPECT_EQ(p.elastic_variant, ElasticVariant::kLookM);
  EXPECT_TRUE(p.elastic.text_prior);
  EXPECT_EQ(p.elastic.merge_scope, MergeScope::kKey);
  EXPECT_EQ(p.elastic.key_merge, KeyMerge::kAveraged);
  kv->mutable_elastic()->set_key_merge(v1::KEY_MERGE_PIVOTAL);
  grpc::ClientContext pivotal_ctx;
  ASSERT_TRUE(stub_->Chat(&pivotal_ctx, req, &resp).ok());
  EXPECT_EQ(engine_.LastRequest().kv_cache.elastic.key_merge, KeyMerge::kPivotal);
  kv->mutable_elastic()->set_key_merge(static_cast<v1::KeyMerge>(9));
  grpc::ClientContext bad_ctx;
  const grpc::Status bad = stub_->Chat(&bad_ctx, req, &resp);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("kv_cache.elastic.key_merge"), std::string::npos)
      << bad.error_message();
  kv->mutable_elastic()->set_key_merge(v1::KEY_MERGE_WEIGHTED);
  kv->mutable_elastic()->set_text_prior(false);
  kv->mutable_elastic()->set_variant(v1::ELASTIC_VARIANT_PAPER);
  kv->mutable_elastic()->set_importance(v1::IMPORTANCE_MODE_HYBRID);
  kv->mutable_elastic()->set_merge_scope(v1::MERGE_SCOPE_KEY);
  grpc::ClientContext set_ctx;
  ASSERT_TRUE(stub_->Chat(&set_ctx, req, &resp).ok());
  p = engine_.LastRequest().kv_cache;
  EXPECT_FALSE(p.elastic.text_prior);
  EXPECT_EQ(p.elastic.importance, ImportanceMode::kHybrid);
  EXPECT_EQ(p.elastic.merge_scope, MergeScope::kKey);
  EXPECT_EQ(p.elastic.key_merge, KeyMerge::kWeighted);

  kv->Clear();
  kv->set_policy(v1::CACHE_POLICY_H2O);
  grpc::ClientContext h2o_ctx;
  ASSERT_TRUE(stub_->Chat(&h2o_ctx, req, &resp).ok());
  EXPECT_TRUE(engine_.LastRequest().kv_cache.h2o.recent_window);
  EXPECT_FALSE(engine_.LastRequest().kv_cache.h2o.shared_scores);
  kv->mutable_h2o()->set_recent_window(false);
  kv->mutable_h2o()->set_shared_scores(true);
  grpc::ClientContext paper_ctx;
  ASSERT_TRUE(stub_->Chat(&paper_ctx, req, &resp).ok());
  EXPECT_FALSE(engine_.LastRequest().kv_cache.h2o.recent_window);
  EXPECT_TRUE(engine_.LastRequest().kv_cache.h2o.shared_scores);
}

// SnapKV's window and kernel: the paper's unless set; out of range names the field.
TEST_F(FakeEngineServiceTest, SnapKvOptionsReachTheEngine) {
  v1::ChatRequest req = Request();
  auto* kv = req.mutable_kv_cache();
  kv->set_policy(v1::CACHE_POLICY_SNAPKV);
  v1::ChatResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Chat(&ctx, req, &resp).ok());
  EXPECT_EQ(engine_.LastRequest().kv_cache.policy, CachePolicy::kSnapKV);
  EXPECT_EQ(engine_.LastRequest().kv_cache.snapkv.window, 32);
  EXPECT_EQ(engine_.LastRequest().kv_cache.snapkv.kernel, 7);
  kv->mutable_snapkv()->set_window(64);
  kv->mutable_snapkv()->set_kernel(5);
  grpc::ClientContext set_ctx;
  ASSERT_TRUE(stub_->Chat(&set_ctx, req, &resp).ok());
  EXPECT_EQ(engine_.LastRequest().kv_cache.snapkv.window, 64);
  EXPECT_EQ(engine_.LastRequest().kv_cache.snapkv.kernel, 5);
  kv->mutable_snapkv()->set_kernel(4);
  grpc::ClientContext bad_ctx;
  const grpc::Status bad = stub_->Chat(&bad_ctx, req, &resp);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("kv_cache.snapkv.kernel"), std::string::npos)
      << bad.error_message();
}

// The Elastic options: a preset, then the fields set on top of it.
TEST_F(FakeEngineServiceTest, ElasticOptionsApplyOverTheVariant) {
  v1::ChatRequest req = Request();
  auto* kv = req.mutable_kv_cache();
  kv->set_policy(v1::CACHE_POLICY_ELASTIC);
  kv->set_recent_distance(9);
  kv->mutable_elastic()->set_variant(v1::ELASTIC_VARIANT_PAPER);
  kv->mutable_elastic()->set_importance(v1::IMPORTANCE_MODE_MEAN);
  kv->mutable_elastic()->set_protect_instruction(true);
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  ASSERT_TRUE(stub_->Chat(&ctx, req, &resp).ok());
  const CacheParams p = engine_.LastRequest().kv_cache;
  EXPECT_EQ(p.elastic_variant, ElasticVariant::kPaper);
  EXPECT_EQ(p.elastic.importance, ImportanceMode::kMean);
  EXPECT_TRUE(p.elastic.protect_instruction);
  EXPECT_FALSE(p.elastic.protect_system);                  // the paper's
  EXPECT_TRUE(p.elastic.merge_keys);                       // the paper's
  EXPECT_EQ(p.elastic.merge_scope, MergeScope::kNearest);  // the paper's
  EXPECT_EQ(p.elastic.recent_distance, 9);
  EXPECT_FLOAT_EQ(p.elastic.evict_age_exponent, 0.f);  // the paper's

  kv->mutable_elastic()->set_evict_age_exponent(1.f);
  grpc::ClientContext age_ctx;
  ASSERT_TRUE(stub_->Chat(&age_ctx, req, &resp).ok());
  EXPECT_FLOAT_EQ(engine_.LastRequest().kv_cache.elastic.evict_age_exponent, 1.f);
  kv->mutable_elastic()->set_evict_age_exponent(3.f);
  grpc::ClientContext bad_age_ctx;
  grpc::Status bad_age = stub_->Chat(&bad_age_ctx, req, &resp);
  EXPECT_EQ(bad_age.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad_age.error_message().find("kv_cache.elastic.evict_age_exponent"), std::string::npos)
      << bad_age.error_message();
  kv->mutable_elastic()->clear_evict_age_exponent();

  kv->mutable_elastic()->set_evict_answer_first(4);
  kv->mutable_elastic()->set_decode_merge(true);
  grpc::ClientContext answer_ctx;
  ASSERT_TRUE(stub_->Chat(&answer_ctx, req, &resp).ok());
  EXPECT_EQ(engine_.LastRequest().kv_cache.elastic.evict_answer_first, 4);
  EXPECT_TRUE(engine_.LastRequest().kv_cache.elastic.decode_merge);
  kv->mutable_elastic()->set_evict_answer_first(-2);
  grpc::ClientContext bad_answer_ctx;
  grpc::Status bad_answer = stub_->Chat(&bad_answer_ctx, req, &resp);
  EXPECT_EQ(bad_answer.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad_answer.error_message().find("kv_cache.elastic.evict_answer_first"),
            std::string::npos)
      << bad_answer.error_message();
  kv->mutable_elastic()->clear_evict_answer_first();
  kv->mutable_elastic()->clear_decode_merge();

  kv->mutable_elastic()->set_protect_tail(6);
  grpc::ClientContext tail_ctx;
  ASSERT_TRUE(stub_->Chat(&tail_ctx, req, &resp).ok());
  EXPECT_EQ(engine_.LastRequest().kv_cache.elastic.protect_tail, 6);
  kv->mutable_elastic()->set_protect_tail(5000);
  grpc::ClientContext bad_tail_ctx;
  grpc::Status bad_tail = stub_->Chat(&bad_tail_ctx, req, &resp);
  EXPECT_EQ(bad_tail.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad_tail.error_message().find("kv_cache.elastic.protect_tail"), std::string::npos)
      << bad_tail.error_message();
  kv->mutable_elastic()->clear_protect_tail();

  kv->mutable_elastic()->set_merge_scope(static_cast<v1::MergeScope>(7));
  grpc::ClientContext bad_ctx;
  grpc::Status bad = stub_->Chat(&bad_ctx, req, &resp);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("kv_cache.elastic.merge_scope"), std::string::npos)
      << bad.error_message();
}

TEST_F(FakeEngineServiceTest, EngineStatusesMapToGrpcCodes) {
  engine_.SetSubmitStatus(ResourceExhausted("the request queue is full"));
  grpc::ClientContext c1;
  v1::ChatResponse resp;
  grpc::Status s = stub_->Chat(&c1, Request(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "the request queue is full");

  engine_.SetSubmitStatus(Status::Ok());
  engine_.SetFinalResult(Internal("model failure: out of memory"));
  grpc::ClientContext c2;
  auto reader = stub_->ChatStream(&c2, Request());
  v1::ChatChunk c;
  std::string text;
  while (reader->Read(&c)) text += c.text_delta();
  grpc::Status s2 = reader->Finish();
  EXPECT_EQ(text, "Hello world");  // what was streamed before the failure
  EXPECT_EQ(s2.error_code(), grpc::StatusCode::INTERNAL);
}

TEST_F(FakeEngineServiceTest, ClientCancellationReachesTheEngine) {
  engine_.SetWaitForCancel(true);
  grpc::ClientContext ctx;
  auto reader = stub_->ChatStream(&ctx, Request());
  v1::ChatChunk c;
  ASSERT_TRUE(reader->Read(&c));
  ctx.TryCancel();
  while (reader->Read(&c)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 500 && engine_.CancelledCount() == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(engine_.CancelledCount(), 1u);
}

TEST_F(FakeEngineServiceTest, AnExpiredDeadlineCountsAsDeadlineExceeded) {
  // gRPC cancels the call at its deadline, and the engine ends it as "cancelled": the outcome
  // is still DEADLINE_EXCEEDED, to the client and in the metrics.
  engine_.SetWaitForCancel(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 300ms);
  v1::ChatResponse resp;
  EXPECT_EQ(stub_->Chat(&ctx, Request(), &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  for (int i = 0; i < 500 && engine_.CancelledCount() == 0; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(engine_.CancelledCount(), 1u);
  std::this_thread::sleep_for(100ms);  // the observer's OnFinished runs after Cancel
  const std::string text = metrics_.Serialize();
  EXPECT_NE(text.find("llava_request_status_total{api=\"grpc\",code=\"DEADLINE_EXCEEDED\"} 1"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("code=\"CANCELLED\"} 1"), std::string::npos) << text;
}

TEST_F(FakeEngineServiceTest, RequestIdsCannotForgeLogLines) {
  v1::ChatRequest req = Request();
  req.set_request_id("abc\n[info] request id=forged finish=stop");
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  grpc::Status s = stub_->Chat(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("request_id must be printable ASCII (byte 3 is 10)"),
            std::string::npos)
      << s.error_message();
}

TEST_F(FakeEngineServiceTest, ModelInfoReportsFacts) {
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.image_tokens(), 576);
  EXPECT_EQ(info.context_length(), 4096);
  EXPECT_EQ(info.kv_bytes_per_token(), 524288);
  EXPECT_EQ(info.default_policy(), v1::CACHE_POLICY_ELASTIC);
  EXPECT_DOUBLE_EQ(info.default_budget(), 0.3);
}

// Protobuf's C++ serializer logs invalid UTF-8 in a string field but sends it; so do other
// clients. gRPC's own answer to such a request was UNIMPLEMENTED with an empty message.
TEST_F(FakeEngineServiceTest, TextThatIsNotUtf8IsRefusedNamingTheField) {
  v1::ChatRequest req = Request();
  auto* second = req.add_messages();
  second->set_role(v1::ROLE_USER);
  second->add_content()->set_text("fine");
  second->add_content()->set_text("caf\xc3(");
  const std::string expected = "messages[1].content[1].text is not valid UTF-8";
  {
    grpc::ClientContext ctx;
    v1::ChatResponse resp;
    const grpc::Status s = stub_->Chat(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(), expected);
  }
  {
    grpc::ClientContext ctx;
    auto reader = stub_->ChatStream(&ctx, req);
    v1::ChatChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(), expected);
  }
  // Nothing reached the engine, and the service still serves.
  EXPECT_TRUE(engine_.LastRequest().messages.empty());
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  ASSERT_TRUE(stub_->Chat(&ctx, Request(), &resp).ok());
  EXPECT_EQ(resp.text(), "Hello world");
}

TEST_F(FakeEngineServiceTest, BytesThatAreNoRequestAreRefused) {
  const std::string garbage("\xff\xff\xff\xff\xff", 5);
  grpc::Status s = RawUnaryCall("/llava.v1.LlavaService/Chat", garbage);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "the request is not a llava.v1.ChatRequest message (protobuf wire format)");
  s = RawUnaryCall("/llava.v1.LlavaService/GetModelInfo", garbage);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "the request is not a llava.v1.GetModelInfoRequest message (protobuf wire format)");
  // A request_id (field 1) of two bytes that are not UTF-8; protobuf's own log line about it is
  // silenced (a client could otherwise write to the server's log at will).
  ::testing::internal::CaptureStderr();
  s = RawUnaryCall("/llava.v1.LlavaService/Chat", std::string("\x0a\x02\xff\xfe", 4));
  const std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "request_id is not valid UTF-8");
  EXPECT_EQ(logged.find("libprotobuf"), std::string::npos) << logged;
  // Well-formed bytes still work through the raw path.
  s = RawUnaryCall("/llava.v1.LlavaService/Chat", Request().SerializeAsString());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace llava::server
