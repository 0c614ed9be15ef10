#include "engine/decode_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "engine/cpu_gemv.h"

namespace llava {
namespace {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) { return Bf16ToFloat(bf16); }

constexpr int64_t kMaxHeadDim = 256;

// Softmax of each of the `rows` rows of `p` [rows, len], in place.
void SoftmaxRows(float* p, int64_t rows, int64_t len) {
  for (int64_t i = 0; i < rows; ++i) {
    float* pi = p + i * len;
    float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t j = 0; j < len; ++j) max = std::max(max, pi[j]);
    for (int64_t j = 0; j < len; ++j) sum += (pi[j] = std::exp(pi[j] - max));
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < len; ++j) pi[j] *= inv;
  }
}

// The `g` query heads that share one KV head against one cache: scores (softmax probabilities
// on return) in `p` [g, len], the weighted sums of values in `out` [g, hd]. Each key and value
// row is converted to fp32 once for the whole group. fp32 arithmetic throughout.
template <typename KV>
inline __attribute__((always_inline)) void Group(const float* q, int64_t g, const KV* k,
                                                 int64_t k_stride, const KV* v, int64_t v_stride,
                                                 int64_t len, int64_t hd, float scale, float* p,
                                                 float* out) {
  float row[kMaxHeadDim];
  for (int64_t j = 0; j < len; ++j) {
    const KV* kj = k + j * k_stride;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) row[d] = ToFloat(kj[d]);
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = q + i * hd;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < hd; ++d) acc += qi[d] * row[d];
      p[i * len + j] = acc * scale;
    }
  }
  SoftmaxRows(p, g, len);
  for (int64_t d = 0; d < g * hd; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < len; ++j) {
    const KV* vj = v + j * v_stride;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) row[d] = ToFloat(vj[d]);
    for (int64_t i = 0; i < g; ++i) {
      const float pij = p[i * len + j];
      float* oi = out + i * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) oi[d] += pij * row[d];
    }
  }
}

// Compiled for AVX-512, AVX2 and baseline x86-64; the loader picks one for this CPU.
__attribute__((target_clones("avx512f", "avx2", "default"))) void GroupF32(
    const float* q, int64_t g, const float* k, int64_t ks, const float* v, int64_t vs, int64_t len,
    int64_t hd, float scale, float* p, float* out) {
  Group(q, g, k, ks, v, vs, len, hd, scale, p, out);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void GroupBf16(
    const float* q, int64_t g, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs,
    int64_t len, int64_t hd, float scale, float* p, float* out) {
  Group(q, g, k, ks, v, vs, len, hd, scale, p, out);
}

// The same computation with AVX-512 intrinsics for head sizes that are a multiple of 16 (64 and
// 128 in LLaMA models): GCC's vectorisation of the loops above ends every dot product with 16
// dependent scalar adds, which made them the largest single cost of a decode step.
__attribute__((target("avx512f"))) inline __m512 Load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 Load16(const uint16_t* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename KV>
__attribute__((target("avx512f"))) void GroupAvx512(const float* q, int64_t g, const KV* k,
                                                    int64_t k_stride, const KV* v, int64_t v_stride,
                                                    int64_t len, int64_t hd, float scale, float* p,
                                                    float* out) {
  const int64_t chunks = hd / 16;  // <= kMaxHeadDim / 16
  __m512 row[kMaxHeadDim / 16];
  for (int64_t j = 0; j < len; ++j) {
    const KV* kj = k + j * k_stride;
    for (int64_t c = 0; c < chunks; ++c) row[c] = Load16(kj + 16 * c);
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = q + i * hd;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), row[0]);
      for (int64_t c = 1; c < chunks; ++c) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), row[c], acc);
      }
      p[i * len + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  SoftmaxRows(p, g, len);
  for (int64_t d = 0; d < g * hd; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < len; ++j) {
    const KV* vj = v + j * v_stride;
    for (int64_t c = 0; c < chunks; ++c) row[c] = Load16(vj + 16 * c);
    for (int64_t i = 0; i < g; ++i) {
      const __m512 pij = _mm512_set1_ps(p[i * len + j]);
      float* oi = out + i * hd;
      for (int64_t c = 0; c < chunks; ++c) {
        _mm512_storeu_ps(oi + 16 * c, _mm512_fmadd_ps(pij, row[c], _mm512_loadu_ps(oi + 16 * c)));
      }
    }
  }
}

}  // namespace

at::Tensor DecodeAttention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values,
                           const std::vector<bool>& want_probs, std::vector<at::Tensor>* probs) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.size(2) <= kMaxHeadDim,
              "DecodeAttention: q must be [B, H, hd <= 256] on CPU");
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  TORCH_CHECK(batch > 0, "DecodeAttention: no sequences");
  TORCH_CHECK(
      static_cast<int64_t>(keys.size()) == batch && static_cast<int64_t>(values.size()) == batch,
      "DecodeAttention: one key and value tensor per sequence");
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor& k = keys[b];
    const at::Tensor& v = values[b];
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(2) == hd &&
                    heads % k.size(0) == 0 && k.stride(2) == 1 && v.stride(2) == 1 &&
                    k.scalar_type() == v.scalar_type() &&
                    (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                    k.size(0) == keys[0].size(0) && k.device().is_cpu() && k.size(1) > 0,
                "DecodeAttention: sequence ", b, " has keys ", k.sizes(), " / values ", v.sizes(),
                " that do not fit q ", q.sizes());
  }
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({batch, heads, hd}, qf.options());
  if (probs != nullptr) {
    probs->assign(batch, at::Tensor());
    for (int64_t b = 0; b < batch; ++b) {
      if (want_probs[b]) (*probs)[b] = at::empty({heads, 1, keys[b].size(1)}, qf.options());
    }
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  static const bool use_avx512 = __builtin_cpu_supports("avx512f");
  // One unit of work: a sequence's KV head and the query heads that read it.
  const int64_t kv_heads = keys[0].size(0), group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / kv_heads, kv = u % kv_heads;
      const at::Tensor& k = keys[b];
      const at::Tensor& v = values[b];
      const int64_t len = k.size(1);
      float* p;
      if (probs != nullptr && want_probs[b]) {
        p = (*probs)[b].data_ptr<float>() + kv * group * len;
      } else {
        scratch.resize(group * len);
        p = scratch.data();
      }
      const int64_t first = b * heads + kv * group;  // row of the group's first query head
      const float* qh = qp + first * hd;
      float* oh = op + first * hd;
      const bool avx512 = use_avx512 && hd % 16 == 0;
      if (k.scalar_type() == at::kFloat && avx512) {
        GroupAvx512(qh, group, k.data_ptr<float>() + kv * k.stride(0), k.stride(1),
                    v.data_ptr<float>() + kv * v.stride(0), v.stride(1), len, hd, scale, p, oh);
      } else if (k.scalar_type() == at::kFloat) {
        GroupF32(qh, group, k.data_ptr<float>() + kv * k.stride(0), k.stride(1),
                 v.data_ptr<float>() + kv * v.stride(0), v.stride(1), len, hd, scale, p, oh);
      } else {
        const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
        const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
        if (avx512) {
          GroupAvx512(qh, group, kp + kv * k.stride(0), k.stride(1), vp + kv * v.stride(0),
                      v.stride(1), len, hd, scale, p, oh);
        } else {
          GroupBf16(qh, group, kp + kv * k.stride(0), k.stride(1), vp + kv * v.stride(0),
                    v.stride(1), len, hd, scale, p, oh);
        }
      }
    }
  });
  return out.view({batch, heads * hd}).to(q.scalar_type());
}

}  // namespace llava
