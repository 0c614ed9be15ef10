// One request through the whole serving path before a server takes traffic. The first request
// of a process is slower than the next (first-touch allocations, thread start-up, one-time
// set-up in libtorch and the kernels): with the default model on an AVX2 CPU its TTFT was 49.6
// ms against 36.3 ms after a warm-up (docs/BENCHMARKS.md, "On a real AVX2-only CPU"), so a
// server runs this one itself and its first client does not.
#pragma once

#include <chrono>

#include "engine/io/model_config.h"
#include "engine/io/status.h"
#include "engine/kv/cache_policy.h"
#include "engine/serving/engine.h"

namespace llava {

// A white image of the vision tower's input size (an uncompressed BMP, decoded like any
// client's image), "Describe the image." and two greedy tokens (the prefill and one decode
// step) with the cache policy `kv`, submitted to `engine` under `id`, which must not be in use.
// Waits for it up to `timeout` (then cancels it and returns DEADLINE_EXCEEDED); returns the
// request's error, if any, and otherwise its time to first token in *ttft_seconds (may be
// null). The engine is left as it was: the request's cache is freed when it finishes.
Status WarmUp(EngineApi* engine, const LlavaConfig& config, const CacheParams& kv, uint64_t id,
              std::chrono::milliseconds timeout, double* ttft_seconds);

}  // namespace llava
