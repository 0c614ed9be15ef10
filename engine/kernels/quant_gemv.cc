#include "engine/kernels/quant_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "engine/kernels/cpu_gemv.h"  // Bf16ToFloat, FloatToBf16

namespace llava {
namespace {

constexpr int64_t kHalf = kQuantGroup / 2;  // 16
constexpr int64_t kPairBytes = 2 * kQuantGroup;

// Where value j (< kQuantGroup) of group `which` (0, 1) of a pair lies among a row's 64 int8
// bytes in a block, and among the activations' 64 bytes of a pair: halves of both groups.
inline int64_t PairOffset(int which, int64_t j) {
  return (j < kHalf ? 0 : 2 * kHalf) + which * kHalf + j % kHalf;
}

// The rows of x quantized per group (the header's arithmetic), in the weights' pair layout:
// q [m, pairs, 64]; per row, pair and group its scale dx [m, pairs, 2], for int4's minimum the
// sum of the group's real values [m, pairs, 2], and for the int8 VNNI kernel -128 sum(q)
// [m, pairs, 2] (see TileVnni). Buffers of the calling thread, reused from call to call (a
// decode step quantizes x for every linear layer).
struct Activations {
  int64_t pairs = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sum;
  std::vector<int32_t> start;
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
const Activations& QuantizeActivations(const T* x, int64_t m, int64_t k, int64_t pairs) {
  thread_local Activations tls;
  Activations& a = tls;  // the calling thread's, also inside the parallel loop below
  a.pairs = pairs;
  a.q.assign(m * pairs * kPairBytes, 0);
  a.dx.assign(m * pairs * 2, 0.f);
  a.sum.assign(m * pairs * 2, 0.f);
  a.start.assign(m * pairs * 2, 0);
  // A prefill's rows are quantized on every thread; a decode step's few rows on this one.
  at::parallel_for(0, m, m >= 16 ? 4 : m, [&](int64_t i_begin, int64_t i_end) {
    float v[kQuantGroup];
    for (int64_t i = i_begin; i < i_end; ++i) {
      for (int64_t g = 0; g * kQuantGroup < k; ++g) {
        const int64_t c0 = g * kQuantGroup, n = std::min(kQuantGroup, k - c0);
        const int which = static_cast<int>(g % 2);
        const int64_t base = i * pairs + g / 2;
        float amax = 0.f, sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          v[j] = ToFloat(x[i * k + c0 + j]);
          amax = std::max(amax, std::fabs(v[j]));
          sum += v[j];
        }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* q = a.q.data() + base * kPairBytes;
        int32_t qsum = 0;
        for (int64_t j = 0; j < n; ++j) {
          const float s = v[j] * inv;  // in [-127, 127]; rounded half away from zero
          const int8_t r = static_cast<int8_t>(s >= 0.f ? s + 0.5f : s - 0.5f);
          q[PairOffset(which, j)] = r;
          qsum += r;
        }
        a.dx[base * 2 + which] = d;
        a.sum[base * 2 + which] = sum;
        a.start[base * 2 + which] = -128 * qsum;
      }
    }
  });
  return a;
}

// ---- packing ----

const uint8_t* Block(const PackedQuant& w, int64_t tile, int64_t pair) {
  return w.data.data() + (tile * w.pairs + pair) * w.block_bytes;
}

// Value j of group g of row r (the generic kernel's and the tests' view of a block).
int PackedValue(const PackedQuant& w, int64_t r, int64_t g, int64_t j) {
  const uint8_t* row = Block(w, r / kPackRows, g / 2) + (r % kPackRows) * w.row_bytes;
  const int which = static_cast<int>(g % 2);
  if (w.format == WeightFormat::kInt8) {
    return static_cast<int8_t>(row[PairOffset(which, j)]);
  }
  const uint8_t byte = row[which * kHalf + j % kHalf];
  return j < kHalf ? byte & 0xF : byte >> 4;
}

// Scale (or, second = true, int4's minimum) of group g of row r.
float PackedScale(const PackedQuant& w, int64_t r, int64_t g, bool minimum = false) {
  const uint8_t* b = Block(w, r / kPackRows, g / 2) + kPackRows * w.row_bytes + (minimum ? 16 : 0);
  uint16_t h;
  std::memcpy(&h, b + 2 * (2 * (r % kPackRows) + g % 2), 2);
  return HalfToFloat(h);
}

// ---- generic: the integer arithmetic in plain C++ (the reference for the vector paths) ----

void GemvGeneric(const Activations& a, const PackedQuant& w, int64_t m, float* y) {
  const int64_t n = w.rows, groups = 2 * w.pairs;
  const bool int4 = w.format == WeightFormat::kInt4;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t i = 0; i < m; ++i) {
        float s = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int8_t* qx = a.q.data() + (i * a.pairs + g / 2) * kPairBytes;
          int32_t dot = 0;
          for (int64_t j = 0; j < kQuantGroup; ++j) {
            dot += PackedValue(w, r, g, j) * qx[PairOffset(static_cast<int>(g % 2), j)];
          }
          const int64_t at = (i * a.pairs + g / 2) * 2 + g % 2;
          s += PackedScale(w, r, g) * a.dx[at] * static_cast<float>(dot);
          if (int4) s += PackedScale(w, r, g, true) * a.sum[at];
        }
        y[i * n + r] = s;
      }
    }
  });
}

// ---- AVX2 and AVX512-VNNI: one tile of kPackRows weight rows x M rows of x ----

__attribute__((target("avx2,fma"))) inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8-lane vectors of a pair from its two values v = (v0, v1) (the activations are stored
// compactly: a row of x must stay in L1 beside the weights streaming past it).
// (v0 x4, v1 x4): a scale per lane of a dot product's two halves.
__attribute__((target("avx2"))) inline __m256 PairVector(const float* v) {
  const __m256 both = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(v)));
  return _mm256_permutevar8x32_ps(both, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
// (v0, v1) x4: the minimums' layout (row r's two groups in lanes 2r, 2r + 1).
__attribute__((target("avx2"))) inline __m256 Alternating(const float* v) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(v)));
}
// (v0, 0, 0, 0, 0, v1, 0, 0): one value in each half, the start of a VNNI accumulator.
__attribute__((target("avx2"))) inline __m256i StartVector(const int32_t* v) {
  const __m256i both = _mm256_castpd_si256(_mm256_broadcast_sd(reinterpret_cast<const double*>(v)));
  return _mm256_and_si256(both, _mm256_setr_epi32(-1, 0, 0, 0, 0, -1, 0, 0));
}

// Blocks prefetched ahead into L2: a tile is one stream, 8 KiB ahead (2 KiB: int8 at 0.75 of
// the bf16 kernel's bytes per second, int4 at 0.9; 8 KiB: 0.9 and 1.0; 16 KiB no better).
constexpr int64_t kAheadBytes = 8192;

// The tile's outputs: acc[r][i] summed (+ row r's share of int4's minimum term, lanes 2r and
// 2r + 1 of mins[i]), for the rows that exist.
template <int M, bool kInt4>
__attribute__((target("avx2,fma"))) inline void StoreTile(const __m256 (&acc)[kPackRows][M],
                                                          const __m256 (&mins)[M], int64_t n,
                                                          int64_t r0, float* y) {
  alignas(32) float m8[8];
  for (int i = 0; i < M; ++i) {
    if constexpr (kInt4) _mm256_store_ps(m8, mins[i]);
    for (int r = 0; r < kPackRows && r0 + r < n; ++r) {
      float s = Sum8(acc[r][i]);
      if constexpr (kInt4) s += m8[2 * r] + m8[2 * r + 1];
      y[i * n + r0 + r] = s;
    }
  }
}

// AVX2: vpmaddubsw multiplies unsigned by signed bytes: int4's nibbles are unsigned already;
// int8 uses |w| and x carrying w's sign (at most 2 * 127 * 127 per int16: no saturation).
// Rows i0 .. i0 + M of x (M <= 2: the 16 ymm registers).
template <int M, bool kInt4>
__attribute__((target("avx2,fma,f16c"))) void TileAvx2(const Activations& a, const PackedQuant& w,
                                                       int64_t tile, int64_t i0, float* y) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256 acc[kPackRows][M], mins[M];
  for (int i = 0; i < M; ++i) {
    mins[i] = _mm256_setzero_ps();
    for (int r = 0; r < kPackRows; ++r) acc[r][i] = _mm256_setzero_ps();
  }
  const uint8_t* b = Block(w, tile, 0);
  const uint8_t* ahead = b + kAheadBytes;  // the next line to prefetch: one per cache line
  for (int64_t p = 0; p < w.pairs; ++p, b += w.block_bytes) {
    for (; ahead < b + w.block_bytes + kAheadBytes; ahead += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    }
    const __m256 s8 = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kPackRows * w.row_bytes)));
#pragma GCC unroll 4
    for (int r = 0; r < kPackRows; ++r) {
      const uint8_t* row = b + r * w.row_bytes;
      __m256i wa, wb;
      if constexpr (kInt4) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        wa = _mm256_and_si256(v, low);
        wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      } else {
        wa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32));
      }
      const __m256 sw =
          _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(2 * r, 2 * r, 2 * r, 2 * r, 2 * r + 1,
                                                         2 * r + 1, 2 * r + 1, 2 * r + 1));
#pragma GCC unroll 2
      for (int i = 0; i < M; ++i) {
        const int64_t at = (i0 + i) * a.pairs + p;
        const __m256i xa =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + at * kPairBytes));
        const __m256i xb =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + at * kPairBytes + 32));
        __m256i dot;
        if constexpr (kInt4) {
          dot = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(wa, xa), _mm256_maddubs_epi16(wb, xb)), ones);
        } else {
          dot = _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wa), _mm256_sign_epi8(xa, wa)),
                                ones),
              _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wb), _mm256_sign_epi8(xb, wb)),
                                ones));
        }
        const __m256 dx = PairVector(a.dx.data() + at * 2);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, dx), acc[r][i]);
      }
    }
    if constexpr (kInt4) {
      const __m256 m8 = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kPackRows * w.row_bytes + 16)));
      for (int i = 0; i < M; ++i) {
        const float* s = a.sum.data() + ((i0 + i) * a.pairs + p) * 2;
        mins[i] = _mm256_fmadd_ps(m8, Alternating(s), mins[i]);
      }
    }
  }
  StoreTile<M, kInt4>(acc, mins, w.rows, tile * kPackRows, y);
}

// AVX512-VNNI on 256-bit vectors: vpdpbusd, unsigned by signed bytes into int32. int4's nibbles
// are unsigned; int8 flips each weight's top bit, which adds 128 (w + 128 in [1, 255]), and the
// accumulator starts at -128 * sum(q_x) of each group to take that back: exact in int32.
// Rows i0 .. i0 + M of x (M <= 2: 8 accumulators beside the 4 rows' 12 vectors).
template <int M, bool kInt4>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) void TileVnni(
    const Activations& a, const PackedQuant& w, int64_t tile, int64_t i0, float* y) {
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[kPackRows][M], mins[M];
  for (int i = 0; i < M; ++i) {
    mins[i] = _mm256_setzero_ps();
    for (int r = 0; r < kPackRows; ++r) acc[r][i] = _mm256_setzero_ps();
  }
  const uint8_t* b = Block(w, tile, 0);
  const uint8_t* ahead = b + kAheadBytes;  // the next line to prefetch: one per cache line
  for (int64_t p = 0; p < w.pairs; ++p, b += w.block_bytes) {
    for (; ahead < b + w.block_bytes + kAheadBytes; ahead += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    }
    const __m256 s8 = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kPackRows * w.row_bytes)));
    // The tile's 4 rows of the pair in registers, then each row of x loaded once.
    __m256i wa[kPackRows], wb[kPackRows];
    __m256 sw[kPackRows];
#pragma GCC unroll 4
    for (int r = 0; r < kPackRows; ++r) {
      const uint8_t* row = b + r * w.row_bytes;
      if constexpr (kInt4) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        wa[r] = _mm256_and_si256(v, low);
        wb[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      } else {
        wa[r] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), flip);
        wb[r] =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)), flip);
      }
      sw[r] = _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(2 * r, 2 * r, 2 * r, 2 * r, 2 * r + 1,
                                                             2 * r + 1, 2 * r + 1, 2 * r + 1));
    }
#pragma GCC unroll 2
    for (int i = 0; i < M; ++i) {
      const int64_t at = (i0 + i) * a.pairs + p;
      const __m256i xa =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + at * kPairBytes));
      const __m256i xb =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + at * kPairBytes + 32));
      const __m256i start = kInt4 ? _mm256_setzero_si256() : StartVector(a.start.data() + at * 2);
      const __m256 dx = PairVector(a.dx.data() + at * 2);
#pragma GCC unroll 4
      for (int r = 0; r < kPackRows; ++r) {
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, wa[r], xa), wb[r], xb);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw[r], dx), acc[r][i]);
      }
    }
    if constexpr (kInt4) {
      const __m256 m8 = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kPackRows * w.row_bytes + 16)));
      for (int i = 0; i < M; ++i) {
        const float* s = a.sum.data() + ((i0 + i) * a.pairs + p) * 2;
        mins[i] = _mm256_fmadd_ps(m8, Alternating(s), mins[i]);
      }
    }
  }
  StoreTile<M, kInt4>(acc, mins, w.rows, tile * kPackRows, y);
}

// Every tile for all m rows of x, in chunks of 2 rows (the tile's weights come from memory
// for the first chunk and from L1/L2 for the others). A prefill's rows go in blocks of
// kRowBlock, each block through all of the thread's tiles: the block's activations (32 rows
// of 4,096 values: 128 KiB) stay in L2, where all m rows per tile were read from L3 again for
// every tile.
template <bool kVnni, bool kInt4>
void GemvTiles(const Activations& a, const PackedQuant& w, int64_t m, float* y) {
  constexpr int kChunk = 2;
  constexpr int64_t kRowBlock = 32;
  at::parallel_for(0, w.tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t b0 = 0; b0 < m; b0 += kRowBlock) {
      const int64_t b1 = std::min(m, b0 + kRowBlock);
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t i0 = b0; i0 < b1; i0 += kChunk) {
          const auto run = [&](auto rows) {
            if constexpr (kVnni) {
              TileVnni<rows.value, kInt4>(a, w, t, i0, y + i0 * w.rows);
            } else {
              TileAvx2<rows.value, kInt4>(a, w, t, i0, y + i0 * w.rows);
            }
          };
          if (b1 - i0 >= 2) {
            run(std::integral_constant<int, 2>{});
          } else {
            run(std::integral_constant<int, 1>{});
          }
        }
      }
    }
  });
}

template <typename T>
void Gemv(const T* x, const PackedQuant& w, const T* bias, T* y, int64_t m, CpuPath path) {
  path = ClampCpuPath(path, DetectedCpuPath());
  const int64_t n = w.rows;
  const Activations& a = QuantizeActivations(x, m, w.cols, w.pairs);
  thread_local std::vector<float> tls_out;
  std::vector<float>& out = tls_out;  // the calling thread's, also inside parallel loops
  out.resize(m * n);
  const bool int4 = w.format == WeightFormat::kInt4;
  if (path == CpuPath::kGeneric) {
    GemvGeneric(a, w, m, out.data());
  } else if (path >= CpuPath::kAvx512 && HasAvx512Vnni()) {
    int4 ? GemvTiles<true, true>(a, w, m, out.data()) : GemvTiles<true, false>(a, w, m, out.data());
  } else {
    int4 ? GemvTiles<false, true>(a, w, m, out.data())
         : GemvTiles<false, false>(a, w, m, out.data());
  }
  at::parallel_for(0, m, m >= 16 ? 4 : m, [&](int64_t i_begin, int64_t i_end) {
    for (int64_t i = i_begin; i < i_end; ++i) {
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
  });
}

}  // namespace

PackedQuant PackQuantized(const QuantizedMatrix& q) {
  PackedQuant w;
  w.format = q.format;
  w.rows = q.rows;
  w.cols = q.cols;
  w.tiles = (q.rows + kPackRows - 1) / kPackRows;
  const int64_t groups = q.groups_per_row();
  w.pairs = (groups + 1) / 2;
  const bool int4 = q.format == WeightFormat::kInt4;
  w.row_bytes = int4 ? kQuantGroup : kPairBytes;
  const int64_t extras = int4 ? 32 : 16;  // 8 fp16 scales (+ 8 minimums)
  w.block_bytes = kPackRows * w.row_bytes + extras;
  w.data.assign(w.tiles * w.pairs * w.block_bytes, 0);
  const int64_t group_bytes = int4 ? kHalf : kQuantGroup;
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* b = w.data.data() + ((r / kPackRows) * w.pairs + g / 2) * w.block_bytes;
      uint8_t* row = b + (r % kPackRows) * w.row_bytes;
      const uint8_t* src = q.data.data() + r * q.row_bytes() + g * group_bytes;
      const int which = static_cast<int>(g % 2);
      if (int4) {
        std::memcpy(row + which * kHalf, src, kHalf);
      } else {
        for (int64_t j = 0; j < kQuantGroup; ++j) row[PairOffset(which, j)] = src[j];
      }
      const int64_t slot = 2 * (2 * (r % kPackRows) + which);
      std::memcpy(b + kPackRows * w.row_bytes + slot, &q.scale[r * groups + g], 2);
      if (int4) std::memcpy(b + kPackRows * w.row_bytes + 16 + slot, &q.min[r * groups + g], 2);
    }
  }
  return w;
}

namespace {

// One row's pair of groups dequantized into 64 values v (the scalar reference).
void DequantizePair(const PackedQuant& w, const uint8_t* b, int64_t rr, float* v) {
  const bool int4 = w.format == WeightFormat::kInt4;
  const uint8_t* row = b + rr * w.row_bytes;
  uint16_t h[4];  // scale 0, scale 1, minimum 0, minimum 1
  std::memcpy(h, b + kPackRows * w.row_bytes + 4 * rr, 4);
  if (int4) std::memcpy(h + 2, b + kPackRows * w.row_bytes + 16 + 4 * rr, 4);
  for (int which = 0; which < 2; ++which) {
    const float d = HalfToFloat(h[which]), m = int4 ? HalfToFloat(h[2 + which]) : 0.f;
    for (int64_t j = 0; j < kQuantGroup; ++j) {
      const int q =
          int4 ? (j < kHalf ? row[which * kHalf + j] & 0xF : row[which * kHalf + j - kHalf] >> 4)
               : static_cast<int8_t>(row[PairOffset(which, j)]);
      v[which * kQuantGroup + j] = d * static_cast<float>(q) + m;
    }
  }
}

// The same for a whole pair on AVX2 (fp32 out) and AVX512-BF16 (bf16 out, rounded to nearest
// even by vcvtneps2bf16): 8 values at a time, d * q + m rounded twice as the scalar code does
// (no FMA), so every path gives the same panel.
__attribute__((target("avx2,fma,f16c"))) void DequantizePairAvx2(const PackedQuant& w,
                                                                 const uint8_t* b, int64_t rr,
                                                                 float* out) {
  const bool int4 = w.format == WeightFormat::kInt4;
  const uint8_t* row = b + rr * w.row_bytes;
  const __m128 s = _mm_cvtph_ps(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(b + kPackRows * w.row_bytes + 4 * rr)));  // d0 d1 m0 m1
  for (int which = 0; which < 2; ++which) {
    const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(which ? _mm_shuffle_ps(s, s, 1) : s));
    __m128i q16[2];  // the group's values 0-15 and 16-31 as bytes
    if (int4) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + which * kHalf));
      q16[0] = _mm_and_si128(v, _mm_set1_epi8(0x0F));
      q16[1] = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    } else {
      q16[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + which * kHalf));
      q16[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * kHalf + which * kHalf));
    }
    __m256 m = _mm256_setzero_ps();
    if (int4) {
      const __m128 mins = _mm_cvtph_ps(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(b + kPackRows * w.row_bytes + 16 + 4 * rr)));
      m = _mm256_set1_ps(_mm_cvtss_f32(which ? _mm_shuffle_ps(mins, mins, 1) : mins));
    }
    for (int h = 0; h < 2; ++h) {
      for (int e = 0; e < 2; ++e) {
        const __m128i bytes = e == 0 ? q16[h] : _mm_srli_si128(q16[h], 8);
        const __m256i ints = int4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
        _mm256_storeu_ps(out + which * kQuantGroup + h * kHalf + e * 8,
                         _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ints), d), m));
      }
    }
  }
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16"))) void
DequantizePairBf16(const PackedQuant& w, const uint8_t* b, int64_t rr, uint16_t* out) {
  alignas(64) float v[kPairBytes];
  DequantizePairAvx2(w, b, rr, v);
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * c),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(v + 16 * c)));
  }
}

template <typename T>
void Dequantize(const PackedQuant& w, int64_t r0, int64_t count, T* out) {
  const CpuPath path = ActiveCpuPath();
  const bool bf16_vectors = path >= CpuPath::kAvx512Bf16;
  at::parallel_for(0, count, 16, [&](int64_t c0, int64_t c1) {
    alignas(64) float v[kPairBytes];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r = r0 + c;
      T* dst = out + c * w.cols;
      for (int64_t p = 0; p < w.pairs; ++p) {
        const uint8_t* b = Block(w, r / kPackRows, p);
        const int64_t n = std::min(kPairBytes, w.cols - p * kPairBytes);
        if constexpr (std::is_same_v<T, float>) {
          if (n == kPairBytes && path >= CpuPath::kAvx2) {
            DequantizePairAvx2(w, b, r % kPackRows, dst + p * kPairBytes);
            continue;
          }
        } else {
          if (n == kPairBytes && bf16_vectors) {
            DequantizePairBf16(w, b, r % kPackRows, dst + p * kPairBytes);
            continue;
          }
        }
        if (path >= CpuPath::kAvx2) {
          DequantizePairAvx2(w, b, r % kPackRows, v);
        } else {
          DequantizePair(w, b, r % kPackRows, v);
        }
        for (int64_t j = 0; j < n; ++j) {
          if constexpr (std::is_same_v<T, float>) {
            dst[p * kPairBytes + j] = v[j];
          } else {
            dst[p * kPairBytes + j] = FloatToBf16(v[j]);
          }
        }
      }
    }
  });
}

}  // namespace

void DequantizeRows(const PackedQuant& w, int64_t r0, int64_t count, float* out) {
  Dequantize(w, r0, count, out);
}

void DequantizeRows(const PackedQuant& w, int64_t r0, int64_t count, uint16_t* out) {
  Dequantize(w, r0, count, out);
}

bool HasAvx512Vnni() {
  // (F16C, which the kernels also use, comes with every AVX-512 CPU; clang's builtin does not
  // know the name.)
  static const bool has =
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return has;
}

void QuantGemv(const float* x, const PackedQuant& w, const float* bias, float* y, int64_t m,
               CpuPath path) {
  Gemv(x, w, bias, y, m, path);
}

void QuantGemv(const uint16_t* x, const PackedQuant& w, const uint16_t* bias, uint16_t* y,
               int64_t m, CpuPath path) {
  Gemv(x, w, bias, y, m, path);
}

}  // namespace llava
