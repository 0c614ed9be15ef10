#include "engine/kernels/activation_memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace llava {
namespace {

// Every allocation starts with this header, 64 bytes before the tensor's data (which stays
// 64-byte aligned, as c10's own allocator aligns): the one deleter tells the two kinds apart
// by it, so libtorch's raw interface (pointer-only frees) works too.
struct alignas(64) Header {
  uint64_t magic;
  uint64_t bytes;      // what the tensor asked for: counted live until freed
  uint64_t map_bytes;  // a block: its mapping (its size class); heap: 0
};
static_assert(sizeof(Header) == 64, "the header keeps the data 64-byte aligned");
constexpr uint64_t kHeapMagic = 0x4c4c415641484541ull;   // "LLAVAHEA"
constexpr uint64_t kBlockMagic = 0x4c4c415641424c4bull;  // "LLAVABLK"

// Blocks are whole multiples of this: a tensor wastes less than one, and what is left of a
// reused free range is still a usable block.
constexpr size_t kGrain = size_t{64} << 10;

size_t BlockBytes(size_t n) { return (n + sizeof(Header) + kGrain - 1) / kGrain * kGrain; }

void RaiseMax(std::atomic<int64_t>& max, int64_t value) {
  int64_t seen = max.load(std::memory_order_relaxed);
  while (value > seen && !max.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

class ActivationAllocator final : public c10::Allocator {
 public:
  explicit ActivationAllocator(const ActivationAllocatorOptions& options) : options_(options) {}

  c10::DataPtr allocate(size_t n) const override {
    if (n == 0) return {nullptr, nullptr, &Free, c10::Device(c10::DeviceType::CPU)};
    void* data = static_cast<int64_t>(n) >= options_.min_block_bytes ? Block(n) : Heap(n);
    return {data, data, &Free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

  static void Free(void* data);

  ActivationMemoryStats Stats() const {
    ActivationMemoryStats s;
    s.live_bytes = live_.load();
    s.peak_live_bytes = peak_live_.load();
    s.window_peak_bytes = window_peak_.load();
    std::lock_guard<std::mutex> lock(mu_);
    s.mapped_bytes = mapped_;
    s.peak_mapped_bytes = peak_mapped_;
    s.cached_bytes = free_bytes_;
    s.maps = maps_;
    s.unmaps = unmaps_;
    s.reuses = reuses_;
    return s;
  }
  void StartWindow() {
    std::lock_guard<std::mutex> lock(mu_);
    // Keep what the window that ends needed (its peak of block bytes, with the slack); the
    // rest of the free ranges goes back to the system.
    UnmapFreeLocked(Bound(window_block_peak_), /*trim=*/true);
    window_block_peak_ = block_live_;
    window_peak_.store(live_.load());
  }
  int64_t ReleaseAll() {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t released = free_bytes_;
    UnmapFreeLocked(mapped_ - free_bytes_);
    return released;
  }

 private:
  void AddLive(int64_t bytes) const {
    const int64_t now = live_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    RaiseMax(peak_live_, now);
    RaiseMax(window_peak_, now);
  }

  void* Heap(size_t n) const {
    void* base = nullptr;
    TORCH_CHECK(posix_memalign(&base, sizeof(Header), n + sizeof(Header)) == 0,
                "CPU allocator: out of memory allocating ", n, " bytes");
    auto* h = static_cast<Header*>(base);
    *h = Header{kHeapMagic, n, 0};
    AddLive(static_cast<int64_t>(n));
    return h + 1;
  }

  int64_t Bound(int64_t block_bytes) const {
    return static_cast<int64_t>(options_.slack * static_cast<double>(block_bytes));
  }

  // Best fit among the free ranges (the smallest that holds `bytes`, split when larger), else a
  // new mapping, after unmapping free ranges beyond the bound.
  void* Block(size_t n) const {
    const size_t bytes = BlockBytes(n);
    char* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto fit = by_size_.lower_bound({bytes, nullptr});
      if (fit != by_size_.end()) {
        const auto [size, start] = *fit;
        TakeFreeLocked(start, size);
        if (size > bytes) PutFreeLocked(start + bytes, size - bytes);
        p = start;
        ++reuses_;
      } else {
        const int64_t live_after = block_live_ + static_cast<int64_t>(bytes);
        UnmapFreeLocked(Bound(std::max(window_block_peak_, live_after)) -
                        static_cast<int64_t>(bytes));
        void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {  // what is kept goes first, then once more
          UnmapFreeLocked(mapped_ - free_bytes_);
          m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        }
        TORCH_CHECK(m != MAP_FAILED, "CPU allocator: out of memory mapping ", bytes, " bytes");
        p = static_cast<char*>(m);
        mapped_ += static_cast<int64_t>(bytes);
        peak_mapped_ = std::max(peak_mapped_, mapped_);
        ++maps_;
      }
      block_live_ += static_cast<int64_t>(bytes);
      window_block_peak_ = std::max(window_block_peak_, block_live_);
    }
    auto* h = reinterpret_cast<Header*>(p);
    *h = Header{kBlockMagic, n, bytes};
    AddLive(static_cast<int64_t>(n));
    return h + 1;
  }

  // A freed block joins the free ranges, merged with its neighbours (adjacent mappings merge
  // too: munmap and reuse work on any page range).
  void Release(char* start, size_t size) const {
    std::lock_guard<std::mutex> lock(mu_);
    block_live_ -= static_cast<int64_t>(size);
    auto next = by_addr_.lower_bound(start);
    if (next != by_addr_.end() && start + size == next->first) {
      const size_t more = next->second;
      TakeFreeLocked(next->first, more);
      size += more;
    }
    auto prev = by_addr_.lower_bound(start);
    if (prev != by_addr_.begin()) {
      --prev;
      if (prev->first + prev->second == start) {
        char* s = prev->first;
        const size_t more = prev->second;
        TakeFreeLocked(s, more);
        start = s;
        size += more;
      }
    }
    PutFreeLocked(start, size);
  }

  void PutFreeLocked(char* start, size_t size) const {
    by_addr_.emplace(start, size);
    by_size_.emplace(size, start);
    free_bytes_ += static_cast<int64_t>(size);
  }
  void TakeFreeLocked(char* start, size_t size) const {
    by_addr_.erase(start);
    by_size_.erase({size, start});
    free_bytes_ -= static_cast<int64_t>(size);
  }

  // Unmaps free ranges, largest first, until at most `keep` bytes are mapped or nothing is
  // free. Before a new mapping, whole ranges go (cutting only the excess off a range left
  // pieces too small for the tensor that had used it); at the end of a window, `trim` cuts the
  // last range's excess off its end, so its head stays for the passes that needed it.
  void UnmapFreeLocked(int64_t keep, bool trim = false) const {
    while (mapped_ > keep && !by_size_.empty()) {
      const auto [size, start] = *by_size_.rbegin();
      const size_t over = (static_cast<size_t>(mapped_ - keep) + kGrain - 1) / kGrain * kGrain;
      const size_t cut = trim ? std::min(size, over) : size;
      TakeFreeLocked(start, size);
      if (cut < size) PutFreeLocked(start, size - cut);
      munmap(start + (size - cut), cut);
      mapped_ -= static_cast<int64_t>(cut);
      ++unmaps_;
    }
  }

  const ActivationAllocatorOptions options_;
  mutable std::atomic<int64_t> live_{0}, peak_live_{0}, window_peak_{0};
  mutable std::mutex mu_;
  // The free ranges, by address (to merge neighbours) and by size (best fit).
  mutable std::map<char*, size_t> by_addr_;
  mutable std::set<std::pair<size_t, char*>> by_size_;
  mutable int64_t free_bytes_ = 0, mapped_ = 0, peak_mapped_ = 0;
  mutable int64_t block_live_ = 0, window_block_peak_ = 0;  // bytes of blocks in use
  mutable int64_t maps_ = 0, unmaps_ = 0, reuses_ = 0;
};

// Never destroyed: tensors freed during static destruction still call its deleter.
std::atomic<ActivationAllocator*> g_allocator{nullptr};

void ActivationAllocator::Free(void* data) {
  if (data == nullptr) return;
  Header* h = static_cast<Header*>(data) - 1;
  ActivationAllocator* a = g_allocator.load();
  TORCH_INTERNAL_ASSERT(a != nullptr && (h->magic == kHeapMagic || h->magic == kBlockMagic),
                        "CPU allocator: freeing memory it did not allocate");
  a->live_.fetch_sub(static_cast<int64_t>(h->bytes), std::memory_order_relaxed);
  if (h->magic == kHeapMagic) {
    h->magic = 0;
    std::free(h);
  } else {
    h->magic = 0;
    a->Release(reinterpret_cast<char*>(h), h->map_bytes);
  }
}

}  // namespace

bool InstallActivationAllocator(const ActivationAllocatorOptions& options) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_allocator.load() != nullptr) return false;
  auto* a = new ActivationAllocator(options);
  g_allocator.store(a);
  // Above c10's own (priority 0), so nothing registered later at the default replaces it.
  c10::SetCPUAllocator(a, /*priority=*/1);
  return true;
}

bool ActivationAllocatorInstalled() { return g_allocator.load() != nullptr; }

ActivationMemoryStats ActivationMemory() {
  ActivationAllocator* a = g_allocator.load();
  return a == nullptr ? ActivationMemoryStats{} : a->Stats();
}

void StartActivationWindow() {
  if (ActivationAllocator* a = g_allocator.load()) a->StartWindow();
}

int64_t ReleaseActivationCache() {
  ActivationAllocator* a = g_allocator.load();
  return a == nullptr ? 0 : a->ReleaseAll();
}

}  // namespace llava
