// Fused ops for the model's forward pass under autograd (llava-train): one pass forward and one
// backward each, where ATen's composite of the same maths runs a chain of element-wise ops with
// their temporaries and saved tensors. The serving path does not use them (outside autograd the
// model has its own fused loops, llava_model.cc), so the results it serves do not change.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace llava {

// softmax(scale * scores) over the last dimension with a query block's causal mask: scores
// [..., bn, L] (CPU, any float type), row r of each block sees its first min(L, first_len + r)
// entries. Returns fp32 probabilities, masked entries exactly 0; differentiable in scores (the
// gradient has scores' type).
at::Tensor TrainCausalSoftmax(const at::Tensor& scores, double scale, int64_t first_len);

// silu(gate) * up for gate_up [N, 2F] = [gate | up] (CPU, bf16, contiguous, as a fused gate/up
// projection returns it under autocast) -> [N, F] bf16; differentiable in gate_up.
at::Tensor TrainSwiGlu(const at::Tensor& gate_up);

// CLIP's quick GELU, x * sigmoid(1.702 x), for a contiguous CPU bf16 x; differentiable.
at::Tensor TrainQuickGelu(const at::Tensor& x);

// weight * x / sqrt(mean(x^2) + eps) over the last dimension, for fp32 x [N, D] and weight [D]
// (the residual stream and the norm's master weights under autocast); differentiable in both.
at::Tensor TrainRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The fused q/k/v projection's output qkv [N, (H + 2 Hkv) hd] (CPU, bf16, contiguous) split into
// q [N, H, hd] and k [N, Hkv, hd], both rotated by the table cos / sin [N, 1, hd] (fp32; the
// rotate-half convention of ApplyRotary), and v [N, Hkv, hd]: three contiguous bf16 tensors,
// differentiable in qkv, whose gradient is written in one pass.
std::vector<at::Tensor> TrainQkvRotary(const at::Tensor& qkv, const at::Tensor& cos,
                                       const at::Tensor& sin, int64_t heads, int64_t kv_heads);

}  // namespace llava
