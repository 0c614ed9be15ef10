// One KV pool per engine: every sequence's keys and values live in it, in pages of a fixed
// number of token slots (vLLM's paged blocks), allocated once, on the model's device, and sized
// by the server's --kv-cache-bytes. A sequence holds a page table into it (kv_cache.h); one
// table serves all layers, since a page id names the same slots in every layer.
//
// Storage: one tensor [L, 2, pages, Hkv, P, hd] in the model's dtype (P = page_rows): page p of
// layer l holds, for each KV head, P consecutive rows of hd values, so the decode attention
// reads a page's rows of a head as one contiguous run, as it would read an unpaged cache.
// With int8 entries (KvDtype::kInt8, CPU only) that tensor is int8 and a second one,
// [L, 2, pages, Hkv, P] fp32, holds each row's scale (QuantizeKvRow below):
// an entry costs hd + 4 bytes per head and K/V instead of 2 hd, so a pool of the same bytes has
// 1.94x the pages at hd = 128. Entries are quantized when written and dequantized when read
// out (Gather) or by the decode attention as it loads them; merges and blends work on the
// dequantized fp32 values and quantize their result.
//
// Why pages of 16 slots rather than single slots (SGLang's token pool): the CPU decode kernels
// work on blocks of 16 rows (8 on AVX2), which a page of 16 keeps contiguous, while a slot table
// needs an indirection per row; a sequence wastes at most 15 slots in its last page
// (docs/BENCHMARKS.md, "The paged KV pool", measures both).
//
// Memory: the tensor is allocated untouched; the allocator (page_allocator.h) hands out the
// lowest free pages first, so the resident part of the pool is the most pages ever in use.
//
// Thread safety: not thread-safe; the engine thread owns the pool and every cache in it.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/kv/kv_layout.h"
#include "engine/kv/page_allocator.h"

namespace at {
class Tensor;
}

namespace llava {

constexpr int64_t kKvPageRows = 16;

// One row of int8 entries (an entry of one KV head): q = round(x * (1 / d)) in [-127, 127]
// with d = max|x| / 127 in fp32 (0 for a row of zeros); x ~ d * q. Returns d (NaN, with
// integers 0, for a row with a NaN or an infinity).
float QuantizeKvRow(const float* x, int64_t n, int8_t* q);

class KvPool {
 public:
  // A pool of floor(bytes / page_bytes) pages (possibly none) of `page_rows` slots, a multiple
  // of 16. Allocates; throws c10::Error when the device cannot.
  KvPool(const KvLayout& layout, int64_t bytes, int64_t page_rows = kKvPageRows);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const KvLayout& layout() const { return layout_; }
  int64_t page_rows() const { return page_rows_; }
  // One page in every layer, K and V: page_rows x layers x bytes_per_entry.
  int64_t page_bytes() const { return page_rows_ * layout_.num_layers * layout_.bytes_per_entry(); }
  int64_t num_pages() const { return pages_.num_pages(); }
  int64_t bytes() const { return num_pages() * page_bytes(); }
  int64_t used_bytes() const { return pages_.used_pages() * page_bytes(); }
  // Pages that hold `entries` slots.
  int64_t PagesFor(int64_t entries) const { return (entries + page_rows_ - 1) / page_rows_; }

  PageAllocator& pages() { return pages_; }
  const PageAllocator& pages() const { return pages_; }

  // Layer `layer`'s keys (values: `values` true) in every page: [pages, Hkv, P, hd], a view
  // (int8 for int8 entries).
  at::Tensor Pages(int layer, bool values) const;
  // The address of page 0 of `layer`'s keys (values: `values` true); pages are page_stride()
  // elements apart and the KV heads of a page head_stride() elements apart.
  void* Base(int layer, bool values) const;
  int64_t page_stride() const { return layout_.kv_heads * page_rows_ * layout_.head_dim; }
  int64_t head_stride() const { return page_rows_ * layout_.head_dim; }

  // int8 entries: the scales of `layer`'s keys (values) in page 0, one fp32 per row; pages are
  // scale_page_stride() apart, KV heads of a page page_rows() apart. Null otherwise.
  float* ScaleBase(int layer, bool values) const;
  int64_t scale_page_stride() const { return layout_.kv_heads * page_rows_; }

 private:
  KvLayout layout_;
  int64_t page_rows_;
  PageAllocator pages_;
  std::unique_ptr<at::Tensor> storage_;  // [L, 2, pages, Hkv, P, hd]
  std::unique_ptr<at::Tensor> scales_;   // int8 entries: [L, 2, pages, Hkv, P] fp32
};

}  // namespace llava
