// How a model is loaded: storage and compute type, device. Torch-free, so that callers which
// only choose the options (the server's flags) need not include the model.
#pragma once

#include <string>

#include "engine/io/safetensors.h"

namespace llava {

struct ModelOptions {
  DType dtype = DType::kBF16;  // weights and activations; kF32 for reference numerics
  std::string device = "cpu";  // "cpu" or "cuda[:i]" (when built against a CUDA libtorch)
};

}  // namespace llava
