#include "engine/kernels/quant_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/kernels/avx512_reduce.h"
#include "engine/kernels/cpu_gemv.h"  // Bf16ToFloat, FloatToBf16

namespace llava {
namespace {

constexpr int kMaxRows = 8;  // rows of x per pass over the weights

// The rows of x quantized per group (see the header): q [m, padded k] (the padding 0), and per
// row and group its scale d, the sum of its real values (int4's minimum multiplies it) and
// -128 * sum(q) (the int8 VNNI kernel's offset, see TileVnni). Buffers of the calling thread,
// reused from call to call (a decode step quantizes x for every linear layer).
struct Activations {
  int64_t m = 0, groups = 0, stride = 0;  // stride: padded k
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> offset;
};

template <typename T>
inline float ToFloat(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return Bf16ToFloat(v);
  }
}

template <typename T>
const Activations& QuantizeActivations(const T* x, int64_t m, int64_t k, int64_t groups) {
  thread_local Activations a;
  a.m = m;
  a.groups = groups;
  a.stride = groups * kQuantGroup;
  a.q.assign(m * a.stride, 0);
  a.d.resize(m * groups);
  a.sum.resize(m * groups);
  a.offset.resize(m * groups);
  float v[kQuantGroup];
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * kQuantGroup, n = std::min(kQuantGroup, k - c0);
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        v[j] = ToFloat(x[i * k + c0 + j]);
        amax = std::max(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = a.q.data() + i * a.stride + c0;
      int32_t qsum = 0;
      for (int64_t j = 0; j < n; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        qsum += q[j];
      }
      a.d[i * groups + g] = d;
      a.sum[i * groups + g] = sum;
      a.offset[i * groups + g] = -128 * qsum;
    }
  }
  return a;
}

// ---- generic: the integer arithmetic in plain C++ (the reference for the vector paths) ----

void RowsGeneric(const Activations& a, const QuantizedMatrix& w, int64_t i0, int64_t rows,
                 float* y) {
  const int64_t n = w.rows, groups = a.groups, rb = w.row_bytes();
  const bool int4 = w.format == WeightFormat::kInt4;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t i = i0; i < i0 + rows; ++i) {
        float s = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int8_t* qx = a.q.data() + i * a.stride + g * kQuantGroup;
          const uint8_t* qw = w.data.data() + r * rb + g * (int4 ? kQuantGroup / 2 : kQuantGroup);
          int32_t dot = 0;
          for (int64_t j = 0; j < kQuantGroup; ++j) {
            const int wv = int4 ? (j < kQuantGroup / 2 ? qw[j] & 0xF : qw[j - 16] >> 4)
                                : static_cast<int8_t>(qw[j]);
            dot += wv * qx[j];
          }
          const int64_t wg = r * groups + g, xg = i * groups + g;
          s += HalfToFloat(w.scale[wg]) * a.d[xg] * static_cast<float>(dot);
          if (int4) s += HalfToFloat(w.min[wg]) * a.sum[xg];
        }
        y[i * n + r] = s;
      }
    }
  });
}

// ---- AVX2 and AVX512-VNNI: tiles of R weight rows x M rows of x, 8 fp32 lanes per pair ----

__attribute__((target("avx2,fma"))) inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 nibbles of an int4 group as 32 bytes in order (low nibbles are values 0-15).
__attribute__((target("avx2"))) inline __m256i Nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// int4's minimum: sum over groups of m_g * sum(x_g), 8 groups at a time.
__attribute__((target("avx2,fma,f16c"))) inline float MinTerm(const uint16_t* m, const float* xs,
                                                              int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g)));
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + g), acc);
  }
  float s = Sum8(acc);
  for (; g < groups; ++g) s += _cvtsh_ss(m[g]) * xs[g];
  return s;
}

// Prefetch distance into L2, in bytes of each weight row (the bf16 kernels' 4 KiB of a row is
// 2048 values; here the same number of values is 2 KiB of int8 and 1 KiB of int4).
constexpr int64_t kAheadValues = 2048;

// AVX2: vpmaddubsw multiplies unsigned by signed bytes. int4's nibbles are unsigned already;
// int8 uses |w| and x with w's sign (at most 127 * 127 * 2 per pair: no int16 saturation).
template <int M, int R, bool kInt4>
__attribute__((target("avx2,fma,f16c"))) void TileAvx2(const Activations& a,
                                                       const QuantizedMatrix& w, int64_t i0,
                                                       float* y, int64_t r0) {
  const int64_t groups = a.groups, rb = w.row_bytes(), n = w.rows;
  constexpr int64_t kGroupBytes = kInt4 ? kQuantGroup / 2 : kQuantGroup;
  const uint8_t* wd = w.data.data() + r0 * rb;
  const uint16_t* ws = w.scale.data() + r0 * groups;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][M];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[R];
    __m256 sw[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = wd + r * rb + g * kGroupBytes;
      if ((g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadValues, _MM_HINT_T1);
      if constexpr (kInt4) {
        wv[r] = Nibbles(p);
      } else {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      }
      sw[r] = _mm256_set1_ps(_cvtsh_ss(ws[r * groups + g]));
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.q.data() + (i0 + i) * a.stride + g * kQuantGroup));
      const __m256 sx = _mm256_set1_ps(a.d[(i0 + i) * groups + g]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i p16 =
            kInt4 ? _mm256_maddubs_epi16(wv[r], xv)
                  : _mm256_maddubs_epi16(_mm256_abs_epi8(wv[r]), _mm256_sign_epi8(xv, wv[r]));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[r][i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sw[r], sx), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) {
      float s = Sum8(acc[r][i]);
      if constexpr (kInt4) {
        s += MinTerm(w.min.data() + (r0 + r) * groups, a.sum.data() + (i0 + i) * groups, groups);
      }
      y[i * n + r0 + r] = s;
    }
  }
}

// AVX512-VNNI on 256-bit vectors (vpdpbusd, unsigned by signed bytes into int32). int4's nibbles
// are unsigned; int8 flips each weight's top bit, which adds 128 (w + 128 in [1, 255]), and the
// accumulator starts at -128 * sum(q_x) to take that back: the dot product stays exact.
template <int M, int R, bool kInt4>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) void TileVnni(
    const Activations& a, const QuantizedMatrix& w, int64_t i0, float* y, int64_t r0) {
  const int64_t groups = a.groups, rb = w.row_bytes(), n = w.rows;
  constexpr int64_t kGroupBytes = kInt4 ? kQuantGroup / 2 : kQuantGroup;
  const uint8_t* wd = w.data.data() + r0 * rb;
  const uint16_t* ws = w.scale.data() + r0 * groups;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][M];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[R];
    __m256 sw[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = wd + r * rb + g * kGroupBytes;
      if ((g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadValues, _MM_HINT_T1);
      if constexpr (kInt4) {
        wv[r] = Nibbles(p);
      } else {
        wv[r] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip);
      }
      sw[r] = _mm256_set1_ps(_cvtsh_ss(ws[r * groups + g]));
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.q.data() + (i0 + i) * a.stride + g * kQuantGroup));
      const __m256 sx = _mm256_set1_ps(a.d[(i0 + i) * groups + g]);
      const __m256i start =
          kInt4 ? _mm256_setzero_si256()
                : _mm256_setr_epi32(a.offset[(i0 + i) * groups + g], 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, wv[r], xv));
        acc[r][i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sw[r], sx), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) {
      float s = Sum8(acc[r][i]);
      if constexpr (kInt4) {
        s += MinTerm(w.min.data() + (r0 + r) * groups, a.sum.data() + (i0 + i) * groups, groups);
      }
      y[i * n + r0 + r] = s;
    }
  }
}

// Weight rows per tile for M rows of x: R * M accumulators, R weight vectors and R scales must
// fit the registers (16 ymm for AVX2, 32 with AVX-512VL).
constexpr int RowsAvx2(int m) { return m == 1 ? 4 : m <= 3 ? 2 : 1; }
constexpr int RowsVnni(int m) { return m == 1 ? 8 : m == 2 ? 6 : m <= 4 ? 4 : 2; }

template <int M, bool kVnni, bool kInt4>
void Rows(const Activations& a, const QuantizedMatrix& w, int64_t i0, float* y) {
  constexpr int R = kVnni ? RowsVnni(M) : RowsAvx2(M);
  const auto tile = [&](auto rows, int64_t r0) {
    if constexpr (kVnni) {
      TileVnni<M, rows.value, kInt4>(a, w, i0, y, r0);
    } else {
      TileAvx2<M, rows.value, kInt4>(a, w, i0, y, r0);
    }
  };
  const int64_t n = w.rows, blocks = (n + R - 1) / R;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t n1 = std::min(n, b1 * R);
    int64_t r0 = b0 * R;
    for (; r0 + R <= n1; r0 += R) tile(std::integral_constant<int, R>{}, r0);
    for (; r0 < n1; ++r0) tile(std::integral_constant<int, 1>{}, r0);
  });
}

// One pass of `rows` (<= kMaxRows) rows of x from row i0: y points at row i0's outputs.
void Pass(const Activations& a, const QuantizedMatrix& w, int64_t i0, int64_t rows, float* y,
          CpuPath path) {
  if (path == CpuPath::kGeneric) return RowsGeneric(a, w, i0, rows, y - i0 * w.rows);
  const bool vnni = path >= CpuPath::kAvx512 && HasAvx512Vnni();
  const bool int4 = w.format == WeightFormat::kInt4;
  const auto run = [&](auto m) {
    constexpr int M = m.value;
    if (vnni) {
      return int4 ? Rows<M, true, true>(a, w, i0, y) : Rows<M, true, false>(a, w, i0, y);
    }
    return int4 ? Rows<M, false, true>(a, w, i0, y) : Rows<M, false, false>(a, w, i0, y);
  };
  switch (rows) {
    case 1:
      return run(std::integral_constant<int, 1>{});
    case 2:
      return run(std::integral_constant<int, 2>{});
    case 3:
      return run(std::integral_constant<int, 3>{});
    case 4:
      return run(std::integral_constant<int, 4>{});
    case 5:
      return run(std::integral_constant<int, 5>{});
    case 6:
      return run(std::integral_constant<int, 6>{});
    case 7:
      return run(std::integral_constant<int, 7>{});
    default:
      return run(std::integral_constant<int, 8>{});
  }
}

template <typename T>
void Gemv(const T* x, const QuantizedMatrix& w, const T* bias, T* y, int64_t m, CpuPath path) {
  path = ClampCpuPath(path, DetectedCpuPath());
  const int64_t n = w.rows;
  const Activations& a = QuantizeActivations(x, m, w.cols, w.groups_per_row());
  thread_local std::vector<float> out;
  out.resize(m * n);
  const int64_t passes = (m + kMaxRows - 1) / kMaxRows;
  for (int64_t p = 0, i0 = 0; p < passes; ++p) {
    const int64_t rows = (m - i0) / (passes - p);  // as even as possible: 9 rows are 4 + 5
    Pass(a, w, i0, rows, out.data() + i0 * n, path);
    i0 += rows;
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < n; ++r) {
      float v = out[i * n + r];
      if (bias != nullptr) v += ToFloat(bias[r]);
      if constexpr (std::is_same_v<T, float>) {
        y[i * n + r] = v;
      } else {
        y[i * n + r] = FloatToBf16(v);
      }
    }
  }
}

}  // namespace

bool HasAvx512Vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
  return has;
}

void QuantGemv(const float* x, const QuantizedMatrix& w, const float* bias, float* y, int64_t m,
               CpuPath path) {
  Gemv(x, w, bias, y, m, path);
}

void QuantGemv(const uint16_t* x, const QuantizedMatrix& w, const uint16_t* bias, uint16_t* y,
               int64_t m, CpuPath path) {
  Gemv(x, w, bias, y, m, path);
}

}  // namespace llava
