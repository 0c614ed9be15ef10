// Element-wise and row-wise CPU kernels shared by the model's fused paths: softmax rows and
// CLIP's quick GELU, vectorised with AVX-512 or AVX2 (a vectorised exp) by the CPU path
// (cpu_features.h), portable loops otherwise. Torch-free (raw pointers), like cpu_gemv.h.
#pragma once

#include <cstdint>

#include "engine/kernels/cpu_features.h"

namespace llava {

// Softmax of each of the `rows` rows of p [rows, len], in place (fp32). `path` is clamped to
// what the CPU runs (tests pass each one).
void SoftmaxRows(float* p, int64_t rows, int64_t len, CpuPath path = ActiveCpuPath());

// Causal softmax: row r of p [rows, len] over its first min(len, first_len + r) entries, the
// rest set to 0 (a query block whose first row sees first_len cache entries).
void CausalSoftmaxRows(float* p, int64_t rows, int64_t len, int64_t first_len);

// y[i] = x[i] * sigmoid(1.702 x[i]) (CLIP's "quick_gelu"), bf16 bit patterns in and out,
// fp32 arithmetic and one rounding. x and y may be the same buffer.
void QuickGeluBf16(const uint16_t* x, uint16_t* y, int64_t n);

}  // namespace llava
