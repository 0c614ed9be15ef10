#include "engine/kernels/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace llava {

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBf16:
      return "bf16";
    case WeightFormat::kInt8:
      return "int8";
    case WeightFormat::kInt4:
      return "int4";
  }
  return "?";
}

StatusOr<WeightFormat> ParseWeightFormat(const std::string& name) {
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kInt4}) {
    if (name == WeightFormatName(f)) return f;
  }
  return InvalidArgument("weights '" + name + "' is unknown (bf16, int8, int4)");
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u);  // NaN, inf
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds past the largest half
  if (x < 0x38800000u) {                        // below 2^-14: a subnormal half (or 0)
    float a;
    std::memcpy(&a, &x, 4);
    // a * 2^24 is exact and < 1024; nearbyint rounds half to even (the default mode). 1024
    // is 0x0400, the smallest normal half, which is right.
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  uint32_t r = x - (112u << 23);   // rebias the exponent from 127 to 15
  r += 0xFFFu + ((r >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return sign | static_cast<uint16_t>(r >> 13);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    const float f = std::ldexp(static_cast<float>(m), -24);
    return sign ? -f : f;
  }
  const uint32_t u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

StatusOr<QuantizedMatrix> QuantizeMatrix(const float* w, int64_t rows, int64_t cols,
                                         WeightFormat format) {
  if (format != WeightFormat::kInt8 && format != WeightFormat::kInt4) {
    return InvalidArgument(std::string("cannot quantize to ") + WeightFormatName(format));
  }
  if (rows < 1 || cols < 1) {
    return InvalidArgument("cannot quantize a [" + std::to_string(rows) + ", " +
                           std::to_string(cols) + "] matrix");
  }
  QuantizedMatrix q;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  const int64_t per_row = q.groups_per_row();
  const bool int4 = format == WeightFormat::kInt4;
  q.scale.resize(rows * per_row);
  q.data.assign(rows * q.row_bytes(), 0);
  if (int4) q.min.resize(rows * per_row);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < per_row; ++c) {
      const int64_t g = r * per_row + c;
      const float* x = w + r * cols + c * kQuantGroup;
      const int64_t n = std::min(kQuantGroup, cols - c * kQuantGroup);  // real weights
      if (!int4) {
        float amax = 0;
        for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
        q.scale[g] = FloatToHalf(amax / 127.f);
        const float d = HalfToFloat(q.scale[g]);
        const float inv = d > 0 ? 1.f / d : 0.f;
        int8_t* out = reinterpret_cast<int8_t*>(q.data.data()) + g * kQuantGroup;
        for (int64_t i = 0; i < n; ++i) {
          out[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.f, 127.f));
        }
        continue;
      }
      float lo = x[0], hi = x[0];
      for (int64_t i = 1; i < n; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
      }
      q.min[g] = FloatToHalf(lo);
      const float m = HalfToFloat(q.min[g]);
      q.scale[g] = FloatToHalf((hi - m) / 15.f);
      const float d = HalfToFloat(q.scale[g]);
      const float inv = d > 0 ? 1.f / d : 0.f;
      const auto nibble = [&](int64_t i) {
        if (i >= n) return uint8_t{0};
        return static_cast<uint8_t>(std::clamp(std::nearbyint((x[i] - m) * inv), 0.f, 15.f));
      };
      uint8_t* out = q.data.data() + g * (kQuantGroup / 2);
      for (int64_t j = 0; j < kQuantGroup / 2; ++j) {
        out[j] = static_cast<uint8_t>(nibble(j) | (nibble(j + kQuantGroup / 2) << 4));
      }
    }
  }
  return q;
}

void DequantizeRow(const QuantizedMatrix& q, int64_t row, float* out) {
  const int64_t per_row = q.groups_per_row();
  for (int64_t c = 0; c < per_row; ++c) {
    const int64_t g = row * per_row + c;
    const int64_t n = std::min(kQuantGroup, q.cols - c * kQuantGroup);
    const float d = HalfToFloat(q.scale[g]);
    float* y = out + c * kQuantGroup;
    if (q.format == WeightFormat::kInt8) {
      const int8_t* v = reinterpret_cast<const int8_t*>(q.data.data()) + g * kQuantGroup;
      for (int64_t i = 0; i < n; ++i) y[i] = d * static_cast<float>(v[i]);
      continue;
    }
    const float m = HalfToFloat(q.min[g]);
    const uint8_t* v = q.data.data() + g * (kQuantGroup / 2);
    for (int64_t i = 0; i < n; ++i) {
      const int nib = i < kQuantGroup / 2 ? v[i] & 0xF : v[i - kQuantGroup / 2] >> 4;
      y[i] = d * static_cast<float>(nib) + m;
    }
  }
}

}  // namespace llava
