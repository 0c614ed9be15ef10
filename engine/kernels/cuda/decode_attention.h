// Attention of one decode step for a batch of sequences on a CUDA device, each against its own
// KV cache read in place: one launch per layer (up to kMaxSequences sequences) where ATen
// takes a dozen launches per sequence. Torch-free header; built only with -DLLAVA_WITH_CUDA=ON.
// The ATen-facing wrapper with the CPU kernel's contract is DecodeAttention
// (engine/kernels/decode_attention.h), which calls this for CUDA tensors.
#pragma once

#include <cstdint>

namespace llava::cuda {

// One sequence's cache for one layer: keys and values [Hkv, len, hd] with the given head and row
// strides (in elements; the last dimension contiguous), and where its probabilities go (float
// [H, len], or nullptr).
struct DecodeSequence {
  const void* keys;
  const void* values;
  float* probs;
  int64_t key_head_stride;
  int64_t value_head_stride;
  int32_t key_row_stride;
  int32_t value_row_stride;
  int32_t len;
};

// Sequences per launch: the table travels as a kernel argument (4 KB at most), so no copy to
// the device and no wait for one.
constexpr int kMaxSequences = 64;

// q [n, H, hd] contiguous, out [n, H, hd] contiguous, both in the caches' type (bf16 when
// `bf16`, else float), n <= kMaxSequences. Query head h reads KV head h / (H / Hkv).
// out = softmax(q k^T * scale) v per sequence and head, fp32 arithmetic. Runs on `stream` (a
// cudaStream_t; nullptr = the default stream) of `device`. Returns false if the launch failed
// or the longest cache needs more shared memory than the device has (4 bytes per entry).
bool DecodeAttention(const void* q, const DecodeSequence* sequences, int n, int heads, int kv_heads,
                     int head_dim, float scale, bool bf16, void* out, int device, void* stream);

}  // namespace llava::cuda
