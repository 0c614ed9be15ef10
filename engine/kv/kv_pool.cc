#include "engine/kv/kv_pool.h"

#include <ATen/ATen.h>

#include "engine/io/aten_dtype.h"

namespace llava {
KvPool::KvPool(const KvLayout& layout, int64_t bytes, int64_t page_rows)
    : layout_(layout), page_rows_(page_rows), pages_([&] {
        TORCH_CHECK(page_rows > 0 && page_rows % 16 == 0, "KvPool: page_rows ", page_rows,
                    " is not a positive multiple of 16");
        const int64_t page = page_rows * layout.num_layers * layout.bytes_per_entry();
        return page > 0 ? std::max<int64_t>(0, bytes) / page : 0;
      }()) {
  storage_ = std::make_unique<at::Tensor>(at::empty(
      {layout.num_layers, 2, pages_.num_pages(), layout.kv_heads, page_rows, layout.head_dim},
      at::TensorOptions().dtype(ScalarTypeOf(layout.dtype)).device(at::Device(layout.device))));
}

KvPool::~KvPool() = default;

at::Tensor KvPool::Pages(int layer, bool values) const {
  return (*storage_)[layer][values ? 1 : 0];
}

void* KvPool::Base(int layer, bool values) const {
  return static_cast<char*>(storage_->data_ptr()) +
         ((int64_t{layer} * 2 + (values ? 1 : 0)) * num_pages() * page_stride()) *
             layout_.dtype_bytes();
}

}  // namespace llava
