#include "engine/kernels/decode_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "engine/kernels/avx512_reduce.h"
#include "engine/kernels/cpu_gemv.h"
#include "engine/kernels/cpu_ops.h"
#ifdef LLAVA_WITH_CUDA
#include "engine/kernels/cuda/decode_attention.h"
#endif

namespace llava {
namespace {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) { return Bf16ToFloat(bf16); }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }
template <typename KV>
constexpr bool kScaled = std::is_same_v<KV, int8_t>;  // rows carry a scale (int8 caches)

constexpr int64_t kMaxHeadDim = 256;

// One KV head of one sequence's cache as the kernels read it: rows [0, len) in pages of
// `page_rows`, page i's first row at k + pages[i] * page_stride (v likewise), consecutive rows
// of a page `ks` (`vs`) elements apart. An unpaged cache is one page. int8 rows: page i's row
// scales start at ksc (vsc) + pages[i] * scale_page_stride.
template <typename KV>
struct HeadRows {
  const KV* k;
  const KV* v;
  const int32_t* pages;
  int64_t page_rows, page_stride, ks, vs, len;
  const float* ksc = nullptr;
  const float* vsc = nullptr;
  int64_t scale_page_stride = 0;

  int64_t NumPages() const { return (len + page_rows - 1) / page_rows; }
  int64_t First(int64_t i) const { return i * page_rows; }  // the page's first row index
  int64_t Rows(int64_t i) const { return std::min(page_rows, len - i * page_rows); }
  const KV* K(int64_t i) const { return k + pages[i] * page_stride; }
  const KV* V(int64_t i) const { return v + pages[i] * page_stride; }
  // Page i's row scales (int8 rows; null otherwise).
  const float* KS(int64_t i) const { return ksc ? ksc + pages[i] * scale_page_stride : nullptr; }
  const float* VS(int64_t i) const { return vsc ? vsc + pages[i] * scale_page_stride : nullptr; }
  // Asks for page i + 1's keys (values) while page i is read: its rows are a short run at an
  // address the hardware prefetcher cannot guess (pages are scattered over the pool).
  void PrefetchNextK(int64_t i) const { PrefetchNext(K(std::min(i + 1, NumPages() - 1)), ks, i); }
  void PrefetchNextV(int64_t i) const { PrefetchNext(V(std::min(i + 1, NumPages() - 1)), vs, i); }

 private:
  void PrefetchNext(const KV* next, int64_t stride, int64_t i) const {
    if (i + 1 >= NumPages()) return;
    const char* p = reinterpret_cast<const char*>(next);
    const int64_t bytes = Rows(i + 1) * stride * static_cast<int64_t>(sizeof(KV));
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
};

// The `g` query heads that share one KV head against one cache: scores (softmax probabilities
// on return) in `p` [g, len], the weighted sums of values in `out` [g, hd]. Each key and value
// row is converted to fp32 once for the whole group. fp32 arithmetic throughout.
template <typename KV>
inline __attribute__((always_inline)) void Group(const float* q, int64_t g, const HeadRows<KV>& c,
                                                 int64_t hd, float scale, float* p, float* out) {
  float row[kMaxHeadDim];
  const int64_t len = c.len;
  for (int64_t pg = 0; pg < c.NumPages(); ++pg) {
    const KV* k = c.K(pg);
    c.PrefetchNextK(pg);
    for (int64_t r = 0, j = c.First(pg); r < c.Rows(pg); ++r, ++j) {
      const KV* kj = k + r * c.ks;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) row[d] = ToFloat(kj[d]);
      if constexpr (kScaled<KV>) {
        const float sr = c.KS(pg)[r];
        for (int64_t d = 0; d < hd; ++d) row[d] *= sr;
      }
      for (int64_t i = 0; i < g; ++i) {
        const float* qi = q + i * hd;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < hd; ++d) acc += qi[d] * row[d];
        p[i * len + j] = acc * scale;
      }
    }
  }
  SoftmaxRows(p, g, len);
  for (int64_t d = 0; d < g * hd; ++d) out[d] = 0.f;
  for (int64_t pg = 0; pg < c.NumPages(); ++pg) {
    const KV* v = c.V(pg);
    c.PrefetchNextV(pg);
    for (int64_t r = 0, j = c.First(pg); r < c.Rows(pg); ++r, ++j) {
      const KV* vj = v + r * c.vs;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) row[d] = ToFloat(vj[d]);
      if constexpr (kScaled<KV>) {
        const float sr = c.VS(pg)[r];
        for (int64_t d = 0; d < hd; ++d) row[d] *= sr;
      }
      for (int64_t i = 0; i < g; ++i) {
        const float pij = p[i * len + j];
        float* oi = out + i * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) oi[d] += pij * row[d];
      }
    }
  }
}

// Compiled for AVX2 + FMA and for baseline x86-64; GroupAnyHeadSize picks by the CPU path
// (AVX-512 CPUs take GroupAvx512 below for head sizes it has, this otherwise).
template <typename KV>
__attribute__((target("avx2,fma"))) void GroupAvx2(const float* q, int64_t g, const HeadRows<KV>& c,
                                                   int64_t hd, float scale, float* p, float* out) {
  Group(q, g, c, hd, scale, p, out);
}

template <typename KV>
void GroupGeneric(const float* q, int64_t g, const HeadRows<KV>& c, int64_t hd, float scale,
                  float* p, float* out) {
  Group(q, g, c, hd, scale, p, out);
}

template <typename KV>
void GroupAnyHeadSize(bool avx2, const float* q, int64_t g, const HeadRows<KV>& c, int64_t hd,
                      float scale, float* p, float* out) {
  if (avx2) return GroupAvx2(q, g, c, hd, scale, p, out);
  GroupGeneric(q, g, c, hd, scale, p, out);
}

// The same computation with AVX-512 intrinsics for head sizes 16, 32, ..., 128 (64 and 128 in
// LLaMA models). GCC's vectorisation of the loops above ends every dot product with 16 dependent
// scalar adds; a first intrinsics version still paid one horizontal add per (row, head) and kept
// the output accumulators in memory. This one works on blocks of 16 cache rows: the block is
// converted to fp32 once into an L1-resident buffer for all heads of the group, the 16 dot
// products of a head are reduced together (SumEach16), and the weighted sum of values keeps its
// accumulators in registers for the whole block. A bf16 query against a bf16 cache (a bf16
// model) scores with AVX512-BF16 dot products instead (ScoresBf16), reading the keys as stored.
// `llava-bench --suite attention` times it outside the model.
__attribute__((target("avx512f"))) inline __m512 Load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 Load16(const uint16_t* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

__attribute__((target("avx512f"))) inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// nb rows of a cache head converted to fp32 into buf [nb, 16 * CH] (int8 rows: times their
// scales[r]). The rows of the next block are prefetched: a decode step reads every cache once,
// from L3 or memory, in runs too short for the hardware prefetcher to get ahead.
template <int CH, typename KV>
__attribute__((target("avx512f"))) inline void ConvertBlock(const KV* src, int64_t stride,
                                                            int64_t nb, float* buf,
                                                            const float* scales) {
  constexpr int64_t kLine = 64 / sizeof(KV), kRowElems = 16 * CH;
  for (int64_t r = 0; r < nb; ++r) {
    for (int64_t e = 0; e < kRowElems; e += kLine) {
      _mm_prefetch(reinterpret_cast<const char*>(src + (r + 16) * stride + e), _MM_HINT_T0);
    }
    if constexpr (kScaled<KV>) {
      const __m512 sr = _mm512_set1_ps(scales[r]);
#pragma GCC unroll 8
      for (int c = 0; c < CH; ++c)
        _mm512_store_ps(buf + r * 16 * CH + 16 * c,
                        _mm512_mul_ps(sr, Load16(src + r * stride + 16 * c)));
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < CH; ++c)
        _mm512_store_ps(buf + r * 16 * CH + 16 * c, Load16(src + r * stride + 16 * c));
    }
  }
}

// Scores of g bf16 query heads against a bf16 cache head with AVX512-BF16 dot products, which
// read the keys as stored (no conversion) and take pairs of products per instruction; fp32
// accumulation, so the result equals the fp32 path's up to summation order when the query is
// bf16 (as in a bf16 model). p [g, len] (rows p_stride apart) = q k^T * scale.
template <int CH>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void ScoresBf16(
    const uint16_t* qb, int64_t g, const uint16_t* k, int64_t k_stride, int64_t len,
    int64_t p_stride, float scale, float* p) {
  static_assert(CH % 2 == 0, "pairs of 16-lane chunks");
  constexpr int64_t hd = 16 * CH, kVec = CH / 2;  // 32 bf16 per vector
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < g; ++i) {
    __m512bh qv[kVec];
#pragma GCC unroll 8
    for (int c = 0; c < kVec; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + i * hd + 32 * c);
    int64_t j0 = 0;
    for (; j0 + 16 <= len; j0 += 16) {
      __m512 dot[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        const uint16_t* kr = k + (j0 + r) * k_stride;
        __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < kVec; ++c) {
          acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
        }
        dot[kSumSlot[r]] = acc;
      }
      _mm512_storeu_ps(p + i * p_stride + j0, _mm512_mul_ps(SumEach16(dot), vscale));
    }
    for (; j0 < len; ++j0) {
      const uint16_t* kr = k + j0 * k_stride;
      __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < kVec; ++c) {
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
      }
      p[i * p_stride + j0] = SumLanes(acc) * scale;
    }
  }
}

// Scores in fp32: each block of 16 key rows converted once for all g heads, the 16 dot products
// of a head reduced together. p [g, len] (rows p_stride apart) = q k^T * scale; buf holds 16
// rows.
template <int CH, typename KV>
__attribute__((target("avx512f"))) void ScoresF32(const float* q, int64_t g, const KV* k,
                                                  const float* k_scales, int64_t k_stride,
                                                  int64_t len, int64_t p_stride, float scale,
                                                  float* p, float* buf) {
  constexpr int64_t hd = 16 * CH;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t nb = std::min<int64_t>(16, len - j0);
    ConvertBlock<CH>(k + j0 * k_stride, k_stride, nb, buf, k_scales ? k_scales + j0 : nullptr);
    for (int64_t i = 0; i < g; ++i) {
      __m512 qv[CH];
#pragma GCC unroll 8
      for (int c = 0; c < CH; ++c) qv[c] = _mm512_loadu_ps(q + i * hd + 16 * c);
      __m512 dot[16];
      if (nb == 16) {
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          __m512 acc = _mm512_mul_ps(qv[0], _mm512_load_ps(buf + r * hd));
#pragma GCC unroll 8
          for (int c = 1; c < CH; ++c)
            acc = _mm512_fmadd_ps(qv[c], _mm512_load_ps(buf + r * hd + 16 * c), acc);
          dot[kSumSlot[r]] = acc;
        }
        _mm512_storeu_ps(p + i * p_stride + j0, _mm512_mul_ps(SumEach16(dot), vscale));
      } else {
        for (int64_t r = 0; r < nb; ++r) {
          __m512 acc = _mm512_mul_ps(qv[0], _mm512_load_ps(buf + r * hd));
#pragma GCC unroll 8
          for (int c = 1; c < CH; ++c)
            acc = _mm512_fmadd_ps(qv[c], _mm512_load_ps(buf + r * hd + 16 * c), acc);
          p[i * p_stride + j0 + r] = SumLanes(acc) * scale;
        }
      }
    }
  }
}

template <int CH, typename KV>
__attribute__((target("avx512f"))) void GroupAvx512(const float* q, const uint16_t* qb, int64_t g,
                                                    const HeadRows<KV>& c, float scale, float* p,
                                                    float* out) {
  constexpr int64_t hd = 16 * CH;
  alignas(64) float storage[16 * hd];
  // Through an opaque pointer: with the block loops fully unrolled, GCC otherwise scalarises the
  // array and copies all of it between stack slots for every block and head (seen in the
  // disassembly; it halved the kernel's speed).
  float* buf = storage;
  asm("" : "+r"(buf));
  const int64_t len = c.len;
  for (int64_t pg = 0; pg < c.NumPages(); ++pg) {
    c.PrefetchNextK(pg);
    bool scored = false;
    if constexpr (std::is_same_v<KV, uint16_t> && CH % 2 == 0) {
      if (qb != nullptr) {
        ScoresBf16<CH>(qb, g, c.K(pg), c.ks, c.Rows(pg), len, scale, p + c.First(pg));
        scored = true;
      }
    }
    if (!scored) {
      ScoresF32<CH>(q, g, c.K(pg), c.KS(pg), c.ks, c.Rows(pg), len, scale, p + c.First(pg), buf);
    }
  }
  SoftmaxRows(p, g, len);
  for (int64_t d = 0; d < g * hd; ++d) out[d] = 0.f;
  for (int64_t pg = 0; pg < c.NumPages(); ++pg) {
    const KV* v = c.V(pg);
    c.PrefetchNextV(pg);
    const int64_t rows = c.Rows(pg);
    for (int64_t j0 = 0; j0 < rows; j0 += 16) {
      const int64_t nb = std::min<int64_t>(16, rows - j0);
      const float* vs = c.VS(pg);
      ConvertBlock<CH>(v + j0 * c.vs, c.vs, nb, buf, vs ? vs + j0 : nullptr);
      for (int64_t i = 0; i < g; ++i) {
        float* oi = out + i * hd;
        const float* pi = p + i * len + c.First(pg) + j0;
        __m512 acc[CH];
#pragma GCC unroll 8
        for (int cc = 0; cc < CH; ++cc) acc[cc] = _mm512_loadu_ps(oi + 16 * cc);
        for (int64_t r = 0; r < nb; ++r) {
          const __m512 pr = _mm512_set1_ps(pi[r]);
#pragma GCC unroll 8
          for (int cc = 0; cc < CH; ++cc)
            acc[cc] = _mm512_fmadd_ps(pr, _mm512_load_ps(buf + r * hd + 16 * cc), acc[cc]);
        }
#pragma GCC unroll 8
        for (int cc = 0; cc < CH; ++cc) _mm512_storeu_ps(oi + 16 * cc, acc[cc]);
      }
    }
  }
}

// GroupAvx512 for the head size, or false when it has no instance for it.
template <typename KV>
bool GroupAvx512ForHeadSize(int64_t hd, const float* q, const uint16_t* qb, int64_t g,
                            const HeadRows<KV>& c, float scale, float* p, float* out) {
  switch (hd) {
#define LLAVA_GROUP_CASE(CH)                     \
  case 16 * CH:                                  \
    GroupAvx512<CH>(q, qb, g, c, scale, p, out); \
    return true;
    LLAVA_GROUP_CASE(1)
    LLAVA_GROUP_CASE(2)
    LLAVA_GROUP_CASE(3)
    LLAVA_GROUP_CASE(4)
    LLAVA_GROUP_CASE(5)
    LLAVA_GROUP_CASE(6)
    LLAVA_GROUP_CASE(7)
    LLAVA_GROUP_CASE(8)
#undef LLAVA_GROUP_CASE
    default:
      return false;
  }
}

// ---- AVX2 + FMA: the same blocked computation with 8-lane vectors, blocks of 8 cache rows ----

__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

__attribute__((target("avx2,fma"))) inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Lane r of the result: the sum of the 8 lanes of v[r].
__attribute__((target("avx2,fma"))) inline __m256 SumEach8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [v0..v3 low-half sums | v0..v3 high-half sums], b the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// nb <= 8 rows of a cache head as fp32 into buf [8, 8 * CH] (int8 rows: times their
// scales[r]); rows from nb on are zero.
template <int CH, typename KV>
__attribute__((target("avx2,fma"))) inline void ConvertBlock8(const KV* src, int64_t stride,
                                                              int64_t nb, float* buf,
                                                              const float* scales) {
  constexpr int64_t kLine = 64 / sizeof(KV), kRowElems = 8 * CH;
  for (int64_t r = 0; r < 8; ++r) {
    if (r >= nb) {
#pragma GCC unroll 16
      for (int c = 0; c < CH; ++c) _mm256_store_ps(buf + r * 8 * CH + 8 * c, _mm256_setzero_ps());
      continue;
    }
    for (int64_t e = 0; e < kRowElems; e += kLine) {
      _mm_prefetch(reinterpret_cast<const char*>(src + (r + 8) * stride + e), _MM_HINT_T0);
    }
    if constexpr (kScaled<KV>) {
      const __m256 sr = _mm256_set1_ps(scales[r]);
#pragma GCC unroll 16
      for (int c = 0; c < CH; ++c)
        _mm256_store_ps(buf + r * 8 * CH + 8 * c,
                        _mm256_mul_ps(sr, Load8(src + r * stride + 8 * c)));
    } else {
#pragma GCC unroll 16
      for (int c = 0; c < CH; ++c)
        _mm256_store_ps(buf + r * 8 * CH + 8 * c, Load8(src + r * stride + 8 * c));
    }
  }
}

template <int CH, typename KV>
__attribute__((target("avx2,fma"))) void GroupAvx2Blocked(const float* q, int64_t g,
                                                          const HeadRows<KV>& c, float scale,
                                                          float* p, float* out) {
  constexpr int64_t hd = 8 * CH;
  alignas(32) float storage[8 * hd];
  float* buf = storage;  // opaque, as in GroupAvx512
  asm("" : "+r"(buf));
  const __m256 vscale = _mm256_set1_ps(scale);
  const int64_t len = c.len;
  for (int64_t pg = 0; pg < c.NumPages(); ++pg) {
    const KV* k = c.K(pg);
    c.PrefetchNextK(pg);
    const int64_t rows = c.Rows(pg), first = c.First(pg);
    for (int64_t j0 = 0; j0 < rows; j0 += 8) {
      const int64_t nb = std::min<int64_t>(8, rows - j0);
      const float* ks = c.KS(pg);
      ConvertBlock8<CH>(k + j0 * c.ks, c.ks, nb, buf, ks ? ks + j0 : nullptr);
      for (int64_t i = 0; i < g; ++i) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int cc = 0; cc < CH; ++cc) {
          const __m256 qv = _mm256_loadu_ps(q + i * hd + 8 * cc);
#pragma GCC unroll 8
          for (int r = 0; r < 8; ++r)
            acc[r] = _mm256_fmadd_ps(qv, _mm256_load_ps(buf + r * hd + 8 * cc), acc[r]);
        }
        const __m256 dots = _mm256_mul_ps(SumEach8(acc), vscale);
        if (nb == 8) {
          _mm256_storeu_ps(p + i * len + first + j0, dots);
        } else {
          alignas(32) float tail[8];
          _mm256_store_ps(tail, dots);
          std::copy(tail, tail + nb, p + i * len + first + j0);
        }
      }
    }
  }
  SoftmaxRows(p, g, len, CpuPath::kAvx2);
  for (int64_t d = 0; d < g * hd; ++d) out[d] = 0.f;
  // The weighted sum of values: up to 8 accumulators (64 lanes of the head) at a time.
  constexpr int kPart = CH < 8 ? CH : 8;
  for (int64_t pg = 0; pg < c.NumPages(); ++pg) {
    const KV* v = c.V(pg);
    c.PrefetchNextV(pg);
    const int64_t rows = c.Rows(pg), first = c.First(pg);
    for (int64_t j0 = 0; j0 < rows; j0 += 8) {
      const int64_t nb = std::min<int64_t>(8, rows - j0);
      const float* vs = c.VS(pg);
      ConvertBlock8<CH>(v + j0 * c.vs, c.vs, nb, buf, vs ? vs + j0 : nullptr);
      for (int64_t i = 0; i < g; ++i) {
        const float* pi = p + i * len + first + j0;
        for (int c0 = 0; c0 < CH; c0 += kPart) {
          float* oi = out + i * hd + 8 * c0;
          __m256 acc[kPart];
#pragma GCC unroll 8
          for (int cc = 0; cc < kPart; ++cc) acc[cc] = _mm256_loadu_ps(oi + 8 * cc);
          for (int64_t r = 0; r < nb; ++r) {
            const __m256 pr = _mm256_set1_ps(pi[r]);
#pragma GCC unroll 8
            for (int cc = 0; cc < kPart; ++cc)
              acc[cc] = _mm256_fmadd_ps(pr, _mm256_load_ps(buf + r * hd + 8 * (c0 + cc)), acc[cc]);
          }
#pragma GCC unroll 8
          for (int cc = 0; cc < kPart; ++cc) _mm256_storeu_ps(oi + 8 * cc, acc[cc]);
        }
      }
    }
  }
}

// GroupAvx2Blocked for the head size (16, 32, ..., 128), or false when it has no instance.
template <typename KV>
bool GroupAvx2ForHeadSize(int64_t hd, const float* q, int64_t g, const HeadRows<KV>& c, float scale,
                          float* p, float* out) {
  switch (hd) {
#define LLAVA_GROUP_CASE(CH)                      \
  case 8 * CH:                                    \
    GroupAvx2Blocked<CH>(q, g, c, scale, p, out); \
    return true;
    LLAVA_GROUP_CASE(2)
    LLAVA_GROUP_CASE(4)
    LLAVA_GROUP_CASE(6)
    LLAVA_GROUP_CASE(8)
    LLAVA_GROUP_CASE(10)
    LLAVA_GROUP_CASE(12)
    LLAVA_GROUP_CASE(14)
    LLAVA_GROUP_CASE(16)
#undef LLAVA_GROUP_CASE
    default:
      return false;
  }
}

// One group on the best kernel of the path: the AVX-512 or AVX2 blocks for the head sizes they
// have, the compiler-vectorised loops otherwise. `qb`: the bf16 query (AVX512-BF16 only).
template <typename KV>
void RunGroup(CpuPath path, int64_t hd, const float* q, const uint16_t* qb, int64_t g,
              const HeadRows<KV>& c, float scale, float* p, float* out) {
  if (path >= CpuPath::kAvx512 && GroupAvx512ForHeadSize(hd, q, qb, g, c, scale, p, out)) return;
  if (path >= CpuPath::kAvx2 && q != nullptr && GroupAvx2ForHeadSize(hd, q, g, c, scale, p, out)) {
    return;
  }
  GroupAnyHeadSize(path >= CpuPath::kAvx2, q, g, c, hd, scale, p, out);
}

}  // namespace

bool DecodeAttentionRunsOn(const at::Device& device) {
#ifdef LLAVA_WITH_CUDA
  if (device.is_cuda()) {
    // Opt-in until scripts/gpu-run.sh passes with it: the model-level device tests pass with
    // it on an H200 in fp32, its own test against the CPU kernel (bf16 too) has not yet run
    // (docs/BENCHMARKS.md, "The batched CUDA decode attention").
    static const bool kernel = [] {
      const char* env = std::getenv("LLAVA_CUDA_ATTENTION");
      return env != nullptr && std::string(env) == "kernel";
    }();
    return kernel;
  }
#endif
  return device.is_cpu();
}

#ifdef LLAVA_WITH_CUDA
namespace {

// The CUDA kernel behind DecodeAttention's contract: every cache read in place through its page
// table, one launch. The sequences' descriptors and page tables go to the device in one copy
// from pinned memory (the caching host allocator keeps the block until the copy is done).
at::Tensor DecodeAttentionCuda(const at::Tensor& q, const std::vector<DecodeKv>& caches,
                               at::ScalarType kv_type, int64_t kv_heads,
                               const std::vector<bool>& want_probs,
                               std::vector<at::Tensor>* probs) {
  TORCH_CHECK(q.dim() == 3, "DecodeAttention: q must be [B, H, hd]");
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  TORCH_CHECK(batch > 0 && batch <= 65535 && static_cast<int64_t>(caches.size()) == batch,
              "DecodeAttention: one cache per sequence, at most 65,535");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "DecodeAttention: float or bf16");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "DecodeAttention: ", heads, " query heads on ",
              kv_heads, " KV heads");
  const size_t table_bytes = sizeof(cuda::DecodeSequence) * static_cast<size_t>(batch);
  std::vector<int64_t> first(batch), num_pages(batch);
  int64_t ids = 0, max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const DecodeKv& c = caches[b];
    TORCH_CHECK(c.len > 0 && c.len <= INT32_MAX && c.page_rows > 0 && c.keys != nullptr &&
                    c.values != nullptr && c.pages != nullptr && c.key_row_stride >= hd &&
                    c.value_row_stride >= hd && c.key_row_stride <= INT32_MAX &&
                    c.value_row_stride <= INT32_MAX,
                "DecodeAttention: sequence ", b, " has no entries or a malformed page table");
    first[b] = ids;
    num_pages[b] = (c.len + c.page_rows - 1) / c.page_rows;
    ids += num_pages[b];
    max_len = std::max(max_len, c.len);
  }
  const int64_t bytes = static_cast<int64_t>(table_bytes) + ids * int64_t{sizeof(int32_t)};
  at::Tensor device_table = at::empty({bytes}, q.options().dtype(at::kByte));
  at::Tensor host_table =
      at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* table = reinterpret_cast<cuda::DecodeSequence*>(host_table.data_ptr<uint8_t>());
  auto* host_ids = reinterpret_cast<int32_t*>(host_table.data_ptr<uint8_t>() + table_bytes);
  const auto* device_ids =
      reinterpret_cast<const int32_t*>(device_table.data_ptr<uint8_t>() + table_bytes);
  if (probs != nullptr) probs->assign(batch, at::Tensor());
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  for (int64_t b = 0; b < batch; ++b) {
    const DecodeKv& c = caches[b];
    cuda::DecodeSequence& s = table[b];
    s.keys = c.keys;
    s.values = c.values;
    s.pages = device_ids + first[b];
    s.probs = nullptr;
    if (probs != nullptr && want_probs[b]) {
      (*probs)[b] = at::empty({heads, 1, c.len}, f32);
      s.probs = (*probs)[b].data_ptr<float>();
    }
    s.key_head_stride = c.key_head_stride;
    s.value_head_stride = c.value_head_stride;
    s.page_stride = c.page_stride;
    s.key_row_stride = static_cast<int32_t>(c.key_row_stride);
    s.value_row_stride = static_cast<int32_t>(c.value_row_stride);
    s.page_rows = static_cast<int32_t>(std::min<int64_t>(c.page_rows, INT32_MAX));
    s.len = static_cast<int32_t>(c.len);
    std::copy(c.pages, c.pages + num_pages[b], host_ids + first[b]);
  }
  device_table.copy_(host_table, /*non_blocking=*/true);
  const at::Tensor qc = q.to(kv_type).contiguous();
  at::Tensor out = at::empty({batch, heads, hd}, qc.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  TORCH_CHECK(cuda::DecodeAttention(
                  qc.data_ptr(),
                  reinterpret_cast<const cuda::DecodeSequence*>(device_table.data_ptr<uint8_t>()),
                  static_cast<int>(batch), static_cast<int>(max_len), static_cast<int>(heads),
                  static_cast<int>(kv_heads), static_cast<int>(hd), scale, kv_type == at::kBFloat16,
                  out.data_ptr(), q.device().index(), /*stream=*/nullptr),
              "DecodeAttention: the CUDA kernel failed (a cache longer than the device's "
              "shared memory holds, 4 bytes an entry, or a launch error)");
  return out.view({batch, heads * hd}).to(q.scalar_type());
}

}  // namespace
#endif

at::Tensor DecodeAttention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values,
                           const std::vector<bool>& want_probs, std::vector<at::Tensor>* probs) {
  TORCH_CHECK(q.dim() == 3, "DecodeAttention: q must be [B, H, hd]");
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  TORCH_CHECK(batch > 0, "DecodeAttention: no sequences");
  TORCH_CHECK(
      static_cast<int64_t>(keys.size()) == batch && static_cast<int64_t>(values.size()) == batch,
      "DecodeAttention: one key and value tensor per sequence");
  static const int32_t kFirstPage = 0;
  std::vector<DecodeKv> caches(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor& k = keys[b];
    const at::Tensor& v = values[b];
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(2) == hd &&
                    heads % k.size(0) == 0 && k.stride(2) == 1 && v.stride(2) == 1 &&
                    k.scalar_type() == v.scalar_type() &&
                    k.scalar_type() == keys[0].scalar_type() && k.size(0) == keys[0].size(0) &&
                    k.device() == q.device() && v.device() == q.device() && k.size(1) > 0,
                "DecodeAttention: sequence ", b, " has keys ", k.sizes(), " / values ", v.sizes(),
                " that do not fit q ", q.sizes());
    DecodeKv& c = caches[b];
    c.keys = k.data_ptr();
    c.values = v.data_ptr();
    c.pages = &kFirstPage;  // one page holding every row
    c.page_rows = k.size(1);
    c.key_head_stride = k.stride(0);
    c.value_head_stride = v.stride(0);
    c.key_row_stride = k.stride(1);
    c.value_row_stride = v.stride(1);
    c.len = k.size(1);
  }
  return DecodeAttention(q, caches, keys[0].scalar_type(), keys[0].size(0), want_probs, probs);
}

at::Tensor DecodeAttention(const at::Tensor& q, const std::vector<DecodeKv>& caches,
                           at::ScalarType kv_type, int64_t kv_heads,
                           const std::vector<bool>& want_probs, std::vector<at::Tensor>* probs) {
#ifdef LLAVA_WITH_CUDA
  if (q.is_cuda()) return DecodeAttentionCuda(q, caches, kv_type, kv_heads, want_probs, probs);
#endif
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.size(2) <= kMaxHeadDim,
              "DecodeAttention: q must be [B, H, hd <= 256] on CPU");
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  TORCH_CHECK(batch > 0 && static_cast<int64_t>(caches.size()) == batch,
              "DecodeAttention: one cache per sequence");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kChar,
              "DecodeAttention: float, bf16 or int8 caches");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "DecodeAttention: ", heads, " query heads on ",
              kv_heads, " KV heads");
  for (int64_t b = 0; b < batch; ++b) {
    const DecodeKv& c = caches[b];
    TORCH_CHECK(c.len > 0 && c.page_rows > 0 && c.keys != nullptr && c.values != nullptr &&
                    c.pages != nullptr && c.key_row_stride >= hd && c.value_row_stride >= hd,
                "DecodeAttention: sequence ", b, " has no entries or a malformed page table");
    TORCH_CHECK(kv_type != at::kChar || (c.key_scales != nullptr && c.value_scales != nullptr),
                "DecodeAttention: int8 sequence ", b, " has no scales");
  }
  const CpuPath path = ActiveCpuPath();
  const bool use_avx512 = path >= CpuPath::kAvx512;
  // A bf16 query against bf16 caches goes to the AVX512-BF16 score kernel as it is (head
  // sizes 32, 64, 96, 128); only the other paths read the query in fp32.
  const bool has_bf16_dot = path >= CpuPath::kAvx512Bf16;
  const at::Tensor qb =
      q.scalar_type() == at::kBFloat16 && has_bf16_dot ? q.contiguous() : at::Tensor();
  const bool need_qf =
      !(qb.defined() && use_avx512 && hd % 32 == 0 && hd <= 128) || kv_type != at::kBFloat16;
  const at::Tensor qf = need_qf ? q.to(at::kFloat).contiguous() : at::Tensor();
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({batch, heads, hd}, f32);
  if (probs != nullptr) {
    probs->assign(batch, at::Tensor());
    for (int64_t b = 0; b < batch; ++b) {
      if (want_probs[b]) (*probs)[b] = at::empty({heads, 1, caches[b].len}, f32);
    }
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const float* qp = need_qf ? qf.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // One unit of work: a sequence's KV head and the query heads that read it.
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / kv_heads, kv = u % kv_heads;
      const DecodeKv& c = caches[b];
      float* p;
      if (probs != nullptr && want_probs[b]) {
        p = (*probs)[b].data_ptr<float>() + kv * group * c.len;
      } else {
        scratch.resize(group * c.len);
        p = scratch.data();
      }
      const int64_t first = b * heads + kv * group;  // row of the group's first query head
      const float* qh = qp != nullptr ? qp + first * hd : nullptr;
      float* oh = op + first * hd;
      if (kv_type == at::kFloat) {
        const HeadRows<float> rows{static_cast<const float*>(c.keys) + kv * c.key_head_stride,
                                   static_cast<const float*>(c.values) + kv * c.value_head_stride,
                                   c.pages,
                                   c.page_rows,
                                   c.page_stride,
                                   c.key_row_stride,
                                   c.value_row_stride,
                                   c.len};
        RunGroup(path, hd, qh, nullptr, group, rows, scale, p, oh);
      } else if (kv_type == at::kChar) {
        HeadRows<int8_t> rows{static_cast<const int8_t*>(c.keys) + kv * c.key_head_stride,
                              static_cast<const int8_t*>(c.values) + kv * c.value_head_stride,
                              c.pages,
                              c.page_rows,
                              c.page_stride,
                              c.key_row_stride,
                              c.value_row_stride,
                              c.len};
        rows.ksc = c.key_scales + kv * c.scale_head_stride;
        rows.vsc = c.value_scales + kv * c.scale_head_stride;
        rows.scale_page_stride = c.scale_page_stride;
        RunGroup(path, hd, qh, nullptr, group, rows, scale, p, oh);
      } else {
        const HeadRows<uint16_t> rows{
            static_cast<const uint16_t*>(c.keys) + kv * c.key_head_stride,
            static_cast<const uint16_t*>(c.values) + kv * c.value_head_stride,
            c.pages,
            c.page_rows,
            c.page_stride,
            c.key_row_stride,
            c.value_row_stride,
            c.len};
        const uint16_t* qbh =
            qb.defined()
                ? reinterpret_cast<const uint16_t*>(qb.data_ptr<at::BFloat16>()) + first * hd
                : nullptr;
        RunGroup(path, hd, qh, qbh, group, rows, scale, p, oh);
      }
    }
  });
  return out.view({batch, heads * hd}).to(q.scalar_type());
}

}  // namespace llava
