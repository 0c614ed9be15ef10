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

// The backward pass of CausalSoftmaxRows after a scale: given p [rows, len] (its output) and
// g [rows, len] (the loss's gradient with respect to p), overwrites g with the gradient with
// respect to the scores before the scale, scale * p * (g - <g, p>) per row. Masked entries
// (p = 0) get 0.
void SoftmaxBackwardRows(const float* p, float* g, int64_t rows, int64_t len, float scale);

// SwiGLU on rows of gate_up [rows, 2f] = [gate | up] (bf16 bit patterns): y [rows, f] =
// silu(gate) * up, fp32 arithmetic and one rounding.
void SwiGluBf16(const uint16_t* gate_up, uint16_t* y, int64_t rows, int64_t f);

// Its backward pass: from dy [rows, f], d_gate_up [rows, 2f] = [dy * up * silu'(gate) |
// dy * silu(gate)], with silu'(g) = s (1 + g (1 - s)), s = sigmoid(g). All bf16 bit patterns.
void SwiGluBackwardBf16(const uint16_t* gate_up, const uint16_t* dy, uint16_t* d_gate_up,
                        int64_t rows, int64_t f);

// The backward pass of QuickGeluBf16: dx[i] = dy[i] * (s + 1.702 x[i] s (1 - s)), s =
// sigmoid(1.702 x[i]). bf16 bit patterns; dx may be dy's buffer.
void QuickGeluBackwardBf16(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n);

// y[i] = x[i] * sigmoid(1.702 x[i]) (CLIP's "quick_gelu"), bf16 bit patterns in and out,
// fp32 arithmetic and one rounding. x and y may be the same buffer.
void QuickGeluBf16(const uint16_t* x, uint16_t* y, int64_t n);

}  // namespace llava
