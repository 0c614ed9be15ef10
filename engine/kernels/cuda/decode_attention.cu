#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cfloat>

#include "engine/kernels/cuda/decode_attention.h"

namespace llava::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;

__device__ inline float Load(const float* p) { return *p; }
__device__ inline float Load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ inline void Store(float* p, float v) { *p = v; }
__device__ inline void Store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

__device__ inline float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Every thread gets the block's total; `red` holds kWarps floats.
template <bool kMax>
__device__ inline float BlockReduce(float v, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = kMax ? WarpMax(v) : WarpSum(v);
  __syncthreads();  // `red` may still be read by a previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// Where the run of rows holding entry j begins (elements from the cache's base; add the head's
// offset), and how many entries from j on are in that run: a page's rest, or all of an unpaged
// cache.
__device__ inline int64_t RunStart(const DecodeSequence& s, int j, int64_t row_stride, int* rows) {
  if (s.pages == nullptr) {
    *rows = s.len - j;
    return static_cast<int64_t>(j) * row_stride;
  }
  const int page = j / s.page_rows, r = j - page * s.page_rows;
  *rows = min(s.page_rows - r, s.len - j);
  return static_cast<int64_t>(s.pages[page]) * s.page_stride + static_cast<int64_t>(r) * row_stride;
}

// One block per (query head, sequence). Shared memory: the scaled query [hd], the row's
// scores then probabilities [len], and kWarps floats for the reductions.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    DecodeAttentionKernel(const T* __restrict__ q, const DecodeSequence* __restrict__ table,
                          int heads, int group, int hd, float scale, T* __restrict__ out) {
  extern __shared__ float smem[];
  const int h = blockIdx.x, b = blockIdx.y;
  const DecodeSequence s = table[b];
  const int len = s.len;
  float* qs = smem;
  float* red = qs + hd;
  float* p = red + kWarps;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  const T* qr = q + (static_cast<int64_t>(b) * heads + h) * hd;
  for (int d = threadIdx.x; d < hd; d += kThreads) qs[d] = Load(qr + d) * scale;
  __syncthreads();

  const int kvh = h / group;
  const T* k = static_cast<const T*>(s.keys) + kvh * s.key_head_stride;
  for (int j = warp; j < len; j += kWarps) {  // a warp per key row, its lanes across hd
    int rows;
    const T* kj = k + RunStart(s, j, s.key_row_stride, &rows);
    float acc = 0.f;
    for (int d = lane; d < hd; d += 32) acc += qs[d] * Load(kj + d);
    acc = WarpSum(acc);
    if (lane == 0) p[j] = acc;
  }
  __syncthreads();

  float m = -FLT_MAX;
  for (int j = threadIdx.x; j < len; j += kThreads) m = fmaxf(m, p[j]);
  m = BlockReduce<true>(m, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < len; j += kThreads) {
    const float e = expf(p[j] - m);
    p[j] = e;
    sum += e;
  }
  const float inv = 1.f / BlockReduce<false>(sum, red);  // (its barrier publishes p)
  if (s.probs != nullptr) {
    float* pr = s.probs + static_cast<int64_t>(h) * len;
    for (int j = threadIdx.x; j < len; j += kThreads) pr[j] = p[j] * inv;
  }

  const T* v = static_cast<const T*>(s.values) + kvh * s.value_head_stride;
  T* o = out + (static_cast<int64_t>(b) * heads + h) * hd;
  for (int d = threadIdx.x; d < hd; d += kThreads) {  // a thread per output column
    float acc = 0.f;
    for (int j = 0; j < len;) {  // a run of rows (a page) at a time
      int rows;
      const T* vr = v + RunStart(s, j, s.value_row_stride, &rows) + d;
      for (int r = 0; r < rows; ++r)
        acc += p[j + r] * Load(vr + static_cast<int64_t>(r) * s.value_row_stride);
      j += rows;
    }
    Store(o + d, acc * inv);
  }
}

// The device's opt-in shared memory per block, asked once per device (a launch per layer and
// decode step would otherwise ask every time).
int OptInSharedBytes(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int> cached[kDevices] = {};
  if (device < 0 || device >= kDevices) return 0;
  int bytes = cached[device].load(std::memory_order_relaxed);
  if (bytes == 0 && cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                           device) == cudaSuccess) {
    cached[device].store(bytes, std::memory_order_relaxed);
  }
  return bytes;
}

template <typename T>
bool Launch(const void* q, const DecodeSequence* sequences, int n, int max_len, int heads,
            int kv_heads, int head_dim, float scale, void* out, int device, cudaStream_t stream) {
  const size_t bytes = sizeof(float) * (static_cast<size_t>(head_dim) + kWarps + max_len);
  if (bytes > static_cast<size_t>(OptInSharedBytes(device))) return false;
  if (bytes > 48 * 1024 &&
      cudaFuncSetAttribute(DecodeAttentionKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes)) != cudaSuccess) {
    return false;
  }
  DecodeAttentionKernel<T><<<dim3(heads, n), kThreads, bytes, stream>>>(
      static_cast<const T*>(q), sequences, heads, heads / kv_heads, head_dim, scale,
      static_cast<T*>(out));
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace

bool DecodeAttention(const void* q, const DecodeSequence* sequences, int n, int max_len, int heads,
                     int kv_heads, int head_dim, float scale, bool bf16, void* out, int device,
                     void* stream) {
  if (n <= 0 || n > 65535 || max_len <= 0 || kv_heads <= 0 || heads % kv_heads != 0) return false;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) return false;
  if (current != device && cudaSetDevice(device) != cudaSuccess) return false;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool ok = bf16 ? Launch<__nv_bfloat16>(q, sequences, n, max_len, heads, kv_heads, head_dim,
                                               scale, out, device, st)
                       : Launch<float>(q, sequences, n, max_len, heads, kv_heads, head_dim, scale,
                                       out, device, st);
  if (current != device) cudaSetDevice(current);
  return ok;
}

}  // namespace llava::cuda
