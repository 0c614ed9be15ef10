// Fused RMSNorm for bf16 activations on a CUDA device. Torch-free header; the kernel is built
// only with -DLLAVA_WITH_CUDA=ON (nvcc from /usr/local/cuda).
#pragma once

#include <cstdint>

namespace llava::cuda {

// y[r, :] = w * (x[r, :] / sqrt(mean(x[r, :]^2) + eps)), fp32 accumulation.
// x, y: [rows, dim] bf16 device pointers (may alias); w: [dim] bf16. Runs on `stream`
// (a cudaStream_t; nullptr = the default stream). Returns false if the launch failed.
bool RmsNormBf16(const void* x, const void* w, void* y, int64_t rows, int64_t dim, float eps,
                 void* stream);

}  // namespace llava::cuda
