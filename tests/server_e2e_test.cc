// The gRPC service end to end: llava-server on an ephemeral 127.0.0.1 port with the tiny
// checkpoint (f32, deterministic), called through the generated client stubs.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <iostream>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#include <random>
#include <thread>

#include "client/channel.h"
#include "engine/kernels/cpu_features.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "llava/v1/llava.grpc.pb.h"
#include "server/convert.h"
#include "tests/server_process.h"
#include "tests/test_util.h"

namespace llava {
namespace {

using namespace std::chrono_literals;

std::string Png(int w, int h) {
  cv::Mat img(h, w, CV_8UC3, cv::Scalar(240, 240, 240));
  cv::circle(img, cv::Point(w / 3, h / 3), std::max(2, w / 5), cv::Scalar(0, 0, 220), -1);
  std::vector<uint8_t> buf;
  cv::imencode(".png", img, buf);
  return std::string(buf.begin(), buf.end());
}

// The value of one series line in Prometheus text ("name{labels} value"); 0 if absent (a
// labelled counter appears once first incremented).
double SeriesValue(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return 0;
  return std::stod(text.substr(at + series.size() + 2));
}

v1::ChatRequest Request(const std::string& question, int max_tokens, bool image) {
  v1::ChatRequest r;
  v1::Message* m = r.add_messages();
  m->set_role(v1::ROLE_USER);
  if (image) {
    auto* img = m->add_content()->mutable_image();
    img->set_data(Png(48, 40));
    img->set_mime_type("image/png");
  }
  m->add_content()->set_text(question);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  return r;
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    InitTorchThreads(1);
    server_ = new testing::ServerProcess(
        LLAVA_SERVER_BINARY,
        {"--model", ::llava::testing::TestData() + "/tiny-new", "--dtype", "f32", "--threads", "1",
         "--max-image-bytes", "200000", "--max-tokens-limit", "400"},
        ::testing::TempDir() + "/llava-server-e2e.log");
    ASSERT_GT(server_->port(), 0) << server_->Log();
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    ModelOptions o;
    o.dtype = DType::kF32;
    auto m = LoadModel(::llava::testing::TestData() + "/tiny-new", o);
    ASSERT_TRUE(m.ok());
    loaded_ = std::move(m).value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete loaded_;
  }
  std::unique_ptr<v1::LlavaService::Stub> Stub() { return v1::LlavaService::NewStub(channel_); }
  // The same request run in-process with the server's defaults: the expected answer.
  static std::string Expected(const v1::ChatRequest& r) {
    server::RequestDefaults d;
    d.kv.policy = CachePolicy::kElastic;
    d.kv.budget = 0.5;
    auto req = server::ToGenerationRequest(r, d);
    EXPECT_TRUE(req.ok());
    Generator gen(*loaded_, EngineLimits{});
    auto res = gen.Generate(*req, nullptr);
    EXPECT_TRUE(res.ok());
    return res.ok() ? res->text : "";
  }
  static testing::ServerProcess* server_;
  static std::shared_ptr<grpc::Channel> channel_;
  static LoadedModel* loaded_;
};
testing::ServerProcess* ServerTest::server_ = nullptr;
std::shared_ptr<grpc::Channel> ServerTest::channel_;
LoadedModel* ServerTest::loaded_ = nullptr;

TEST_F(ServerTest, HealthIsServing) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

// The README's one-shot call: `--image FILE` (repeatable) followed by the question. The image
// option once swallowed the question as a second file name and fell into interactive mode.
TEST_F(ServerTest, ChatClientAnswersOneQuestionWithTwoImages) {
  const std::string image = ::llava::testing::SourceDir() + "/models/examples/shapes.png";
  const std::string out = ::llava::testing::RunCommand(
      std::string(LLAVA_CHAT_BINARY) + " --server " + server_->address() +
      " --max-tokens 4 --image " + image + " --image " + image +
      " 'What is in the image?' < /dev/null 2>&1");
  const int rows = 2 * loaded_->model().config().image_tokens();
  EXPECT_NE(out.find("(" + std::to_string(rows) + " image)"), std::string::npos) << out;
  EXPECT_NE(out.find("[FINISH_REASON_"), std::string::npos) << out;
  EXPECT_EQ(out.find("/quit"), std::string::npos) << "interactive mode: " << out;
}

TEST_F(ServerTest, ModelInfo) {
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(Stub()->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.image_tokens(), loaded_->model().config().image_tokens());
  EXPECT_EQ(info.context_length(), 512);
  EXPECT_EQ(info.default_policy(), v1::CACHE_POLICY_ELASTIC);
  EXPECT_EQ(info.max_tokens_limit(), 400);
  EXPECT_EQ(info.model_path(), "tiny-new") << "the folder's name, not the server's path";
  // The server runs under this process's environment (LLAVA_CPU_PATH included).
  EXPECT_EQ(info.cpu_path(), CpuPathName(ActiveCpuPath()));
  // No --max-batch: auto, which is 8 for fp32 weights on every CPU path (README).
  EXPECT_EQ(info.max_batch(), 8);
  EXPECT_EQ(info.kv_bytes_per_token(), loaded_->model().kv_layout().num_layers *
                                           loaded_->model().kv_layout().bytes_per_entry());
}

TEST_F(ServerTest, UnaryAndStreamingGiveTheInProcessAnswer) {
  v1::ChatRequest req = Request("What is in the image?", 12, true);
  req.set_request_id("abc-1");
  const std::string expected = Expected(req);
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  grpc::Status s = Stub()->Chat(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.request_id(), "abc-1");
  EXPECT_EQ(resp.text(), expected);
  EXPECT_NE(resp.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  EXPECT_EQ(resp.usage().image_tokens(), loaded_->model().config().image_tokens());
  EXPECT_GT(resp.usage().kv_bytes_full(), 0);
  EXPECT_LT(resp.usage().kv_bytes_used(), resp.usage().kv_bytes_full());  // Elastic 0.5 default
  // The tiny model's instruction (24 of 43 prompt tokens) fills the default Elastic's half
  // budget: the image rows are dropped rather than merged (no anchor is left for them).
  EXPECT_GT(resp.usage().tokens_merged() + resp.usage().tokens_evicted(), 0);

  grpc::ClientContext sctx;
  auto reader = Stub()->ChatStream(&sctx, req);
  v1::ChatChunk chunk;
  std::string text;
  int chunks = 0;
  v1::ChatChunk last;
  while (reader->Read(&chunk)) {
    text += chunk.text_delta();
    ++chunks;
    last = chunk;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(text, expected);
  EXPECT_EQ(last.finish_reason(), resp.finish_reason());
  EXPECT_EQ(last.usage().completion_tokens(), resp.usage().completion_tokens());
  EXPECT_GE(chunks, 2);
}

TEST_F(ServerTest, ConcurrentStreamsAreIndependent) {
  std::vector<v1::ChatRequest> reqs = {
      Request("describe the picture", 10, true), Request("hello there", 8, false),
      Request("how many objects", 14, true), Request("what colour is the circle", 9, true)};
  reqs[1].mutable_kv_cache()->set_policy(v1::CACHE_POLICY_FULL);
  reqs[2].mutable_kv_cache()->set_policy(v1::CACHE_POLICY_STREAMING_LLM);
  reqs[2].mutable_kv_cache()->set_budget(0.3);
  std::vector<std::string> got(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      auto reader = Stub()->ChatStream(&ctx, reqs[i]);
      v1::ChatChunk c;
      while (reader->Read(&c)) got[i] += c.text_delta();
      EXPECT_TRUE(reader->Finish().ok());
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], Expected(reqs[i])) << i;
}

TEST_F(ServerTest, InvalidInputNamesTheFieldAndTheServerKeepsServing) {
  struct Case {
    std::function<void(v1::ChatRequest*)> edit;
    const char* field;
  };
  const float nan = std::nanf("");
  std::vector<Case> cases = {
      {[](v1::ChatRequest* r) { r->clear_messages(); }, "messages must not be empty"},
      {[](v1::ChatRequest* r) { r->mutable_messages(0)->set_role(v1::ROLE_UNSPECIFIED); },
       "messages[0].role"},
      {[](v1::ChatRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->mutable_image()->clear_data();
       },
       "messages[0].content[0].image.data is empty"},
      {[](v1::ChatRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->mutable_image()->set_data(
             "\x89PNG\r\n\x1a\nbroken");
       },
       "messages[0].content[0].image.data"},
      {[](v1::ChatRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->mutable_image()->set_data(
             std::string(300000, 'x'));
         r->mutable_messages(0)->mutable_content(0)->mutable_image()->clear_mime_type();
       },
       "more than the limit 200000"},
      {[](v1::ChatRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->mutable_image()->set_mime_type("image/gif");
       },
       "messages[0].content[0].image.mime_type"},
      {[](v1::ChatRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->mutable_image()->set_mime_type("image/jpeg");
       },
       "messages[0].content[0].image.mime_type says image/jpeg but the data is PNG"},
      {[](v1::ChatRequest* r) {
         r->mutable_messages(0)->mutable_content(1)->set_text(std::string(3000, 'a') + " b");
       },
       "exceeds the context length"},
      {[](v1::ChatRequest* r) { r->mutable_sampling()->set_max_tokens(0); }, "sampling.max_tokens"},
      {[](v1::ChatRequest* r) { r->mutable_sampling()->set_max_tokens(100000); },
       "sampling.max_tokens"},
      {[nan](v1::ChatRequest* r) { r->mutable_sampling()->set_temperature(nan); },
       "sampling.temperature"},
      {[](v1::ChatRequest* r) { r->mutable_sampling()->set_temperature(-1); },
       "sampling.temperature"},
      {[](v1::ChatRequest* r) { r->mutable_sampling()->set_top_p(0); }, "sampling.top_p"},
      {[](v1::ChatRequest* r) { r->mutable_sampling()->set_top_p(1.5); }, "sampling.top_p"},
      {[](v1::ChatRequest* r) {
         r->mutable_kv_cache()->set_policy(static_cast<v1::CachePolicy>(99));
       },
       "kv_cache.policy"},
      {[](v1::ChatRequest* r) { r->mutable_kv_cache()->set_budget(0); }, "kv_cache.budget"},
      {[](v1::ChatRequest* r) { r->mutable_kv_cache()->set_budget(1.5); }, "kv_cache.budget"},
      {[](v1::ChatRequest* r) {
         r->mutable_kv_cache()->mutable_elastic()->set_variant(static_cast<v1::ElasticVariant>(5));
       },
       "kv_cache.elastic.variant"},
      {[](v1::ChatRequest* r) {
         r->mutable_kv_cache()->mutable_elastic()->set_importance(
             static_cast<v1::ImportanceMode>(9));
       },
       "kv_cache.elastic.importance"},
      {[](v1::ChatRequest* r) { r->mutable_messages(0)->set_role(v1::ROLE_ASSISTANT); },
       "messages[0].content[0].image"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::ChatRequest req = Request("What is it?", 4, true);
    cases[i].edit(&req);
    for (bool stream : {false, true}) {
      grpc::ClientContext ctx;
      grpc::Status s;
      if (stream) {
        auto reader = Stub()->ChatStream(&ctx, req);
        v1::ChatChunk c;
        while (reader->Read(&c)) {
        }
        s = reader->Finish();
      } else {
        v1::ChatResponse resp;
        s = Stub()->Chat(&ctx, req, &resp);
      }
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << "case " << i << ": " << s.error_message();
      EXPECT_NE(s.error_message().find(cases[i].field), std::string::npos)
          << "case " << i << ": " << s.error_message();
    }
  }
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  EXPECT_TRUE(Stub()->Chat(&ctx, Request("still there?", 3, true), &resp).ok());
}

TEST_F(ServerTest, CancellationAndDeadline) {
  {
    // 400 tokens whatever the random model says: the cancel must land inside the generation,
    // also on a loaded machine where the client reads its first chunk late (the answer alone,
    // ending at the tiny model's EOS, was over before the cancel in a CI run beside a soak).
    v1::ChatRequest request = Request("describe everything", 400, true);
    request.mutable_sampling()->set_ignore_eos(true);
    grpc::ClientContext ctx;
    auto reader = Stub()->ChatStream(&ctx, request);
    v1::ChatChunk c;
    ASSERT_TRUE(reader->Read(&c));
    ctx.TryCancel();
    while (reader->Read(&c)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {
    // The deadline is a quarter of what the same request takes without one, so that it falls
    // inside the generation on a fast machine as on a slow one (a fixed 50 ms did not).
    const auto start = std::chrono::steady_clock::now();
    {
      grpc::ClientContext ctx;
      v1::ChatResponse resp;
      ASSERT_TRUE(Stub()->Chat(&ctx, Request("describe everything", 400, true), &resp).ok());
    }
    const auto full = std::chrono::steady_clock::now() - start;
    const auto deadline = std::max<std::chrono::steady_clock::duration>(full / 4, 1ms);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline));
    v1::ChatResponse resp;
    grpc::Status s = Stub()->Chat(&ctx, Request("describe everything", 400, true), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  }
  // The server log shows both requests ending, and the KV cache is empty again.
  std::this_thread::sleep_for(200ms);
  EXPECT_NE(server_->Log().find("finish=cancelled"), std::string::npos);
  const std::string metrics = server_->HttpGet("/metrics");
  EXPECT_NE(metrics.find("\nllava_kv_cache_used_bytes 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nllava_num_requests_running 0\n"), std::string::npos);
  // The deadline request ends either by the engine's deadline check (DEADLINE_EXCEEDED) or by
  // gRPC cancelling the call at the deadline first (finish "cancelled"): both count once.
  const double cancelled =
      SeriesValue(metrics, "llava_request_success_total{finish_reason=\"cancelled\"}");
  const double expired =
      SeriesValue(metrics, "llava_request_status_total{api=\"grpc\",code=\"DEADLINE_EXCEEDED\"}");
  EXPECT_GE(cancelled, 1) << metrics;
  EXPECT_EQ(cancelled + expired, 2) << metrics;
}

TEST_F(ServerTest, MetricsEndpointServesTheDocumentedSeries) {
  grpc::ClientContext ctx;
  v1::ChatResponse resp;
  ASSERT_TRUE(Stub()->Chat(&ctx, Request("metrics please", 5, true), &resp).ok());
  const std::string http = server_->HttpGet("/metrics");
  ASSERT_EQ(http.rfind("HTTP/1.1 200 OK", 0), 0u) << http.substr(0, 200);
  for (const char* series : {"llava_num_requests_running",
                             "llava_num_requests_waiting",
                             "llava_kv_cache_usage_ratio",
                             "llava_kv_cache_used_bytes",
                             "llava_kv_cache_full_equivalent_bytes",
                             "llava_kv_cache_budget_bytes",
                             "llava_kv_cache_pool_bytes",
                             "llava_kv_compression_ratio_bucket{policy=",
                             "llava_kv_tokens_merged_total{policy=",
                             "llava_kv_tokens_evicted_total{policy=",
                             "process_resident_memory_bytes",
                             "process_cpu_seconds_total",
                             "process_open_fds",
                             "process_start_time_seconds",
                             "llava_memory_limit_bytes",
                             "llava_time_to_first_token_seconds_bucket",
                             "llava_inter_token_latency_seconds_bucket",
                             "llava_e2e_request_latency_seconds_bucket",
                             "llava_request_queue_time_seconds_bucket",
                             "llava_vision_encode_seconds_bucket",
                             "llava_prompt_tokens_total",
                             "llava_generation_tokens_total",
                             "llava_request_success_total{finish_reason=",
                             "llava_request_status_total{api=",
                             "llava_batch_size",
                             "llava_max_batch",
                             "llava_http_connections",
                             "llava_http_connections_closed_total{reason=\"cap\"}"}) {
    EXPECT_NE(http.find(series), std::string::npos) << series;
  }
  // The pool is allocated at start, whole pages of the budget; nothing is held once idle.
  EXPECT_GT(SeriesValue(http, "llava_kv_cache_pool_bytes"), 0) << http;
  EXPECT_LE(SeriesValue(http, "llava_kv_cache_pool_bytes"),
            SeriesValue(http, "llava_kv_cache_budget_bytes") + 1)
      << http;
  // The request ran under the default policy (Elastic): its savings are counted under it.
  EXPECT_GE(SeriesValue(http, "llava_kv_compression_ratio_count{policy=\"elastic\"}"), 1) << http;
  EXPECT_EQ(SeriesValue(http, "llava_kv_compression_ratio_count{policy=\"h2o\"}"), 0);
  EXPECT_GT(SeriesValue(http, "process_resident_memory_bytes"), 50e6);  // libtorch loaded
  EXPECT_GE(SeriesValue(http, "process_open_fds"), 3);
  EXPECT_EQ(SeriesValue(http, "llava_max_batch"), 8) << "--max-batch auto, fp32 weights";
  EXPECT_EQ(server_->HttpGet("/healthz").rfind("HTTP/1.1 200 OK", 0), 0u);
  EXPECT_EQ(server_->HttpGet("/nope").rfind("HTTP/1.1 404", 0), 0u);
  // promtool (Debian's prometheus package) validates the exposition format.
  const std::string body = http.substr(http.find("\r\n\r\n") + 4);
  const std::string path = ::testing::TempDir() + "/metrics.txt";
  ::llava::testing::WriteFile(path, body);
  ASSERT_EQ(std::system("command -v promtool > /dev/null"), 0) << "promtool is not installed";
  EXPECT_EQ(std::system(("promtool check metrics < '" + path + "'").c_str()), 0) << body;
}

// A server that needs a bearer token, with llava-chat as the client: no token, a wrong one and
// the right one; the log names the client, never the token.
TEST(ServerAuth, ChatClientNeedsTheServersToken) {
  const std::string dir = ::testing::TempDir();
  const std::string tokens = dir + "/llava-e2e-tokens", good = dir + "/llava-good-token",
                    bad = dir + "/llava-bad-token";
  std::ofstream(tokens) << "# who may call\nci-bot s3cr3t-t0ken-0123456789\n";
  std::ofstream(good) << "s3cr3t-t0ken-0123456789\n";
  std::ofstream(bad) << "s3cr3t-t0ken-0123456788\n";
  testing::ServerProcess server(
      LLAVA_SERVER_BINARY,
      {"--model", ::llava::testing::TestData() + "/tiny-new", "--dtype", "f32", "--threads", "1",
       "--auth-tokens-file", tokens, "--reflection", "false"},
      dir + "/llava-auth.log");
  ASSERT_GT(server.port(), 0) << server.Log();
  auto chat = [&](const std::string& token_flag) {
    return ::llava::testing::RunCommand(std::string(LLAVA_CHAT_BINARY) + " --server " +
                                        server.address() + " --max-tokens 3 " + token_flag +
                                        " 'hello there' < /dev/null 2>&1");
  };
  const std::string none = chat(""), wrong = chat("--token-file " + bad),
                    right = chat("--token-file " + good);
  EXPECT_NE(none.find("error: 16 this server needs a bearer token"), std::string::npos) << none;
  EXPECT_NE(wrong.find("error: 16 this server needs a bearer token"), std::string::npos) << wrong;
  EXPECT_NE(right.find("[FINISH_REASON_"), std::string::npos) << right;
  const std::string log = server.Log();
  EXPECT_NE(log.find("client=ci-bot"), std::string::npos) << log;
  EXPECT_EQ(log.find("s3cr3t"), std::string::npos) << "a token reached the log:\n" << log;
}

// The gRPC port over mutual TLS with llava-chat, and the HTTP API's with curl: the right CA and
// client certificate work; no TLS, a wrong CA, no client certificate or one from another CA
// fail; a renewed certificate is served on both ports without a restart, and an expired one is
// refused by the clients.
// Certificates for the TLS tests in `dir`: CAs ca1 and ca2; server (ca1), server2 (ca2),
// client (ca1), rogue (ca2), expired (ca1, valid 0 days); live.{pem,key} start as server's.
void MakeCertificates(const std::string& dir) {
  const std::string make_certs = R"(set -e
    rm -rf DIR && mkdir -p DIR && cd DIR
    key() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "$@" 2> /dev/null; }
    for ca in ca1 ca2; do key -x509 -keyout $ca.key -out $ca.pem -days 2 -subj /CN=$ca; done
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
    sign() {  # name ca days
      key -keyout $1.key -out $1.csr -subj /CN=$1
      openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -out $1.pem \
        -days $3 -extfile san.ext 2> /dev/null
    }
    sign server ca1 2; sign server2 ca2 2; sign client ca1 2; sign rogue ca2 2; sign expired ca1 0
    cp server.pem live.pem; cp server.key live.key
    echo made)";
  std::string script = make_certs;
  for (size_t at = script.find("DIR"); at != std::string::npos; at = script.find("DIR"))
    script.replace(at, 3, dir);
  ASSERT_NE(::llava::testing::RunCommand("bash -c '" + script + "' 2>&1").find("made"),
            std::string::npos);
}

TEST(ServerTls, MutualTlsWrongCaRenewalAndExpiry) {
  const std::string dir = ::testing::TempDir() + "/llava-tls";
  ASSERT_NO_FATAL_FAILURE(MakeCertificates(dir));
  testing::ServerProcess server(
      LLAVA_SERVER_BINARY,
      {"--model", ::llava::testing::TestData() + "/tiny-new", "--dtype", "f32", "--threads", "1",
       "--tls-cert", dir + "/live.pem", "--tls-key", dir + "/live.key", "--tls-client-ca",
       dir + "/ca1.pem", "--tls-reload-seconds", "1"},
      dir + "/server.log");
  ASSERT_GT(server.port(), 0) << server.Log();
  auto chat = [&](const std::string& flags) {
    return ::llava::testing::RunCommand(std::string(LLAVA_CHAT_BINARY) + " --server " +
                                        server.address() + " --max-tokens 3 --timeout 10 " + flags +
                                        " 'hello there' < /dev/null 2>&1");
  };
  auto with = [&](const std::string& ca, const std::string& cert) {
    std::string f = "--tls-ca " + dir + "/" + ca + ".pem";
    if (!cert.empty())
      f += " --tls-cert " + dir + "/" + cert + ".pem --tls-key " + dir + "/" + cert + ".key";
    return chat(f);
  };
  // GET /v1/models over HTTPS; "https" or "http" as the scheme.
  auto models = [&](const std::string& ca, const std::string& cert,
                    const std::string& scheme = "https") {
    std::string cmd = "curl -sS --max-time 10 --cacert " + dir + "/" + ca + ".pem";
    if (!cert.empty())
      cmd += " --cert " + dir + "/" + cert + ".pem --key " + dir + "/" + cert + ".key";
    return ::llava::testing::RunCommand(cmd + " " + scheme + "://127.0.0.1:" +
                                        std::to_string(server.http_port()) + "/v1/models 2>&1");
  };
  const std::string listed = "\"object\":\"list\"";
  ASSERT_GT(server.http_port(), 0) << server.Log();
  EXPECT_NE(models("ca1", "client").find(listed), std::string::npos) << models("ca1", "client");
  EXPECT_EQ(models("ca1", "client", "http").find(listed), std::string::npos) << "plain HTTP";
  EXPECT_EQ(models("ca2", "client").find(listed), std::string::npos) << "HTTP API, wrong CA";
  EXPECT_EQ(models("ca1", "").find(listed), std::string::npos) << "HTTP API, no client cert";
  EXPECT_EQ(models("ca1", "rogue").find(listed), std::string::npos)
      << "HTTP API, a client certificate of another CA";
  const std::string ok = "[FINISH_REASON_";
  EXPECT_NE(with("ca1", "client").find(ok), std::string::npos) << with("ca1", "client");
  EXPECT_EQ(chat("").find(ok), std::string::npos) << "plaintext against a TLS port";
  EXPECT_EQ(with("ca2", "client").find(ok), std::string::npos) << "the wrong CA";
  EXPECT_EQ(with("ca1", "").find(ok), std::string::npos) << "no client certificate";
  EXPECT_EQ(with("ca1", "rogue").find(ok), std::string::npos)
      << "a client certificate of another CA";
  // Renewal: new files, same process.
  ::llava::testing::RunCommand("cd " + dir +
                               " && cp server2.key live.key.new && cp server2.pem live.pem.new && "
                               "mv live.key.new live.key && mv live.pem.new live.pem");
  std::string renewed;
  for (int i = 0; i < 50 && renewed.find(ok) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    renewed = with("ca2", "client");
  }
  EXPECT_NE(renewed.find(ok), std::string::npos)
      << "the renewed certificate was not served: " << renewed;
  EXPECT_EQ(with("ca1", "client").find(ok), std::string::npos)
      << "the old certificate is still served";
  std::string renewed_http;
  for (int i = 0; i < 50 && renewed_http.find(listed) == std::string::npos; ++i) {
    renewed_http = models("ca2", "client");
    if (renewed_http.find(listed) == std::string::npos)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_NE(renewed_http.find(listed), std::string::npos)
      << "the HTTP API did not serve the renewed certificate: " << renewed_http;
  EXPECT_EQ(models("ca1", "client").find(listed), std::string::npos)
      << "the HTTP API still serves the old certificate";
  // An expired certificate (valid for 0 days) of the same CA as a valid one: clients refuse it.
  auto serve = [&](const std::string& name) {
    ::llava::testing::RunCommand("cd " + dir + " && cp " + name + ".key live.key.new && cp " +
                                 name + ".pem live.pem.new && mv live.key.new live.key && " +
                                 "mv live.pem.new live.pem");
  };
  serve("server");
  std::string back;
  for (int i = 0; i < 50 && back.find(ok) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    back = with("ca1", "client");
  }
  ASSERT_NE(back.find(ok), std::string::npos) << back;
  ::llava::testing::RunCommand("cd " + dir +
                               " && cp expired.key live.key.new && cp expired.pem live.pem.new && "
                               "mv live.key.new live.key && mv live.pem.new live.pem");
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(with("ca1", "client").find(ok), std::string::npos)
      << "an expired certificate was accepted";
  EXPECT_EQ(models("ca1", "client").find(listed), std::string::npos)
      << "the HTTP API's expired certificate was accepted";
}

// SIGHUP re-reads the HTTP API's certificate at once: with --tls-reload-seconds 3600 a
// renewed pair is not served until the signal, and is served after it.
TEST(ServerTls, SighupReloadsTheHttpApiCertificate) {
  const std::string dir = ::testing::TempDir() + "/llava-tls-hup";
  ASSERT_NO_FATAL_FAILURE(MakeCertificates(dir));
  testing::ServerProcess server(LLAVA_SERVER_BINARY,
                                {"--model", ::llava::testing::TestData() + "/tiny-new", "--dtype",
                                 "f32", "--threads", "1", "--tls-cert", dir + "/live.pem",
                                 "--tls-key", dir + "/live.key", "--tls-reload-seconds", "3600"},
                                dir + "/server.log");
  ASSERT_GT(server.http_port(), 0) << server.Log();
  auto models = [&](const std::string& ca) {
    return ::llava::testing::RunCommand(
        "curl -sS --max-time 10 --cacert " + dir + "/" + ca +
        ".pem https://127.0.0.1:" + std::to_string(server.http_port()) + "/v1/models 2>&1");
  };
  const std::string listed = "\"object\":\"list\"";
  ASSERT_NE(models("ca1").find(listed), std::string::npos) << models("ca1");
  // A certificate valid for 2 days: a warning at start, and its expiry in the metrics.
  EXPECT_NE(server.Log().find("live.pem expires in 2.0 days"), std::string::npos) << server.Log();
  const std::string metrics = server.HttpGet("/metrics");
  const std::string series = "\nllava_tls_certificate_expiry_seconds ";
  const size_t at = metrics.find(series);
  ASSERT_NE(at, std::string::npos) << metrics;
  const double left = std::stod(metrics.substr(at + series.size()));
  EXPECT_GT(left, 2 * 86400 - 600);
  EXPECT_LE(left, 2 * 86400);
  ::llava::testing::RunCommand("cd " + dir +
                               " && cp server2.key live.key.new && cp server2.pem live.pem.new && "
                               "mv live.key.new live.key && mv live.pem.new live.pem");
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_NE(models("ca1").find(listed), std::string::npos) << "reloaded before the signal";
  server.Signal(SIGHUP);
  std::string renewed;
  for (int i = 0; i < 50 && renewed.find(listed) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    renewed = models("ca2");
  }
  EXPECT_NE(renewed.find(listed), std::string::npos) << renewed << "\n" << server.Log();
  EXPECT_EQ(models("ca1").find(listed), std::string::npos) << "the old certificate after SIGHUP";
  EXPECT_NE(server.Log().find("SIGHUP: HTTP API certificate reloaded"), std::string::npos)
      << server.Log();
}

// Scale-out that works for gRPC: one client channel over two servers spreads its requests
// between them (client/channel.h: round_robin over every address of the target), where a
// plain channel would send them all to one.
TEST(ServerScaleOut, RoundRobinSpreadsRequestsOverEveryAddress) {
  const std::vector<std::string> args = {
      "--model", ::llava::testing::TestData() + "/tiny-new", "--dtype", "f32", "--threads", "1"};
  testing::ServerProcess a(LLAVA_SERVER_BINARY, args, ::testing::TempDir() + "/llava-rr-a.log");
  testing::ServerProcess b(LLAVA_SERVER_BINARY, args, ::testing::TempDir() + "/llava-rr-b.log");
  ASSERT_GT(a.port(), 0) << a.Log();
  ASSERT_GT(b.port(), 0) << b.Log();
  auto stub =
      v1::LlavaService::NewStub(client::MakeChannel("ipv4:" + a.address() + "," + b.address()));
  auto chat = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 30s);
    v1::ChatResponse resp;
    return stub->Chat(&ctx, Request("hello there", 3, false), &resp).ok();
  };
  auto served = [](const testing::ServerProcess& s) {
    return SeriesValue(s.HttpGet("/metrics"),
                       "llava_request_status_total{api=\"grpc\",code=\"OK\"}");
  };
  // Until both connections are up (round_robin picks only READY ones; on a loaded machine the
  // second may take longer than a few requests): each server has answered at least one.
  for (int i = 0; i < 200 && (served(a) < 1 || served(b) < 1); ++i) {
    ASSERT_TRUE(chat());
    if (i >= 4) std::this_thread::sleep_for(50ms);
  }
  const double a0 = served(a), b0 = served(b);
  ASSERT_GE(a0, 1) << "a never served: " << a.Log();
  ASSERT_GE(b0, 1) << "b never served: " << b.Log();
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(chat());
  const double on_a = served(a) - a0, on_b = served(b) - b0;
  EXPECT_EQ(on_a + on_b, 8);
  EXPECT_GE(on_a, 3) << "requests on a: " << on_a << ", on b: " << on_b;
  EXPECT_GE(on_b, 3) << "requests on a: " << on_a << ", on b: " << on_b;
}

// Faults against a running server: 1,000 streams cancelled at random points, 1,000 requests
// with random deadlines (1 ms .. 2 s, log-uniform) from 8 clients at once, then a flood of 32
// requests past the queue. Every call ends with a status the API documents, and afterwards nothing
// is left behind: no running or waiting request, no KV byte held or reserved; then SIGTERM drains
// and exits 0.
TEST(ServerLifecycle, RandomCancelsDeadlinesAndFloodsLeaveNothingBehind) {
  testing::ServerProcess server(LLAVA_SERVER_BINARY,
                                {"--model", ::llava::testing::TestData() + "/tiny-new", "--dtype",
                                 "f32", "--threads", "1", "--max-batch", "4", "--max-queue", "8"},
                                ::testing::TempDir() + "/llava-server-faults.log");
  ASSERT_GT(server.port(), 0) << server.Log();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  constexpr int kClients = 8, kEach = 1000 / kClients;
  std::atomic<int> cancelled{0}, expired{0}, refused{0}, completed{0}, unexpected{0};
  // One call's outcome: the fault it was given (`fault`), a refusal, a completion, or something
  // the API does not document.
  auto tally = [&](grpc::StatusCode code, grpc::StatusCode fault, std::atomic<int>* faults) {
    if (code == fault) {
      ++*faults;
    } else if (code == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
    } else if (code == grpc::StatusCode::OK) {
      ++completed;
    } else {
      ++unexpected;
    }
  };
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(1234 + c);
      auto stub = v1::LlavaService::NewStub(channel);
      v1::ChatRequest req = Request("describe everything at length", 120, c % 2 == 0);
      req.mutable_sampling()->set_ignore_eos(true);
      for (int i = 0; i < kEach; ++i) {
        {  // a stream cancelled after 0..20 chunks
          grpc::ClientContext ctx;
          auto reader = stub->ChatStream(&ctx, req);
          v1::ChatChunk chunk;
          const int stop_after = static_cast<int>(rng() % 21);
          for (int n = 0; n < stop_after && reader->Read(&chunk); ++n) {
          }
          ctx.TryCancel();
          while (reader->Read(&chunk)) {
          }
          tally(reader->Finish().error_code(), grpc::StatusCode::CANCELLED, &cancelled);
        }
        {  // a unary call with a deadline between 1 ms and 2 s
          grpc::ClientContext ctx;
          const double ms =
              std::exp(std::uniform_real_distribution<double>(0, std::log(2000))(rng));
          ctx.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::microseconds(static_cast<int64_t>(ms * 1000)));
          v1::ChatResponse resp;
          tally(stub->Chat(&ctx, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED,
                &expired);
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  // A flood: 32 long requests at once against 4 running + 8 waiting places.
  std::vector<std::thread> flood;
  for (int f = 0; f < 32; ++f) {
    flood.emplace_back([&] {
      auto stub = v1::LlavaService::NewStub(channel);
      v1::ChatRequest req = Request("describe everything at length", 300, false);
      req.mutable_sampling()->set_ignore_eos(true);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 60s);
      v1::ChatResponse resp;
      tally(stub->Chat(&ctx, req, &resp).error_code(), grpc::StatusCode::OK, &completed);
    });
  }
  for (auto& t : flood) t.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_GT(cancelled.load(), 500);
  EXPECT_GT(expired.load(), 100);
  EXPECT_GT(refused.load(), 0) << "the flood found room for every request";
  std::string metrics;
  for (int i = 0; i < 100; ++i) {
    metrics = server.HttpGet("/metrics");
    if (SeriesValue(metrics, "llava_num_requests_running") == 0 &&
        SeriesValue(metrics, "llava_num_requests_waiting") == 0 &&
        SeriesValue(metrics, "llava_kv_cache_used_bytes") == 0 &&
        SeriesValue(metrics, "llava_kv_cache_reserved_bytes") == 0) {
      break;
    }
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_NE(metrics.find("\nllava_num_requests_running 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nllava_num_requests_waiting 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nllava_kv_cache_used_bytes 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nllava_kv_cache_reserved_bytes 0\n"), std::string::npos) << metrics;
  std::cout << "cancelled " << cancelled << ", expired " << expired << ", refused " << refused
            << ", completed " << completed << "\n";
  EXPECT_EQ(server.Terminate(std::chrono::seconds(30)), 0) << server.Log().substr(0, 2000);
}

TEST(ServerLifecycle, QueueOverflowAndSigtermDrain) {
  testing::ServerProcess server(LLAVA_SERVER_BINARY,
                                {"--model", ::llava::testing::TestData() + "/tiny-new", "--dtype",
                                 "f32", "--threads", "1", "--max-batch", "1", "--max-queue", "1"},
                                ::testing::TempDir() + "/llava-server-lifecycle.log");
  ASSERT_GT(server.port(), 0) << server.Log();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::LlavaService::NewStub(channel);
  // One long request runs (450 tokens, no early EOS for this prompt), one may wait, the
  // others are refused while it runs.
  v1::ChatRequest long_req = Request("long answer please", 450, false);
  long_req.mutable_kv_cache()->set_policy(v1::CACHE_POLICY_FULL);
  {  // The test's premise: this request does not end early (the tiny model is deterministic).
    ModelOptions o;
    o.dtype = DType::kF32;
    auto m = LoadModel(::llava::testing::TestData() + "/tiny-new", o);
    ASSERT_TRUE(m.ok());
    auto req = server::ToGenerationRequest(long_req, server::RequestDefaults());
    ASSERT_TRUE(req.ok());
    auto res = Generator(**m, EngineLimits{}).Generate(*req, nullptr);
    ASSERT_TRUE(res.ok());
    ASSERT_EQ(res->finish, FinishReason::kLength) << "pick a prompt that runs to max_tokens";
  }
  grpc::ClientContext c1;
  c1.set_deadline(std::chrono::system_clock::now() + 30s);
  auto r1 = stub->ChatStream(&c1, long_req);
  v1::ChatChunk chunk;
  ASSERT_TRUE(r1->Read(&chunk));  // running
  std::vector<grpc::StatusCode> codes(6);
  std::vector<std::thread> flood;
  for (size_t i = 0; i < codes.size(); ++i) {
    flood.emplace_back([&, i] {
      grpc::ClientContext ctx;
      v1::ChatResponse resp;
      codes[i] = stub->Chat(&ctx, Request("another", 3, false), &resp).error_code();
    });
  }
  for (auto& t : flood) t.join();
  const int refused = std::count(codes.begin(), codes.end(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const int served = std::count(codes.begin(), codes.end(), grpc::StatusCode::OK);
  EXPECT_GE(refused, 4);
  EXPECT_EQ(refused + served, 6);
  grpc::ClientContext c2;
  c2.set_deadline(std::chrono::system_clock::now() + 30s);
  auto r2 = stub->ChatStream(&c2, Request("second", 5, false));
  v1::ChatChunk first2;
  ASSERT_TRUE(r2->Read(&first2));  // admitted and streaming before the signal
  // SIGTERM: in-flight requests finish, the process exits 0.
  std::thread term([&] { EXPECT_EQ(server.Terminate(60s), 0) << server.Log(); });
  v1::ChatChunk last;
  while (r1->Read(&chunk)) last = chunk;
  grpc::Status s1 = r1->Finish();
  EXPECT_TRUE(s1.ok()) << s1.error_code() << " " << s1.error_message();
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_LENGTH);
  while (r2->Read(&chunk)) {
  }
  grpc::Status s2 = r2->Finish();
  EXPECT_TRUE(s2.ok()) << s2.error_code() << " " << s2.error_message();
  term.join();
  EXPECT_NE(server.Log().find("draining"), std::string::npos);
}

}  // namespace
}  // namespace llava
