// Bearer tokens (server/auth.h) on their own, then through the gRPC layer with a scripted
// engine; tests/server_e2e_test.cc runs llava-chat against a server that needs a token.
#include "server/auth.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "llava/v1/llava.grpc.pb.h"
#include "server/llava_service.h"

namespace llava::server {
namespace {

using namespace std::chrono_literals;

void Write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

TEST(TokenStore, ParsesNamesCommentsAndEnvironmentLists) {
  auto t = TokenStore::Parse(
      "# ops tokens\nalice 0123456789abcdef0123\n\n  fedcba9876543210  # ci\n", "f");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0], std::make_pair(std::string("alice"), std::string("0123456789abcdef0123")));
  EXPECT_EQ((*t)[1].first, "token-4");  // unnamed: its line
  auto env = TokenStore::Parse("a 0123456789abcdefXX,b fedcba9876543210YY", "env");
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->size(), 2u);
  EXPECT_FALSE(TokenStore::Parse("short", "f").ok()) << "tokens under 16 characters";
  EXPECT_FALSE(TokenStore::Parse("a b 0123456789abcdef", "f").ok());
}

TEST(TokenStore, AuthenticatesBearerTokensOnly) {
  auto store = TokenStore::Create("", "alice 0123456789abcdef0123,bob fedcba9876543210zz");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TokenStore& s = **store;
  EXPECT_EQ(s.Authenticate("Bearer 0123456789abcdef0123"), "alice");
  EXPECT_EQ(s.Authenticate("Bearer fedcba9876543210zz"), "bob");
  EXPECT_FALSE(s.Authenticate("Bearer 0123456789abcdef012"));    // a prefix
  EXPECT_FALSE(s.Authenticate("Bearer 0123456789abcdef01234"));  // longer
  EXPECT_FALSE(s.Authenticate("bearer 0123456789abcdef0123"));   // the scheme is case-exact
  EXPECT_FALSE(s.Authenticate("0123456789abcdef0123"));
  EXPECT_FALSE(s.Authenticate(""));
  EXPECT_FALSE(s.Authenticate("Bearer "));
  EXPECT_FALSE(TokenStore::Create("", "").ok()) << "a store without tokens is an error";
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
}

TEST(TokenStore, ReReadsTheFileWhenItChanges) {
  const std::string path = ::testing::TempDir() + "/llava-tokens";
  Write(path, "first 1111111111111111\n");
  auto store = TokenStore::Create(path, "");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->Authenticate("Bearer 1111111111111111"), "first");
  std::this_thread::sleep_for(20ms);  // a new modification time
  Write(path, "second 2222222222222222222\n");
  EXPECT_EQ((*store)->Authenticate("Bearer 2222222222222222222"), "second");
  EXPECT_FALSE((*store)->Authenticate("Bearer 1111111111111111")) << "a revoked token";
  // A broken file keeps the tokens that were good.
  std::this_thread::sleep_for(20ms);
  Write(path, "too short\n");
  EXPECT_EQ((*store)->Authenticate("Bearer 2222222222222222222"), "second");
  // An emptied file (a rotation that truncates, then writes) keeps them too, and the rewritten
  // file is read once it changes again.
  for (const char* text : {"", "# only a comment\n"}) {
    std::this_thread::sleep_for(20ms);
    Write(path, text);
    EXPECT_EQ((*store)->Authenticate("Bearer 2222222222222222222"), "second") << text;
    EXPECT_EQ((*store)->size(), 1u);
  }
  std::this_thread::sleep_for(20ms);
  Write(path, "third 3333333333333333333\n");
  EXPECT_EQ((*store)->Authenticate("Bearer 3333333333333333333"), "third");
  EXPECT_FALSE((*store)->Authenticate("Bearer 2222222222222222222"));
  EXPECT_FALSE(TokenStore::Create(path + ".missing", "").ok());
}

// The gRPC service with a token store and an engine that answers at once.
class AnswerAtOnce : public EngineApi {
 public:
  Status Submit(uint64_t, const GenerationRequest&, std::shared_ptr<RequestObserver> observer,
                std::optional<std::chrono::steady_clock::time_point>) override {
    observer->OnText("ok");
    GenerationResult r;
    r.completion_tokens = 1;
    observer->OnFinished(r);
    return Status::Ok();
  }
  void Cancel(uint64_t) override {}
  EngineSnapshot Snapshot() const override { return {}; }
};

// One ServerReflectionInfo exchange (list_services) over a generic call: its status, and whether
// an answer came.
std::pair<grpc::Status, bool> ListServices(const std::shared_ptr<grpc::Channel>& channel,
                                           const char* authorization) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  if (authorization != nullptr) ctx.AddMetadata("authorization", authorization);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call =
      stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](auto&& start) {
    start();
    cq.Next(&tag, &ok);
    return ok;
  };
  step([&] { call->StartCall(&ctx); });
  const char list_services[] = {0x3a, 0x00};  // field 7 (list_services), an empty string
  grpc::Slice slice(list_services, sizeof(list_services));
  grpc::ByteBuffer request(&slice, 1);
  step([&] { call->Write(request, &ctx); });
  step([&] { call->WritesDone(&ctx); });
  grpc::ByteBuffer reply;
  const bool answered = step([&] { call->Read(&reply, &ctx); });
  grpc::Status status;
  step([&] { call->Finish(&status, &ctx); });
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return {status, answered};
}

TEST(GrpcAuth, EveryRpcButHealthNeedsAKnownToken) {
  auto store = TokenStore::Create("", "ci 0123456789abcdef0123");
  ASSERT_TRUE(store.ok());
  AnswerAtOnce engine;
  ServingMetrics metrics;
  RequestGate gate(&engine, &metrics, store->get());
  LlavaServiceImpl service(&gate, ServiceConfig());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> guards;
  guards.push_back(ReflectionNeedsToken(&gate));
  builder.experimental().SetInterceptorCreators(std::move(guards));
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  auto stub = v1::LlavaService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  v1::ChatRequest req;
  auto* m = req.add_messages();
  m->set_role(v1::ROLE_USER);
  m->add_content()->set_text("hi");
  auto chat = [&](const char* authorization) {
    grpc::ClientContext ctx;
    if (authorization != nullptr) ctx.AddMetadata("authorization", authorization);
    v1::ChatResponse resp;
    return stub->Chat(&ctx, req, &resp);
  };
  EXPECT_EQ(chat(nullptr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(chat("Bearer wrong-token-wrong-token").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status refused = chat("Bearer 0123456789abcdef012");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(refused.error_message().find("0123456789"), std::string::npos)
      << "the reply never echoes a token";
  EXPECT_TRUE(chat("Bearer 0123456789abcdef0123").ok());
  {
    grpc::ClientContext ctx;
    v1::ModelInfo info;
    EXPECT_EQ(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // grpc.health.v1 stays open for probes.
  {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckResponse health;
    auto health_stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    const grpc::Status s =
        health_stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &health);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  // Reflection answers with a token only (it describes every method of the service).
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  const auto [refused_status, refused_answered] = ListServices(channel, nullptr);
  EXPECT_FALSE(refused_answered) << "reflection answered without a token";
  EXPECT_FALSE(refused_status.ok());
  const auto [status, answered] = ListServices(channel, "Bearer 0123456789abcdef0123");
  EXPECT_TRUE(answered);
  EXPECT_TRUE(status.ok()) << status.error_message();
  const std::string text = metrics.Serialize();
  EXPECT_NE(text.find("llava_request_status_total{api=\"grpc\",code=\"UNAUTHENTICATED\"} 5"),
            std::string::npos)
      << text;
  server->Shutdown(std::chrono::system_clock::now() + 2s);
}

}  // namespace
}  // namespace llava::server
