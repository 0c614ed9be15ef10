// llava-server: the gRPC chat service.
//
// Flags can also come from the environment (LLAVA_MODEL, LLAVA_LISTEN, ...: the flag name in
// upper case with '-' as '_'), which is how the Kubernetes manifests configure it.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <limits>
#include <thread>

#include "engine/kernels/activation_memory.h"
#include "engine/kernels/cpu_features.h"
#include "engine/kernels/runtime.h"
#include "engine/model/model_options.h"
#include "engine/serving/engine.h"
#include "engine/serving/warmup.h"
#include "server/http_endpoint.h"
#include "server/llava_service.h"
#include "server/openai_server.h"
#include "server/tls.h"

namespace {

volatile std::sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }
volatile std::sig_atomic_t g_hangup = 0;
void OnHangup(int) { g_hangup = 1; }

// Facts about the loaded model for GetModelInfo.
llava::server::ModelFacts FactsOf(const llava::LoadedModel& model, const std::string& path,
                                  const std::string& dtype) {
  const llava::LlavaConfig& c = model.config();
  const llava::KvLayout layout = model.kv_layout();
  llava::server::ModelFacts f;
  // The folder's name only: the server's file system layout is none of the client's business.
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  f.model_path = dir.substr(dir.find_last_of('/') + 1);
  f.dtype = dtype;
  if (model.options().device.rfind("cuda", 0) != 0)
    f.cpu_path = llava::CpuPathName(llava::ActiveCpuPath());
  f.vocab_size = c.text.vocab_size;
  f.context_length = c.text.max_position_embeddings;
  f.image_size = c.vision.image_size;
  f.image_tokens = c.image_tokens();
  f.num_layers = layout.num_layers;
  f.kv_bytes_per_token = layout.num_layers * layout.bytes_per_entry();
  return f;
}

// An expired certificate is refused by every client; one close to it soon will be. Said at start
// and on SIGHUP; llava_tls_certificate_expiry_seconds says it to the monitoring.
void WarnIfExpiring(const std::string& cert) {
  if (cert.empty()) return;
  auto left = llava::server::CertificateSecondsLeft(cert);
  if (!left.ok()) return;
  const double days = static_cast<double>(*left) / 86400;
  if (*left <= 0) {
    spdlog::warn("--tls-cert {} expired {:.1f} days ago: clients refuse it", cert, -days);
  } else if (days < 14) {
    spdlog::warn("--tls-cert {} expires in {:.1f} days", cert, days);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llava-server: multimodal chat over gRPC with per-request KV-cache policies"};
  std::string model_dir = LLAVA_DEFAULT_MODEL_DIR, listen = "0.0.0.0:50051";
  std::string metrics_listen = "0.0.0.0:9090", http_listen = "0.0.0.0:8000", served_model_name;
  int64_t http_max_body_bytes = 0;
  int http_threads = 0;
  std::string dtype = "auto", device = "cpu", policy = "elastic";
  double budget = 0.5, kv_gib = 4.0, grace_s = 30;
  int threads = 0, max_batch = 0, max_queue = 64, default_max_tokens = 256, prefill_chunk = 256;
  int max_tokens_limit = 2048, max_images = 4, max_messages = 64, max_prompt_tokens = 0;
  int64_t max_image_bytes = 20 << 20, max_image_pixels = 40'000'000;
  auto env = [](const char* name) { return std::string("LLAVA_") + name; };
  app.add_option("--model", model_dir, "llava-hf model folder")
      ->envname(env("MODEL"))
      ->capture_default_str();
  app.add_option("--listen", listen, "gRPC address")->envname(env("LISTEN"))->capture_default_str();
  app.add_option("--metrics-listen", metrics_listen, "HTTP address of /metrics and /healthz")
      ->envname(env("METRICS_LISTEN"))
      ->capture_default_str();
  app.add_option("--http-listen", http_listen,
                 "address of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models); "
                 "'off' disables it")
      ->envname(env("HTTP_LISTEN"))
      ->capture_default_str();
  app.add_option("--http-max-body-bytes", http_max_body_bytes,
                 "largest HTTP request body (then 413); 0 = what --max-images images of "
                 "--max-image-bytes take in base64, plus 1 MiB")
      ->envname(env("HTTP_MAX_BODY_BYTES"))
      ->check(CLI::NonNegativeNumber);
  app.add_option("--http-threads", http_threads,
                 "HTTP requests parsed and submitted at once (JSON, images; 0 = one per core, "
                 "at least 4); waiting for the engine holds none")
      ->envname(env("HTTP_THREADS"))
      ->check(CLI::NonNegativeNumber);
  int http_max_connections = 1024;
  app.add_option("--http-max-connections", http_max_connections,
                 "HTTP connections open at once; a new one closes the oldest that waits for a "
                 "request, else it is answered 503")
      ->envname(env("HTTP_MAX_CONNECTIONS"))
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--served-model-name", served_model_name,
                 "the model id of the HTTP API (default: the model folder's name)")
      ->envname(env("SERVED_MODEL_NAME"));
  llava::server::TlsFiles tls;
  app.add_option("--tls-cert", tls.cert,
                 "PEM certificate chain of the gRPC port and the HTTP API (TLS)")
      ->envname(env("TLS_CERT"));
  app.add_option("--tls-key", tls.key, "PEM private key of --tls-cert")->envname(env("TLS_KEY"));
  app.add_option("--tls-client-ca", tls.client_ca,
                 "PEM CA bundle: clients must present a certificate it signed (mutual TLS)")
      ->envname(env("TLS_CLIENT_CA"));
  app.add_option("--tls-reload-seconds", tls.reload_seconds,
                 "how often the TLS files are checked for renewal")
      ->envname(env("TLS_RELOAD_SECONDS"))
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  std::string auth_tokens_file;
  bool reflection = true;
  app.add_option("--auth-tokens-file", auth_tokens_file,
                 "bearer tokens, one per line (TOKEN or NAME TOKEN), re-read when the file "
                 "changes; LLAVA_AUTH_TOKENS may hold more (',' between them). With any token, "
                 "every RPC but health and every /v1 route needs one")
      ->envname(env("AUTH_TOKENS_FILE"));
  app.add_option("--reflection", reflection, "gRPC server reflection (turn off in production)")
      ->envname(env("REFLECTION"))
      ->capture_default_str();
  bool warmup = true;
  app.add_option("--warmup", warmup,
                 "run one request (a blank image, two tokens, the default policy) through the "
                 "model before the ports open, so that the first client does not pay the "
                 "process's first-request costs")
      ->envname(env("WARMUP"))
      ->capture_default_str();
  int64_t kv_bytes = 0;
  auto* gib_opt =
      app.add_option("--kv-cache-gib", kv_gib,
                     "the KV pool, allocated at start on the model's device (whole pages), GiB")
          ->envname(env("KV_CACHE_GIB"))
          ->capture_default_str();
  app.add_option("--kv-cache-bytes", kv_bytes, "the KV pool in bytes (instead of --kv-cache-gib)")
      ->envname(env("KV_CACHE_BYTES"))
      ->check(CLI::PositiveNumber)
      ->excludes(gib_opt);
  app.add_option("--max-batch", max_batch,
                 "running requests at most (0 = auto: " + std::to_string(llava::kAutoMaxBatchWide) +
                     " on a GPU and for bf16 on avx512bf16, else " +
                     std::to_string(llava::kAutoMaxBatchNarrow) +
                     "; the KV budget may admit fewer)")
      ->envname(env("MAX_BATCH"))
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  app.add_option("--max-queue", max_queue, "waiting requests at most (then RESOURCE_EXHAUSTED)")
      ->envname(env("MAX_QUEUE"))
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--prefill-chunk", prefill_chunk,
                 "prompt rows fed per engine turn over all requests still prefilling, so a long "
                 "prompt does not stall the running streams (0 = each prompt whole)")
      ->envname(env("PREFILL_CHUNK"))
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--default-policy", policy,
                 "full | elastic | h2o | streaming_llm | snapkv | lookm, with options as in "
                 "llava-generate --policy (e.g. elastic+paper, h2o+paper)")
      ->envname(env("DEFAULT_POLICY"))
      ->capture_default_str();
  app.add_option("--default-budget", budget, "default KV budget ratio")
      ->envname(env("DEFAULT_BUDGET"))
      ->capture_default_str();
  app.add_option("--default-max-tokens", default_max_tokens)
      ->envname(env("DEFAULT_MAX_TOKENS"))
      ->capture_default_str();
  app.add_option("--max-tokens-limit", max_tokens_limit)
      ->envname(env("MAX_TOKENS_LIMIT"))
      ->capture_default_str();
  app.add_option("--max-images", max_images, "images per request")
      ->envname(env("MAX_IMAGES"))
      ->capture_default_str();
  app.add_option("--max-messages", max_messages, "messages per request")
      ->envname(env("MAX_MESSAGES"))
      ->capture_default_str();
  app.add_option("--max-prompt-tokens", max_prompt_tokens,
                 "prompt tokens per request, image rows included (0 = the model's context)")
      ->envname(env("MAX_PROMPT_TOKENS"))
      ->capture_default_str();
  app.add_option("--max-image-bytes", max_image_bytes)
      ->envname(env("MAX_IMAGE_BYTES"))
      ->capture_default_str();
  app.add_option("--max-image-pixels", max_image_pixels)
      ->envname(env("MAX_IMAGE_PIXELS"))
      ->capture_default_str();
  app.add_option(
         "--dtype", dtype,
         "auto (bf16 on GPUs and vector CPU paths, f32 on the generic one and for models of "
         "at most 16 Mi parameters on the avx2/avx512 paths) | bf16 | f32")
      ->envname(env("DTYPE"))
      ->check(CLI::IsMember({"auto", "bf16", "f32"}))
      ->capture_default_str();
  std::string weights = "bf16";
  app.add_option("--weights", weights,
                 "the decoder's linear layers: bf16 (as loaded, --dtype) | int8 | int4 (quantized "
                 "at load, CPU only; a checkpoint of llava-quantize runs its own format; "
                 "docs/BENCHMARKS.md, \"Quantized weights\")")
      ->envname(env("WEIGHTS"))
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  std::string kv_dtype = "auto";
  app.add_option("--kv-cache-dtype", kv_dtype,
                 "what the KV pool stores: auto (the model's dtype) | int8 (one fp32 scale per "
                 "entry and head, CPU only: 0.52x the bytes of bf16 at head size 128; "
                 "docs/POLICIES.md, \"int8 KV cache\")")
      ->envname(env("KV_CACHE_DTYPE"))
      ->check(CLI::IsMember({"auto", "int8"}))
      ->capture_default_str();
  app.add_option("--device", device, "cpu | cuda[:i]")
      ->envname(env("DEVICE"))
      ->capture_default_str();
  app.add_option("--threads", threads,
                 "intra-op threads (0 = auto: 1 for a model of at most 16 Mi parameters, else one "
                 "per core)")
      ->envname(env("THREADS"));
  llava::MallocSettings malloc_settings;
  int64_t mmap_threshold_mib = malloc_settings.mmap_threshold_bytes >> 20;
  app.add_option("--malloc-arena-max", malloc_settings.arena_max,
                 "glibc malloc arenas at most (0 = glibc's default, 8 per core); "
                 "MALLOC_ARENA_MAX in the environment wins")
      ->envname(env("MALLOC_ARENA_MAX"))
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--malloc-mmap-threshold-mib", mmap_threshold_mib,
                 "glibc malloc's fixed mmap and trim threshold in MiB (0 = glibc's sliding one)")
      ->envname(env("MALLOC_MMAP_THRESHOLD_MIB"))
      ->check(CLI::Range(0, 2047))
      ->capture_default_str();
  bool activation_allocator = true;
  app.add_option("--activation-allocator", activation_allocator,
                 "The forward pass's large CPU tensors in blocks kept between passes, bounded by "
                 "the recent peak (false: glibc's heap)")
      ->envname(env("ACTIVATION_ALLOCATOR"))
      ->capture_default_str();
  app.add_option("--shutdown-grace-seconds", grace_s)
      ->envname(env("SHUTDOWN_GRACE_SECONDS"))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // Before any thread starts: arenas are taken per thread at its first allocation.
  malloc_settings.mmap_threshold_bytes = mmap_threshold_mib << 20;
  const std::string malloc_said =
      llava::ConfigureMalloc(malloc_settings) + "; " + llava::LimitOneDnnCache();
  std::string threads_why;
  threads = llava::InitTorchThreads(llava::ResolveModelThreads(threads, model_dir, &threads_why));

  llava::CacheParams default_kv;
  default_kv.budget = budget;
  auto parsed_policy = llava::ParseCacheSpec(policy, default_kv);
  if (!parsed_policy.ok()) {
    spdlog::error("--default-policy / --default-budget: {}", parsed_policy.status().ToString());
    return 2;
  }
  llava::ModelOptions options;
  options.device = device;
  options.weights = llava::ParseWeightFormat(weights).value();  // checked by the flag
  options.kv_dtype = llava::ParseKvDtype(kv_dtype).value();     // checked by the flag
  std::string dtype_why;
  llava::ResolveModelDType(dtype, model_dir, &options, &dtype_why);
  dtype = options.dtype == llava::DType::kF32 ? "f32" : "bf16";
  if (options.weights != llava::WeightFormat::kBf16) dtype += ", " + weights + " weights";
  if (options.kv_dtype == llava::KvDtype::kInt8) dtype += ", int8 KV cache";
  std::string batch_why;
  max_batch = llava::AutoMaxBatch(max_batch, device.rfind("cuda", 0) == 0, llava::ActiveCpuPath(),
                                  options.dtype, &batch_why);
  spdlog::info("cpu kernels: {} (this CPU: {}); weights: {}",
               llava::CpuPathName(llava::ActiveCpuPath()),
               llava::CpuPathName(llava::DetectedCpuPath()), dtype_why);
  spdlog::info("loading {} ({}, {}, threads {}, max batch {}); {}", model_dir, dtype, device,
               threads_why, batch_why, malloc_said);
  auto loaded = llava::LoadModel(model_dir, options);
  if (!loaded.ok()) {
    spdlog::error("{}", loaded.status().ToString());
    return 1;
  }
  if ((*loaded)->options().weights != options.weights) {
    spdlog::info("the checkpoint holds {} decoder weights (llava-quantize): they run as stored",
                 llava::WeightFormatName((*loaded)->options().weights));
  }

  llava::EngineOptions eo;
  eo.kv_cache_bytes = kv_bytes > 0 ? kv_bytes : static_cast<int64_t>(kv_gib * (1 << 30));
  eo.max_batch = max_batch;
  eo.max_queue = max_queue;
  eo.prefill_chunk = prefill_chunk;
  eo.limits.max_tokens_limit = max_tokens_limit;
  eo.limits.prompt.max_images = max_images;
  eo.limits.prompt.max_messages = max_messages;
  eo.limits.max_prompt_tokens = max_prompt_tokens;
  eo.limits.image.max_encoded_bytes = static_cast<size_t>(max_image_bytes);
  eo.limits.image.max_pixels = max_image_pixels;
  // The KV pool is allocated here, once, on the model's device.
  std::unique_ptr<llava::Engine> engine_holder;
  try {
    engine_holder = std::make_unique<llava::Engine>(**loaded, eo);
  } catch (const std::exception& e) {
    spdlog::error("cannot allocate the KV pool of {} bytes on {}: {}", eo.kv_cache_bytes, device,
                  e.what());
    return 1;
  }
  llava::Engine& engine = *engine_holder;
  // After the weights and the pool: from here on the CPU tensors are the requests'
  // (activation_memory.h; llava_activation_bytes).
  if (activation_allocator) llava::InstallActivationAllocator();
  if (warmup) {
    // Before the gate exists, under an id its requests never reach (they count from 1).
    double ttft = 0;
    const llava::Status s =
        llava::WarmUp(&engine, (**loaded).config(), *parsed_policy,
                      std::numeric_limits<uint64_t>::max(), std::chrono::minutes(5), &ttft);
    if (s.ok()) {
      spdlog::info("warm-up: one request through the model, first token in {:.1f} ms", ttft * 1e3);
    } else {
      spdlog::warn("warm-up request failed, serving anyway: {}", s.ToString());
    }
  }

  llava::server::ServiceConfig sc;
  sc.model = FactsOf(**loaded, model_dir, dtype);
  sc.max_tokens_limit = max_tokens_limit;
  sc.kv_cache_bytes = engine.Snapshot().kv_pool_bytes;
  sc.max_batch = eo.max_batch;
  sc.defaults.max_tokens = default_max_tokens;
  sc.defaults.kv = *parsed_policy;
  llava::server::ServingMetrics metrics;
  std::unique_ptr<llava::server::TokenStore> tokens;
  const char* inline_tokens = std::getenv("LLAVA_AUTH_TOKENS");
  if (!auth_tokens_file.empty() || (inline_tokens != nullptr && *inline_tokens != '\0')) {
    auto store =
        llava::server::TokenStore::Create(auth_tokens_file, inline_tokens ? inline_tokens : "");
    if (!store.ok()) {
      spdlog::error("{}", store.status().ToString());
      return 2;
    }
    tokens = std::move(store).value();
    spdlog::info("bearer tokens required: {} known", tokens->size());
  }
  llava::server::RequestGate gate(&engine, &metrics, tokens.get());
  llava::server::LlavaServiceImpl service(&gate, sc);
  std::atomic<bool> serving{false};
  llava::server::MetricsHttpServer http(
      [&] {
        metrics.UpdateFromEngine(engine.Snapshot());
        metrics.UpdateProcess();
        if (!tls.cert.empty()) {
          auto left = llava::server::CertificateSecondsLeft(tls.cert);
          if (left.ok()) metrics.SetCertificateSecondsLeft(static_cast<double>(*left));
        }
        return metrics.Serialize();
      },
      [&] { return serving.load(); });
  const int metrics_port = http.Start(metrics_listen);
  if (metrics_port < 0) {
    spdlog::error("cannot listen on --metrics-listen {}", metrics_listen);
    return 1;
  }

  // The OpenAI-compatible API: on by default, since most clients (SDKs, chat UIs, evaluation
  // harnesses, the Gateway API Inference Extension) speak it; it serves the same engine with the
  // same limits, and is no more exposed than the gRPC port.
  std::unique_ptr<llava::server::OpenAiServer> openai;
  if (http_listen != "off" && !http_listen.empty()) {
    llava::server::OpenAiServerConfig oc;
    oc.defaults = sc.defaults;
    oc.model_id = served_model_name.empty() ? sc.model.model_path : served_model_name;
    oc.max_body_bytes = http_max_body_bytes > 0
                            ? static_cast<size_t>(http_max_body_bytes)
                            : static_cast<size_t>(max_image_bytes * max_images / 3 * 4 + (1 << 20));
    oc.threads = http_threads > 0
                     ? http_threads
                     : std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
    oc.max_connections = http_max_connections;
    oc.tls = tls;  // the same certificate, key and client CA as the gRPC port
    openai = std::make_unique<llava::server::OpenAiServer>(&gate, oc);
    const int http_port = openai->Start(http_listen);
    if (http_port < 0) {
      spdlog::error("cannot listen on --http-listen {}", http_listen);
      return 1;
    }
    spdlog::info("OpenAI-compatible API on port {} ({}, model id '{}')", http_port,
                 tls.cert.empty() ? "http" : "https", oc.model_id);
  }

  grpc::EnableDefaultHealthCheckService(true);
  if (reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (reflection && tokens) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> guards;
    guards.push_back(llava::server::ReflectionNeedsToken(&gate));
    builder.experimental().SetInterceptorCreators(std::move(guards));
  }
  int bound_port = 0;
  auto credentials = llava::server::GrpcServerCredentials(tls);
  if (!credentials.ok()) {
    spdlog::error("{}", credentials.status().ToString());
    return 2;
  }
  WarnIfExpiring(tls.cert);
  if (!tls.cert.empty()) {
    spdlog::info(
        "gRPC over TLS ({}), files re-read every {} s",
        tls.client_ca.empty() ? "server certificate" : "mutual, client certificates required",
        tls.reload_seconds);
  }
  builder.AddListeningPort(listen, *credentials, &bound_port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_image_bytes * max_images + (1 << 20)));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || bound_port == 0) {
    spdlog::error("cannot listen on {}", listen);
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  serving = true;
  spdlog::info("metrics on port {} (/metrics, /healthz)", metrics_port);
  // The bound port on its own line, for scripts and tests that listen on port 0.
  spdlog::info("serving on port {} (model {}, default policy {} budget {:.2f}, KV pool {:.2f} GiB)",
               bound_port, model_dir, policy, budget,
               static_cast<double>(sc.kv_cache_bytes) / static_cast<double>(1 << 30));

  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGHUP, OnHangup);
  while (g_signal == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (g_hangup == 0) continue;
    g_hangup = 0;
    // The token file is re-read whenever it changes; the HTTP API's certificate is re-read here;
    // gRPC's certificate watcher has no trigger and reads its files every --tls-reload-seconds.
    if (tokens) spdlog::info("SIGHUP: {} bearer tokens", tokens->size());
    if (openai && !tls.cert.empty()) {
      spdlog::info("SIGHUP: HTTP API certificate {}",
                   openai->ReloadTls() ? "reloaded" : "unchanged or not loadable, kept");
    }
    WarnIfExpiring(tls.cert);
    if (!tls.cert.empty()) {
      spdlog::info("SIGHUP: the gRPC port reads its certificate within {} s", tls.reload_seconds);
    }
  }

  spdlog::info("signal {}: draining for up to {:.0f} s", static_cast<int>(g_signal), grace_s);
  server->GetHealthCheckService()->SetServingStatus(false);
  serving = false;
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
  // New RPCs are refused from here; running ones finish (or are cancelled at the deadline).
  std::thread drain([&] { engine.Shutdown(grace); });
  server->Shutdown(std::chrono::system_clock::now() + grace + std::chrono::seconds(2));
  drain.join();
  // The engine has finished or cancelled every request; the HTTP streams still have to write
  // what it produced last (their final chunk and [DONE]): milliseconds, unless a client stopped
  // reading. With the gRPC port's 2 s, the whole stop takes at most the grace + 4 s (deploy/'s
  // termination grace allows for it).
  if (openai) openai->Stop(std::chrono::seconds(2));
  spdlog::info("stopped");
  return 0;
}
