#include "engine/cpu_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace llava {
namespace {

inline uint16_t FloatToBf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu))
    return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Rows [n0, n1) of W against all M rows of x, R weight rows at a time: R x M accumulators
// (R * M <= 24 of the 32 zmm registers), each k step loads R weight vectors and M x vectors.
template <int M, int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void GemvRows(
    const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n, int64_t k,
    int64_t n0, int64_t n1) {
  int64_t r0 = n0;
  for (; r0 + R <= n1; r0 += R) {
    // Full unrolling keeps `acc` in registers (checked in the disassembly; a packed-GEMM
    // prototype without the pragmas spilled every accumulator on every k step).
    __m512 acc[R][M];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
    }
    const uint16_t* wr = w + r0 * k;
    for (int64_t kk = 0; kk < k; kk += 32) {
      __m512bh wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + r * k + kk + 512), _MM_HINT_T0);
        wv[r] = (__m512bh)_mm512_loadu_si512(wr + r * k + kk);
      }
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * k + kk);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float b = bias != nullptr ? Bf16ToFloat(bias[r0 + r]) : 0.f;
      for (int i = 0; i < M; ++i)
        y[i * n + r0 + r] = FloatToBf16(_mm512_reduce_add_ps(acc[r][i]) + b);
    }
  }
  if constexpr (R > 1) {
    if (r0 < n1) GemvRows<M, 1>(x, w, bias, y, n, k, r0, n1);
  }
}

template <int M>
void GemvM(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n,
           int64_t k) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : 3;
  const int64_t blocks = (n + R - 1) / R;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    GemvRows<M, R>(x, w, bias, y, n, k, b0 * R, std::min(n, b1 * R));
  });
}

}  // namespace

bool CpuHasBf16Gemv() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

void Bf16Gemv(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t m,
              int64_t n, int64_t k) {
  switch (m) {
    case 1:
      return GemvM<1>(x, w, bias, y, n, k);
    case 2:
      return GemvM<2>(x, w, bias, y, n, k);
    case 3:
      return GemvM<3>(x, w, bias, y, n, k);
    case 4:
      return GemvM<4>(x, w, bias, y, n, k);
    case 5:
      return GemvM<5>(x, w, bias, y, n, k);
    case 6:
      return GemvM<6>(x, w, bias, y, n, k);
    case 7:
      return GemvM<7>(x, w, bias, y, n, k);
    case 8:
      return GemvM<8>(x, w, bias, y, n, k);
    default:
      break;
  }
}

}  // namespace llava
