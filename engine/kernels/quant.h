// Weight-only quantization of linear layers: the two formats, the quantizer and the reference
// dequantizer that the quantized kernels are checked against. Torch-free (raw arrays).
//
// Both formats cut a row into groups of kQuantGroup consecutive weights, each with its own fp16
// scale, the arithmetic of llama.cpp's Q8_0 and Q4_1 (the layout is ours: each array separate,
// so a kernel streams the quantized values without stepping over scales):
// - int8: q = round(w / d) in [-127, 127], d = max|w| / 127; w ~ d * q. 8.5 bits per weight.
// - int4: q = round((w - m) / d) in [0, 15], m = min w, d = (max w - m) / 15; w ~ d * q + m. Two
//   per byte: byte j of a group holds q[j] in its low nibble and q[j + 16] in its high one.
//   5 bits per weight.
// d and m are rounded to fp16 first and q computed from the rounded values, so the only error
// is q's rounding: at most d / 2 per weight (and fp16's rounding of m, for int4).
// A row whose length is not a multiple of kQuantGroup ends in a short group, stored padded to a
// whole group: its range is that of its real weights, its padding quantized as 0 (int8) or as
// the minimum (int4); the kernels multiply the padding by zeros.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/io/status.h"

namespace llava {

enum class WeightFormat { kBf16, kInt8, kInt4 };
const char* WeightFormatName(WeightFormat f);  // "bf16", "int8", "int4"
StatusOr<WeightFormat> ParseWeightFormat(const std::string& name);

constexpr int64_t kQuantGroup = 32;

struct QuantizedMatrix {
  WeightFormat format = WeightFormat::kInt8;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> data;    // [rows, row_bytes()]: int8 two's complement; int4 nibbles
  std::vector<uint16_t> scale;  // [rows, groups_per_row()], fp16 bit patterns
  std::vector<uint16_t> min;    // int4 only, as scale
  int64_t groups_per_row() const { return (cols + kQuantGroup - 1) / kQuantGroup; }
  int64_t padded_cols() const { return groups_per_row() * kQuantGroup; }
  int64_t row_bytes() const {  // of `data`
    return format == WeightFormat::kInt4 ? padded_cols() / 2 : padded_cols();
  }
  int64_t bytes() const {
    return static_cast<int64_t>(data.size() + 2 * (scale.size() + min.size()));
  }
};

// Quantizes w [rows, cols] (row-major, finite) to `format` (kInt8 or kInt4); InvalidArgument
// for another format or an empty shape.
StatusOr<QuantizedMatrix> QuantizeMatrix(const float* w, int64_t rows, int64_t cols,
                                         WeightFormat format);

// Row `row` of q as floats: out[cols].
void DequantizeRow(const QuantizedMatrix& q, int64_t row, float* out);

// IEEE half precision <-> float, round to nearest even (subnormals, infinities and NaN kept).
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

}  // namespace llava
