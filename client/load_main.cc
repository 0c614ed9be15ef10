// llava-load: a closed-loop load generator for llava-server. `--concurrency` workers each send
// streaming chat requests back to back until `--requests` have completed; prints throughput
// and latency percentiles, and ends with one `key=value` summary line for scripts. Over gRPC
// (ChatStream) by default, or over the OpenAI-compatible HTTP API (`--http URL`: server-sent
// events), the same requests either way.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "client/base64.h"
#include "client/channel.h"
#include "llava/v1/llava.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * (v.size() - 1) + 0.5));
  return v[i];
}

// One streamed request as the client saw it.
struct Sample {
  std::string error;  // empty on success
  double first = -1;  // seconds to the first text
  std::vector<double> gaps;
  double total = 0;
  int64_t chunks = 0, completion_tokens = 0, kv_used = 0, kv_full = 0;
};

// Times a stream: call Text() for each piece of text as it arrives.
struct StreamClock {
  Clock::time_point t0 = Clock::now(), prev = t0;
  void Text(Sample* s) {
    const Clock::time_point now = Clock::now();
    ++s->chunks;
    if (s->first < 0) {
      s->first = std::chrono::duration<double>(now - t0).count();
    } else {
      s->gaps.push_back(std::chrono::duration<double>(now - prev).count());
    }
    prev = now;
  }
  void End(Sample* s) const { s->total = std::chrono::duration<double>(Clock::now() - t0).count(); }
};

Sample GrpcStream(llava::v1::LlavaService::Stub* stub, const llava::v1::ChatRequest& req,
                  const std::string& token) {
  Sample s;
  StreamClock clock;
  grpc::ClientContext ctx;
  llava::client::Authorize(&ctx, token);
  auto reader = stub->ChatStream(&ctx, req);
  llava::v1::ChatChunk chunk, last;
  while (reader->Read(&chunk)) {
    if (!chunk.text_delta().empty()) clock.Text(&s);
    last = chunk;
  }
  const grpc::Status status = reader->Finish();
  clock.End(&s);
  if (!status.ok()) {
    s.error = std::to_string(status.error_code()) + " " + status.error_message();
    return s;
  }
  s.completion_tokens = last.usage().completion_tokens();
  s.kv_used = last.usage().kv_bytes_used();
  s.kv_full = last.usage().kv_bytes_full();
  return s;
}

// POST /v1/chat/completions with "stream": true; reads the server-sent events as they come.
Sample HttpStream(httplib::Client* client, const std::string& body, const std::string& token) {
  Sample s;
  StreamClock clock;
  std::string pending;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  if (!token.empty()) req.set_header("Authorization", "Bearer " + token);
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    pending.append(data, n);
    for (size_t end = pending.find("\n\n"); end != std::string::npos; end = pending.find("\n\n")) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      const auto j = nlohmann::json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) s.error = j["error"].value("message", "error event");
      if (j.contains("usage") && j["usage"].is_object()) {
        s.completion_tokens = j["usage"].value("completion_tokens", int64_t{0});
        s.kv_used = j["usage"].value("kv_bytes_used", int64_t{0});
        s.kv_full = j["usage"].value("kv_bytes_full", int64_t{0});
      }
      if (j.contains("choices") && !j["choices"].empty()) {
        const auto& delta = j["choices"][0]["delta"];
        if (delta.contains("content") && delta["content"].is_string() &&
            !delta["content"].get<std::string>().empty()) {
          clock.Text(&s);
        }
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client->send(req, res, err);
  clock.End(&s);
  if (!sent) {
    s.error = "HTTP " + httplib::to_string(err);
  } else if (res.status != 200) {
    s.error = "HTTP " + std::to_string(res.status) + " " + pending;
  }
  return s;
}

// The gRPC request as the OpenAI API's JSON (images as data URIs, the cache as the kv_cache
// extension), so both transports carry the same work.
std::string ToOpenAiJson(const llava::v1::ChatRequest& r, const std::string& policy) {
  nlohmann::json parts = nlohmann::json::array();
  for (const auto& part : r.messages(0).content()) {
    if (part.has_image()) {
      const std::string& d = part.image().data();
      const char* mime = d.rfind("\x89PNG", 0) == 0    ? "image/png"
                         : d.rfind("\xFF\xD8", 0) == 0 ? "image/jpeg"
                         : d.rfind("BM", 0) == 0       ? "image/bmp"
                                                       : "image/webp";
      parts.push_back(
          {{"type", "image_url"},
           {"image_url",
            {{"url", std::string("data:") + mime + ";base64," + llava::client::Base64Encode(d)}}}});
    } else {
      parts.push_back({{"type", "text"}, {"text", part.text()}});
    }
  }
  nlohmann::json j = {{"messages", {{{"role", "user"}, {"content", parts}}}},
                      {"max_tokens", r.sampling().max_tokens()},
                      {"temperature", r.sampling().temperature()},
                      {"ignore_eos", r.sampling().ignore_eos()},
                      {"stream", true},
                      {"stream_options", {{"include_usage", true}}}};
  if (!policy.empty()) j["kv_cache"]["policy"] = policy;
  if (r.kv_cache().has_budget()) j["kv_cache"]["budget"] = r.kv_cache().budget();
  return j.dump();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Load generator for llava-server"};
  std::string server = "127.0.0.1:50051", prompt = "Describe the image in detail.", policy;
  std::vector<std::string> images;
  int concurrency = 8, requests = 32, max_tokens = 64, min_tokens = 0;
  double budget = -1, temperature = 0;
  bool ignore_eos = false;
  std::string http, token_file;
  app.add_option("--server", server, llava::client::kTargetHelp)->capture_default_str();
  app.add_option("--token-file", token_file, llava::client::kTokenFileHelp);
  llava::client::TlsOptions tls;
  llava::client::AddTlsFlags(&app, &tls);
  app.add_option("--http", http,
                 "use the OpenAI-compatible HTTP API at this base URL instead of gRPC (e.g. "
                 "http://127.0.0.1:8000)");
  app.add_option("--concurrency", concurrency, "parallel streams")->capture_default_str();
  app.add_option("--requests", requests, "requests in all")->capture_default_str();
  app.add_option("--prompt", prompt)->capture_default_str();
  app.add_option("--image", images, "image file (repeatable), sent with every request");
  app.add_option("--max-tokens", max_tokens)->capture_default_str();
  app.add_option("--min-tokens", min_tokens,
                 "spread the requests' max_tokens evenly over [min, --max-tokens] (a fixed "
                 "permutation), so streams do not start and end in lockstep; 0 = all equal")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", temperature)->capture_default_str();
  app.add_option("--policy", policy,
                 "full | elastic | h2o | streaming_llm | snapkv (default: server's)");
  app.add_option("--budget", budget, "KV budget ratio (default: server's)");
  app.add_flag("--ignore-eos", ignore_eos,
               "generate exactly --max-tokens per request (equal work for every policy)");
  CLI11_PARSE(app, argc, argv);
  const std::optional<std::string> read_token = llava::client::ReadToken(token_file);
  if (!read_token) {
    std::fprintf(stderr, "error: cannot read --token-file %s\n", token_file.c_str());
    return 2;
  }
  const std::string token = *read_token;

  llava::v1::ChatRequest base;
  auto* m = base.add_messages();
  m->set_role(llava::v1::ROLE_USER);
  for (const auto& path : images) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "error: cannot read %s\n", path.c_str());
      return 1;
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    m->add_content()->mutable_image()->set_data(ss.str());
  }
  m->add_content()->set_text(prompt);
  base.mutable_sampling()->set_max_tokens(max_tokens);
  base.mutable_sampling()->set_temperature(static_cast<float>(temperature));
  if (ignore_eos) base.mutable_sampling()->set_ignore_eos(true);
  if (!policy.empty()) {
    llava::v1::CachePolicy p;
    std::string name = "CACHE_POLICY_" + policy;
    for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (!llava::v1::CachePolicy_Parse(name, &p)) {
      std::fprintf(stderr, "error: unknown --policy %s\n", policy.c_str());
      return 1;
    }
    base.mutable_kv_cache()->set_policy(p);
  }
  if (budget > 0) base.mutable_kv_cache()->set_budget(budget);

  auto channel = llava::client::MakeChannel(server, tls);
  std::atomic<int> next{0};
  std::mutex mu;
  std::vector<double> ttft, itl, e2e;
  int64_t tokens = 0, text_chunks = 0;
  int errors = 0;
  int64_t kv_used = 0, kv_full = 0;
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < concurrency; ++w) {
    workers.emplace_back([&, w] {
      auto stub = llava::v1::LlavaService::NewStub(channel);
      std::unique_ptr<httplib::Client> client;
      if (!http.empty()) {
        // An https:// URL verifies the server against --tls-ca (the system's CAs without it)
        // and presents --tls-cert/--tls-key when given (mutual TLS).
        client = tls.cert.empty() ? std::make_unique<httplib::Client>(http)
                                  : std::make_unique<httplib::Client>(http, tls.cert, tls.key);
        if (!tls.ca.empty()) client->set_ca_cert_path(tls.ca);
        client->set_read_timeout(600, 0);
        client->set_keep_alive(true);
        client->set_tcp_nodelay(true);  // headers and body go out as two writes
      }
      for (int i = next.fetch_add(1); i < requests; i = next.fetch_add(1)) {
        llava::v1::ChatRequest req = base;
        if (min_tokens > 0 && min_tokens < max_tokens) {
          // Request i's share of the range: a stride coprime with most spans spreads lengths.
          const int span = max_tokens - min_tokens + 1;
          req.mutable_sampling()->set_max_tokens(
              min_tokens + static_cast<int>((static_cast<int64_t>(i) * 7919) % span));
        }
        req.set_request_id("load-" + std::to_string(w));
        const Sample s = client ? HttpStream(client.get(), ToOpenAiJson(req, policy), token)
                                : GrpcStream(stub.get(), req, token);
        std::lock_guard<std::mutex> lock(mu);
        if (!s.error.empty()) {
          ++errors;
          std::fprintf(stderr, "request failed: %s\n", s.error.c_str());
          continue;
        }
        if (s.first >= 0) ttft.push_back(s.first);
        itl.insert(itl.end(), s.gaps.begin(), s.gaps.end());
        e2e.push_back(s.total);
        tokens += s.completion_tokens;
        text_chunks += s.chunks;
        kv_used += s.kv_used;
        kv_full += s.kv_full;
      }
    });
  }
  for (auto& t : workers) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const int ok = static_cast<int>(e2e.size());
  std::printf("requests %d ok, %d failed in %.2f s (concurrency %d)\n", ok, errors, wall,
              concurrency);
  std::printf("throughput: %.2f requests/s, %.1f generated tokens/s\n", ok / wall, tokens / wall);
  std::printf("TTFT  p50 %.3f s  p90 %.3f s  p99 %.3f s\n", Percentile(ttft, 50),
              Percentile(ttft, 90), Percentile(ttft, 99));
  // A chunk carries every token produced while the previous one was being sent, so under
  // load a gap between chunks can span several tokens (text_chunks_per_token < 1).
  std::printf(
      "ITL   p50 %.4f s  p90 %.4f s  p99 %.4f s (gaps between text chunks; %.3f chunks "
      "per token)\n",
      Percentile(itl, 50), Percentile(itl, 90), Percentile(itl, 99),
      tokens > 0 ? double(text_chunks) / tokens : 0.0);
  std::printf("E2E   p50 %.3f s  p99 %.3f s\n", Percentile(e2e, 50), Percentile(e2e, 99));
  std::printf("KV bytes kept / full at the end of requests: %.3f\n",
              kv_full > 0 ? double(kv_used) / kv_full : 0.0);
  std::printf(
      "concurrency=%d requests=%d ok=%d errors=%d wall_s=%.3f req_s=%.3f tok_s=%.2f "
      "ttft_p50_s=%.4f ttft_p90_s=%.4f ttft_p99_s=%.4f itl_p50_s=%.5f itl_p90_s=%.5f "
      "itl_p99_s=%.5f e2e_p50_s=%.4f e2e_p99_s=%.4f kv_kept_ratio=%.4f "
      "text_chunks_per_token=%.4f\n",
      concurrency, requests, ok, errors, wall, ok / wall, tokens / wall, Percentile(ttft, 50),
      Percentile(ttft, 90), Percentile(ttft, 99), Percentile(itl, 50), Percentile(itl, 90),
      Percentile(itl, 99), Percentile(e2e, 50), Percentile(e2e, 99),
      kv_full > 0 ? double(kv_used) / kv_full : 0.0,
      tokens > 0 ? double(text_chunks) / tokens : 0.0);
  return errors == 0 ? 0 : 1;
}
