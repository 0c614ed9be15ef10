#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "engine/kernels/cuda/rms_norm.h"

namespace llava::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: each thread sums squares over a strided slice, the block reduces through
// shared memory, then every thread scales its slice.
__global__ void RmsNormKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                              __nv_bfloat16* __restrict__ y, int64_t dim, float eps) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* xr = x + row * dim;
  __nv_bfloat16* yr = y + row * dim;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = __bfloat162float(xr[i]);
    sum += v * v;
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    // As the reference: normalise in fp32, round to bf16, then multiply by the weight.
    const __nv_bfloat16 normed = __float2bfloat16(__bfloat162float(xr[i]) * scale);
    yr[i] = __float2bfloat16(__bfloat162float(normed) * __bfloat162float(w[i]));
  }
}

}  // namespace

bool RmsNormBf16(const void* x, const void* w, void* y, int64_t rows, int64_t dim, float eps,
                 void* stream) {
  if (rows == 0) return true;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
      static_cast<__nv_bfloat16*>(y), dim, eps);
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace llava::cuda
