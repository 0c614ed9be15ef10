// llava-generate: answers one question about an image, streaming the answer to stdout.
//   llava-generate --model DIR --image FILE --prompt TEXT [--temperature T --top-p P ...]
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "engine/kernels/cpu_features.h"
#include "engine/kernels/runtime.h"
#include "engine/kv/kv_policy.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"

int main(int argc, char** argv) {
  CLI::App app{"Generate an answer about an image with a LLaVA model"};
  std::string model_dir = LLAVA_DEFAULT_MODEL_DIR, prompt, dtype = "auto", device = "cpu";
  std::vector<std::string> image_paths;
  std::string system_prompt;
  int threads = 0;
  bool show_stats = false;
  llava::SamplingParams sp;
  app.add_option("--model", model_dir, "llava-hf model folder")->capture_default_str();
  app.add_option("--image", image_paths, "image file (repeatable)");
  app.add_option("--prompt", prompt, "the question")->required();
  app.add_option("--system", system_prompt, "optional system prompt");
  bool question_first = false;
  app.add_flag("--question-first", question_first,
               "the question before the image (the paper's layout; with --system llava_v1 for "
               "LLaVA-1.5's system prompt)");
  app.add_option("--max-tokens", sp.max_tokens, "tokens to generate at most")
      ->capture_default_str();
  app.add_option("--temperature", sp.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-p", sp.top_p, "nucleus sampling mass")->capture_default_str();
  app.add_option("--top-k", sp.top_k, "0 = off")->capture_default_str();
  app.add_option("--seed", sp.seed, "sampling seed")->capture_default_str();
  app.add_option("--repetition-penalty", sp.repetition_penalty)->capture_default_str();
  app.add_option("--stop", sp.stop, "stop string (repeatable)");
  std::string policy = "elastic", position_mode = "original";
  llava::CacheParams kv;
  int recent_distance = 0;
  app.add_option(
         "--policy", policy,
         "KV cache policy (" + llava::KvPolicyNames() +
             " | lookm) with options, e.g. elastic+paper, h2o+paper (engine/kv/cache_policy.h, "
             "ParseCacheSpec)")
      ->capture_default_str();
  app.add_option("--budget", kv.budget, "KV budget ratio gamma in (0, 1]")->capture_default_str();
  app.add_option("--recent-distance", recent_distance,
                 "Elastic fixed-point distance (0: the preset's, 25)");
  app.add_option("--sink-tokens", kv.sink_tokens, "protected first tokens (-1: policy default)")
      ->capture_default_str();
  app.add_option("--position-mode", position_mode, "original | compressed")->capture_default_str();
  app.add_option("--dtype", dtype, "auto | bf16 | f32 (llava-server --help)")
      ->check(CLI::IsMember({"auto", "bf16", "f32"}))
      ->capture_default_str();
  std::string weights = "bf16";
  app.add_option("--weights", weights, "bf16 | int8 | int4 (llava-server --help)")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  std::string kv_dtype = "auto";
  app.add_option("--kv-cache-dtype", kv_dtype, "auto | int8 (llava-server --help)")
      ->check(CLI::IsMember({"auto", "int8"}))
      ->capture_default_str();
  app.add_option("--device", device, "cpu | cuda[:i]")->capture_default_str();
  app.add_option("--threads", threads,
                 "intra-op threads (0 = auto: 1 for a model of at most 16 Mi parameters, else one "
                 "per core)");
  app.add_flag("--stats", show_stats, "print token counts and timings to stderr");
  CLI11_PARSE(app, argc, argv);
  std::string threads_why;
  llava::InitTorchThreads(llava::ResolveModelThreads(threads, model_dir, &threads_why));

  llava::ModelOptions options;
  options.device = device;
  options.weights = llava::ParseWeightFormat(weights).value();  // checked by the flag
  options.kv_dtype = llava::ParseKvDtype(kv_dtype).value();     // checked by the flag
  std::string dtype_why;
  llava::ResolveModelDType(dtype, model_dir, &options, &dtype_why);
  if (show_stats) {
    std::fprintf(stderr, "cpu kernels: %s; weights: %s; threads: %s\n",
                 llava::CpuPathName(llava::ActiveCpuPath()), dtype_why.c_str(),
                 threads_why.c_str());
  }
  auto loaded = llava::LoadModel(model_dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "error: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  llava::GenerationRequest req;
  req.sampling = sp;
  auto parsed_mode = llava::ParsePositionMode(position_mode);
  if (!parsed_mode.ok()) {
    std::fprintf(stderr, "error: %s\n", parsed_mode.status().ToString().c_str());
    return 1;
  }
  kv.position_mode = *parsed_mode;
  auto parsed = llava::ParseCacheSpec(policy, kv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "error: %s\n", parsed.status().ToString().c_str());
    return 1;
  }
  req.kv_cache = *parsed;
  if (recent_distance > 0) req.kv_cache.elastic.recent_distance = recent_distance;
  if (system_prompt == "llava_v1") system_prompt = llava::kLlavaV1SystemPrompt;
  if (!system_prompt.empty()) {
    req.messages.push_back({"system", {{llava::ContentPart::Kind::kText, system_prompt, 0}}});
  }
  llava::ChatMessage user{"user", {}};
  if (question_first) user.content.push_back({llava::ContentPart::Kind::kText, prompt, 0});
  for (size_t i = 0; i < image_paths.size(); ++i) {
    std::string bytes;
    if (!llava::ReadFileToString(image_paths[i], &bytes)) {
      std::fprintf(stderr, "error: cannot read --image %s\n", image_paths[i].c_str());
      return 1;
    }
    req.images.push_back(std::move(bytes));
    user.content.push_back({llava::ContentPart::Kind::kImage, "", static_cast<int>(i)});
  }
  if (!question_first) user.content.push_back({llava::ContentPart::Kind::kText, prompt, 0});
  req.messages.push_back(std::move(user));

  llava::Generator generator(**loaded, llava::EngineLimits{});
  auto result = generator.Generate(req, [](const std::string& delta) {
    std::cout << delta << std::flush;
    return true;
  });
  std::cout << std::endl;
  if (!result.ok()) {
    std::fprintf(stderr, "error: %s\n", result.status().ToString().c_str());
    return 1;
  }
  if (show_stats) {
    const auto& r = *result;
    const double decode_s = r.total_seconds - r.ttft_seconds;
    std::fprintf(
        stderr,
        "prompt_tokens=%d image_tokens=%d completion_tokens=%d finish=%s ttft_s=%.3f "
        "total_s=%.3f decode_tok_s=%.1f kv_bytes=%lld kv_full_bytes=%lld merged=%lld "
        "evicted=%lld\n",
        r.prompt_tokens, r.image_tokens, r.completion_tokens, llava::FinishReasonName(r.finish),
        r.ttft_seconds, r.total_seconds,
        r.completion_tokens > 1 ? (r.completion_tokens - 1) / decode_s : 0.0,
        static_cast<long long>(r.kv.bytes_kept), static_cast<long long>(r.kv.full_equivalent_bytes),
        static_cast<long long>(r.kv.tokens_merged), static_cast<long long>(r.kv.tokens_evicted));
  }
  return 0;
}
