// Skinny matrix products for decoding on x86 CPUs: y = x W^T (+ b) for up to 8 rows of x,
// the weights read as stored (bf16, or fp32 for fp32 models) and the arithmetic in fp32 registers.
// Decoding is bound by streaming the weights, and oneDNN's bf16 GEMV in libtorch 1.13 streams them
// at about two thirds of the memory bandwidth (and has no fast path at all without AVX512-BF16);
// this kernel reads each weight row once for all rows of x, with several weight rows in flight per
// thread. On AVX512-BF16 prefill stays with oneDNN, which runs at the CPU's bf16 peak there
// (llava-bench --suite matmul; a tiled version of this kernel reached 55-90% of it).
// Torch-free header (raw pointers), so the kernel TU is the only one built with OpenMP.
#pragma once

#include <cstdint>
#include <cstring>

#include "engine/kernels/cpu_features.h"

namespace llava {

constexpr int kGemvMaxRows = 8;

// More rows than kGemvMaxRows run as passes of at most kGemvMaxRows rows each (as even as
// possible: 9 rows are 4 + 5), each pass streaming the weights again. Worth it up to this many
// rows on the paths that widen bf16 in registers, where the alternative (PanelLinear) widens a
// panel of weights to fp32 in memory and OpenBLAS then packs it again (docs/BENCHMARKS.md,
// "Batches of 9-64 rows").
constexpr int kStreamedMaxRows = 64;

// The most rows of x that Linear sends to Bf16Gemv (bf16 = true) or F32Gemv on `path`: up to
// kStreamedMaxRows on the AVX2 and AVX-512 paths (and for fp32 on AVX512-BF16, which runs the
// AVX2 kernel), kGemvMaxRows where a better product takes over (oneDNN's bf16 GEMM on
// AVX512-BF16) or the kernel is plain C++ (generic).
int GemvMaxRows(bool bf16, CpuPath path = ActiveCpuPath());

// The float a bf16 bit pattern stands for (exact).
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bf16 bit pattern nearest to f (ties to even; finite values).
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// y [m, n] = x [m, k] . w [n, k]^T (+ bias [n]); bf16 in and out (uint16_t bit patterns),
// fp32 accumulation, round-to-nearest-even. Requires m >= 1 (more than kGemvMaxRows in passes),
// k >= 1 and row-major contiguous operands; `bias` may be null. Runs on libtorch's intra-op
// threads. `path` picks the kernel (clamped to what the CPU runs): avx512bf16 multiplies bf16 pairs
// with vdpbf16ps (a k % 32 tail masked); avx512 and avx2 widen each weight vector to fp32 and
// use AVX2 FMAs (the AVX-512 machines without BF16 run it too); generic is plain C++.
void Bf16Gemv(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t m,
              int64_t n, int64_t k, CpuPath path = ActiveCpuPath());

// The same product in fp32 (an fp32 model's decode rows: `--dtype f32`, or `auto` for a small
// model on the paths without BF16): the AVX2 kernel on every vector path, plain C++ on generic.
void F32Gemv(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
             int64_t k, CpuPath path = ActiveCpuPath());

}  // namespace llava
