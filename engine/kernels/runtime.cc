#include "engine/kernels/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <cstdlib>
#include <thread>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "engine/kernels/cpu_features.h"

namespace llava {

int InitTorchThreads(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  // OpenBLAS, libtorch's fp32 BLAS on Debian, runs its own pthreads, which busy-wait for about
  // 0.1 s after each call: the OpenMP threads of the next ATen op then wait for a core, and a
  // prefill in fp32 panels ran at 4-20 GFLOP/s instead of 70 (docs/BENCHMARKS.md, "CPU
  // paths"). The engine splits its fp32 products over the OpenMP threads itself
  // (PanelLinear), so OpenBLAS runs on the calling thread. Looked up by name: another BLAS
  // behind libblas.so.3 has no such call and nothing to change.
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(1);
  }
  return at::get_num_threads();
}

int AutoThreadCount(int requested, int64_t parameters, int cores, std::string* why) {
  std::string reason;
  int n = 0;
  if (requested > 0) {
    n = requested;
    reason = "forced by --threads";
  } else if (parameters >= 0 && parameters <= kAutoF32MaxParameters) {
    n = 1;
    reason = "auto: " + std::to_string(parameters) + " parameters, too few to split over cores";
  } else {
    n = std::max(1, cores);
    reason = "auto: one per core";
  }
  if (why != nullptr) *why = std::to_string(n) + " (" + reason + ")";
  return n;
}

int AutoMaxBatch(int requested, bool gpu, CpuPath path, DType dtype, std::string* why) {
  std::string reason;
  int n = 0;
  if (requested > 0) {
    n = requested;
    reason = "forced by --max-batch";
  } else if (gpu) {
    n = kAutoMaxBatchWide;
    reason = "auto: a GPU";
  } else if (path >= CpuPath::kAvx512Bf16 && dtype == DType::kBF16) {
    n = kAutoMaxBatchWide;
    reason = "auto: bf16 products on avx512bf16 gain from more rows";
  } else {
    n = kAutoMaxBatchNarrow;
    reason = std::string("auto: on ") + CpuPathName(path) + " with " +
             (dtype == DType::kBF16 ? "bf16" : "f32") + " weights more than " +
             std::to_string(kAutoMaxBatchNarrow) + " rows only lengthen each step";
  }
  if (why != nullptr) *why = std::to_string(n) + " (" + reason + ")";
  return n;
}

std::string ConfigureMalloc(const MallocSettings& settings) {
#if defined(__GLIBC__)
  std::string said;
  auto note = [&said](const std::string& what) { said += (said.empty() ? "" : ", ") + what; };
  if (std::getenv("MALLOC_ARENA_MAX") != nullptr) {
    note(std::string("arenas from MALLOC_ARENA_MAX=") + std::getenv("MALLOC_ARENA_MAX"));
  } else if (settings.arena_max > 0 && mallopt(M_ARENA_MAX, settings.arena_max) == 1) {
    note("at most " + std::to_string(settings.arena_max) + " arenas");
  } else {
    note("glibc's arenas");
  }
  const bool env_threshold = std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
                             std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr;
  const int64_t bytes = settings.mmap_threshold_bytes;
  if (env_threshold) {
    note("mmap/trim thresholds from the environment");
  } else if (bytes > 0 && bytes <= INT32_MAX &&
             mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1 &&
             mallopt(M_TRIM_THRESHOLD, static_cast<int>(bytes)) == 1) {
    note("mmap and trim thresholds " + std::to_string(bytes >> 20) + " MiB");
  } else {
    note("glibc's sliding mmap threshold");
  }
  return "malloc: " + said;
#else
  (void)settings;
  return "malloc: not glibc, left as it is";
#endif
}

std::string LimitOneDnnCache(int capacity) {
  for (const char* name : {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"}) {
    if (const char* v = std::getenv(name)) {
      return std::string("oneDNN primitive cache from ") + name + "=" + v;
    }
  }
  // Looked up by name, as openblas_set_num_threads above: libtorch loads oneDNN where it has it.
  using SetCapacity = int (*)(int);
  auto set =
      reinterpret_cast<SetCapacity>(dlsym(RTLD_DEFAULT, "dnnl_set_primitive_cache_capacity"));
  if (set == nullptr) return "no oneDNN";
  if (set(capacity) != 0) return "oneDNN primitive cache: left as it is (refused)";
  return "oneDNN primitive cache " + std::to_string(capacity) + " primitives";
}

int64_t TrimFreeHeap(int64_t keep_bytes) {
#if defined(__GLIBC__)
  const struct mallinfo2 info = mallinfo2();
  const auto free_bytes = static_cast<int64_t>(info.fordblks);
  if (free_bytes <= keep_bytes) return 0;
  malloc_trim(0);
  return free_bytes;
#else
  (void)keep_bytes;
  return 0;
#endif
}

}  // namespace llava
