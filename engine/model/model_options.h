// How a model is loaded: storage and compute type, device. Torch-free, so that callers which
// only choose the options (the server's flags) need not include the model.
#pragma once

#include <string>

#include "engine/io/safetensors.h"
#include "engine/kernels/quant.h"
#include "engine/kv/kv_layout.h"

namespace llava {

struct ModelOptions {
  DType dtype = DType::kBF16;  // weights and activations; kF32 for reference numerics
  std::string device = "cpu";  // "cpu" or "cuda[:i]" (when built against a CUDA libtorch)
  // The decoder's linear layers quantized at load (CPU only): kInt8 or kInt4 (engine/kernels/
  // quant.h); the output projection is int8 in both. The vision tower, projector, embeddings and
  // norms keep `dtype`.
  WeightFormat weights = WeightFormat::kBf16;
  // What the KV cache stores (kv_layout(); engine/kv/kv_pool.h): the model's dtype, or int8
  // entries with a scale per row (CPU only).
  KvDtype kv_dtype = KvDtype::kModel;
};

}  // namespace llava
