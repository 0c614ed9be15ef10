#include "engine/decode_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace llava {
namespace {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  const uint32_t u = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One query head against one cache: scores (softmax probabilities on return) in `p` [len],
// the weighted sum of values in `out` [hd]. fp32 arithmetic throughout.
template <typename KV>
inline __attribute__((always_inline)) void Head(const float* q, const KV* k, int64_t k_stride,
                                                const KV* v, int64_t v_stride, int64_t len,
                                                int64_t hd, float scale, float* p, float* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < len; ++j) {
    const KV* kj = k + j * k_stride;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < hd; ++d) acc += q[d] * ToFloat(kj[d]);
    p[j] = acc * scale;
    max = std::max(max, p[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < len; ++j) {
    p[j] = std::exp(p[j] - max);
    sum += p[j];
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < len; ++j) {
    p[j] *= inv;
    const float pj = p[j];
    const KV* vj = v + j * v_stride;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) out[d] += pj * ToFloat(vj[d]);
  }
}

// Compiled for AVX-512, AVX2 and baseline x86-64; the loader picks one for this CPU.
__attribute__((target_clones("avx512f", "avx2", "default"))) void HeadF32(
    const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t len, int64_t hd,
    float scale, float* p, float* out) {
  Head(q, k, ks, v, vs, len, hd, scale, p, out);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void HeadBf16(
    const float* q, const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t len,
    int64_t hd, float scale, float* p, float* out) {
  Head(q, k, ks, v, vs, len, hd, scale, p, out);
}

}  // namespace

at::Tensor DecodeAttention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values,
                           const std::vector<bool>& want_probs, std::vector<at::Tensor>* probs) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu(), "DecodeAttention: q must be [B, H, hd] on CPU");
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
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
                    k.device().is_cpu() && k.size(1) > 0,
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
  at::parallel_for(0, batch * heads, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / heads, h = u % heads;
      const at::Tensor& k = keys[b];
      const at::Tensor& v = values[b];
      const int64_t kv_head = h / (heads / k.size(0)), len = k.size(1);
      float* p;
      if (probs != nullptr && want_probs[b]) {
        p = (*probs)[b].data_ptr<float>() + h * len;
      } else {
        scratch.resize(len);
        p = scratch.data();
      }
      const float* qh = qp + u * hd;
      float* oh = op + u * hd;
      if (k.scalar_type() == at::kFloat) {
        HeadF32(qh, k.data_ptr<float>() + kv_head * k.stride(0), k.stride(1),
                v.data_ptr<float>() + kv_head * v.stride(0), v.stride(1), len, hd, scale, p, oh);
      } else {
        const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
        const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
        HeadBf16(qh, kp + kv_head * k.stride(0), k.stride(1), vp + kv_head * v.stride(0),
                 v.stride(1), len, hd, scale, p, oh);
      }
    }
  });
  return out.view({batch, heads * hd}).to(q.scalar_type());
}

}  // namespace llava
