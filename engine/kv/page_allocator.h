// The free list of the KV pool (kv_pool.h): which of `num_pages` fixed-size pages are free.
// Torch-free, so its invariants are tested exactly.
//
// Invariant: every page is either free (on the stack, once) or in use (owned by exactly one
// sequence's page table: the caller's side of the contract). Pages are handed out lowest id
// first and a freed page is the next one handed out, so the pages ever touched are the lowest
// ids up to the most ever in use at once: on the CPU the pool's untouched tail never enters the
// process's resident memory.
//
// Thread safety: not thread-safe; the engine thread owns the pool.
#pragma once

#include <cstdint>
#include <vector>

namespace llava {

class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  // Appends `n` page ids to `out`, or appends nothing and returns false when fewer than `n`
  // pages are free (all or nothing).
  bool Allocate(int64_t n, std::vector<int32_t>* out);
  // Returns `pages` to the free list. Each must be in use; a page freed twice or out of range
  // aborts (a broken page table would otherwise hand one page to two sequences).
  void Free(const int32_t* pages, int64_t n);

  int64_t num_pages() const { return static_cast<int64_t>(in_use_.size()); }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_pages() const { return num_pages() - free_pages(); }
  // The most pages ever in use at once (= the pages ever touched).
  int64_t high_water() const { return high_water_; }
  bool InUse(int32_t page) const { return in_use_[page] != 0; }

 private:
  std::vector<int32_t> free_;    // a stack: back() is handed out next
  std::vector<uint8_t> in_use_;  // [num_pages]
  int64_t high_water_ = 0;
};

}  // namespace llava
