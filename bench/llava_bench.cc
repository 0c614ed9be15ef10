// llava-bench: decoder throughput at LLaVA-1.5-7B layer shapes with random bf16 weights.
//
// Prints the machine's memory read bandwidth, prefill tokens/s for a 512-token prompt, decode
// tokens/s at 1, 4 and 8 concurrent sequences (linear layers batched across sequences,
// attention per sequence), and the decode "bandwidth floor": a batch-1 decode step must read
// every decoder weight once, so tokens/s <= bandwidth / weight bytes. Medians of --reps runs;
// each batch-1 run is set against a bandwidth probe taken just before it.
// With --model DIR the same measurements run on that checkpoint (e.g. the shipped default
// model: how decode scales with the batch when per-sequence work, not weights, dominates).
// --device cuda[:i] runs the decoder, policies and paper suites on a GPU (a CUDA libtorch;
// scripts/gpu-run.sh); every timed region ends with a copy of its result to the host, which
// waits for the device. The last line is `key=value` pairs for scripts.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include "engine/kernels/activation_memory.h"
#include "engine/kernels/cpu_features.h"
#include "engine/kernels/cpu_gemv.h"
#include "engine/kernels/decode_attention.h"
#include "engine/kernels/quant_gemv.h"
#include "engine/kernels/runtime.h"
#include "engine/kv/kv_cache.h"
#include "engine/kv/kv_pool.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"

namespace {

using Clock = std::chrono::steady_clock;

llava::CacheParams FullCache() {
  llava::CacheParams p;
  p.policy = llava::CachePolicy::kFull;
  return p;
}

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Waits for the device: the result's bytes on the host (a no-op wait on the CPU).
void Sync(const at::Tensor& t) { (void)t.to(at::kCPU); }

// Read bandwidth in bytes/s: a sum over `buf`, a buffer far larger than the caches (best of
// `runs`). The caller makes the buffer once and keeps it, so that probing before every timed
// run does not also allocate and fill 1 GiB each time.
double MeasureReadBandwidth(const at::Tensor& buf, int runs = 7) {
  const double bytes = static_cast<double>(buf.numel() * buf.element_size());
  double best = 0;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = Clock::now();
    volatile float s = buf.sum().item<float>();
    (void)s;
    best = std::max(best, bytes / Seconds(t0));
  }
  return best;
}

// A KV pool for `sequences` caches of up to `entries` entries each (plus a decode step's spare),
// as the server's engine holds one: the benchmarks measure the paged caches it serves from.
std::unique_ptr<llava::KvPool> PoolFor(const llava::LlavaModel& model, int64_t sequences,
                                       int64_t entries) {
  const llava::KvLayout l = model.kv_layout();
  const int64_t pages = sequences * ((entries + llava::kKvPageRows) / llava::kKvPageRows);
  return std::make_unique<llava::KvPool>(
      l, pages * llava::kKvPageRows * l.num_layers * l.bytes_per_entry());
}

// One forward pass over `chunks` as the engine runs it: each cache's pages reserved first,
// the pass committed to every cache after. Every chunk's `kv` is a KvCache.
at::Tensor Feed(const llava::LlavaModel& model, const std::vector<llava::SequenceChunk>& chunks) {
  auto cache = [](const llava::SequenceChunk& c) { return static_cast<llava::KvCache*>(c.kv); };
  for (const llava::SequenceChunk& c : chunks) {
    TORCH_CHECK(cache(c)->Reserve(c.embeds.size(0)), "benchmark KV pool too small");
  }
  at::Tensor logits = model.Forward(chunks);
  for (const llava::SequenceChunk& c : chunks)
    cache(c)->Commit(c.embeds.size(0), c.prompt_continues);
  return logits;
}

// LLaVA-1.5-7B's decoder layers and vocabulary; the vision tower is not measured here.
llava::LlavaConfig BenchConfig(int layers) {
  llava::LlavaConfig c = llava::PresetConfig(llava::ModelPreset::kLlava7b, 32064, 32000);
  c.text.num_hidden_layers = layers;
  return c;
}

// Random weights for every tensor the model reads (engine/io/weight_manifest.h): matrices and
// embeddings ~N(0, 0.02), norms 1, biases 0. Made on `device`, so that the model takes them
// without a copy (all 32 layers of 7B are 13.5 GB).
std::vector<std::pair<std::string, at::Tensor>> RandomWeights(const llava::LlavaConfig& c,
                                                              const at::Device& device) {
  using llava::WeightRole;
  const at::TensorOptions bf16 = at::TensorOptions(at::kBFloat16).device(device);
  std::vector<std::pair<std::string, at::Tensor>> w;
  for (const llava::WeightSpec& s : llava::LlavaWeightManifest(c)) {
    if (!s.used) continue;
    at::Tensor x;
    switch (s.role) {
      case WeightRole::kNormWeight:
        x = at::ones(s.shape, bf16);
        break;
      case WeightRole::kBias:
      case WeightRole::kNormBias:
        x = at::zeros(s.shape, bf16);
        break;
      default:
        x = at::randn(s.shape, bf16.dtype(at::kFloat)).mul_(0.02).to(at::kBFloat16);
    }
    w.emplace_back(s.name, x);
  }
  return w;
}

// Bytes one decode step must read: decoder matrices, norms and lm_head (bf16).
double DecodeWeightBytes(const llava::LlavaConfig& c) {
  const double d = c.text.hidden_size, f = c.text.intermediate_size;
  const double per_layer = 4 * d * d + 3 * d * f + 2 * d;
  return 2.0 * (c.text.num_hidden_layers * per_layer + d + c.text.vocab_size * d);
}

// Elastic Cache's costs and savings at 7B layer shapes (issue 3): prefill overhead (importance
// from the attention probabilities + merge) on a LLaVA-sized prompt, and the decode step time
// with a long context, Elastic at gamma = 0.2 vs Full; both Elastic presets (the product default
// and the paper's). The prompt is laid out as a chat prompt: 4 text tokens, an image, and a
// 20-token instruction.
void PolicySuite(const llava::LlavaModel& model, int prompt, int context, int steps, int reps,
                 double gamma) {
  const int64_t vocab = model.config().text.vocab_size;
  auto layout = [](int64_t t) {
    llava::PromptSegments s;
    const int64_t instruction = std::min<int64_t>(20, t / 4);
    s.images = {{std::min<int64_t>(4, t), t - instruction}};
    s.instruction = {t - instruction, t};
    return s;
  };
  llava::CacheParams full = FullCache();
  std::vector<std::pair<std::string, llava::CacheParams>> variants;
  for (const char* spec : {"elastic", "elastic+paper"}) {
    llava::CacheParams base;
    base.budget = gamma;
    variants.emplace_back(spec, *llava::ParseCacheSpec(spec, base));
  }
  const auto prompt_pool = PoolFor(model, 1, prompt);
  auto time_prefill = [&](const llava::CacheParams& p, const at::Tensor& emb) {
    auto cache = llava::NewKvCache(prompt_pool.get(), p, layout(emb.size(0)));
    const auto t0 = Clock::now();
    Sync(Feed(model, {{emb, 0, cache.get(), false}}));
    return Seconds(t0);
  };
  std::vector<double> full_s;
  std::vector<std::vector<double>> variant_s(variants.size());
  for (int r = 0; r < reps; ++r) {
    at::Tensor emb = model.Embed(at::randint(3, vocab, {prompt}, at::kLong));
    full_s.push_back(time_prefill(full, emb));
    for (size_t v = 0; v < variants.size(); ++v) {
      variant_s[v].push_back(time_prefill(variants[v].second, emb));
    }
  }
  const double pf = Median(full_s);
  std::string machine =
      "suite=policies layers=" + std::to_string(model.config().text.num_hidden_layers) +
      " prompt=" + std::to_string(prompt) + " context=" + std::to_string(context);
  char buf[256];
  std::snprintf(buf, sizeof(buf), " prefill_full_s=%.3f", pf);
  machine += buf;
  for (size_t v = 0; v < variants.size(); ++v) {
    const double pe = Median(variant_s[v]);
    std::printf("prefill  prompt=%d  full %.3f ms  %s(%.2f) %.3f ms  overhead %.1f%%\n", prompt,
                1e3 * pf, variants[v].first.c_str(), gamma, 1e3 * pe, 100 * (pe / pf - 1));
    std::snprintf(buf, sizeof(buf), " prefill_overhead[%s]=%.3f", variants[v].first.c_str(),
                  pe / pf - 1);
    machine += buf;
  }

  // Decode at `context` cached tokens: prefill once per policy, then time single steps.
  at::Tensor ctx = model.Embed(at::randint(3, vocab, {context}, at::kLong));
  const auto context_pool = PoolFor(model, 1, context + steps);
  auto decode = [&](const llava::CacheParams& p, int64_t* bytes, int64_t* full_bytes) {
    auto cache = llava::NewKvCache(context_pool.get(), p, layout(context));
    Sync(Feed(model, {{ctx, 0, cache.get(), false}}));
    std::vector<double> runs;
    for (int s = 0; s < steps; ++s) {
      at::Tensor e = model.Embed(at::randint(3, vocab, {1}, at::kLong));
      const auto t0 = Clock::now();
      Sync(Feed(model, {{e, cache->NextPosition(), cache.get(), false}}));
      runs.push_back(Seconds(t0));
    }
    *bytes = cache->Stats().bytes_kept;
    *full_bytes = cache->Stats().full_equivalent_bytes;
    return Median(runs);
  };
  int64_t bytes_full = 0, full_equivalent = 0;
  const double step_full = decode(full, &bytes_full, &full_equivalent);
  std::snprintf(buf, sizeof(buf), " step_full_ms=%.2f", 1e3 * step_full);
  machine += buf;
  for (const auto& [name, params] : variants) {
    int64_t bytes = 0;
    const double step = decode(params, &bytes, &full_equivalent);
    std::printf(
        "decode   context=%d  full %.1f ms/step  %s(%.2f) %.1f ms/step  ratio %.3f  "
        "kv kept/full %.4f\n",
        context, 1e3 * step_full, name.c_str(), gamma, 1e3 * step, step / step_full,
        double(bytes) / full_equivalent);
    std::snprintf(buf, sizeof(buf), " step_ratio[%s]=%.3f kv_kept_ratio[%s]=%.4f", name.c_str(),
                  step / step_full, name.c_str(), double(bytes) / full_equivalent);
    machine += buf;
  }
  std::printf("kv bytes full %.1f MB\n%s\n", bytes_full / 1e6, machine.c_str());
}

// The paper's throughput experiment (ElasticCache, ECCV 2024: +77.9% at budget 0.2, batch 16,
// LLaVA-7B, 1024-token prompts, 512-token answers): `batch` sequences of `prompt` tokens laid
// out as in PolicySuite, each prefilled alone, then `answer` greedy steps of the whole batch;
// Full against Elastic at `gamma`. Prints decode tokens/s, end-to-end tokens/s and the batch's
// latency, the KV bytes of one finished sequence, and the largest batch whose caches fit in
// `kv_budget` bytes (default: what Full needs at `batch`), which is where a smaller cache turns
// into throughput. With `equal_memory`, Elastic is also run at that batch (at most `max_batch`).
struct PaperRun {
  int batch = 0;
  double prefill_s = 0, decode_s = 0;
  int64_t kv_bytes_per_seq = 0;
};

PaperRun RunPaperBatch(const llava::LlavaModel& model, const llava::CacheParams& params, int batch,
                       int prompt, int answer) {
  const int64_t vocab = model.config().text.vocab_size;
  llava::PromptSegments layout;
  const int64_t instruction = std::min<int64_t>(20, prompt / 4);
  layout.images = {{std::min<int64_t>(4, prompt), prompt - instruction}};
  layout.instruction = {prompt - instruction, prompt};
  PaperRun run;
  run.batch = batch;
  const auto pool = PoolFor(model, batch, prompt + answer);
  std::vector<std::unique_ptr<llava::KvCache>> caches;
  std::vector<at::Tensor> last;
  auto t0 = Clock::now();
  for (int i = 0; i < batch; ++i) {
    caches.push_back(llava::NewKvCache(pool.get(), params, layout));
    at::Tensor emb = model.Embed(at::randint(3, vocab, {prompt}, at::kLong));
    last.push_back(Feed(model, {{emb, 0, caches.back().get(), false}}).argmax(-1));
  }
  at::Tensor ids = at::cat(last).to(at::kCPU);  // the first answer token of each sequence
  run.prefill_s = Seconds(t0);
  std::vector<llava::SequenceChunk> chunks(batch);
  t0 = Clock::now();
  for (int s = 1; s < answer; ++s) {
    at::Tensor emb = model.Embed(ids);
    for (int i = 0; i < batch; ++i) {
      chunks[i] = {emb.narrow(0, i, 1), caches[i]->NextPosition(), caches[i].get(), false};
    }
    ids = Feed(model, chunks).argmax(-1).to(at::kCPU);  // as a server reads its tokens
  }
  run.decode_s = Seconds(t0);
  run.kv_bytes_per_seq = caches[0]->Stats().bytes_kept;
  return run;
}

void PaperSuite(const llava::LlavaModel& model, int prompt, int answer, int batch, double gamma,
                double kv_budget, bool equal_memory, int max_batch) {
  llava::CacheParams full = FullCache();
  llava::CacheParams base;
  base.budget = gamma;
  const llava::CacheParams elastic = *llava::ParseCacheSpec("elastic", base);
  char buf[512];
  std::string machine =
      "suite=paper layers=" + std::to_string(model.config().text.num_hidden_layers) +
      " prompt=" + std::to_string(prompt) + " answer=" + std::to_string(answer);
  auto report = [&](const char* name, const PaperRun& r) {
    const double tokens = double(r.batch) * answer;
    std::printf(
        "paper  %-8s batch=%-3d prefill %.2f s  decode %.2f s  decode %.1f tokens/s  "
        "end-to-end %.1f tokens/s  latency %.2f s  kv/seq %.1f MB\n",
        name, r.batch, r.prefill_s, r.decode_s, double(r.batch) * (answer - 1) / r.decode_s,
        tokens / (r.prefill_s + r.decode_s), r.prefill_s + r.decode_s, r.kv_bytes_per_seq / 1e6);
    std::snprintf(buf, sizeof(buf),
                  " %s_b%d_decode_tok_s=%.1f %s_b%d_e2e_tok_s=%.1f %s_b%d_latency_s=%.2f", name,
                  r.batch, double(r.batch) * (answer - 1) / r.decode_s, name, r.batch,
                  tokens / (r.prefill_s + r.decode_s), name, r.batch, r.prefill_s + r.decode_s);
    machine += buf;
  };
  (void)RunPaperBatch(model, full, 1, std::min(prompt, 16), 2);  // warm-up (a GPU's libraries)
  const PaperRun f = RunPaperBatch(model, full, batch, prompt, answer);
  report("full", f);
  const PaperRun e = RunPaperBatch(model, elastic, batch, prompt, answer);
  report("elastic", e);
  const double e2e_full = batch * answer / (f.prefill_s + f.decode_s);
  const double e2e_elastic = batch * answer / (e.prefill_s + e.decode_s);
  if (kv_budget <= 0) kv_budget = double(batch) * f.kv_bytes_per_seq;
  const int fit_full = static_cast<int>(kv_budget / f.kv_bytes_per_seq);
  const int fit_elastic = static_cast<int>(kv_budget / e.kv_bytes_per_seq);
  std::printf(
      "same batch: elastic/full end-to-end %.3f (%+.1f%%)\n"
      "kv budget %.3f GB: largest batch full %d, elastic %d\n",
      e2e_elastic / e2e_full, 100 * (e2e_elastic / e2e_full - 1), kv_budget / 1e9, fit_full,
      fit_elastic);
  std::snprintf(buf, sizeof(buf),
                " same_batch_e2e_ratio=%.3f kv_budget_gb=%.3f fit_batch_full=%d "
                "fit_batch_elastic=%d",
                e2e_elastic / e2e_full, kv_budget / 1e9, fit_full, fit_elastic);
  machine += buf;
  if (equal_memory && fit_elastic > batch) {
    const PaperRun big =
        RunPaperBatch(model, elastic, std::min(fit_elastic, max_batch), prompt, answer);
    report("elastic", big);
    const double ratio = big.batch * answer / (big.prefill_s + big.decode_s) / e2e_full;
    std::printf(
        "same kv memory: elastic at batch %d / full at batch %d end-to-end %.3f (%+.1f%%)\n",
        big.batch, batch, ratio, 100 * (ratio - 1));
    std::snprintf(buf, sizeof(buf), " same_memory_e2e_ratio=%.3f", ratio);
    machine += buf;
  }
  std::printf("%s\n", machine.c_str());
}

}  // namespace

// kIters x kAcc independent AVX512-BF16 dot products (vdpbf16ps: 32 multiply-adds each) on
// registers only, no memory traffic.
constexpr int kPeakAcc = 16;  // enough independent chains to cover the instruction latency
constexpr int64_t kPeakIters = 1 << 24;
__attribute__((target("avx512f,avx512bf16"))) float Bf16DotLoop() {
  __m512 acc[kPeakAcc];
  for (int a = 0; a < kPeakAcc; ++a) acc[a] = _mm512_set1_ps(0.f);
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3F80);  // 1.0
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3C00);  // 2^-7
  for (int64_t i = 0; i < kPeakIters; ++i) {
#pragma GCC unroll 16
    for (int a = 0; a < kPeakAcc; ++a) acc[a] = _mm512_dpbf16_ps(acc[a], x, y);
  }
  float s = 0;
  for (int a = 0; a < kPeakAcc; ++a) s += _mm512_cvtss_f32(acc[a]);
  return s;
}

// The CPU's bf16 arithmetic peak in GFLOP/s on `threads` threads. No GEMM can beat it, and it
// bounds prefill, which is compute-bound.
double Bf16PeakGflops(int threads) {
  std::vector<float> sink(threads);
  const auto t0 = Clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sink[t] = Bf16DotLoop();
  });
  const double seconds = Seconds(t0);
  volatile float keep = sink[0];
  (void)keep;
  return 64.0 * kPeakAcc * kPeakIters * threads / seconds / 1e9;
}

// GFLOP/s of one bf16 matrix product y = x W^T, [m, k] x [n, k]: libtorch's at::linear against
// llava::Linear (engine/kernels/cpu_gemv.h for up to 8 rows; more rows: oneDNN on AVX512-BF16,
// PanelLinear on the other paths). Medians of reps.
void MatmulSuite(int reps, int threads) {
  if (llava::CpuPathAtLeast(llava::CpuPath::kAvx512Bf16)) {
    std::vector<double> one, all;
    for (int r = 0; r < 3; ++r) {
      one.push_back(Bf16PeakGflops(1));
      all.push_back(Bf16PeakGflops(threads));
    }
    std::printf("suite=matmul bf16_peak_gflops_1_thread=%.1f bf16_peak_gflops_%d_threads=%.1f\n",
                Median(one), threads, Median(all));
  }
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  const Shape shapes[] = {
      // the default model's prefill: 159-token prompt (decoder), 144 patches (vision tower)
      {"small.qkv", 159, 512, 256},
      {"small.o", 159, 256, 256},
      {"small.gate_up", 159, 1376, 256},
      {"small.down", 159, 256, 688},
      {"vit.qkv", 144, 576, 192},
      {"vit.fc1", 144, 768, 192},
      {"vit.fc2", 144, 192, 768},
      {"small.decode8", 8, 1376, 256},
      {"small.decode16", 16, 1376, 256},
      {"small.decode32", 32, 1376, 256},
      // LLaVA-1.5-7B's decoder, 512-token prefill
      {"7b.qkv", 512, 12288, 4096},
      {"7b.o", 512, 4096, 4096},
      {"7b.gate_up", 512, 22016, 4096},
      {"7b.down", 512, 4096, 11008},
      // LLaVA-1.5-7B's decode at batch 1 and 8 (the GEMV)
      {"7b.gate_up.decode1", 1, 22016, 4096},
      {"7b.gate_up.decode8", 8, 22016, 4096},
      {"7b.down.decode8", 8, 4096, 11008},
  };
  for (const Shape& sh : shapes) {
    at::Tensor x = at::randn({sh.m, sh.k}).to(at::kBFloat16);
    llava::Linear lin{(at::randn({sh.n, sh.k}) * 0.05).to(at::kBFloat16), at::Tensor()};
    const double flop = 2.0 * sh.m * sh.n * sh.k;
    const int inner = std::max<int64_t>(1, static_cast<int64_t>(2e9 / flop));
    auto time = [&](auto&& f) {
      std::vector<double> runs;
      f();  // warm-up
      for (int r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        for (int i = 0; i < inner; ++i) f();
        runs.push_back(flop * inner / Seconds(t0) / 1e9);
      }
      return Median(runs);
    };
    // The reference: ATen's bf16 product (oneDNN) on AVX512-BF16; on the other paths, where
    // it has no fast path, the same product on weights stored in fp32 (what --dtype f32 runs).
    const bool bf16_ref = llava::CpuPathAtLeast(llava::CpuPath::kAvx512Bf16);
    const llava::Linear lin_f32{lin.weight.to(at::kFloat), at::Tensor()};
    const at::Tensor xf = x.to(at::kFloat);
    const double ref = bf16_ref ? time([&] { (void)at::linear(x, lin.weight); })
                                : time([&] { (void)lin_f32(xf); });
    const double ours = time([&] { (void)lin(x); });
    std::printf(
        "suite=matmul shape=%s m=%lld n=%lld k=%lld %s_gflops=%.1f "
        "linear_gflops=%.1f ratio=%.2f\n",
        sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.n),
        static_cast<long long>(sh.k), bf16_ref ? "at_linear" : "f32_weights", ref, ours,
        ours / ref);
  }
}

// The decode products with quantized weights (engine/kernels/quant_gemv.h) against bf16
// (llava::Linear) at LLaVA-7B's decode shapes: milliseconds per product and the weight bytes
// streamed per second. Decoding is bound by those bytes, so the ratio to bf16 is the speed-up a
// decode step can get from each format. Medians of reps.
void QuantSuite(int reps) {
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  const Shape shapes[] = {
      {"7b.qkv.decode1", 1, 12288, 4096},      {"7b.gate_up.decode1", 1, 22016, 4096},
      {"7b.down.decode1", 1, 4096, 11008},     {"7b.lm_head.decode1", 1, 32064, 4096},
      {"7b.gate_up.decode8", 8, 22016, 4096},  {"7b.down.decode8", 8, 4096, 11008},
      {"small.gate_up.decode1", 1, 1376, 256}, {"small.down.decode8", 8, 256, 688},
  };
  for (const Shape& sh : shapes) {
    const at::Tensor wf = at::randn({sh.n, sh.k}) * 0.05;
    const llava::Linear lin{wf.to(at::kBFloat16), at::Tensor()};
    const at::Tensor x = at::randn({sh.m, sh.k}).to(at::kBFloat16);
    at::Tensor y = at::empty({sh.m, sh.n}, at::kBFloat16);
    const int inner = std::max<int64_t>(1, static_cast<int64_t>(4e8 / (sh.n * sh.k)));
    auto ms = [&](auto&& f) {
      std::vector<double> runs;
      f();  // warm-up
      for (int r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        for (int i = 0; i < inner; ++i) f();
        runs.push_back(Seconds(t0) * 1e3 / inner);
      }
      return Median(runs);
    };
    const double bf16_ms = ms([&] { (void)lin(x); });
    std::printf("suite=quant shape=%s m=%lld n=%lld k=%lld format=bf16 ms=%.3f weight_gbps=%.1f\n",
                sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.n),
                static_cast<long long>(sh.k), bf16_ms, 2.0 * sh.n * sh.k / bf16_ms / 1e6);
    for (llava::WeightFormat f : {llava::WeightFormat::kInt8, llava::WeightFormat::kInt4}) {
      auto q = llava::QuantizeMatrix(wf.data_ptr<float>(), sh.n, sh.k, f);
      if (!q.ok()) throw std::runtime_error(q.status().ToString());
      const llava::PackedQuant packed = llava::PackQuantized(*q);
      const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
      const double q_ms = ms([&] { llava::QuantGemv(xp, packed, nullptr, yp, sh.m); });
      std::printf(
          "suite=quant shape=%s m=%lld n=%lld k=%lld format=%s ms=%.3f weight_gbps=%.1f "
          "speedup_vs_bf16=%.2f\n",
          sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.n),
          static_cast<long long>(sh.k), llava::WeightFormatName(f), q_ms,
          static_cast<double>(packed.bytes()) / q_ms / 1e6, bf16_ms / q_ms);
    }
  }
}

// The quantized formats' logit error against the bf16 model (and, for scale, bf16's own against
// fp32), on the same weights: a 128-token prompt, then 16 decoded tokens fed the same ids, so
// that the prefill's dequantized panels and the decode GEMV both count. Prints the normalised
// mean squared error of the logits, their relative RMS error and how often the top token agrees.
void LogitErrorSuite(
    const std::function<llava::LlavaModel*(llava::DType, llava::WeightFormat)>& make, int prompt,
    int steps) {
  auto run = [&](const llava::LlavaModel& m, const at::Tensor& ids) {
    const auto pool = PoolFor(m, 1, ids.numel() + 1);
    auto cache = llava::NewKvCache(pool.get(), FullCache());
    std::vector<at::Tensor> rows = {
        Feed(m, {{m.Embed(ids.narrow(0, 0, prompt)), 0, cache.get(), true}})};
    for (int64_t t = prompt; t < ids.numel(); ++t) {
      rows.push_back(
          Feed(m, {{m.Embed(ids.narrow(0, t, 1)), cache->NextPosition(), cache.get(), false}}));
    }
    return at::cat(rows, 0).to(at::kDouble);
  };
  const llava::LlavaModel* bf16 = make(llava::DType::kBF16, llava::WeightFormat::kBf16);
  const at::Tensor ids =
      at::randint(3, bf16->config().text.vocab_size, {prompt + steps}, at::kLong);
  const at::Tensor ref = run(*bf16, ids);
  const at::Tensor ref_top = ref.argmax(-1);
  std::printf("suite=logit-error rows=%lld logit_std=%.4f\n", static_cast<long long>(ref.size(0)),
              ref.std().item<double>());
  auto report = [&](const char* name, const at::Tensor& l) {
    const double nmse = (l - ref).pow(2).sum().item<double>() / ref.pow(2).sum().item<double>();
    const double agree = l.argmax(-1).eq(ref_top).to(at::kDouble).mean().item<double>();
    std::printf("suite=logit-error weights=%s nmse_vs_bf16=%.3g rel_rms=%.4f top1_agree=%.3f\n",
                name, nmse, std::sqrt(nmse), agree);
  };
  report("f32", run(*make(llava::DType::kF32, llava::WeightFormat::kBf16), ids));
  for (llava::WeightFormat f : {llava::WeightFormat::kInt8, llava::WeightFormat::kInt4}) {
    report(llava::WeightFormatName(f), run(*make(llava::DType::kBF16, f), ids));
  }
}

// One decode step's attention outside the model: `batch` sequences, each with a bf16 cache of
// `len` rows per layer (2 KV heads of 64, 4 query heads: the default model's shapes), one
// DecodeAttention call per layer. Prints ms per step (median of reps) and the cache bytes read
// per second.
void AttentionSuite(int reps, int batch, int len, int layers) {
  std::vector<std::vector<at::Tensor>> keys(layers), values(layers);
  for (int l = 0; l < layers; ++l) {
    for (int b = 0; b < batch; ++b) {
      // Capacity beyond the length, as a growing cache has.
      keys[l].push_back(at::randn({2, len + 64, 64}).to(at::kBFloat16).narrow(1, 0, len));
      values[l].push_back(at::randn({2, len + 64, 64}).to(at::kBFloat16).narrow(1, 0, len));
    }
  }
  const at::Tensor q = at::randn({batch, 4, 64}).to(at::kBFloat16);
  const std::vector<bool> want(batch, false);
  constexpr int kSteps = 200;
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < kSteps; ++i) {
      for (int l = 0; l < layers; ++l)
        (void)llava::DecodeAttention(q, keys[l], values[l], want, nullptr);
    }
    ms.push_back(Seconds(t0) / kSteps * 1e3);
  }
  const double step_ms = Median(ms);
  const double bytes = 2.0 * batch * layers * 2 * len * 64 * 2;
  std::printf(
      "suite=attention batch=%d len=%d layers=%d layout=contiguous step_ms=%.3f "
      "cache_gb_s=%.1f\n",
      batch, len, layers, step_ms, bytes / (step_ms / 1e3) / 1e9);

  // The same rows read through page tables, as the KV pool stores them: pages of 16 and 64
  // slots, and single slots (a table entry per row, SGLang's token pool), each sequence's
  // pages scattered over the pool (a fixed permutation).
  for (int64_t page : {1, 16, 64}) {
    const int64_t per_seq = (len + page - 1) / page, total = per_seq * batch;
    std::vector<int32_t> ids(total);
    for (int64_t i = 0; i < total; ++i) ids[i] = static_cast<int32_t>((i * 7919) % total);
    std::vector<at::Tensor> pools;
    std::vector<std::vector<llava::DecodeKv>> caches(layers);
    for (int l = 0; l < layers; ++l) {
      pools.push_back(at::randn({2, total, 2, page, 64}).to(at::kBFloat16));
      for (int b = 0; b < batch; ++b) {
        llava::DecodeKv c;
        c.keys = pools.back()[0].data_ptr();
        c.values = pools.back()[1].data_ptr();
        c.pages = ids.data() + b * per_seq;
        c.page_rows = page;
        c.page_stride = 2 * page * 64;
        c.key_head_stride = c.value_head_stride = page * 64;
        c.key_row_stride = c.value_row_stride = 64;
        c.len = len;
        caches[l].push_back(c);
      }
    }
    std::vector<double> paged_ms;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      for (int i = 0; i < kSteps; ++i) {
        for (int l = 0; l < layers; ++l) {
          (void)llava::DecodeAttention(q, caches[l], at::kBFloat16, 2, want, nullptr);
        }
      }
      paged_ms.push_back(Seconds(t0) / kSteps * 1e3);
    }
    const double paged = Median(paged_ms);
    std::printf(
        "suite=attention batch=%d len=%d layers=%d layout=pages%lld step_ms=%.3f "
        "cache_gb_s=%.1f vs_contiguous=%.3f\n",
        batch, len, layers, static_cast<long long>(page), paged, bytes / (paged / 1e3) / 1e9,
        paged / step_ms);
  }

  // int8 entries in pages of 16 (--kv-cache-dtype int8): the integers and one fp32 scale per
  // row, hd + 4 bytes a head row against bf16's 2 hd. cache_gb_s counts the bytes read.
  {
    constexpr int64_t page = 16;
    const int64_t per_seq = (len + page - 1) / page, total = per_seq * batch;
    std::vector<int32_t> ids(total);
    for (int64_t i = 0; i < total; ++i) ids[i] = static_cast<int32_t>((i * 7919) % total);
    std::vector<at::Tensor> pools, scales;
    std::vector<std::vector<llava::DecodeKv>> caches(layers);
    for (int l = 0; l < layers; ++l) {
      pools.push_back(at::randint(-127, 128, {2, total, 2, page, 64}, at::kChar));
      scales.push_back(at::rand({2, total, 2, page}) / 64);
      for (int b = 0; b < batch; ++b) {
        llava::DecodeKv c;
        c.keys = pools.back()[0].data_ptr();
        c.values = pools.back()[1].data_ptr();
        c.key_scales = scales.back()[0].data_ptr<float>();
        c.value_scales = scales.back()[1].data_ptr<float>();
        c.pages = ids.data() + b * per_seq;
        c.page_rows = page;
        c.page_stride = 2 * page * 64;
        c.key_head_stride = c.value_head_stride = page * 64;
        c.key_row_stride = c.value_row_stride = 64;
        c.scale_page_stride = 2 * page;
        c.scale_head_stride = page;
        c.len = len;
        caches[l].push_back(c);
      }
    }
    std::vector<double> int8_ms;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      for (int i = 0; i < kSteps; ++i) {
        for (int l = 0; l < layers; ++l) {
          (void)llava::DecodeAttention(q, caches[l], at::kChar, 2, want, nullptr);
        }
      }
      int8_ms.push_back(Seconds(t0) / kSteps * 1e3);
    }
    const double t = Median(int8_ms);
    const double int8_bytes = 2.0 * batch * layers * 2 * len * (64 + 4);
    std::printf(
        "suite=attention batch=%d len=%d layers=%d layout=pages16_int8 step_ms=%.3f "
        "cache_gb_s=%.1f vs_contiguous=%.3f\n",
        batch, len, layers, t, int8_bytes / (t / 1e3) / 1e9, t / step_ms);
  }
}

int main(int argc, char** argv) {
  CLI::App app{"Decoder benchmark at LLaVA-1.5-7B layer shapes (random bf16 weights)"};
  int layers = 4, threads = 0, prompt = 512, reps = 5, steps = 16, context = 64;
  std::vector<int> batches = {1, 4, 8};
  app.add_option("--layers", layers, "decoder layers")->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads (0 = one per core)");
  app.add_option("--prompt", prompt, "prefill prompt length")->capture_default_str();
  app.add_option("--reps", reps, "repetitions; medians are reported")->capture_default_str();
  app.add_option("--steps", steps, "decode steps per repetition")->capture_default_str();
  app.add_option("--context", context, "tokens in each sequence before decoding")
      ->capture_default_str();
  app.add_option("--batches", batches, "decode batch sizes")->capture_default_str();
  std::string suite = "decoder", model_dir, device_name = "cpu";
  app.add_option("--model", model_dir,
                 "a llava-hf folder to measure (bf16) instead of random 7B-shape layers");
  app.add_option("--device", device_name, "cpu | cuda[:i] (decoder, policies and paper suites)")
      ->capture_default_str();
  app.add_option("--suite", suite,
                 "decoder (issue 2 numbers) | policies (Elastic vs Full) | paper (the paper's "
                 "throughput experiment: --prompt, --answer, --batches, Full vs Elastic 0.2) | "
                 "matmul (bf16 GEMM kernels at prefill shapes) | quant (int8 and int4 decode "
                 "products against bf16) | logit-error (int8 and int4 logits against bf16's) | "
                 "attention (decode attention kernel: --batches, --context rows, --layers)")
      ->check(CLI::IsMember(
          {"decoder", "policies", "paper", "matmul", "quant", "logit-error", "attention"}))
      ->capture_default_str();
  int answer = 512, max_batch = 128;
  double kv_budget_gb = 0, gamma = 0.2;
  bool equal_memory = false;
  app.add_option("--answer", answer, "paper: answer tokens per sequence")->capture_default_str();
  app.add_option("--budget", gamma, "paper: Elastic's KV budget")->capture_default_str();
  app.add_option("--kv-budget-gb", kv_budget_gb,
                 "paper: KV bytes for the largest-batch arithmetic (0 = Full's at the batch)");
  app.add_option("--equal-memory", equal_memory,
                 "paper: also run Elastic at the largest batch that fits in that KV budget")
      ->capture_default_str();
  app.add_option("--max-batch", max_batch, "paper: cap on that batch")->capture_default_str();
  std::string weights = "bf16";
  app.add_option("--weights", weights,
                 "decoder, policies and paper suites: bf16 | int8 | int4 (llava-server --help)")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  std::string kv_dtype = "auto";
  app.add_option("--kv-cache-dtype", kv_dtype,
                 "decoder, policies and paper suites: auto | int8 (llava-server --help)")
      ->check(CLI::IsMember({"auto", "int8"}))
      ->capture_default_str();
  std::string malloc_mode = "server";
  app.add_option("--malloc", malloc_mode,
                 "server (llava-server's malloc settings, oneDNN cache and activation allocator: "
                 "runtime.h, activation_memory.h) | glibc (glibc's defaults)")
      ->check(CLI::IsMember({"server", "glibc"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const std::string malloc_said = malloc_mode == "server"
                                      ? llava::ConfigureMalloc(llava::MallocSettings{}) + "; " +
                                            llava::LimitOneDnnCache() +
                                            "; activation allocator after the weights"
                                      : "malloc: glibc's defaults";
  threads = llava::InitTorchThreads(threads);
  at::manual_seed(0);
  std::printf("cpu_path=%s detected=%s device=%s weights=%s kv_cache_dtype=%s\n%s\n",
              llava::CpuPathName(llava::ActiveCpuPath()),
              llava::CpuPathName(llava::DetectedCpuPath()), device_name.c_str(), weights.c_str(),
              kv_dtype.c_str(), malloc_said.c_str());
  llava::ModelOptions options;
  options.device = device_name;
  options.weights = llava::ParseWeightFormat(weights).value();  // checked by the flag
  options.kv_dtype = llava::ParseKvDtype(kv_dtype).value();     // checked by the flag
  at::Device device(at::kCPU);
  try {
    device = at::Device(device_name);
  } catch (const c10::Error&) {
    std::fprintf(stderr, "--device: '%s' is not a device name (cpu, cuda, cuda:1)\n",
                 device_name.c_str());
    return 1;
  }
  if (!device.is_cpu()) {
    std::printf("decode attention on %s: %s\n", device_name.c_str(),
                llava::DecodeAttentionRunsOn(device) ? "one batched kernel per layer"
                                                     : "ATen, one sequence at a time");
  }
  if (!device.is_cpu() && (suite == "matmul" || suite == "quant" || suite == "attention")) {
    std::fprintf(stderr, "--suite %s measures the CPU kernels: --device must be cpu\n",
                 suite.c_str());
    return 1;
  }
  if (device.is_cuda() && !at::hasCUDA()) {
    std::fprintf(stderr, "--device %s: this libtorch has no CUDA support or sees no GPU\n",
                 device_name.c_str());
    return 1;
  }

  if (suite == "attention") {
    for (int b : batches) AttentionSuite(std::max(3, reps), b, context, layers);
    return 0;
  }
  if (suite == "quant") {
    QuantSuite(std::max(5, reps));
    return 0;
  }
  if (suite == "matmul") {
    MatmulSuite(std::max(3, reps), threads);
    return 0;
  }
  if (suite == "logit-error") {
    if (!device.is_cpu()) {
      std::fprintf(stderr, "--suite logit-error: quantized weights run on the CPU only\n");
      return 1;
    }
    const llava::LlavaConfig config = BenchConfig(layers);
    // One set of random weights for every model (unless --model names a folder).
    const auto random = model_dir.empty() ? RandomWeights(config, device)
                                          : std::vector<std::pair<std::string, at::Tensor>>{};
    std::vector<std::unique_ptr<llava::LlavaModel>> models;
    auto make = [&](llava::DType dtype, llava::WeightFormat f) -> llava::LlavaModel* {
      llava::ModelOptions o;
      o.dtype = dtype;
      o.weights = f;
      auto m = model_dir.empty()
                   ? llava::LlavaModel::FromWeights(config, llava::NewTensorMapSource(random), o)
                   : llava::LlavaModel::Load(model_dir, o);
      if (!m.ok()) throw std::runtime_error(m.status().ToString());
      models.push_back(std::move(m).value());
      return models.back().get();
    };
    LogitErrorSuite(make, 128, 16);
    return 0;
  }
  // 1 GiB is far beyond a CPU's caches; a GPU reads it in ~0.3 ms, so it gets 8 GiB there.
  const int64_t probe_bytes = device.is_cpu() ? int64_t{1} << 30 : int64_t{8} << 30;
  const auto probe_buffer = [&] {
    return at::ones({probe_bytes / 4}, at::TensorOptions(at::kFloat).device(device));
  };
  const double bandwidth = MeasureReadBandwidth(probe_buffer());
  std::printf("threads=%d read_bandwidth=%.1f GB/s\n", threads, bandwidth / 1e9);

  const bool loaded = !model_dir.empty();
  const llava::LlavaConfig random_config = BenchConfig(layers);
  auto model_or =
      loaded ? llava::LlavaModel::Load(model_dir, options)
             : llava::LlavaModel::FromWeights(
                   random_config, llava::NewTensorMapSource(RandomWeights(random_config, device)),
                   options);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", model_or.status().ToString().c_str());
    return 1;
  }
  const llava::LlavaModel& model = **model_or;
  if (malloc_mode == "server") llava::InstallActivationAllocator();  // as llava-server does
  const llava::LlavaConfig& config = model.config();
  layers = config.text.num_hidden_layers;
  const int64_t vocab = config.text.vocab_size;
  if (suite == "policies") {
    // 600 tokens: 576 image rows + a short question, as a LLaVA-1.5 prompt; a model of ours
    // (--model) gets its own prompt size (image rows + 20) and a context that fits.
    const int64_t max_pos = config.text.max_position_embeddings;
    const int policy_prompt = loaded ? config.image_tokens() + 20 : 600;
    const int policy_context = static_cast<int>(std::min<int64_t>(2048, max_pos - steps - 1));
    PolicySuite(model, policy_prompt, policy_context, steps, std::max(3, reps), 0.2);
    return 0;
  }
  if (suite == "paper") {
    for (int b : batches) {
      PaperSuite(model, prompt, answer, b, gamma, kv_budget_gb * 1e9, equal_memory, max_batch);
    }
    return 0;
  }

  // Prefill: one prompt through a fresh cache, after one untimed prefill (as llama-bench warms
  // up): the first one also pays for the allocator's first pages and the widened panels' buffers,
  // which a serving process has paid long before (AVX2 path, 4 alternating runs: 92-96 tokens/s
  // with the warm-up and three timed prefills, 90-93 with two timed prefills and none).
  std::vector<double> prefill;
  const auto prefill_pool = PoolFor(model, 1, prompt);
  const llava::CacheParams full = FullCache();
  for (int r = -1; r < std::max(3, reps / 2); ++r) {
    auto cache = llava::NewKvCache(prefill_pool.get(), full);
    at::Tensor emb = model.Embed(at::randint(3, vocab, {prompt}, at::kLong));
    const auto t0 = Clock::now();
    Sync(Feed(model, {{emb, 0, cache.get(), false}}));
    if (r >= 0) prefill.push_back(prompt / Seconds(t0));
  }
  const double prefill_tps = Median(prefill);
  std::printf("prefill  prompt=%d  %.1f tokens/s\n", prompt, prefill_tps);

  // Decode: `b` sequences of `context` tokens, then `steps` batched steps. The batch-1 runs
  // each take their own bandwidth probe just before: a shared host's bandwidth moved from 37 to
  // 57 GB/s between runs of this program (docs/BENCHMARKS.md, "On a real AVX2-only CPU"), so
  // the floor fraction is the median of each run against its own probe, not of the runs
  // against one probe taken a minute earlier.
  const double weight_bytes = DecodeWeightBytes(config);
  const at::Tensor probe = probe_buffer();  // kept for the decode runs only (8 GiB on a GPU)
  std::vector<double> b1_fractions, b1_probes;
  std::vector<std::pair<int, double>> decode;
  for (int b : batches) {
    std::vector<double> runs;
    for (int r = 0; r < reps; ++r) {
      const double run_probe = b == 1 ? MeasureReadBandwidth(probe, 3) : 0;
      const auto pool = PoolFor(model, b, context + steps);
      std::vector<std::unique_ptr<llava::KvCache>> caches;
      std::vector<llava::SequenceChunk> chunks(b);
      for (int i = 0; i < b; ++i) {
        caches.push_back(llava::NewKvCache(pool.get(), full));
        Sync(Feed(model, {{model.Embed(at::randint(3, vocab, {context}, at::kLong)), 0,
                           caches.back().get(), false}}));
      }
      const auto t0 = Clock::now();
      for (int s = 0; s < steps; ++s) {
        at::Tensor ids = at::randint(3, vocab, {b}, at::kLong);
        at::Tensor emb = model.Embed(ids);
        for (int i = 0; i < b; ++i) {
          chunks[i] = {emb.narrow(0, i, 1), caches[i]->NextPosition(), caches[i].get(), false};
        }
        Sync(Feed(model, chunks).argmax(-1));
      }
      runs.push_back(double(b) * steps / Seconds(t0));
      if (b == 1) {
        b1_probes.push_back(run_probe);
        b1_fractions.push_back(runs.back() * weight_bytes / run_probe);
      }
    }
    decode.emplace_back(b, Median(runs));
    std::printf("decode   batch=%d  %.1f tokens/s\n", b, decode.back().second);
  }

  // Without a batch-1 run, the floor comes from the probe at the start.
  const double run_bandwidth = b1_probes.empty() ? bandwidth : Median(b1_probes);
  const double floor_tps = run_bandwidth / weight_bytes;
  const double b1 = decode.empty() ? 0 : decode.front().second;
  const double fraction = b1_fractions.empty() ? b1 / floor_tps : Median(b1_fractions);
  std::printf("bandwidth floor: %.1f tokens/s (%.2f GB of weights per token", floor_tps,
              weight_bytes / 1e9);
  if (!b1_probes.empty()) {
    std::printf("; probes beside the batch-1 runs %.1f-%.1f GB/s",
                *std::min_element(b1_probes.begin(), b1_probes.end()) / 1e9,
                *std::max_element(b1_probes.begin(), b1_probes.end()) / 1e9);
  }
  std::printf(")\n");
  std::printf("layers=%d threads=%d prefill_tok_s=%.1f", layers, threads, prefill_tps);
  for (const auto& [b, tps] : decode) std::printf(" decode_b%d_tok_s=%.1f", b, tps);
  for (const auto& [b, tps] : decode) {
    if (b != 1 && b1 > 0) std::printf(" speedup_b%d=%.2f", b, tps / b1);
  }
  std::printf(" bandwidth_gb_s=%.1f floor_tok_s=%.1f floor_fraction=%.2f\n", run_bandwidth / 1e9,
              floor_tps, fraction);
  return 0;
}
