// Where the forward pass's CPU tensors live: an allocator for libtorch's CPU tensors that keeps
// large blocks mapped between passes and bounds what it keeps by the live bytes it has seen.
// Torch-free header.
//
// glibc's heap fragments under a 7B-wide prefill: tensors of a dozen sizes are freed in an order
// that leaves holes no later request fits, and small long-lived allocations pin the heap's top,
// so a 256-row pass left tens of MB of free heap beside its live tensors (docs/BENCHMARKS.md,
// "The paged KV pool"). Mapping each large tensor on its own (a low mmap threshold) fixes the
// holes but pays page faults on every pass. Here tensors of at least `min_block_bytes` get
// blocks (64 KiB multiples) of mapped memory kept apart from the heap: a freed block joins the
// free ranges, merged with its free neighbours; a new tensor takes the smallest free range that
// holds it (split when larger), so the next layer and the next pass reuse the same resident
// pages. Only when none holds it is memory mapped, after unmapping free ranges (largest first)
// beyond `slack` x the most block bytes in use at once in the current window. Each
// `StartActivationWindow` (the engine: at most every 100 ms, between passes) also unmaps what
// the window that ends did not need. So the memory behind the activations follows the largest
// step of the recent passes, not their history.
#pragma once

#include <cstdint>

namespace llava {

struct ActivationAllocatorOptions {
  int64_t min_block_bytes = 256 << 10;  // smaller tensors stay on malloc's heap
  double slack = 1.1;  // mapped bytes kept within slack x the window's peak of block bytes in use
};

struct ActivationMemoryStats {
  int64_t live_bytes = 0;         // CPU tensor bytes allocated through the allocator, now
  int64_t peak_live_bytes = 0;    // the most at once since the process started
  int64_t window_peak_bytes = 0;  // the most at once since the window started
  int64_t mapped_bytes = 0;       // blocks mapped (in use and kept), now
  int64_t peak_mapped_bytes = 0;  // the most mapped at once
  int64_t cached_bytes = 0;       // blocks kept for reuse, now (part of mapped_bytes)
  int64_t maps = 0, unmaps = 0, reuses = 0;  // block events, ever
};

// Makes the allocator libtorch's CPU allocator for the rest of the process (the first call
// wins; later calls return false). Tensors made before keep their own allocator.
bool InstallActivationAllocator(const ActivationAllocatorOptions& options = {});
bool ActivationAllocatorInstalled();

// Zeros when the allocator is not installed.
ActivationMemoryStats ActivationMemory();

// Starts a new window for the bound: the recent peak becomes the bytes live now. The engine
// calls it between passes at most every 100 ms, so a heavy prefill's blocks are unmapped once
// the passes after it need less.
void StartActivationWindow();

// Unmaps every kept block (an idle server). Returns the bytes unmapped.
int64_t ReleaseActivationCache();

}  // namespace llava
