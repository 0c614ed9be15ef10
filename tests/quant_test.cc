// Weight quantization (engine/kernels/quant.h): fp16 conversion, and both formats' groups by hand.
#include "engine/kernels/quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

namespace llava {
namespace {

TEST(Half, KnownValuesAndEveryHalfRoundTrips) {
  EXPECT_EQ(FloatToHalf(1.f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.1f), 0x2E66);     // 0.0999755859375
  EXPECT_EQ(FloatToHalf(65504.f), 0x7BFF);  // the largest half
  EXPECT_EQ(FloatToHalf(65519.f), 0x7BFF);  // below the midpoint to 65536
  EXPECT_EQ(FloatToHalf(65520.f), 0x7C00);  // the midpoint rounds (to even) to infinity
  EXPECT_EQ(FloatToHalf(std::ldexp(1.f, -24)), 0x0001);        // the smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.f, -25)), 0x0000);        // half of it: ties to even (0)
  EXPECT_EQ(FloatToHalf(std::ldexp(3.f, -25)), 0x0002);        // 1.5 ulp: ties to even (2)
  EXPECT_EQ(FloatToHalf(1.f + std::ldexp(1.f, -11)), 0x3C00);  // 1 + half an ulp: even (1)
  EXPECT_EQ(FloatToHalf(1.f + std::ldexp(3.f, -11)), 0x3C02);  // 1 + 1.5 ulp: even (2 ulp)
  EXPECT_EQ(FloatToHalf(-0.f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(FloatToHalf(std::nanf("")) & 0x7C00, 0x7C00);
  EXPECT_NE(FloatToHalf(std::nanf("")) & 0x03FF, 0);
  EXPECT_FLOAT_EQ(HalfToFloat(0x3555), 0.33325195f);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0) continue;  // NaN
    ASSERT_EQ(FloatToHalf(HalfToFloat(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

// int8, one group: w_i = (i - 16) / 4, i < 32, in [-4, 3.75]. d = 4 / 127 = 0.0314961 rounds to
// the half 0x2808 = 2^-5 (1 + 8/1024) = 0.031494140625; q = round(w / d): -4 -> -127.008 ->
// -127, 3.75 -> 119.07 -> 119, 0.25 -> 7.94 -> 8, 0 -> 0.
TEST(Quantize, Int8GroupByHand) {
  std::vector<float> w(32);
  for (int i = 0; i < 32; ++i) w[i] = (i - 16) / 4.f;
  auto q = QuantizeMatrix(w.data(), 1, 32, WeightFormat::kInt8);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  ASSERT_EQ(q->scale.size(), 1u);
  EXPECT_EQ(q->scale[0], 0x2808);
  EXPECT_TRUE(q->min.empty());
  const auto* v = reinterpret_cast<const int8_t*>(q->data.data());
  EXPECT_EQ(v[0], -127);
  EXPECT_EQ(v[31], 119);
  EXPECT_EQ(v[17], 8);
  EXPECT_EQ(v[16], 0);
  EXPECT_EQ(q->bytes(), 32 + 2);
  std::vector<float> back(32);
  DequantizeRow(*q, 0, back.data());
  EXPECT_FLOAT_EQ(back[31], 119 * 0.031494140625f);
  for (int i = 0; i < 32; ++i) EXPECT_LE(std::fabs(back[i] - w[i]), 0.031494140625f / 2) << i;
}

// int4, one group: w_i = i / 10 - 1, in [-1, 2.1]. m = -1 (0xBC00); d = 3.1 / 15 = 0.2066667
// rounds to 2^-3 (1 + 669/1024) = 0.2066650390625 (0x329D); q = round((w + 1) / d): w_0 -> 0,
// w_31 (3.1 / d = 15.0001) -> 15, w_10 (1 / d = 4.839) -> 5, w_16 (1.6 / d = 7.742) -> 8.
// Byte 0 holds q_0 low and q_16 high: 0x80.
TEST(Quantize, Int4GroupByHand) {
  std::vector<float> w(32);
  for (int i = 0; i < 32; ++i) w[i] = i / 10.f - 1.f;
  auto q = QuantizeMatrix(w.data(), 1, 32, WeightFormat::kInt4);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->min[0], 0xBC00);
  EXPECT_EQ(q->scale[0], 0x329D);
  ASSERT_EQ(q->data.size(), 16u);
  EXPECT_EQ(q->data[0], 0x80);
  EXPECT_EQ(q->data[15] >> 4, 15);  // q_31
  EXPECT_EQ(q->data[10] & 0xF, 5);  // q_10
  EXPECT_EQ(q->bytes(), 16 + 2 + 2);
  std::vector<float> back(32);
  DequantizeRow(*q, 0, back.data());
  EXPECT_FLOAT_EQ(back[10], 5 * 0.2066650390625f - 1.f);
  for (int i = 0; i < 32; ++i) EXPECT_LE(std::fabs(back[i] - w[i]), 0.2066650390625f / 2) << i;
}

// Many rows and groups of random weights: every weight within half its group's step, each
// group's scale from its own range (a row of large weights does not coarsen its neighbours).
TEST(Quantize, EveryWeightWithinHalfAStepOfItsGroup) {
  const int64_t rows = 5, cols = 96;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> w(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] = normal(rng) * (r == 2 ? 100.f : 0.02f);
  }
  for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
    auto q = QuantizeMatrix(w.data(), rows, cols, f);
    ASSERT_TRUE(q.ok());
    std::vector<float> back(cols);
    for (int64_t r = 0; r < rows; ++r) {
      DequantizeRow(*q, r, back.data());
      for (int64_t c = 0; c < cols; ++c) {
        const float step = HalfToFloat(q->scale[r * 3 + c / 32]);
        // fp16's rounding of int4's minimum adds at most 2^-11 of it.
        const float slack =
            f == WeightFormat::kInt4 ? std::fabs(HalfToFloat(q->min[r * 3 + c / 32])) / 2048 : 0.f;
        ASSERT_LE(std::fabs(back[c] - w[r * cols + c]), step / 2 * 1.0001f + slack)
            << WeightFormatName(f) << " row " << r << " col " << c;
      }
    }
  }
}

TEST(Quantize, RejectsShapesAndFormatsItCannotQuantize) {
  std::vector<float> w(48, 1.f);
  auto q = QuantizeMatrix(w.data(), 0, 48, WeightFormat::kInt8);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("[0, 48]"), std::string::npos) << q.status().message();
  EXPECT_FALSE(QuantizeMatrix(w.data(), 1, 32, WeightFormat::kBf16).ok());
  EXPECT_EQ(ParseWeightFormat("int4").value(), WeightFormat::kInt4);
  auto bad = ParseWeightFormat("int3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("weights 'int3'"), std::string::npos);
  // A group of zeros: scale 0, every value 0, dequantized exactly.
  std::vector<float> zeros(32, 0.f), back(32, 1.f);
  auto z = QuantizeMatrix(zeros.data(), 1, 32, WeightFormat::kInt4);
  ASSERT_TRUE(z.ok());
  DequantizeRow(*z, 0, back.data());
  for (float v : back) EXPECT_EQ(v, 0.f);
}

// A row of 40 weights: one whole group and a short one of 8, stored padded to 64. The short
// group's scale comes from its own 8 weights (not from padding zeros), the padding is 0 (int8)
// or the minimum's nibble 0 (int4), and the dequantized row has the 40 weights only.
TEST(Quantize, AShortLastGroupTakesItsRangeFromItsOwnWeights) {
  std::vector<float> w(2 * 40);
  for (int i = 0; i < 80; ++i) w[i] = i % 40 < 32 ? 0.5f : 10.f + (i % 40 - 32);  // 10 .. 17
  for (WeightFormat f : {WeightFormat::kInt8, WeightFormat::kInt4}) {
    auto q = QuantizeMatrix(w.data(), 2, 40, f);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    EXPECT_EQ(q->groups_per_row(), 2);
    EXPECT_EQ(q->padded_cols(), 64);
    ASSERT_EQ(q->scale.size(), 4u);
    if (f == WeightFormat::kInt8) {
      EXPECT_EQ(q->scale[1], FloatToHalf(17.f / 127.f));
      const auto* v = reinterpret_cast<const int8_t*>(q->data.data());
      for (int i = 40; i < 64; ++i) EXPECT_EQ(v[i], 0) << i;
    } else {
      EXPECT_EQ(q->min[1], FloatToHalf(10.f));               // not 0 from the padding
      EXPECT_EQ(q->scale[1], FloatToHalf(7.f / 15.f));       // (17 - 10) / 15
      EXPECT_EQ(q->data[32 / 2 + 8] & 0xF, 0) << "padding";  // position 8 of group 1
    }
    std::vector<float> back(41, -99.f);
    DequantizeRow(*q, 1, back.data());
    EXPECT_EQ(back[40], -99.f) << "wrote past cols";
    for (int i = 0; i < 40; ++i) {
      EXPECT_NEAR(back[i], w[40 + i], HalfToFloat(q->scale[2 + i / 32]) / 2 + 1e-3f) << i;
    }
  }
}

}  // namespace
}  // namespace llava
