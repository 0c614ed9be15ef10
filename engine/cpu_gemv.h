// Skinny bf16 matrix products for decoding on x86 CPUs with AVX512-BF16: y = x W^T (+ b) for
// up to 8 rows of x. Decoding is bound by streaming the weights, and oneDNN's bf16 GEMV in
// libtorch 1.13 streams them at about two thirds of the memory bandwidth; this kernel reads
// each weight row once for all rows of x, with several weight rows in flight per thread.
// Prefill stays with oneDNN, which runs at the CPU's bf16 peak there (llava-bench --suite
// matmul; a tiled version of this kernel reached 55-90% of it).
// Torch-free header (raw pointers), so the kernel TU is the only one built with OpenMP.
#pragma once

#include <cstdint>
#include <cstring>

namespace llava {

constexpr int kGemvMaxRows = 8;

// The float a bf16 bit pattern stands for (exact).
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// True when the CPU supports AVX512-BF16 (checked once).
bool CpuHasBf16Gemv();

// y [m, n] = x [m, k] . w [n, k]^T (+ bias [n]); bf16 in and out (uint16_t bit patterns),
// fp32 accumulation, round-to-nearest-even. Requires 1 <= m <= kGemvMaxRows, k >= 1 (a
// k % 32 tail is masked), row-major contiguous operands and CpuHasBf16Gemv(). `bias` may be
// null. Runs on libtorch's intra-op threads.
void Bf16Gemv(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t m,
              int64_t n, int64_t k);

}  // namespace llava
