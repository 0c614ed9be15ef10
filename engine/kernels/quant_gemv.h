// Products with quantized weights (engine/kernels/quant.h) for decoding: y = x W^T (+ b) for a
// few rows of x. Decoding streams every weight once per step, so int8 (8.5 bits a weight) and
// int4 (5 bits) cut the bytes that bound it by 1.9x and 3.2x against bf16.
//
// The arithmetic is llama.cpp's for Q8_0 / Q4_1 weights against Q8_0 activations: each row of x
// is quantized per group of kQuantGroup to int8 with its own scale (x ~ dx * qx), every group's
// dot product runs in int32, and only its sum is scaled, y = sum_g dw_g dx_g (qw_g . qx_g)
// (+ m_g sum(x_g) for int4's minimum). The integer dot products are vpdpbusd (AVX512-VNNI) or
// vpmaddubsw + vpmaddwd (AVX2), chosen like the other kernels by ActiveCpuPath(); the generic
// path is the same arithmetic in plain C++. Quantizing x costs a relative error of about 1/254 of
// each group's largest value, which the tests bound (tests/quant_gemv_test.cc).
// Torch-free header (raw pointers); the kernel runs on libtorch's intra-op threads.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/kernels/cpu_features.h"
#include "engine/kernels/quant.h"

namespace llava {

// The kernels' layout of a QuantizedMatrix, built once when the weights are loaded: rows in
// tiles of kPackRows, a row's groups in pairs (a last odd group paired with a zero one), and per
// tile and pair one block holding, row after row, the pair's values, then the 8 fp16 scales
// (row 0 group 0, row 0 group 1, row 1 group 0, ...) and for int4 the 8 minimums. A row's
// values in a block: int8, bytes 0-15 of both groups then bytes 16-31 of both (64 bytes);
// int4, each group's 16 nibble bytes as QuantizedMatrix stores them (32 bytes). So a tile is one
// stream of memory, and one 256-bit product covers half of each of the two groups, which the
// activations' layout matches. Rows past `rows` (to a whole tile) are zeros.
constexpr int64_t kPackRows = 4;
struct PackedQuant {
  WeightFormat format = WeightFormat::kInt8;
  int64_t rows = 0, cols = 0;  // the matrix's
  int64_t tiles = 0, pairs = 0;
  int64_t row_bytes = 0;      // a row's values in a block: 64 (int8) or 32 (int4)
  int64_t block_bytes = 0;    // kPackRows * row_bytes + the scales (+ minimums)
  std::vector<uint8_t> data;  // [tiles, pairs, block_bytes]
  int64_t bytes() const { return static_cast<int64_t>(data.size()); }
};
PackedQuant PackQuantized(const QuantizedMatrix& q);

// y [m, w.rows] = x [m, w.cols] . dequant(w)^T (+ bias [w.rows]), all row-major contiguous;
// bias may be null; any m >= 1 (each tile of weights is read from memory once for all rows of
// x). x, bias and y in fp32, or bf16 bit patterns (uint16_t).
void QuantGemv(const float* x, const PackedQuant& w, const float* bias, float* y, int64_t m,
               CpuPath path = ActiveCpuPath());
void QuantGemv(const uint16_t* x, const PackedQuant& w, const uint16_t* bias, uint16_t* y,
               int64_t m, CpuPath path = ActiveCpuPath());

// Rows [r0, r0 + count) of w dequantized into out [count, w.cols] (fp32, or bf16 bit patterns
// rounded to nearest even): the prefill's weights, a panel at a time, for the bf16 or fp32
// GEMM of the CPU path.
void DequantizeRows(const PackedQuant& w, int64_t r0, int64_t count, float* out);
void DequantizeRows(const PackedQuant& w, int64_t r0, int64_t count, uint16_t* out);

// True when this CPU has the AVX512-VNNI integer dot products (on 256-bit vectors) that the
// avx512 and avx512bf16 paths use; without them those paths run the AVX2 kernels.
bool HasAvx512Vnni();

}  // namespace llava
