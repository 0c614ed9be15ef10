#include "engine/kv/kv_pool.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/io/aten_dtype.h"

namespace llava {

float QuantizeKvRow(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (!std::isfinite(amax) || std::any_of(x, x + n, [](float v) { return std::isnan(v); })) {
    // Non-finite activations stay non-finite (as a bf16 cache would keep them), with no
    // undefined float-to-int conversion: integers 0, the scale NaN.
    std::fill(q, q + n, int8_t{0});
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.f, 127.f));
  }
  return d;
}

KvPool::KvPool(const KvLayout& layout, int64_t bytes, int64_t page_rows)
    : layout_(layout), page_rows_(page_rows), pages_([&] {
        TORCH_CHECK(page_rows > 0 && page_rows % 16 == 0, "KvPool: page_rows ", page_rows,
                    " is not a positive multiple of 16");
        const int64_t page = page_rows * layout.num_layers * layout.bytes_per_entry();
        return page > 0 ? std::max<int64_t>(0, bytes) / page : 0;
      }()) {
  TORCH_CHECK(!layout.int8() || at::Device(layout.device).is_cpu(),
              "KvPool: int8 KV entries are CPU only, not on ", layout.device);
  const at::TensorOptions options = at::TensorOptions().device(at::Device(layout.device));
  storage_ = std::make_unique<at::Tensor>(at::empty(
      {layout.num_layers, 2, pages_.num_pages(), layout.kv_heads, page_rows, layout.head_dim},
      options.dtype(layout.int8() ? at::kChar : ScalarTypeOf(layout.dtype))));
  if (layout.int8()) {
    scales_ = std::make_unique<at::Tensor>(
        at::empty({layout.num_layers, 2, pages_.num_pages(), layout.kv_heads, page_rows},
                  options.dtype(at::kFloat)));
  }
}

KvPool::~KvPool() = default;

at::Tensor KvPool::Pages(int layer, bool values) const {
  return (*storage_)[layer][values ? 1 : 0];
}

void* KvPool::Base(int layer, bool values) const {
  return static_cast<char*>(storage_->data_ptr()) +
         ((int64_t{layer} * 2 + (values ? 1 : 0)) * num_pages() * page_stride()) *
             storage_->element_size();
}

float* KvPool::ScaleBase(int layer, bool values) const {
  if (!scales_) return nullptr;
  return scales_->data_ptr<float>() +
         (int64_t{layer} * 2 + (values ? 1 : 0)) * num_pages() * scale_page_stride();
}

}  // namespace llava
