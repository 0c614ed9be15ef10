#include "engine/kernels/cpu_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "engine/kernels/avx512_reduce.h"

namespace llava {
namespace {

// Prefetches into L2 the weights `ahead` columns past column kk of row r of a tile of R rows
// (w points at the tile's first row). Near the end of a row the same distance reaches into row r
// of the next tile, whose rows would otherwise start cold: the hardware prefetcher follows each
// row as its own stream and starts anew at every tile. At 7B decode shapes this gave +15-28% for
// 8 rows and +17-25% for one (docs/BENCHMARKS.md, "Prefetch across tiles"). Past the last tile
// the address lies beyond the weights, which a prefetch may do (it never faults).
template <int R, typename T>
inline void PrefetchWeights(const T* w, int r, int64_t k, int64_t kk, int64_t ahead) {
  const int64_t col = kk + ahead;
  const int64_t row = col < k ? r : r + R - 1;  // col >= k already walks one row on
  _mm_prefetch(reinterpret_cast<const char*>(w + row * k + col), _MM_HINT_T1);
}

// Outputs [r0, r0 + R) of M rows of x: R x M accumulators (R * M <= 24 of the 32 zmm
// registers), each k step loads R weight vectors and M x vectors.
template <int M, int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void Tile(const uint16_t* x,
                                                                        const uint16_t* w,
                                                                        const uint16_t* bias,
                                                                        uint16_t* y, int64_t n,
                                                                        int64_t k, int64_t r0) {
  // Full unrolling keeps `acc` in registers (checked in the disassembly; a packed-GEMM
  // prototype without the pragmas spilled every accumulator on every k step).
  __m512 acc[R][M];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  const uint16_t* wr = w + r0 * k;
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) {
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // Into L2, 4 KiB ahead: at LLaVA-7B shapes +11% for 4-8 rows over 1 KiB ahead into L1
      // (which competes with the loads for L1 miss buffers); no change for 1 row or small k.
      PrefetchWeights<R>(wr, r, k, kk, 2048);
      wv[r] = (__m512bh)_mm512_loadu_si512(wr + r * k + kk);
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * k + kk);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[r]);
    }
  }
  if (kk < k) {  // the last k % 32 columns, zero-filled on both sides
    const __mmask32 tail = (__mmask32{1} << (k - kk)) - 1;
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + r * k + kk);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i * k + kk);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[r]);
    }
  }
  // The R * M horizontal sums, 16 at a time where there are enough of them (SumEach16), then
  // + bias and the bf16 rounding (vcvtneps2bf16: round to nearest even, 16 at a time).
  constexpr int T = R * M, kGroups = (T + 15) / 16;
  alignas(64) float sum[kGroups * 16];
  if constexpr (T >= 6) {
#pragma GCC unroll 2
    for (int t0 = 0; t0 < T; t0 += 16) {
      __m512 v[16];
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) {
        v[kSumSlot[l]] = t0 + l < T ? acc[(t0 + l) / M][(t0 + l) % M] : _mm512_setzero_ps();
      }
      _mm512_store_ps(sum + t0, SumEach16(v));
    }
  } else {
    for (int t = 0; t < T; ++t) sum[t] = SumLanes(acc[t / M][t % M]);
  }
  if (bias != nullptr) {
    for (int t = 0; t < T; ++t) sum[t] += Bf16ToFloat(bias[r0 + t / M]);
  }
  alignas(32) uint16_t out[kGroups * 16];
  for (int g = 0; g < kGroups; ++g) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * g),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sum + 16 * g)));
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) y[i * n + r0 + r] = out[r * M + i];
  }
}

// All outputs for all rows, R weight rows per tile (and single rows at the end of a thread's
// range), so each weight row is streamed from memory once for the whole batch.
template <int M, int R>
void SkinnyR(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n,
             int64_t k) {
  const int64_t blocks = (n + R - 1) / R;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t n1 = std::min(n, b1 * R);
    int64_t r0 = b0 * R;
    for (; r0 + R <= n1; r0 += R) Tile<M, R>(x, w, bias, y, n, k, r0);
    for (; r0 < n1; ++r0) Tile<M, 1>(x, w, bias, y, n, k, r0);
  });
}

// Weight rows per tile. Long rows (7B: k = 4096) are bound by streaming the weights: as many
// rows as the registers allow, so each x vector load feeds several products. Short rows (the
// default model: k = 256-688) are bound by the horizontal sums at the end of each tile (one
// per k / 32 products): for 6-8 rows, 2 weight rows keep them to one SumEach16 (8 rows at
// k = 256: 145 -> 163 GFLOP/s on one core); one row with 16 weight rows was slower.
template <int M>
void Skinny(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n,
            int64_t k) {
  constexpr int kLong = M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : 3;
  constexpr int kShort = M >= 6 ? 2 : kLong;  // fewer rows hurt below 6 (measured at 1)
  if (k > 1024) return SkinnyR<M, kLong>(x, w, bias, y, n, k);
  return SkinnyR<M, kShort>(x, w, bias, y, n, k);
}

// f(std::integral_constant<int, m>) for the row count m in [1, kGemvMaxRows]: one kernel
// instance per row count, so each keeps its accumulators in registers.
template <typename F>
void ForRows(int64_t m, F&& f) {
  static_assert(kGemvMaxRows == 8, "one case per row count");
  switch (m) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

// ---- AVX2 + FMA (and AVX-512 CPUs without BF16): bf16 -> fp32 in registers ----

__attribute__((target("avx2,fma"))) inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The activations x [count] (bf16) widened to fp32 in a buffer of the calling thread, reused
// from call to call: a decode step makes this call for every linear layer, and a fresh
// allocation of up to 8 x 11008 floats each time cost page faults. Valid until the thread's
// next call.
const float* WidenToFloat(const uint16_t* x, int64_t count) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) buffer[i] = Bf16ToFloat(x[i]);
  return buffer.data();
}

// 8 weights as fp32: bf16 widened (exact: a bf16 is the top half of a float), or fp32 as is.
__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
inline float ToFloat(uint16_t v) { return Bf16ToFloat(v); }
inline float ToFloat(float v) { return v; }
inline void Store(uint16_t* out, float v) { *out = FloatToBf16(v); }
inline void Store(float* out, float v) { *out = v; }

// Outputs [r0, r0 + R) of M rows of x, with x in fp32 (xf [M, k]; row i at xf + i * k, its
// outputs at y + i * n) and the weights and outputs in T (bf16 bit patterns or fp32): R x M
// accumulators of 8 lanes. Per 8 columns, the R weight vectors are loaded (and widened) once
// and each x vector is loaded once, so a tile of R * M FMAs costs R + M loads. kPrefetch: the
// tile prefetches its own rows ahead of its loads (false where they are in L2 already). `ahead`,
// when not null, is a region the tile prefetches evenly over its columns, `stride` bytes a step
// of 8 columns: the weights of a tile to come (see SkinnyAvx2).
template <int M, int R, bool kPrefetch = true, typename T>
__attribute__((target("avx2,fma"))) inline void TileAvx2(const float* xf, const T* w, const T* bias,
                                                         T* y, int64_t n, int64_t k, int64_t r0,
                                                         const char* ahead = nullptr,
                                                         int64_t stride = 0) {
  __m256 acc[R][M];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  const T* wr = w + r0 * k;
  const int64_t k8 = k - k % 8;
  constexpr int64_t kAhead = 1024;  // weights prefetched ahead: 2 KiB of bf16, 4 KiB of fp32
  for (int64_t kk = 0; kk < k8; kk += 8) {
    __m256 wv[R];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      if constexpr (kPrefetch) PrefetchWeights<R>(wr, r, k, kk, kAhead);
      wv[r] = Load8(wr + r * k + kk);
    }
    if (ahead != nullptr) _mm_prefetch(ahead + kk / 8 * stride, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m256 xv = _mm256_loadu_ps(xf + i * k + kk);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(xv, wv[r], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) {
      float s = Sum8(acc[r][i]);
      for (int64_t kk = k8; kk < k; ++kk) s += xf[i * k + kk] * ToFloat(wr[r * k + kk]);
      if (bias != nullptr) s += ToFloat(bias[r0 + r]);
      Store(&y[i * n + r0 + r], s);
    }
  }
}

// R weight rows per tile: for one x row 4 of bf16 (decode at batch 1 is bound by streaming them,
// and on an AVX2-only EPYC four streams a thread read 6-26% faster than eight: docs/BENCHMARKS.md,
// "Four weight rows at batch 1") and 8 of fp32; fewer as x rows are added so that the R * M
// accumulators, R weight vectors and one x vector fit the 16 ymm registers. More than 4 rows of x
// run as two groups (4 and M - 4) over the same R weight rows, which the second group reads from
// L2: one tile of 8 x 1 would cost 9 loads per 8 FMAs, two of 4 x 3 cost 7 per 12
// (docs/BENCHMARKS.md, "Batch 8, second attempt"). With two groups the memory would stream only
// during the first (it read at the machine's full bandwidth while the second ran from L2), so both
// groups instead prefetch the next tile's rows (contiguous in w), half each, spread over their
// columns: every tile after a thread's first finds its weights in L2 and both groups run at the
// FMAs' pace (docs/BENCHMARKS.md, "Two groups, one stream").
template <int M, typename T>
void SkinnyAvx2(const float* xf, const T* w, const T* bias, T* y, int64_t n, int64_t k) {
  constexpr int kFirst = M > 4 ? 4 : M, kSecond = M - kFirst;
  constexpr int R = M == 1 ? (std::is_same_v<T, uint16_t> ? 4 : 8) : M == 2 ? 6 : M == 3 ? 4 : 3;
  const int64_t blocks = (n + R - 1) / R;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t n1 = std::min(n, b1 * R);
    int64_t r0 = b0 * R;
    if constexpr (kSecond > 0) {
      // Half the next tile's bytes a group, over k / 8 steps; k % 8 columns are not prefetched.
      const int64_t half = int64_t{R} * k * static_cast<int64_t>(sizeof(T)) / 2;
      const int64_t stride = k >= 8 ? half / (k / 8) + 1 : 0;
      T* ys = y + kFirst * n;
      const float* xs = xf + kFirst * k;
      for (bool first = true; r0 + R <= n1; r0 += R, first = false) {
        const char* next = reinterpret_cast<const char*>(w + (r0 + R) * k);
        if (r0 + 2 * R > n1) next = nullptr;  // the range's last full tile
        if (first) {
          TileAvx2<kFirst, R, true>(xf, w, bias, y, n, k, r0, next, stride);
        } else {
          TileAvx2<kFirst, R, false>(xf, w, bias, y, n, k, r0, next, stride);
        }
        TileAvx2<kSecond, R, false>(xs, w, bias, ys, n, k, r0, next ? next + half : nullptr,
                                    stride);
      }
      for (; r0 < n1; ++r0) {
        TileAvx2<kFirst, 1>(xf, w, bias, y, n, k, r0);
        TileAvx2<kSecond, 1, false>(xs, w, bias, ys, n, k, r0);
      }
    } else {
      for (; r0 + R <= n1; r0 += R) TileAvx2<M, R>(xf, w, bias, y, n, k, r0);
      for (; r0 < n1; ++r0) TileAvx2<M, 1>(xf, w, bias, y, n, k, r0);
    }
  });
}

void Bf16GemvAvx2(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                  int64_t m, int64_t n, int64_t k) {
  const float* xf = WidenToFloat(x, m * k);
  ForRows(m, [&](auto rows) { SkinnyAvx2<rows.value>(xf, w, bias, y, n, k); });
}

// ---- Portable: plain loops (baseline x86-64 or any other CPU) ----

// x [m, k] in fp32 (widened), weights, bias and outputs in T.
template <typename T>
void GemvGeneric(const float* xf, const T* w, const T* bias, T* y, int64_t m, int64_t n,
                 int64_t k) {
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t j = 0; j < k; ++j) row[j] = ToFloat(w[r * k + j]);
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = xf + i * k;
        float s = 0.f;
        for (int64_t j = 0; j < k; ++j) s += xi[j] * row[j];
        if (bias != nullptr) s += ToFloat(bias[r]);
        Store(&y[i * n + r], s);
      }
    }
  });
}

// Rows [i0, i0 + rows) of every pass of `m` rows split as evenly as possible into passes of at
// most kGemvMaxRows: fn(i0, rows) for each pass in order.
template <typename Fn>
void ForPasses(int64_t m, Fn&& fn) {
  const int64_t passes = (m + kGemvMaxRows - 1) / kGemvMaxRows;
  for (int64_t p = 0, i0 = 0; p < passes; ++p) {
    const int64_t rows = (m - i0) / (passes - p);  // the later passes take the remainder
    fn(i0, rows);
    i0 += rows;
  }
}

}  // namespace

int GemvMaxRows(bool bf16, CpuPath path) {
  path = ClampCpuPath(path, DetectedCpuPath());
  if (path == CpuPath::kGeneric || (bf16 && path == CpuPath::kAvx512Bf16)) return kGemvMaxRows;
  return kStreamedMaxRows;
}

void Bf16Gemv(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t m,
              int64_t n, int64_t k, CpuPath path) {
  if (m > kGemvMaxRows) {
    return ForPasses(m, [&](int64_t i0, int64_t rows) {
      Bf16Gemv(x + i0 * k, w, bias, y + i0 * n, rows, n, k, path);
    });
  }
  path = ClampCpuPath(path, DetectedCpuPath());
  if (path == CpuPath::kGeneric) return GemvGeneric(WidenToFloat(x, m * k), w, bias, y, m, n, k);
  if (path != CpuPath::kAvx512Bf16) return Bf16GemvAvx2(x, w, bias, y, m, n, k);
  ForRows(m, [&](auto rows) { Skinny<rows.value>(x, w, bias, y, n, k); });
}

void F32Gemv(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
             int64_t k, CpuPath path) {
  if (m > kGemvMaxRows) {
    return ForPasses(m, [&](int64_t i0, int64_t rows) {
      F32Gemv(x + i0 * k, w, bias, y + i0 * n, rows, n, k, path);
    });
  }
  path = ClampCpuPath(path, DetectedCpuPath());
  if (path == CpuPath::kGeneric) return GemvGeneric(x, w, bias, y, m, n, k);
  ForRows(m, [&](auto rows) { SkinnyAvx2<rows.value>(x, w, bias, y, n, k); });
}

}  // namespace llava
