// The shape of one model's KV cache: what every cache and the pool (kv_pool.h) are sized by.
// Torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "engine/io/safetensors.h"
#include "engine/io/status.h"

namespace llava {

// What a KV entry is stored as: in the model's activation dtype, or as int8 with one fp32 scale
// per entry, KV head and K/V (kv_pool.h; docs/ARCHITECTURE.md, "The KV pool"). One choice per
// pool, so per server: a page has one format.
enum class KvDtype { kModel, kInt8 };

inline const char* KvDtypeName(KvDtype d) { return d == KvDtype::kInt8 ? "int8" : "auto"; }
// "auto" (the model's dtype) or "int8".
inline StatusOr<KvDtype> ParseKvDtype(const std::string& name) {
  if (name == "auto") return KvDtype::kModel;
  if (name == "int8") return KvDtype::kInt8;
  return InvalidArgument("kv cache dtype \"" + name + "\": expected auto or int8");
}

struct KvLayout {
  int num_layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;         // the model's activation dtype: what K and V are computed in
  std::string device = "cpu";         // where they are stored ("cpu", "cuda[:i]")
  KvDtype entries = KvDtype::kModel;  // what K and V are stored in

  bool int8() const { return entries == KvDtype::kInt8; }
  int dtype_bytes() const { return static_cast<int>(DTypeSize(dtype)); }
  // K and V of one entry in one layer, as stored: an int8 head row carries its fp32 scale.
  int64_t bytes_per_entry() const {
    return int8() ? int64_t{2} * kv_heads * (head_dim + 4) : model_bytes_per_entry();
  }
  // The same in the model's dtype (what a cache without int8 entries holds).
  int64_t model_bytes_per_entry() const { return int64_t{2} * kv_heads * head_dim * dtype_bytes(); }
};

}  // namespace llava
