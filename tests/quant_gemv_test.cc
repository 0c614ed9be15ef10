// The quantized products (engine/kernels/quant_gemv.h) on every CPU path this machine runs.
// Exact cases first: weights and x chosen so that both quantizations are lossless, where the
// kernel must give the plain float product; then random weights against the dequantized
// product, and every path against the generic one.
#include "engine/kernels/quant_gemv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "engine/kernels/cpu_gemv.h"

namespace llava {
namespace {

std::vector<CpuPath> RunnablePaths() {
  std::vector<CpuPath> out;
  for (CpuPath p : {CpuPath::kGeneric, CpuPath::kAvx2, CpuPath::kAvx512, CpuPath::kAvx512Bf16}) {
    if (p <= DetectedCpuPath()) out.push_back(p);
  }
  return out;
}

// y = x w^T (+ bias) in double.
std::vector<double> Product(const std::vector<float>& x, const std::vector<float>& w,
                            const std::vector<float>& bias, int64_t m, int64_t n, int64_t k) {
  std::vector<double> y(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < n; ++r) {
      double s = bias.empty() ? 0.0 : bias[r];
      for (int64_t j = 0; j < k; ++j) s += double{x[i * k + j]} * w[r * k + j];
      y[i * n + r] = s;
    }
  }
  return y;
}

// Weights and x that quantize without loss: int8 weights are q / 16 with q in [-127, 127] and
// each group holding a +-127 (so its scale is exactly 1/16); int4 weights are -1 + q / 8 with q
// in [0, 15] and each group holding both 0 and 15 (min -1, scale 1/8); x is integers in
// [-127, 127] with a +-127 in each group (scale 1). A short last group holds the extremes too.
struct Exact {
  std::vector<float> w, x;
};
Exact MakeExact(WeightFormat f, int64_t m, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> i8(-127, 127), i4(0, 15);
  Exact e;
  e.w.resize(n * k);
  e.x.resize(m * k);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pos = j % kQuantGroup;
      if (f == WeightFormat::kInt8) {
        const int q = pos == 0 ? (r % 2 ? 127 : -127) : i8(rng);
        e.w[r * k + j] = q / 16.f;
      } else {
        const int q = pos == 0 ? 0 : pos == 1 ? 15 : i4(rng);
        e.w[r * k + j] = -1.f + q / 8.f;
      }
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      e.x[i * k + j] =
          j % kQuantGroup == 0 ? (i % 2 ? -127.f : 127.f) : static_cast<float>(i8(rng));
    }
  }
  return e;
}

// Shapes that reach every chunk of rows of x (1-4, and many: 9, 17, 70), weight rows that leave
// every remainder of a tile of 4, an odd number of groups (a pair completed by zeros), k with a
// short last group and k past the prefetch distance.
TEST(QuantGemv, LosslessInputsGiveTheFloatProductOnEveryPath) {
  struct Shape {
    int64_t m, n, k;
  };
  for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
    for (Shape s :
         {Shape{1, 37, 64}, Shape{2, 13, 200}, Shape{3, 11, 96}, Shape{4, 9, 4160}, Shape{5, 7, 40},
          Shape{8, 19, 256}, Shape{9, 5, 72}, Shape{17, 6, 128}, Shape{70, 9, 160}}) {
      const Exact e = MakeExact(f, s.m, s.n, s.k, static_cast<uint32_t>(s.m * 31 + s.k));
      std::vector<float> bias(s.n);
      for (int64_t r = 0; r < s.n; ++r) bias[r] = 0.25f * static_cast<float>(r);
      const std::vector<double> want = Product(e.x, e.w, bias, s.m, s.n, s.k);
      auto q = QuantizeMatrix(e.w.data(), s.n, s.k, f);
      ASSERT_TRUE(q.ok());
      const PackedQuant packed = PackQuantized(*q);
      for (CpuPath path : RunnablePaths()) {
        std::vector<float> y(s.m * s.n, -1.f);
        QuantGemv(e.x.data(), packed, bias.data(), y.data(), s.m, path);
        for (int64_t t = 0; t < s.m * s.n; ++t) {
          // fp32 accumulation of exact terms: relative rounding only.
          ASSERT_NEAR(y[t], want[t], 1e-5 * (std::fabs(want[t]) + 127.0 * s.k / 16))
              << WeightFormatName(f) << " " << CpuPathName(path) << " m=" << s.m << " n=" << s.n
              << " k=" << s.k << " at " << t;
        }
      }
    }
  }
}

// Random weights and x: the product of the dequantized weights with x, up to the error of
// quantizing x (at most half a step, d_x / 2 per value), and the vector paths equal to the
// generic one up to fp32 rounding.
TEST(QuantGemv, RandomInputsMatchTheDequantizedProductUpToXsQuantization) {
  const int64_t m = 6, n = 45, k = 688;  // the default model's MLP width (a short last group)
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> w(n * k), x(m * k);
  for (float& v : w) v = 0.05f * normal(rng);
  for (float& v : x) v = normal(rng);
  for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
    auto q = QuantizeMatrix(w.data(), n, k, f);
    ASSERT_TRUE(q.ok());
    std::vector<float> deq(n * k);
    for (int64_t r = 0; r < n; ++r) DequantizeRow(*q, r, deq.data() + r * k);
    const std::vector<double> want = Product(x, deq, {}, m, n, k);
    // The bound: sum over groups of d_x / 2 * sum |w_deq| in the group.
    std::vector<double> bound(m * n, 0.0);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t g = 0; g * kQuantGroup < k; ++g) {
        float amax = 0.f;
        for (int64_t j = g * kQuantGroup; j < std::min(k, (g + 1) * kQuantGroup); ++j) {
          amax = std::max(amax, std::fabs(x[i * k + j]));
        }
        for (int64_t r = 0; r < n; ++r) {
          double s = 0.0;
          for (int64_t j = g * kQuantGroup; j < std::min(k, (g + 1) * kQuantGroup); ++j) {
            s += std::fabs(deq[r * k + j]);
          }
          bound[i * n + r] += amax / 127.0 / 2 * s;
        }
      }
    }
    const PackedQuant packed = PackQuantized(*q);
    std::vector<float> generic(m * n);
    QuantGemv(x.data(), packed, nullptr, generic.data(), m, CpuPath::kGeneric);
    double err = 0.0, scale = 0.0;
    for (int64_t t = 0; t < m * n; ++t) {
      ASSERT_LE(std::fabs(generic[t] - want[t]), bound[t] * 1.01 + 1e-4) << t;
      err += std::fabs(generic[t] - want[t]);
      scale += std::fabs(want[t]);
    }
    // The typical error is far below the worst case: under 1% of the typical output.
    EXPECT_LT(err / scale, 0.01) << WeightFormatName(f);
    for (CpuPath path : RunnablePaths()) {
      std::vector<float> y(m * n);
      QuantGemv(x.data(), packed, nullptr, y.data(), m, path);
      for (int64_t t = 0; t < m * n; ++t) {
        ASSERT_NEAR(y[t], generic[t], 1e-4f * (1.f + std::fabs(generic[t])))
            << WeightFormatName(f) << " " << CpuPathName(path) << " at " << t;
      }
    }
  }
}

// bf16 in and out, with a bias: the fp32 result rounded to bf16.
TEST(QuantGemv, Bf16RowsRoundTheFp32Result) {
  const int64_t m = 3, n = 10, k = 96;
  const Exact e = MakeExact(WeightFormat::kInt8, m, n, k, 11);
  auto q = QuantizeMatrix(e.w.data(), n, k, WeightFormat::kInt8);
  ASSERT_TRUE(q.ok());
  std::vector<uint16_t> xb(m * k), bias(n), y(m * n);
  for (int64_t t = 0; t < m * k; ++t) xb[t] = FloatToBf16(e.x[t]);  // integers <= 127: exact
  std::vector<float> biasf(n);
  for (int64_t r = 0; r < n; ++r) {
    biasf[r] = 0.5f * static_cast<float>(r);
    bias[r] = FloatToBf16(biasf[r]);
  }
  const std::vector<double> want = Product(e.x, e.w, biasf, m, n, k);
  const PackedQuant packed = PackQuantized(*q);
  for (CpuPath path : RunnablePaths()) {
    QuantGemv(xb.data(), packed, bias.data(), y.data(), m, path);
    for (int64_t t = 0; t < m * n; ++t) {
      EXPECT_EQ(y[t], FloatToBf16(static_cast<float>(want[t])))
          << CpuPathName(path) << " at " << t << ": " << Bf16ToFloat(y[t]) << " vs " << want[t];
    }
  }
}

// DequantizeRows gives back DequantizeRow's values of the unpacked matrix, for any range of
// rows (across tiles), with a short last group and an odd number of groups; bf16 rounds them.
TEST(QuantGemv, DequantizedPanelsMatchTheQuantizedMatrix) {
  const int64_t n = 11, k = 104;  // 4 groups (2 pairs), the last of 8 values; a tile of 3 rows
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> w(n * k);
  for (float& v : w) v = normal(rng);
  for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
    auto q = QuantizeMatrix(w.data(), n, k, f);
    ASSERT_TRUE(q.ok());
    const PackedQuant packed = PackQuantized(*q);
    std::vector<float> out(6 * k), want(k);
    std::vector<uint16_t> out16(6 * k);
    DequantizeRows(packed, 3, 6, out.data());  // rows 3-8: tiles 0, 1 and 2
    DequantizeRows(packed, 3, 6, out16.data());
    for (int64_t c = 0; c < 6; ++c) {
      DequantizeRow(*q, 3 + c, want.data());
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(out[c * k + j], want[j])
            << WeightFormatName(f) << " row " << 3 + c << " col " << j;
        ASSERT_EQ(out16[c * k + j], FloatToBf16(want[j]));
      }
    }
  }
}

}  // namespace
}  // namespace llava
