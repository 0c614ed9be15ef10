// The libtorch scalar type of a checkpoint dtype. Includes a libtorch header: not for the
// torch-free targets.
#pragma once

#include <c10/core/ScalarType.h>

#include "engine/io/safetensors.h"

namespace llava {

inline c10::ScalarType ScalarTypeOf(DType d) {
  switch (d) {
    case DType::kF32:
      return c10::kFloat;
    case DType::kF16:
      return c10::kHalf;
    case DType::kBF16:
      return c10::kBFloat16;
    case DType::kU8:
      return c10::kByte;
  }
  return c10::kFloat;
}

}  // namespace llava
