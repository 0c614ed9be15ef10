// llava-chat: a command-line chat client for llava-server.
//
//   llava-chat --server HOST:PORT --image FILE [--image FILE2] "question"   one answer, streamed
//   llava-chat --server HOST:PORT [--image FILE]                           interactive, multi-turn
//
// In interactive mode each line is a user turn; "/image FILE" attaches an image to the next
// turn, "/reset" starts a new conversation, "/quit" (or end of input) leaves. Usage (tokens,
// KV bytes saved, latency) is printed to stderr after each answer.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "client/channel.h"
#include "llava/v1/llava.grpc.pb.h"

namespace {

using llava::v1::ChatChunk;
using llava::v1::ChatRequest;
using llava::v1::Message;

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

std::string MimeOf(const std::string& path) {
  std::string ext = path.substr(path.find_last_of('.') + 1);
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (ext == "png") return "image/png";
  if (ext == "jpg" || ext == "jpeg") return "image/jpeg";
  if (ext == "webp") return "image/webp";
  if (ext == "bmp") return "image/bmp";
  return "";  // the server detects it
}

struct Options {
  std::string server = "127.0.0.1:50051", system, policy, position_mode, elastic_variant;
  std::string token_file, token;
  llava::client::TlsOptions tls;
  int max_tokens = 0, top_k = -1, recent_distance = 0, sink_tokens = -1;
  float temperature = -1, top_p = -1, repetition_penalty = -1;
  double budget = -1, timeout_s = 600;
  int64_t seed = -1;
  std::vector<std::string> stop;
};

// Applies the flags the user set (unset ones stay unset: the server's defaults apply).
bool FillRequest(const Options& o, ChatRequest* r) {
  auto* s = r->mutable_sampling();
  if (o.max_tokens > 0) s->set_max_tokens(o.max_tokens);
  if (o.temperature >= 0) s->set_temperature(o.temperature);
  if (o.top_p >= 0) s->set_top_p(o.top_p);
  if (o.top_k >= 0) s->set_top_k(o.top_k);
  if (o.seed >= 0) s->set_seed(static_cast<uint64_t>(o.seed));
  if (o.repetition_penalty >= 0) s->set_repetition_penalty(o.repetition_penalty);
  for (const auto& st : o.stop) s->add_stop(st);
  auto* kv = r->mutable_kv_cache();
  if (!o.policy.empty()) {
    llava::v1::CachePolicy p;
    std::string name = "CACHE_POLICY_" + o.policy;
    for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (!llava::v1::CachePolicy_Parse(name, &p)) {
      std::cerr << "error: --policy must be full, elastic, h2o, streaming_llm or snapkv\n";
      return false;
    }
    kv->set_policy(p);
  }
  if (o.budget >= 0) kv->set_budget(o.budget);
  if (o.recent_distance > 0) kv->set_recent_distance(o.recent_distance);
  if (o.sink_tokens >= 0) kv->set_sink_tokens(o.sink_tokens);
  if (o.position_mode == "compressed") kv->set_position_mode(llava::v1::POSITION_MODE_COMPRESSED);
  if (o.elastic_variant == "paper")
    kv->mutable_elastic()->set_variant(llava::v1::ELASTIC_VARIANT_PAPER);
  if (o.elastic_variant == "product") {
    kv->mutable_elastic()->set_variant(llava::v1::ELASTIC_VARIANT_PRODUCT);
  }
  return true;
}

// Streams one answer to stdout; returns the full text, or nullopt on error.
std::optional<std::string> Ask(llava::v1::LlavaService::Stub* stub, const ChatRequest& req,
                               double timeout_s, const std::string& token) {
  grpc::ClientContext ctx;
  llava::client::Authorize(&ctx, token);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  auto reader = stub->ChatStream(&ctx, req);
  ChatChunk chunk, last;
  std::string text;
  while (reader->Read(&chunk)) {
    std::cout << chunk.text_delta() << std::flush;
    text += chunk.text_delta();
    last = chunk;
  }
  std::cout << "\n";
  grpc::Status s = reader->Finish();
  if (!s.ok()) {
    std::cerr << "error: " << s.error_code() << " " << s.error_message() << "\n";
    return std::nullopt;
  }
  const auto& u = last.usage();
  const double saved =
      u.kv_bytes_full() > 0 ? 100.0 * (1.0 - double(u.kv_bytes_used()) / u.kv_bytes_full()) : 0;
  std::cerr << "[" << llava::v1::FinishReason_Name(last.finish_reason()) << "] prompt "
            << u.prompt_tokens() << " tokens (" << u.image_tokens() << " image), completion "
            << u.completion_tokens() << " tokens; KV " << u.kv_bytes_used() << " of "
            << u.kv_bytes_full() << " bytes (" << static_cast<int>(saved) << "% saved, "
            << u.tokens_merged() << " merged, " << u.tokens_evicted() << " evicted); TTFT "
            << u.time_to_first_token_seconds() << " s, total " << u.total_seconds() << " s\n";
  return text;
}

bool AddImage(const std::string& path, Message* m) {
  std::string bytes;
  if (!ReadFile(path, &bytes)) {
    std::cerr << "error: cannot read image " << path << "\n";
    return false;
  }
  auto* img = m->add_content()->mutable_image();
  img->set_data(std::move(bytes));
  img->set_mime_type(MimeOf(path));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Chat with llava-server"};
  Options o;
  std::vector<std::string> images;
  std::string question;
  app.add_option("--server", o.server, llava::client::kTargetHelp)->capture_default_str();
  app.add_option("--token-file", o.token_file, llava::client::kTokenFileHelp);
  llava::client::AddTlsFlags(&app, &o.tls);
  // One file per --image (repeatable): a vector option would otherwise swallow the question.
  app.add_option("--image", images, "image file (repeatable); attached to the first turn")
      ->allow_extra_args(false);
  app.add_option("question", question, "ask once and exit; omit for interactive mode");
  app.add_option("--system", o.system, "system prompt");
  app.add_option("--max-tokens", o.max_tokens, "default: the server's");
  app.add_option("--temperature", o.temperature);
  app.add_option("--top-p", o.top_p);
  app.add_option("--top-k", o.top_k);
  app.add_option("--seed", o.seed);
  app.add_option("--stop", o.stop, "stop string (repeatable)");
  app.add_option("--repetition-penalty", o.repetition_penalty);
  app.add_option("--policy", o.policy, "full | elastic | h2o | streaming_llm | snapkv");
  app.add_option("--budget", o.budget, "KV budget ratio in (0, 1]");
  app.add_option("--recent-distance", o.recent_distance);
  app.add_option("--sink-tokens", o.sink_tokens);
  app.add_option("--position-mode", o.position_mode, "original | compressed");
  app.add_option("--elastic-variant", o.elastic_variant,
                 "product (the default Elastic) | paper (the method as published)")
      ->check(CLI::IsMember({"product", "paper"}));
  app.add_option("--timeout", o.timeout_s, "seconds per answer")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const std::optional<std::string> token = llava::client::ReadToken(o.token_file);
  if (!token) {
    std::cerr << "error: cannot read --token-file " << o.token_file << "\n";
    return 2;
  }
  o.token = *token;

  auto stub = llava::v1::LlavaService::NewStub(llava::client::MakeChannel(o.server, o.tls));
  ChatRequest conversation;
  if (!o.system.empty()) {
    Message* m = conversation.add_messages();
    m->set_role(llava::v1::ROLE_SYSTEM);
    m->add_content()->set_text(o.system);
  }
  std::vector<std::string> pending_images = images;
  auto turn = [&](const std::string& text) -> bool {
    ChatRequest req = conversation;
    Message* m = req.add_messages();
    m->set_role(llava::v1::ROLE_USER);
    for (const auto& path : pending_images) {
      if (!AddImage(path, m)) return false;
    }
    m->add_content()->set_text(text);
    if (!FillRequest(o, &req)) return false;
    auto answer = Ask(stub.get(), req, o.timeout_s, o.token);
    if (!answer) return false;
    pending_images.clear();
    conversation = req;
    conversation.clear_sampling();
    conversation.clear_kv_cache();
    Message* a = conversation.add_messages();
    a->set_role(llava::v1::ROLE_ASSISTANT);
    a->add_content()->set_text(*answer);
    return true;
  };

  if (!question.empty()) return turn(question) ? 0 : 1;
  std::string line;
  std::cerr << "llava-chat: /image FILE attaches an image, /reset, /quit\n";
  while (std::cerr << "> " && std::getline(std::cin, line)) {
    if (line.empty()) continue;
    if (line == "/quit") break;
    if (line == "/reset") {
      conversation.clear_messages();
      continue;
    }
    if (line.rfind("/image ", 0) == 0) {
      pending_images.push_back(line.substr(7));
      continue;
    }
    turn(line);
  }
  return 0;
}
