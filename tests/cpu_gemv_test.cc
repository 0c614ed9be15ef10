// The CPU kernels (cpu_gemv.h, cpu_ops.h) against ATen in fp32 on the same inputs.
#include "engine/kernels/cpu_gemv.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <tuple>
#include <vector>

#include "engine/kernels/cpu_features.h"
#include "engine/kernels/cpu_ops.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"

namespace llava {
namespace {

// Every kernel path this CPU can run: a better CPU also tests the lower paths.
std::vector<CpuPath> RunnablePaths() {
  std::vector<CpuPath> out;
  for (CpuPath p : {CpuPath::kGeneric, CpuPath::kAvx2, CpuPath::kAvx512, CpuPath::kAvx512Bf16}) {
    if (p <= DetectedCpuPath()) out.push_back(p);
  }
  return out;
}

TEST(CpuFeatures, NamesRoundTripAndRequestsAreClampedToTheCpu) {
  for (CpuPath p : {CpuPath::kGeneric, CpuPath::kAvx2, CpuPath::kAvx512, CpuPath::kAvx512Bf16}) {
    CpuPath back;
    ASSERT_TRUE(ParseCpuPath(CpuPathName(p), &back));
    EXPECT_EQ(back, p);
  }
  CpuPath unused;
  EXPECT_FALSE(ParseCpuPath("avx512_bf16", &unused));
  EXPECT_FALSE(ParseCpuPath("", &unused));
  EXPECT_EQ(ClampCpuPath(CpuPath::kAvx512Bf16, CpuPath::kAvx2), CpuPath::kAvx2);
  EXPECT_EQ(ClampCpuPath(CpuPath::kGeneric, CpuPath::kAvx512Bf16), CpuPath::kGeneric);
  EXPECT_LE(ActiveCpuPath(), DetectedCpuPath());
  // Under LLAVA_CPU_PATH (the CI's runs of these tests on each lower path) the active path is
  // the one asked for, when this CPU has it.
  // Under emulation (tests/CMakeLists.txt: QEMU's Haswell) the CPU must be seen as it is.
  if (const char* expected = std::getenv("LLAVA_EXPECT_DETECTED_CPU_PATH")) {
    EXPECT_STREQ(CpuPathName(DetectedCpuPath()), expected);
  }
  const char* env = std::getenv("LLAVA_CPU_PATH");
  if (env != nullptr && *env != '\0') {
    CpuPath want;
    ASSERT_TRUE(ParseCpuPath(env, &want)) << env;
    EXPECT_EQ(ActiveCpuPath(), ClampCpuPath(want, DetectedCpuPath()));
  }
}

TEST(CpuFeatures, AutoDTypeFollowsTheDeviceThePathAndTheModelSize) {
  const int64_t small = kAutoF32MaxParameters, large = kAutoF32MaxParameters + 1;
  auto resolve = [](const std::string& name, const std::string& device, CpuPath path,
                    int64_t parameters) {
    DType d = DType::kF16;  // neither answer: the call must set it
    std::string why;
    EXPECT_TRUE(ResolveDType(name, device, path, parameters, &d, &why)) << name;
    EXPECT_FALSE(why.empty());
    return d;
  };
  for (CpuPath p : {CpuPath::kGeneric, CpuPath::kAvx2, CpuPath::kAvx512, CpuPath::kAvx512Bf16}) {
    EXPECT_EQ(resolve("bf16", "cpu", p, small), DType::kBF16);
    EXPECT_EQ(resolve("f32", "cpu", p, large), DType::kF32);
    EXPECT_EQ(resolve("auto", "cuda:1", p, small), DType::kBF16);
  }
  // Native bf16 products: bf16 whatever the size.
  EXPECT_EQ(resolve("auto", "cpu", CpuPath::kAvx512Bf16, 1000), DType::kBF16);
  // Widening paths: fp32 for a model that stays in the caches, bf16 when the size is unknown.
  for (CpuPath p : {CpuPath::kAvx2, CpuPath::kAvx512}) {
    EXPECT_EQ(resolve("auto", "cpu", p, small), DType::kF32);
    EXPECT_EQ(resolve("auto", "cpu", p, large), DType::kBF16);
    EXPECT_EQ(resolve("auto", "cpu", p, -1), DType::kBF16);
  }
  EXPECT_EQ(resolve("auto", "cpu", CpuPath::kGeneric, large), DType::kF32);
  DType d;
  EXPECT_FALSE(ResolveDType("fp16", "cpu", CpuPath::kAvx2, small, &d, nullptr));
}

// [n, k] of the GEMV tests: k not a multiple of 32 or 8 (688: the default model's FFN; 7, 100)
// takes the tails, 4099 rows a partial last tile.
const std::vector<std::pair<int64_t, int64_t>> kGemvShapes = {{37, 64},  {4099, 96}, {64, 4096},
                                                              {40, 688}, {5, 7},     {19, 100}};

// Every row count a single kernel instance handles, then counts that run in passes (9 = 4 + 5,
// 17 = 5 + 6 + 6, 64 = 8 x 8).
std::vector<int64_t> GemvRowCounts() {
  std::vector<int64_t> out;
  for (int64_t m = 1; m <= kGemvMaxRows; ++m) out.push_back(m);
  for (int64_t m : {9, 13, 16, 17, 32, 64}) out.push_back(m);
  return out;
}

TEST(GemvMaxRows, PassesWhereTheKernelWidensAndEightWhereABetterProductTakesOver) {
  for (CpuPath p : RunnablePaths()) {
    const bool widening = p == CpuPath::kAvx2 || p == CpuPath::kAvx512;
    EXPECT_EQ(GemvMaxRows(true, p), widening ? kStreamedMaxRows : kGemvMaxRows) << CpuPathName(p);
    EXPECT_EQ(GemvMaxRows(false, p), p == CpuPath::kGeneric ? kGemvMaxRows : kStreamedMaxRows)
        << CpuPathName(p);
  }
}

TEST(Bf16Gemv, MatchesFp32ReferenceForEveryRowCountOnEveryPath) {
  InitTorchThreads(2);
  at::manual_seed(0);
  for (CpuPath path : RunnablePaths()) {
    for (int64_t m : GemvRowCounts()) {
      for (auto [n, k] : kGemvShapes) {
        at::Tensor x = at::randn({m, k}).to(at::kBFloat16);
        at::Tensor w = (at::randn({n, k}) * 0.1).to(at::kBFloat16);
        at::Tensor b = at::randn({n}).to(at::kBFloat16);
        for (bool with_bias : {false, true}) {
          at::Tensor y = at::empty({m, n}, at::kBFloat16);
          Bf16Gemv(static_cast<const uint16_t*>(x.data_ptr()),
                   static_cast<const uint16_t*>(w.data_ptr()),
                   with_bias ? static_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                   static_cast<uint16_t*>(y.data_ptr()), m, n, k, path);
          at::Tensor ref = at::linear(x.to(at::kFloat), w.to(at::kFloat),
                                      with_bias ? b.to(at::kFloat) : at::Tensor());
          // bf16 output rounding: relative error below 2^-8 of the row scale.
          const double err = (y.to(at::kFloat) - ref).abs().max().item<double>();
          EXPECT_LT(err, ref.abs().max().item<double>() / 128)
              << CpuPathName(path) << " m=" << m << " n=" << n << " k=" << k;
        }
      }
    }
  }
}

// The fp32 kernel (fp32 models' decode rows) in the same shapes: only the summation order
// differs from ATen's, so the error is a few fp32 ulps of the row's magnitude.
TEST(F32Gemv, MatchesATenForEveryRowCountOnEveryPath) {
  InitTorchThreads(2);
  at::manual_seed(1);
  for (CpuPath path : RunnablePaths()) {
    for (int64_t m : GemvRowCounts()) {
      for (auto [n, k] : kGemvShapes) {
        at::Tensor x = at::randn({m, k}), w = at::randn({n, k}) * 0.1, b = at::randn({n});
        for (bool with_bias : {false, true}) {
          at::Tensor y = at::empty({m, n});
          F32Gemv(x.data_ptr<float>(), w.data_ptr<float>(),
                  with_bias ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), m, n, k, path);
          at::Tensor ref = at::linear(x.to(at::kDouble), w.to(at::kDouble),
                                      with_bias ? b.to(at::kDouble) : at::Tensor());
          const double err = (y.to(at::kDouble) - ref).abs().max().item<double>();
          const double scale =
              (x.abs().to(at::kDouble).matmul(w.abs().to(at::kDouble).t())).max().item<double>();
          EXPECT_LT(err, scale * 1e-5)
              << CpuPathName(path) << " m=" << m << " n=" << n << " k=" << k;
        }
      }
    }
  }
}

// The prefill product of the paths without AVX512-BF16 (bf16 weights widened a panel at a
// time) and of fp32 models, with a width that is not a multiple of the panel and a bias.
TEST(PanelLinear, MatchesFp32Reference) {
  InitTorchThreads(2);
  at::manual_seed(4);
  const int64_t k = 96, n = kLinearPanelFloats / k * 2 + 37;  // two full panels and a part
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    at::Tensor x = at::randn({21, k}).to(dtype);
    at::Tensor w = (at::randn({n, k}) * 0.1).to(dtype);
    at::Tensor b = at::randn({n}).to(dtype);
    for (bool with_bias : {false, true}) {
      at::Tensor y = PanelLinear(x, w, with_bias ? b : at::Tensor());
      at::Tensor ref = at::linear(x.to(at::kFloat), w.to(at::kFloat),
                                  with_bias ? b.to(at::kFloat) : at::Tensor());
      ASSERT_EQ(y.sizes(), ref.sizes());
      EXPECT_EQ(y.scalar_type(), dtype);
      const double tol = dtype == at::kFloat ? 1e-4 : ref.abs().max().item<double>() / 128;
      EXPECT_LT((y.to(at::kFloat) - ref).abs().max().item<double>(), tol) << with_bias;
    }
  }
}

// Rows longer than kLinearChunkColumns are multiplied a chunk of columns at a time, the chunks'
// products summed: every chunk, the uneven last one included, must count once.
TEST(PanelLinear, LongRowsAddEveryChunk) {
  InitTorchThreads(2);
  at::manual_seed(5);
  for (int64_t k : {kLinearChunkColumns + 1, 2 * kLinearChunkColumns + 40}) {
    for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
      at::Tensor x = at::randn({9, k}).to(dtype);
      at::Tensor w = (at::randn({37, k}) * 0.05).to(dtype);
      at::Tensor b = at::randn({37}).to(dtype);
      at::Tensor y = PanelLinear(x, w, b);
      at::Tensor ref = at::linear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat));
      const double tol = dtype == at::kFloat ? 1e-3 : ref.abs().max().item<double>() / 128;
      EXPECT_LT((y.to(at::kFloat) - ref).abs().max().item<double>(), tol) << "k=" << k;
    }
  }
}

// Each thread keeps its widened panel and its panel of outputs between calls: a call after a
// larger or smaller one must not see the other's values, and a result must not share memory
// with those buffers (the next call would overwrite it).
TEST(PanelLinear, BuffersKeptBetweenCallsLeaveNoTrace) {
  InitTorchThreads(2);
  at::manual_seed(6);
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    std::vector<at::Tensor> ys, refs;
    for (auto [rows, n, k] : {std::tuple<int64_t, int64_t, int64_t>{33, 300, 200},
                              {5, 40, 24},
                              {17, 301, 199},
                              {33, 300, 200}}) {
      at::Tensor x = at::randn({rows, k}).to(dtype);
      at::Tensor w = (at::randn({n, k}) * 0.1).to(dtype);
      at::Tensor b = at::randn({n}).to(dtype);
      ys.push_back(PanelLinear(x, w, b));
      refs.push_back(at::linear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat)));
    }
    for (size_t i = 0; i < ys.size(); ++i) {  // after every call
      const double tol = dtype == at::kFloat ? 1e-4 : refs[i].abs().max().item<double>() / 128;
      EXPECT_LT((ys[i].to(at::kFloat) - refs[i]).abs().max().item<double>(), tol) << i;
    }
  }
}

TEST(Bf16Gemv, LinearDispatchesEveryRowCount) {
  InitTorchThreads(2);
  at::manual_seed(1);
  Linear lin{(at::randn({48, 64}) * 0.1).to(at::kBFloat16), at::randn({48}).to(at::kBFloat16)};
  for (int64_t rows : {1, 3, 8, 9, 40}) {  // 9 and 40: oneDNN or PanelLinear
    at::Tensor x = at::randn({rows, 64}).to(at::kBFloat16);
    at::Tensor ref =
        at::linear(x.to(at::kFloat), lin.weight.to(at::kFloat), lin.bias.to(at::kFloat));
    at::Tensor y = lin(x);
    ASSERT_EQ(y.sizes(), ref.sizes());
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_LT((y.to(at::kFloat) - ref).abs().max().item<double>(),
              ref.abs().max().item<double>() / 64)
        << rows;
  }
}

TEST(F32Gemv, LinearDispatchesEveryRowCount) {
  InitTorchThreads(2);
  at::manual_seed(2);
  Linear lin{at::randn({48, 64}) * 0.1, at::randn({48})};
  for (int64_t rows : {1, 3, 8, 9, 40}) {  // 9 and 40: PanelLinear
    at::Tensor x = at::randn({rows, 64});
    at::Tensor ref = at::linear(x, lin.weight, lin.bias);
    at::Tensor y = lin(x.view({1, rows, 64}));
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{1, rows, 48}));
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    EXPECT_LT((y[0] - ref).abs().max().item<double>(), 1e-4) << rows;
  }
}

// Under autograd (the trainer) the product must stay differentiable: at::linear. (Not in the
// forced-path runs of tests/CMakeLists.txt: ATen's bf16 backward is outside the CPU paths.)
TEST(LinearAutograd, Bf16WeightsStayDifferentiable) {
  InitTorchThreads(2);
  at::manual_seed(1);
  Linear lin{(at::randn({48, 64}) * 0.1).to(at::kBFloat16), at::randn({48}).to(at::kBFloat16)};
  Linear trained{lin.weight.clone().requires_grad_(true), lin.bias};
  at::Tensor y = trained(at::randn({2, 64}).to(at::kBFloat16));
  ASSERT_TRUE(y.requires_grad());
  y.to(at::kFloat).sum().backward();
  ASSERT_TRUE(trained.weight.grad().defined());
}

TEST(CpuOps, SoftmaxRowsMatchesATen) {
  at::manual_seed(2);
  // Lengths around the 16-lane vector width; large and very negative logits (exp underflow).
  for (int64_t len : {1, 5, 16, 17, 145, 300}) {
    at::Tensor x = at::randn({3, len}) * 20;
    x[1].fill_(0);
    x[2][0] = -1e4;
    at::Tensor want = at::softmax(x, -1);
    for (CpuPath path : RunnablePaths()) {
      at::Tensor got = x.clone();
      SoftmaxRows(got.data_ptr<float>(), 3, len, path);
      EXPECT_LT((got - want).abs().max().item<double>(), 1e-6) << len << " " << CpuPathName(path);
    }
  }
}

TEST(CpuOps, QuickGeluMatchesTheFormula) {
  at::manual_seed(3);
  for (int64_t n : {1, 15, 16, 33, 1000}) {
    at::Tensor x = (at::randn({n}) * 6).to(at::kBFloat16);
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor want = xf * at::sigmoid(1.702 * xf);
    at::Tensor y = at::empty_like(x);
    QuickGeluBf16(static_cast<const uint16_t*>(x.data_ptr()), static_cast<uint16_t*>(y.data_ptr()),
                  n);
    // One bf16 rounding of the exact value: 2^-8 relative, plus a little absolute near 0.
    EXPECT_TRUE(at::allclose(y.to(at::kFloat), want, 1.0 / 256, 1e-6)) << n;
  }
}

}  // namespace
}  // namespace llava
