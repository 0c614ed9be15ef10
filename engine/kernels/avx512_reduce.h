// Horizontal sums of AVX-512 float vectors for the CPU kernels (cpu_gemv.cc,
// decode_attention.cc). Only for translation units that check the CPU before calling them.
// GCC 12's _mm512_reduce_add_ps reads an "undefined" vector that -Wuninitialized flags once
// the call is inlined into a template; these use defined shuffles only.
#pragma once

#include <immintrin.h>

namespace llava {

// The sum of the 16 lanes of v.
__attribute__((target("avx512f"))) inline float SumLanes(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // + the other 256-bit half
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));  // + the neighbouring 128 bits
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));        // + the other 64 bits
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));        // + the neighbouring lane
  return _mm512_cvtss_f32(v);
}

// Where SumEach16 must find the vector whose sum it returns in lane i.
constexpr int kSumSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// Lane i of the result is the sum of the 16 lanes of v[kSumSlot[i]]: four rounds of
// shuffle + add, each halving the lanes per vector (15 adds where 16 separate horizontal sums
// take 64 adds and as many shuffles).
__attribute__((target("avx512f"))) inline __m512 SumEach16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int r = 0; r < 8; ++r) {  // 128-bit blocks {0,1} + {2,3}: v[r] | v[r+8]
    x[r] = _mm512_add_ps(_mm512_shuffle_f32x4(v[r], v[r + 8], 0x44),
                         _mm512_shuffle_f32x4(v[r], v[r + 8], 0xEE));
  }
  for (int r = 0; r < 4; ++r) {  // blocks: v[r], v[r+8], v[r+4], v[r+12]
    y[r] = _mm512_add_ps(_mm512_shuffle_f32x4(x[r], x[r + 4], 0x88),
                         _mm512_shuffle_f32x4(x[r], x[r + 4], 0xDD));
  }
  for (int r = 0; r < 2; ++r) {  // lanes {0,2} of a block: y[r]'s part, {1,3}: y[r+2]'s
    z[r] = _mm512_add_ps(_mm512_unpacklo_ps(y[r], y[r + 2]), _mm512_unpackhi_ps(y[r], y[r + 2]));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x44), _mm512_shuffle_ps(z[0], z[1], 0xEE));
}

}  // namespace llava
