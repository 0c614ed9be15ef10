// The shape of one model's KV cache: what every cache and the pool (kv_pool.h) are sized by.
// Torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "engine/io/safetensors.h"

namespace llava {

struct KvLayout {
  int num_layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;  // the model's activation dtype: what K and V are stored in
  std::string device = "cpu";  // where they are stored ("cpu", "cuda[:i]")

  int dtype_bytes() const { return static_cast<int>(DTypeSize(dtype)); }
  // K and V of one entry in one layer.
  int64_t bytes_per_entry() const { return int64_t{2} * kv_heads * head_dim * dtype_bytes(); }
};

}  // namespace llava
