#include "engine/model/autograd_ops.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>

#include "engine/kernels/cpu_ops.h"
#include "engine/model/llava_model.h"

namespace llava {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CausalSoftmaxFunction : public torch::autograd::Function<CausalSoftmaxFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& scores, double scale,
                            int64_t first_len) {
    const int64_t len = scores.size(-1), bn = scores.size(-2);
    at::Tensor p = scores.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    p.mul_(scale);
    float* pp = p.data_ptr<float>();
    for (int64_t blk = 0, blocks = p.numel() / (bn * len); blk < blocks; ++blk) {
      CausalSoftmaxRows(pp + blk * bn * len, bn, len, first_len);
    }
    ctx->save_for_backward({p});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["type"] = static_cast<int64_t>(scores.scalar_type());
    return p;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor p = ctx->get_saved_variables()[0];
    const auto type = static_cast<at::ScalarType>(ctx->saved_data["type"].toInt());
    at::Tensor g = grads[0].to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    const int64_t len = p.size(-1);
    SoftmaxBackwardRows(p.data_ptr<float>(), g.data_ptr<float>(), p.numel() / len, len,
                        static_cast<float>(ctx->saved_data["scale"].toDouble()));
    return {g.to(type), at::Tensor(), at::Tensor()};
  }
};

uint16_t* Bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
    at::Tensor y = at::empty({rows, f}, gate_up.options());
    SwiGluBf16(Bits(gate_up), Bits(y), rows, f);
    ctx->save_for_backward({gate_up});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor gate_up = ctx->get_saved_variables()[0];
    const at::Tensor dy = grads[0].to(at::kBFloat16).contiguous();
    at::Tensor d = at::empty_like(gate_up);
    SwiGluBackwardBf16(Bits(gate_up), Bits(dy), Bits(d), gate_up.size(0), gate_up.size(1) / 2);
    return {d};
  }
};

struct QuickGeluFunction : public torch::autograd::Function<QuickGeluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor y = at::empty_like(x);
    QuickGeluBf16(Bits(x), Bits(y), x.numel());
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor x = ctx->get_saved_variables()[0];
    at::Tensor d = grads[0].to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/true).contiguous();
    QuickGeluBackwardBf16(Bits(x), Bits(d), Bits(d), x.numel());
    return {d};
  }
};

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    const int64_t d = x.size(-1), rows = x.numel() / d;
    at::Tensor y = at::empty_like(x);
    at::Tensor inv = at::empty({rows}, x.options());  // 1 / rms per row, for the backward pass
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* ip = inv.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xp + r * d;
      float ss = 0.f;
      for (int64_t j = 0; j < d; ++j) ss += xr[j] * xr[j];
      ip[r] = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t j = 0; j < d; ++j) yp[r * d + j] = wp[j] * (xr[j] * ip[r]);
    }
    ctx->save_for_backward({x, weight, inv});
    return y;
  }

  // n = x * inv; dw = sum over rows of dy * n; dx = inv * (dy w - n * mean(dy w n)).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &inv = saved[2];
    const at::Tensor dy = grads[0].to(at::kFloat).contiguous();
    const int64_t d = x.size(-1), rows = x.numel() / d;
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw = at::zeros({d}, weight.options());
    const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
    const float *ip = inv.data_ptr<float>(), *gp = dy.data_ptr<float>();
    float *dxp = dx.data_ptr<float>(), *dwp = dw.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float *xr = xp + r * d, *gr = gp + r * d;
      float dot = 0.f;  // sum of dy w n
      for (int64_t j = 0; j < d; ++j) {
        const float n = xr[j] * ip[r];
        dwp[j] += gr[j] * n;
        dot += gr[j] * wp[j] * n;
      }
      const float mean = dot / static_cast<float>(d);
      for (int64_t j = 0; j < d; ++j) {
        dxp[r * d + j] = ip[r] * (gr[j] * wp[j] - xr[j] * ip[r] * mean);
      }
    }
    return {dx, dw, at::Tensor()};
  }
};

struct QkvRotaryFunction : public torch::autograd::Function<QkvRotaryFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
    const int64_t n = qkv.size(0), hd = cos.size(-1), width = qkv.size(1);
    at::Tensor q = at::empty({n, heads, hd}, qkv.options());
    at::Tensor k = at::empty({n, kv_heads, hd}, qkv.options());
    at::Tensor v = at::empty({n, kv_heads, hd}, qkv.options());
    const auto* xp = qkv.data_ptr<at::BFloat16>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    auto *qp = q.data_ptr<at::BFloat16>(), *kp = k.data_ptr<at::BFloat16>();
    auto* vp = v.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) {
      const at::BFloat16* row = xp + i * width;
      for (int64_t h = 0; h < heads; ++h) {
        RotateHeadRow(row + h * hd, cp + i * hd, sp + i * hd, qp + (i * heads + h) * hd, hd, 1.f);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        RotateHeadRow(row + (heads + h) * hd, cp + i * hd, sp + i * hd,
                      kp + (i * kv_heads + h) * hd, hd, 1.f);
      }
      std::copy(row + (heads + kv_heads) * hd, row + width, vp + i * kv_heads * hd);
    }
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["kv_heads"] = kv_heads;
    return {q, k, v};
  }

  // The rotation is orthogonal: its backward applies the transpose (sin negated).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &cos = saved[0], &sin = saved[1];
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const int64_t kv_heads = ctx->saved_data["kv_heads"].toInt();
    const int64_t hd = cos.size(-1), n = cos.size(0), width = (heads + 2 * kv_heads) * hd;
    at::Tensor d = at::zeros({n, width}, at::TensorOptions(at::kBFloat16));
    auto* dp = d.data_ptr<at::BFloat16>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t counts[3] = {heads, kv_heads, kv_heads}, first[3] = {0, heads, heads + kv_heads};
    for (int part = 0; part < 3; ++part) {
      if (!grads[part].defined()) continue;
      const at::Tensor g = grads[part].to(at::kBFloat16).contiguous();
      const auto* gp = g.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t h = 0; h < counts[part]; ++h) {
          const at::BFloat16* from = gp + (i * counts[part] + h) * hd;
          at::BFloat16* to = dp + i * width + (first[part] + h) * hd;
          if (part == 2) {
            std::copy(from, from + hd, to);
          } else {
            RotateHeadRow(from, cp + i * hd, sp + i * hd, to, hd, -1.f);
          }
        }
      }
    }
    return {d, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor TrainQuickGelu(const at::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "TrainQuickGelu: needs a contiguous CPU bf16 tensor");
  return QuickGeluFunction::apply(x);
}

at::Tensor TrainRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x.size(-1),
              "TrainRmsNorm: needs contiguous CPU fp32 x [N, D] and weight [D]");
  return RmsNormFunction::apply(x, weight, eps);
}

std::vector<at::Tensor> TrainQkvRotary(const at::Tensor& qkv, const at::Tensor& cos,
                                       const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  const int64_t hd = cos.size(-1);
  TORCH_CHECK(qkv.is_cpu() && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() &&
                  qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * hd &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == qkv.size(0) &&
                  sin.sizes() == cos.sizes() && hd % 2 == 0,
              "TrainQkvRotary: needs contiguous CPU bf16 qkv [N, (H + 2 Hkv) hd] and fp32 "
              "cos / sin [N, 1, hd]");
  return QkvRotaryFunction::apply(qkv, cos, sin, heads, kv_heads);
}

at::Tensor TrainSwiGlu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_cpu() && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "TrainSwiGlu: needs a contiguous CPU bf16 [N, 2F] tensor");
  return SwiGluFunction::apply(gate_up);
}

at::Tensor TrainCausalSoftmax(const at::Tensor& scores, double scale, int64_t first_len) {
  return CausalSoftmaxFunction::apply(scores, scale, first_len);
}

}  // namespace llava
