// llava-load: a closed-loop load generator for llava-server. `--concurrency` workers each send
// streaming chat requests back to back until `--requests` have completed; prints throughput
// and latency percentiles, and ends with one `key=value` summary line for scripts.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Load generator for llava-server"};
  std::string server = "127.0.0.1:50051", prompt = "Describe the image in detail.", policy;
  std::vector<std::string> images;
  int concurrency = 8, requests = 32, max_tokens = 64, min_tokens = 0;
  double budget = -1, temperature = 0;
  bool ignore_eos = false;
  app.add_option("--server", server, llava::client::kTargetHelp)->capture_default_str();
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
  app.add_option("--policy", policy, "full | elastic | h2o | streaming_llm (default: server's)");
  app.add_option("--budget", budget, "KV budget ratio (default: server's)");
  app.add_flag("--ignore-eos", ignore_eos,
               "generate exactly --max-tokens per request (equal work for every policy)");
  CLI11_PARSE(app, argc, argv);

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

  auto channel = llava::client::MakeChannel(server);
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
      for (int i = next.fetch_add(1); i < requests; i = next.fetch_add(1)) {
        grpc::ClientContext ctx;
        llava::v1::ChatRequest req = base;
        if (min_tokens > 0 && min_tokens < max_tokens) {
          // Request i's share of the range: a stride coprime with most spans spreads lengths.
          const int span = max_tokens - min_tokens + 1;
          req.mutable_sampling()->set_max_tokens(
              min_tokens + static_cast<int>((static_cast<int64_t>(i) * 7919) % span));
        }
        req.set_request_id("load-" + std::to_string(w));
        const Clock::time_point t0 = Clock::now();
        auto reader = stub->ChatStream(&ctx, req);
        llava::v1::ChatChunk chunk, last;
        std::vector<double> gaps;
        int64_t chunks = 0;
        double first = -1;
        Clock::time_point prev = t0;
        while (reader->Read(&chunk)) {
          const Clock::time_point now = Clock::now();
          if (!chunk.text_delta().empty()) {
            ++chunks;
            if (first < 0) {
              first = std::chrono::duration<double>(now - t0).count();
            } else {
              gaps.push_back(std::chrono::duration<double>(now - prev).count());
            }
            prev = now;
          }
          last = chunk;
        }
        const grpc::Status s = reader->Finish();
        const double total = std::chrono::duration<double>(Clock::now() - t0).count();
        std::lock_guard<std::mutex> lock(mu);
        if (!s.ok()) {
          ++errors;
          std::fprintf(stderr, "request failed: %d %s\n", s.error_code(),
                       s.error_message().c_str());
          continue;
        }
        if (first >= 0) ttft.push_back(first);
        itl.insert(itl.end(), gaps.begin(), gaps.end());
        e2e.push_back(total);
        tokens += last.usage().completion_tokens();
        text_chunks += chunks;
        kv_used += last.usage().kv_bytes_used();
        kv_full += last.usage().kv_bytes_full();
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
