// The trainer's fused autograd ops (engine/model/autograd_ops.h) against ATen's composite of
// the same maths, forward and backward, in fp32 and bf16. On every CPU path (the ctest
// engine_tests.cpu_path_* runs force the portable loops too).
#include "engine/model/autograd_ops.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "engine/model/llava_model.h"

namespace llava {
namespace {

// The largest difference relative to the reference's largest entry.
double RelMaxDiff(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>() /
         want.to(at::kFloat).abs().max().item<double>();
}

// scale * scores, masked causally for a block of the last `bn` rows of a cache of `len`, then
// softmax, by ATen's ops.
at::Tensor ReferenceCausalSoftmax(const at::Tensor& scores, double scale, int64_t first_len) {
  const int64_t bn = scores.size(-2), len = scores.size(-1);
  at::Tensor rows = at::arange(bn, at::kLong).unsqueeze(1) + first_len;  // first hidden column
  at::Tensor cols = at::arange(len, at::kLong).unsqueeze(0);
  at::Tensor s = (scores.to(at::kFloat) * scale)
                     .masked_fill(cols >= rows, -std::numeric_limits<float>::infinity());
  return at::softmax(s, -1);
}

TEST(TrainOps, CausalSoftmaxMatchesATenForwardAndBackward) {
  at::manual_seed(4);
  for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    // [Hkv, G, bn, L]; lengths around the 16-lane width; the block's rows see 5.. of 21 columns.
    for (int64_t len : {7, 16, 21, 40}) {
      const int64_t bn = 5, first_len = len - bn + 1;
      at::Tensor base = (at::randn({2, 3, bn, len}) * 4).to(type);
      at::Tensor w = at::randn({2, 3, bn, len});  // the loss: sum(w * probs)
      at::Tensor a = base.clone().requires_grad_(true), b = base.clone().requires_grad_(true);
      at::Tensor got = TrainCausalSoftmax(a, 0.125, first_len);
      at::Tensor want = ReferenceCausalSoftmax(b, 0.125, first_len);
      ASSERT_EQ(got.scalar_type(), at::kFloat);
      EXPECT_LT(RelMaxDiff(got, want), 1e-6) << len;
      // The masked entries are exactly 0 (the cache policies add these probabilities up).
      EXPECT_EQ(got.index({"...", 0, at::indexing::Slice(first_len, at::indexing::None)})
                    .abs()
                    .sum()
                    .item<double>(),
                0.0);
      (got * w).sum().backward();
      (want * w).sum().backward();
      ASSERT_EQ(a.grad().scalar_type(), type);
      const double tol = type == at::kFloat ? 1e-5 : 1.0 / 64;  // the bf16 gradient's rounding
      EXPECT_LT(RelMaxDiff(a.grad(), b.grad()), tol) << len << " " << type;
    }
  }
}

TEST(TrainOps, SwiGluMatchesATenForwardAndBackward) {
  at::manual_seed(5);
  for (int64_t f : {1, 16, 37, 688}) {
    at::Tensor base = (at::randn({9, 2 * f}) * 3).to(at::kBFloat16);
    at::Tensor w = at::randn({9, f});
    at::Tensor a = base.clone().requires_grad_(true);
    at::Tensor b = base.to(at::kFloat).requires_grad_(true);  // the reference in fp32
    at::Tensor got = TrainSwiGlu(a);
    at::Tensor want = at::silu(b.narrow(1, 0, f)) * b.narrow(1, f, f);
    ASSERT_EQ(got.scalar_type(), at::kBFloat16);
    // One bf16 rounding of the fp32 value: 2^-8 relative, plus a little absolute near 0.
    EXPECT_TRUE(at::allclose(got.to(at::kFloat), want, 1.0 / 128, 1e-3)) << f;
    (got.to(at::kFloat) * w).sum().backward();
    (want * w).sum().backward();
    ASSERT_EQ(a.grad().scalar_type(), at::kBFloat16);
    // The incoming gradient is rounded to bf16 as well, then the result once more.
    EXPECT_LT(RelMaxDiff(a.grad(), b.grad()), 1.0 / 64) << f;
  }
}

TEST(TrainOps, QuickGeluMatchesATenForwardAndBackward) {
  at::manual_seed(8);
  for (int64_t n : {1, 16, 45, 1000}) {
    at::Tensor base = (at::randn({n}) * 4).to(at::kBFloat16);
    at::Tensor w = at::randn({n});
    at::Tensor a = base.clone().requires_grad_(true);
    at::Tensor b = base.to(at::kFloat).requires_grad_(true);
    at::Tensor got = TrainQuickGelu(a);
    at::Tensor want = b * at::sigmoid(1.702 * b);
    EXPECT_TRUE(at::allclose(got.to(at::kFloat), want, 1.0 / 128, 1e-3)) << n;
    (got.to(at::kFloat) * w).sum().backward();
    (want * w).sum().backward();
    EXPECT_LT(RelMaxDiff(a.grad(), b.grad()), 1.0 / 64) << n;
  }
}

TEST(TrainOps, RmsNormMatchesATenForwardAndBackward) {
  at::manual_seed(6);
  for (int64_t d : {7, 33, 256}) {
    at::Tensor base = at::randn({11, d}) * 3;
    at::Tensor wbase = at::randn({d});
    at::Tensor w = at::randn({11, d});
    at::Tensor x1 = base.clone().requires_grad_(true), x2 = base.clone().requires_grad_(true);
    at::Tensor g1 = wbase.clone().requires_grad_(true), g2 = wbase.clone().requires_grad_(true);
    at::Tensor got = TrainRmsNorm(x1, g1, 1e-5);
    at::Tensor want = g2 * (x2 * at::rsqrt(x2.pow(2).mean(-1, true) + 1e-5));
    EXPECT_LT(RelMaxDiff(got, want), 1e-6) << d;
    (got * w).sum().backward();
    (want * w).sum().backward();
    EXPECT_LT(RelMaxDiff(x1.grad(), x2.grad()), 1e-5) << d;
    EXPECT_LT(RelMaxDiff(g1.grad(), g2.grad()), 1e-5) << d;
  }
}

TEST(TrainOps, QkvRotaryMatchesTheComposite) {
  at::manual_seed(7);
  const int64_t n = 9, heads = 4, kv_heads = 2, hd = 16;
  at::Tensor base = at::randn({n, (heads + 2 * kv_heads) * hd}).to(at::kBFloat16);
  const at::Tensor inv_freq =
      1.0 / at::pow(10000.0, at::arange(0, hd, 2, at::kFloat) / static_cast<double>(hd));
  const RotaryTable table = MakeRotaryTable(at::arange(3, 3 + n, at::kLong), inv_freq);
  at::Tensor a = base.clone().requires_grad_(true), b = base.clone().requires_grad_(true);
  const std::vector<at::Tensor> got = TrainQkvRotary(a, table.cos, table.sin, heads, kv_heads);
  // The model's composite (ApplyRotary takes ATen's ops for a tensor that requires grad).
  const std::vector<at::Tensor> want = {
      ApplyRotary(b.narrow(1, 0, heads * hd).view({n, heads, hd}), table),
      ApplyRotary(b.narrow(1, heads * hd, kv_heads * hd).view({n, kv_heads, hd}), table),
      b.narrow(1, (heads + kv_heads) * hd, kv_heads * hd).view({n, kv_heads, hd})};
  at::Tensor loss_a = at::zeros({}), loss_b = at::zeros({});
  for (int part = 0; part < 3; ++part) {
    ASSERT_EQ(got[part].sizes(), want[part].sizes()) << part;
    // The same fp32 arithmetic and one bf16 rounding: equal up to a rounding tie at most.
    EXPECT_LT(RelMaxDiff(got[part], want[part]), 1.0 / 256) << part;
    at::Tensor w = at::randn(want[part].sizes());
    loss_a = loss_a + (got[part].to(at::kFloat) * w).sum();
    loss_b = loss_b + (want[part].to(at::kFloat) * w).sum();
  }
  loss_a.backward();
  loss_b.backward();
  EXPECT_LT(RelMaxDiff(a.grad(), b.grad()), 1.0 / 256);
  // Only the rotation part: a gradient of v alone passes through unchanged, in v's columns.
  at::Tensor c = base.clone().requires_grad_(true);
  at::Tensor wv = at::randn({n, kv_heads, hd});
  (TrainQkvRotary(c, table.cos, table.sin, heads, kv_heads)[2].to(at::kFloat) * wv)
      .sum()
      .backward();
  EXPECT_EQ(c.grad().narrow(1, 0, (heads + kv_heads) * hd).abs().sum().item<double>(), 0.0);
  EXPECT_LT(RelMaxDiff(c.grad().narrow(1, (heads + kv_heads) * hd, kv_heads * hd),
                       wv.reshape({n, kv_heads * hd})),
            1.0 / 256);
}

}  // namespace
}  // namespace llava
