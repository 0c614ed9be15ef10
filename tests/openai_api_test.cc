// The OpenAI wire format on its own (server/openai_api.h): request JSON to GenerationRequest,
// data URIs, field names in errors, response and chunk JSON, HTTP statuses. No sockets, no
// model; tests/openai_client/test.mjs drives the same code through the official client.
#include "server/openai_api.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "client/base64.h"

namespace llava::server {
namespace {

using nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string Base64(const std::string& bytes) { return client::Base64Encode(bytes); }

const std::string& Png() {
  static const std::string png =
      ReadFile(std::string(LLAVA_SOURCE_DIR) + "/models/examples/scene1.png");
  return png;
}

RequestDefaults Defaults() {
  RequestDefaults d;
  d.max_tokens = 77;
  d.kv.policy = CachePolicy::kElastic;
  d.kv.budget = 0.5;
  return d;
}

json ImageRequest() {
  return json{{"model", "m"},
              {"messages",
               {{{"role", "user"},
                 {"content",
                  {{{"type", "image_url"},
                    {"image_url", {{"url", "data:image/png;base64," + Base64(Png())}}}},
                   {{"type", "text"}, {"text", "What is it?"}}}}}}}};
}

Status ErrorOf(const json& body) {
  auto r = ParseChatCompletion(body.dump(), Defaults());
  return r.ok() ? Status::Ok() : r.status();
}

TEST(OpenAiApi, ImageAndTextPartsBecomeOneUserMessage) {
  ASSERT_FALSE(Png().empty());
  auto r = ParseChatCompletion(ImageRequest().dump(), Defaults());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const GenerationRequest& g = r->request;
  ASSERT_EQ(g.messages.size(), 1u);
  EXPECT_EQ(g.messages[0].role, "user");
  ASSERT_EQ(g.messages[0].content.size(), 2u);
  EXPECT_EQ(g.messages[0].content[0].kind, ContentPart::Kind::kImage);
  EXPECT_EQ(g.messages[0].content[1].text, "What is it?");
  ASSERT_EQ(g.images.size(), 1u);
  EXPECT_EQ(g.images[0], Png()) << "the data URI decodes to the file's bytes";
  EXPECT_EQ(g.image_fields[0], "messages[0].content[0].image_url.url");
  EXPECT_EQ(r->model, "m");
  EXPECT_FALSE(r->stream);
  // Defaults: the server's, not OpenAI's (temperature 1).
  EXPECT_EQ(g.sampling.max_tokens, 77);
  EXPECT_EQ(g.sampling.temperature, 0.f);
  EXPECT_EQ(g.kv_cache.policy, CachePolicy::kElastic);
  EXPECT_DOUBLE_EQ(g.kv_cache.budget, 0.5);
}

TEST(OpenAiApi, StringContentRolesAndSampling) {
  json body = {{"messages",
                {{{"role", "developer"}, {"content", "Be brief."}},
                 {{"role", "user"}, {"content", "Hi"}},
                 {{"role", "assistant"}, {"content", "Hello"}},
                 {{"role", "user"}, {"content", "Again"}}}},
               {"max_tokens", 10},
               {"max_completion_tokens", 12},
               {"temperature", 0.5},
               {"top_p", 0.9},
               {"seed", 42},
               {"stop", "END"},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"some_future_field", {{"x", 1}}}};  // unknown: ignored
  auto r = ParseChatCompletion(body.dump(), Defaults());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const GenerationRequest& g = r->request;
  ASSERT_EQ(g.messages.size(), 4u);
  EXPECT_EQ(g.messages[0].role, "system");
  EXPECT_EQ(g.messages[2].role, "assistant");
  EXPECT_EQ(g.messages[3].content[0].text, "Again");
  EXPECT_EQ(g.sampling.max_tokens, 12) << "max_completion_tokens wins over max_tokens";
  EXPECT_FLOAT_EQ(g.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(g.sampling.top_p, 0.9f);
  EXPECT_EQ(g.sampling.seed, 42u);
  EXPECT_EQ(g.sampling.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);

  body["stop"] = {"a", "b"};
  body.erase("max_completion_tokens");
  r = ParseChatCompletion(body.dump(), Defaults());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->request.sampling.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r->request.sampling.max_tokens, 10);
}

TEST(OpenAiApi, KvCacheExtension) {
  json body = ImageRequest();
  body["kv_cache"] = {{"policy", "elastic+paper"}, {"budget", 0.2}, {"sink_tokens", 3}};
  auto r = ParseChatCompletion(body.dump(), Defaults());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->request.kv_cache.policy, CachePolicy::kElastic);
  EXPECT_EQ(r->request.kv_cache.elastic_variant, ElasticVariant::kPaper);
  EXPECT_DOUBLE_EQ(r->request.kv_cache.budget, 0.2);
  EXPECT_EQ(r->request.kv_cache.sink_tokens, 3);
  body["kv_cache"] = {{"policy", "h2o"}};
  r = ParseChatCompletion(body.dump(), Defaults());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->request.kv_cache.policy, CachePolicy::kH2O);
  EXPECT_DOUBLE_EQ(r->request.kv_cache.budget, 0.5) << "the server's default budget is kept";
  body["kv_cache"] = {{"policy", "lookm"}};
  r = ParseChatCompletion(body.dump(), Defaults());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->request.kv_cache.elastic_variant, ElasticVariant::kLookM);
  body["kv_cache"] = {{"policy", "h2o+paper"}};
  r = ParseChatCompletion(body.dump(), Defaults());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->request.kv_cache.h2o.recent_window);
}

TEST(OpenAiApi, ErrorsNameTheField) {
  struct Case {
    const char* what;
    json patch;  // merged into a valid request
    const char* field;
  };
  const std::vector<Case> cases = {
      {"n > 1", {{"n", 2}}, "n"},
      {"temperature as a string", {{"temperature", "hot"}}, "temperature"},
      {"seed as a float", {{"seed", 1.5}}, "seed"},
      {"stop of numbers", {{"stop", {1, 2}}}, "stop[0]"},
      {"tools", {{"tools", {{{"type", "function"}}}}}, "tools"},
      {"logprobs", {{"logprobs", true}}, "logprobs"},
      {"penalty", {{"presence_penalty", 0.5}}, "presence_penalty"},
      {"budget as a string", {{"kv_cache", {{"budget", "low"}}}}, "kv_cache.budget"},
      {"unknown policy", {{"kv_cache", {{"policy", "lru"}}}}, "kv_cache.policy"},
      {"budget 0", {{"kv_cache", {{"budget", 0}}}}, "kv_cache.budget"},
      {"timeout 0", {{"timeout", 0}}, "timeout"},
      {"json response format",
       {{"response_format", {{"type", "json_object"}}}},
       "response_format.type"},
      {"stream as a string", {{"stream", "yes"}}, "stream"},
  };
  for (const Case& c : cases) {
    json body = ImageRequest();
    body.merge_patch(c.patch);
    const Status s = ErrorOf(body);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_EQ(s.message().rfind(c.field, 0), 0u) << c.what << ": " << s.message();
  }
  auto with_parts = [](json parts) {
    return json{{"messages", {{{"role", "user"}, {"content", parts}}}}};
  };
  const std::string field = "messages[0].content[0].image_url.url";
  for (const char* url :
       {"https://example.com/a.png", "http://10.0.0.1/a.png", "file:///etc/passwd",
        "data:image/png,rawbytes", "data:image/png;base64,@@@@",
        "data:text/plain;base64,aGVsbG8=", "data:image/png;base64,"}) {
    const Status s = ErrorOf(with_parts({{{"type", "image_url"}, {"image_url", {{"url", url}}}},
                                         {{"type", "text"}, {"text", "Hi"}}}));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << url;
    EXPECT_EQ(s.message().rfind(field, 0), 0u) << url << ": " << s.message();
  }
  // The declared type must match the bytes.
  const Status jpeg = ErrorOf(with_parts(
      {{{"type", "image_url"}, {"image_url", {{"url", "data:image/jpeg;base64," + Base64(Png())}}}},
       {{"type", "text"}, {"text", "Hi"}}}));
  EXPECT_NE(jpeg.message().find("says image/jpeg but the data is png"), std::string::npos)
      << jpeg.message();
  EXPECT_EQ(ErrorOf(with_parts({{{"type", "input_audio"}}}))
                .message()
                .rfind("messages[0].content[0].type", 0),
            0u);
  EXPECT_EQ(ErrorOf(json{{"messages", {{{"role", "tool"}, {"content", "x"}}}}})
                .message()
                .rfind("messages[0].role", 0),
            0u);
  EXPECT_EQ(ErrorOf(json{{"model", "m"}}).message(), "messages is missing");
  auto bad = ParseChatCompletion("{\"messages\": [", Defaults());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseChatCompletion("[1]", Defaults()).status().code(), StatusCode::kInvalidArgument);
}

// Nesting and width are checked on the bytes before a DOM is built (30 MB of '[' cost 1.5 GB
// as one): a deep or wide body is refused by name, brackets and commas inside strings count
// for nothing.
TEST(OpenAiApi, DeepOrWideJsonIsRefusedBeforeParsing) {
  const std::string deep(1 << 20, '[');
  auto r = ParseChatCompletion(deep, Defaults());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nests deeper than 32"), std::string::npos)
      << r.status().ToString();

  std::string wide = R"({"messages":[{"role":"user","content":"Hi"}],"x":[0)";
  for (int i = 0; i < 70000; ++i) wide += ",0";
  wide += "]}";
  r = ParseChatCompletion(wide, Defaults());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than 65536 JSON values"), std::string::npos)
      << r.status().ToString();

  // 31 levels of an unknown field, and a text full of brackets, commas and escaped quotes.
  std::string nested = std::string(31, '[') + std::string(31, ']');
  const std::string text = std::string(100, '[') + std::string(70000, ',') + "\\\"]]";
  r = ParseChatCompletion(R"({"messages":[{"role":"user","content":")" + text +
                              R"("}],"some_future_field":)" + nested + "}",
                          Defaults());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
}

TEST(OpenAiApi, UrlSafeBase64AndLineBreaksDecode) {
  // RFC 4648's test vectors for the encoder the tests and llava-load use.
  EXPECT_EQ(Base64("f"), "Zg==");
  EXPECT_EQ(Base64("fo"), "Zm8=");
  EXPECT_EQ(Base64("foobar"), "Zm9vYmFy");
  const std::string bytes = Png();
  std::string b64 = Base64(bytes);
  std::string wrapped;
  for (size_t i = 0; i < b64.size(); i += 76) wrapped += b64.substr(i, 76) + "\n";
  auto r = DecodeImageDataUri("data:image/png;base64," + wrapped, "f");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, bytes);
  for (char& c : b64) c = c == '+' ? '-' : c == '/' ? '_' : c;
  r = DecodeImageDataUri("data:image/png;base64," + b64, "f");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, bytes);
  // Truncated by one character: not a whole number of bytes, or not a PNG any more.
  EXPECT_FALSE(
      DecodeImageDataUri("data:image/png;base64," + b64.substr(0, b64.size() / 2 + 1), "f").ok());
}

TEST(OpenAiApi, EngineFieldNamesBecomeTheRequestsNames) {
  EXPECT_EQ(
      ToOpenAiFieldNames(InvalidArgument("sampling.top_p must be in (0, 1], got 2")).message(),
      "top_p must be in (0, 1], got 2");
  EXPECT_EQ(
      ToOpenAiFieldNames(InvalidArgument("the prompt (9 tokens) plus sampling.max_tokens (9)"))
          .message(),
      "the prompt (9 tokens) plus max_tokens (9)");
  EXPECT_EQ(ToOpenAiFieldNames(ResourceExhausted("queue")).code(), StatusCode::kResourceExhausted);
}

TEST(OpenAiApi, ErrorBodiesAndStatuses) {
  EXPECT_EQ(HttpStatusOf(InvalidArgument("x")), 400);
  EXPECT_EQ(HttpStatusOf(NotFound("x")), 404);
  EXPECT_EQ(HttpStatusOf(ResourceExhausted("x")), 429);
  EXPECT_EQ(HttpStatusOf(Unavailable("x")), 503);
  EXPECT_EQ(HttpStatusOf(DeadlineExceeded("x")), 504);
  EXPECT_EQ(HttpStatusOf(Internal("x")), 500);
  json e = json::parse(ErrorJson(InvalidArgument("messages[0].content[1].image_url: bad")));
  EXPECT_EQ(e["error"]["param"], "messages[0].content[1].image_url");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["message"], "messages[0].content[1].image_url: bad");
  e = json::parse(ErrorJson(InvalidArgument("the request body is not valid JSON")));
  EXPECT_TRUE(e["error"]["param"].is_null());
  e = json::parse(ErrorJson(ResourceExhausted("the request queue is full")));
  EXPECT_EQ(e["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(e["error"]["param"].is_null());
}

TEST(OpenAiApi, ResponseAndChunkShapes) {
  CompletionMeta meta{"chatcmpl-7", "shapes-llava", 1700000000};
  GenerationResult r;
  r.finish = FinishReason::kLength;
  r.prompt_tokens = 160;
  r.image_tokens = 144;
  r.completion_tokens = 5;
  r.kv.bytes_kept = 100;
  r.kv.full_equivalent_bytes = 400;
  json c = json::parse(CompletionJson(meta, "Hello \xE2\x9C\x93", r, 0.25));
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["id"], "chatcmpl-7");
  EXPECT_EQ(c["created"], 1700000000);
  EXPECT_EQ(c["choices"][0]["message"]["content"], "Hello \xE2\x9C\x93");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["total_tokens"], 165);
  EXPECT_EQ(c["usage"]["image_tokens"], 144);
  EXPECT_DOUBLE_EQ(c["usage"]["kv_saved_ratio"].get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(c["usage"]["queue_seconds"].get<double>(), 0.25);

  const std::string role = "assistant", text = "Hi";
  json first = json::parse(ChunkJson(meta, &role, nullptr, nullptr, false));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(first.contains("usage"));
  json mid = json::parse(ChunkJson(meta, nullptr, &text, nullptr, true));
  EXPECT_EQ(mid["choices"][0]["delta"], json({{"content", "Hi"}}));
  EXPECT_TRUE(mid.contains("usage") && mid["usage"].is_null());
  json last = json::parse(ChunkJson(meta, nullptr, nullptr, "stop", true));
  EXPECT_EQ(last["choices"][0]["delta"], json::object());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  json usage = json::parse(UsageChunkJson(meta, r, 0));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 5);
}

}  // namespace
}  // namespace llava::server
