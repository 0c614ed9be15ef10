#include "engine/kernels/cpu_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/kernels/avx512_reduce.h"
#include "engine/kernels/cpu_gemv.h"

namespace llava {
namespace {

void SoftmaxRowsPortable(float* p, int64_t rows, int64_t len) {
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = p + i * len;
    float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t j = 0; j < len; ++j) max = std::max(max, pi[j]);
    for (int64_t j = 0; j < len; ++j) sum += (pi[j] = std::exp(pi[j] - max));
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < len; ++j) pi[j] *= inv;
  }
}

// exp(x) for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its Taylor series to r^7 (relative error < 1e-8 on that range), times 2^n.
__attribute__((target("avx512f"))) inline __m512 ExpNonPositive(__m512 x) {
  const __m512 in = x;
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));  // e^-103 is below the smallest denormal
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       // ln2, the rest
  __m512 e = _mm512_set1_ps(1.f / 5040);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 720));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  // 0 for -inf (masked scores) and everything below the clamp, so masked entries get exactly 0.
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(in, _mm512_set1_ps(-103.f), _CMP_GT_OQ),
                             _mm512_scalef_ps(e, n));
}

__attribute__((target("avx512f"))) void SoftmaxRowsAvx512(float* p, int64_t rows, int64_t len) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = p + i * len;
    __m512 vmax = neg_inf;
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = len - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - j)) - 1);
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, m, pi + j));
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = len - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - j)) - 1);
      const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pi + j), max));
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
      _mm512_mask_storeu_ps(pi + j, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / SumLanes(vsum));
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = len - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - j)) - 1);
      _mm512_mask_storeu_ps(pi + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pi + j), inv));
    }
  }
}

// ExpNonPositive on 8 lanes with AVX2: 2^n is built in the exponent bits, so x is clamped at
// -87 (e^-87 ~ 1.6e-38, near the smallest normal float) and anything below gives exactly 0.
__attribute__((target("avx2,fma"))) inline __m256 ExpNonPositiveAvx2(__m256 x) {
  const __m256 in = x;
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 e = _mm256_set1_ps(1.f / 5040);
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 720));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 120));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 24));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 6));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  const __m256i pow2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // n >= -126
  const __m256 out = _mm256_mul_ps(e, _mm256_castsi256_ps(pow2));
  return _mm256_and_ps(out, _mm256_cmp_ps(in, _mm256_set1_ps(-87.f), _CMP_GT_OQ));
}

// Lanes [0, left) of 8 set (all ones), the others clear.
__attribute__((target("avx2"))) inline __m256i FirstLanes8(int64_t left) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))), idx);
}

__attribute__((target("avx2,fma"))) void SoftmaxRowsAvx2(float* p, int64_t rows, int64_t len) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = p + i * len;
    __m256 vmax = neg_inf;
    for (int64_t j = 0; j < len; j += 8) {
      const __m256i m = FirstLanes8(len - j);
      vmax = _mm256_max_ps(
          vmax, _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(pi + j, m), _mm256_castsi256_ps(m)));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    const __m256 max = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j += 8) {
      const __m256i m = FirstLanes8(len - j);
      const __m256 e =
          _mm256_and_ps(ExpNonPositiveAvx2(_mm256_sub_ps(_mm256_maskload_ps(pi + j, m), max)),
                        _mm256_castsi256_ps(m));
      vsum = _mm256_add_ps(vsum, e);
      _mm256_maskstore_ps(pi + j, m, e);
    }
    _mm256_store_ps(lanes, vsum);
    float sum = 0.f;
    for (float l : lanes) sum += l;
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int64_t j = 0; j < len; j += 8) {
      const __m256i m = FirstLanes8(len - j);
      _mm256_maskstore_ps(pi + j, m, _mm256_mul_ps(_mm256_maskload_ps(pi + j, m), inv));
    }
  }
}

// The mask of the first `left` of 16 lanes.
inline __mmask16 FirstLanes(int64_t left) {
  return left >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << left) - 1);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void QuickGeluAvx512(
    const uint16_t* x, uint16_t* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), k = _mm512_set1_ps(1.702f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes(n - i);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    const __m512 z = _mm512_mul_ps(k, v);
    // sigmoid(z) = 1 / (1 + e^-z) for z >= 0 and e^z / (1 + e^z) below: e^-|z| never overflows.
    const __m512 t = ExpNonPositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, t));
    const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, t);
    _mm256_mask_storeu_epi16(y + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, sig)));
  }
}

__attribute__((target("avx512f"))) void SoftmaxBackwardRowsAvx512(const float* p, float* g,
                                                                  int64_t rows, int64_t len,
                                                                  float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * len;
    float* gr = g + r * len;
    __m512 vdot = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = FirstLanes(len - j);
      vdot =
          _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, pr + j), _mm512_maskz_loadu_ps(m, gr + j), vdot);
    }
    const __m512 dot = _mm512_set1_ps(SumLanes(vdot)), s = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = FirstLanes(len - j);
      const __m512 pv = _mm512_maskz_loadu_ps(m, pr + j);
      const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, gr + j), dot);
      _mm512_mask_storeu_ps(gr + j, m, _mm512_mul_ps(_mm512_mul_ps(pv, d), s));
    }
  }
}

// sigmoid(z) = 1 / (1 + e^-z) for z >= 0 and e^z / (1 + e^z) below: e^-|z| never overflows.
__attribute__((target("avx512f"))) inline __m512 SigmoidAvx512(__m512 z) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = ExpNonPositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
  const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, t));
  return _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), inv, t);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512 LoadBf16(
    __mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void StoreBf16(__mmask16 m,
                                                                                      uint16_t* p,
                                                                                      __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void SwiGluAvx512(
    const uint16_t* gate_up, uint16_t* y, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gr = gate_up + r * 2 * f;
    for (int64_t j = 0; j < f; j += 16) {
      const __mmask16 m = FirstLanes(f - j);
      const __m512 g = LoadBf16(m, gr + j), u = LoadBf16(m, gr + f + j);
      StoreBf16(m, y + r * f + j, _mm512_mul_ps(_mm512_mul_ps(g, SigmoidAvx512(g)), u));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void SwiGluBackwardAvx512(
    const uint16_t* gate_up, const uint16_t* dy, uint16_t* d_gate_up, int64_t rows, int64_t f) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gr = gate_up + r * 2 * f;
    uint16_t* dr = d_gate_up + r * 2 * f;
    for (int64_t j = 0; j < f; j += 16) {
      const __mmask16 m = FirstLanes(f - j);
      const __m512 g = LoadBf16(m, gr + j), u = LoadBf16(m, gr + f + j);
      const __m512 d = LoadBf16(m, dy + r * f + j);
      const __m512 s = SigmoidAvx512(g);
      // silu'(g) = s (1 + g (1 - s))
      const __m512 ds = _mm512_mul_ps(s, _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
      StoreBf16(m, dr + j, _mm512_mul_ps(_mm512_mul_ps(d, u), ds));
      StoreBf16(m, dr + f + j, _mm512_mul_ps(d, _mm512_mul_ps(g, s)));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void QuickGeluBackwardAvx512(
    const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), k = _mm512_set1_ps(1.702f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes(n - i);
    const __m512 v = LoadBf16(m, x + i), d = LoadBf16(m, dy + i);
    const __m512 z = _mm512_mul_ps(k, v);
    const __m512 s = SigmoidAvx512(z);
    const __m512 ds = _mm512_fmadd_ps(_mm512_mul_ps(z, s), _mm512_sub_ps(one, s), s);
    StoreBf16(m, dx + i, _mm512_mul_ps(d, ds));
  }
}

float Sigmoid(float z) {
  const float t = std::exp(-std::fabs(z));
  return z >= 0 ? 1.f / (1.f + t) : t / (1.f + t);
}

}  // namespace

void SwiGluBf16(const uint16_t* gate_up, uint16_t* y, int64_t rows, int64_t f) {
  static const bool avx512 = CpuPathAtLeast(CpuPath::kAvx512Bf16);
  if (avx512) return SwiGluAvx512(gate_up, y, rows, f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < f; ++j) {
      const float g = Bf16ToFloat(gate_up[r * 2 * f + j]);
      const float u = Bf16ToFloat(gate_up[r * 2 * f + f + j]);
      y[r * f + j] = FloatToBf16(g * Sigmoid(g) * u);
    }
  }
}

void SwiGluBackwardBf16(const uint16_t* gate_up, const uint16_t* dy, uint16_t* d_gate_up,
                        int64_t rows, int64_t f) {
  static const bool avx512 = CpuPathAtLeast(CpuPath::kAvx512Bf16);
  if (avx512) return SwiGluBackwardAvx512(gate_up, dy, d_gate_up, rows, f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < f; ++j) {
      const float g = Bf16ToFloat(gate_up[r * 2 * f + j]);
      const float u = Bf16ToFloat(gate_up[r * 2 * f + f + j]);
      const float d = Bf16ToFloat(dy[r * f + j]);
      const float s = Sigmoid(g);
      d_gate_up[r * 2 * f + j] = FloatToBf16(d * u * (s * (1.f + g * (1.f - s))));
      d_gate_up[r * 2 * f + f + j] = FloatToBf16(d * (g * s));
    }
  }
}

void QuickGeluBackwardBf16(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n) {
  static const bool avx512 = CpuPathAtLeast(CpuPath::kAvx512Bf16);
  if (avx512) return QuickGeluBackwardAvx512(x, dy, dx, n);
  for (int64_t i = 0; i < n; ++i) {
    const float z = 1.702f * Bf16ToFloat(x[i]);
    const float s = Sigmoid(z);
    dx[i] = FloatToBf16(Bf16ToFloat(dy[i]) * (z * s * (1.f - s) + s));
  }
}

void SoftmaxBackwardRows(const float* p, float* g, int64_t rows, int64_t len, float scale) {
  static const bool avx512 = CpuPathAtLeast(CpuPath::kAvx512);
  if (avx512) return SoftmaxBackwardRowsAvx512(p, g, rows, len, scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * len;
    float* gr = g + r * len;
    float dot = 0.f;
    for (int64_t j = 0; j < len; ++j) dot += pr[j] * gr[j];
    for (int64_t j = 0; j < len; ++j) gr[j] = scale * pr[j] * (gr[j] - dot);
  }
}

void SoftmaxRows(float* p, int64_t rows, int64_t len, CpuPath path) {
  path = ClampCpuPath(path, DetectedCpuPath());
  if (path >= CpuPath::kAvx512) {
    SoftmaxRowsAvx512(p, rows, len);
  } else if (path == CpuPath::kAvx2) {
    SoftmaxRowsAvx2(p, rows, len);
  } else {
    SoftmaxRowsPortable(p, rows, len);
  }
}

void CausalSoftmaxRows(float* p, int64_t rows, int64_t len, int64_t first_len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = p + r * len;
    const int64_t valid = std::min(len, first_len + r);
    SoftmaxRows(pr, 1, valid);
    std::fill(pr + valid, pr + len, 0.f);
  }
}

void QuickGeluBf16(const uint16_t* x, uint16_t* y, int64_t n) {
  static const bool avx512 = CpuPathAtLeast(CpuPath::kAvx512Bf16);
  if (avx512) return QuickGeluAvx512(x, y, n);
  for (int64_t i = 0; i < n; ++i) {
    const float v = Bf16ToFloat(x[i]);
    y[i] = FloatToBf16(v / (1.f + std::exp(-1.702f * v)));
  }
}

}  // namespace llava
