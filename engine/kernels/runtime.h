// Process-level libtorch setup. Torch-free header.
#pragma once

#include <cstdint>
#include <string>

#include "engine/kernels/cpu_features.h"  // CpuPath, DType

namespace llava {

// Sets libtorch's intra-op thread count (Debian's libtorch starts with 1 on these machines).
// `threads` <= 0 means one per hardware core. Returns the count in effect. Also makes
// OpenBLAS single-threaded: the engine's fp32 products are split over libtorch's threads
// (PanelLinear in llava_model.h), and OpenBLAS's own threads would compete with them.
int InitTorchThreads(int threads);

// The intra-op thread count that `--threads 0` (auto) means for a model of `parameters`
// parameters (-1: unknown) on a machine of `cores` cores: one for a model of at most
// kAutoF32MaxParameters (cpu_features.h), whose products are too short to split over cores
// (the default model's first token: 39-47 ms on one thread, 56-95 ms on two, AMD EPYC AVX2;
// docs/BENCHMARKS.md), else one per core. `requested` > 0 is returned as it is. `why`, when
// not null, says which and why.
int AutoThreadCount(int requested, int64_t parameters, int cores, std::string* why = nullptr);

// The running-request cap that `--max-batch 0` (auto) means: kAutoMaxBatchWide on a GPU and
// for bf16 weights on the AVX512-BF16 path, whose products gain from more rows (7B shapes, two
// cores: 116 tokens/s at 8 rows, 176 at 32; served with Elastic 0.2 and KV for 8 Full requests,
// a cap of 32 ran 1.45x the tokens/s of a cap of 8 at a quarter of the TTFT);
// kAutoMaxBatchNarrow elsewhere, where two cores' FMAs are saturated from 8 rows on (AVX2 path:
// 81 tokens/s at 8 rows, 73 at 32), so a larger batch only lengthens every step (the same
// serving run: 0.94x the tokens/s, 4x the inter-token latency). docs/BENCHMARKS.md, "a default
// batch per path". The KV byte budget may still admit fewer. `requested` > 0 is returned as it
// is; `why`, when not null, says which and why.
inline constexpr int kAutoMaxBatchWide = 32;
inline constexpr int kAutoMaxBatchNarrow = 8;
int AutoMaxBatch(int requested, bool gpu, CpuPath path, DType dtype, std::string* why = nullptr);

// glibc malloc settings for a process that serves for days (docs/BENCHMARKS.md, "Soak" and
// "Elastic prefill overhead"). glibc's defaults cost a server twice:
// - one arena per thread (up to 8 per core): each of gRPC's and the HTTP workers' threads fragments
//   its own, and a soak's RSS kept rising (+1.86%/h; +0.96%/h with two arenas);
// - a sliding mmap threshold (128 KiB up to 32 MiB): a prefill's larger tensors get fresh
//   mappings, and every run pays their page faults again (the default model's Full prefill
//   ~20% slower; the Elastic/Full overhead read 7% instead of 3.5%).
struct MallocSettings {
  int arena_max = 2;                          // 0: glibc's default
  int64_t mmap_threshold_bytes = 64ll << 20;  // also the trim threshold; 0: glibc's default
};
// Applies `settings` with mallopt, except what the environment already set (MALLOC_ARENA_MAX,
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ win). Returns a line for the log saying what
// is in effect. Without glibc: does nothing and says so.
std::string ConfigureMalloc(const MallocSettings& settings);

// oneDNN (ATen's bf16 products on AVX512-BF16) keeps every primitive it has made, up to 1,024
// by default, and a serving load makes new ones for each shape it has not seen (each prompt's
// length, each batch's rows): heaptrack found its cache the largest growth of the heap while
// serving, ~19 MB over 32 requests of the bench checkpoint (docs/BENCHMARKS.md, "The paged KV
// pool"). Caps it at `capacity` primitives unless ONEDNN_PRIMITIVE_CACHE_CAPACITY or
// DNNL_PRIMITIVE_CACHE_CAPACITY is set. Returns a line for the log; without oneDNN, says so.
inline constexpr int kOneDnnCacheCapacity = 64;
std::string LimitOneDnnCache(int capacity = kOneDnnCacheCapacity);

// Bounds the free memory the allocator keeps between forward passes: when glibc's arenas hold
// more than `keep_bytes` free (mallinfo2), gives the free pages back (malloc_trim) and returns
// the free bytes it held; else returns 0 and does nothing. The high fixed mmap threshold above
// keeps a pass's tensors on the heap, where the next pass reuses them without page faults, but
// its free chunks fragment: a 7B-wide prefill of 256 rows left ~100 MB free beside ~90 MB live
// (docs/BENCHMARKS.md, "The paged KV pool"). Without glibc: does nothing.
int64_t TrimFreeHeap(int64_t keep_bytes);

}  // namespace llava
