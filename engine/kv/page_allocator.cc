#include "engine/kv/page_allocator.h"

#include <cstdio>
#include <cstdlib>

namespace llava {

PageAllocator::PageAllocator(int64_t num_pages) : in_use_(num_pages, 0) {
  free_.reserve(num_pages);
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

bool PageAllocator::Allocate(int64_t n, std::vector<int32_t>* out) {
  if (n < 0 || n > free_pages()) return false;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = free_.back();
    free_.pop_back();
    in_use_[p] = 1;
    out->push_back(p);
  }
  if (used_pages() > high_water_) high_water_ = used_pages();
  return true;
}

void PageAllocator::Free(const int32_t* pages, int64_t n) {
  // Freed in reverse, so that the lowest of them is handed out first again.
  for (int64_t i = n - 1; i >= 0; --i) {
    const int32_t p = pages[i];
    if (p < 0 || p >= num_pages() || !in_use_[p]) {
      std::fprintf(stderr, "PageAllocator: page %d freed but not in use\n", p);
      std::abort();
    }
    in_use_[p] = 0;
    free_.push_back(p);
  }
}

}  // namespace llava
