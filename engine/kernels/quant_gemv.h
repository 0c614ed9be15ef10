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

#include "engine/kernels/cpu_features.h"
#include "engine/kernels/quant.h"

namespace llava {

// y [m, w.rows] = x [m, w.cols] . dequant(w)^T (+ bias [w.rows]), all row-major contiguous;
// bias may be null. x, bias and y in fp32, or bf16 bit patterns (uint16_t). Any m >= 1 (rows
// run in passes of at most 8, each streaming the weights once).
void QuantGemv(const float* x, const QuantizedMatrix& w, const float* bias, float* y, int64_t m,
               CpuPath path = ActiveCpuPath());
void QuantGemv(const uint16_t* x, const QuantizedMatrix& w, const uint16_t* bias, uint16_t* y,
               int64_t m, CpuPath path = ActiveCpuPath());

// True when this CPU has the AVX512-VNNI integer dot products that the avx512 and avx512bf16
// paths use (else those paths run the AVX2 kernels).
bool HasAvx512Vnni();

}  // namespace llava
