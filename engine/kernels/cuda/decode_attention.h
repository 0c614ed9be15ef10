// Attention of one decode step for a batch of sequences on a CUDA device, each against its own
// KV cache read in place (through its page table when it lives in the KV pool): one launch per
// layer where ATen takes a dozen launches per sequence. Torch-free header; built only with
// -DLLAVA_WITH_CUDA=ON. The ATen-facing wrapper with the CPU kernel's contract is
// DecodeAttention (engine/kernels/decode_attention.h), which calls this for CUDA tensors.
#pragma once

#include <cstdint>

namespace llava::cuda {

// One sequence's cache for one layer, read in place: entry j of KV head h starts at
//   keys + pages[j / P] * page_stride + h * key_head_stride + (j % P) * key_row_stride
// (P = page_rows; values likewise) when `pages` is set (a page table in device memory: the KV pool,
// engine/kv/kv_pool.h), and at keys + h * key_head_stride + j * key_row_stride when it is null
// (a contiguous [Hkv, len, hd] cache). Strides in elements, the last dimension contiguous.
// `probs` receives the probabilities (float [H, len]) or is nullptr.
struct DecodeSequence {
  const void* keys;
  const void* values;
  const int32_t* pages;  // device memory; nullptr: unpaged
  float* probs;
  int64_t key_head_stride;
  int64_t value_head_stride;
  int64_t page_stride;
  int32_t key_row_stride;
  int32_t value_row_stride;
  int32_t page_rows;  // paged: entries per page (> 0)
  int32_t len;        // > 0
};

// q [n, H, hd] contiguous, out [n, H, hd] contiguous, both in the caches' type (bf16 when
// `bf16`, else float). `sequences` is a table of n descriptors in device memory (with their page
// tables: one upload per call, engine/kernels/decode_attention.cc), `max_len` the longest `len`
// among them. Query head h reads KV head h / (H / Hkv). out = softmax(q k^T * scale) v per
// sequence and head, fp32 arithmetic, one launch. Runs on `stream` (a cudaStream_t; nullptr =
// the default stream) of `device`. Returns false if the launch failed or the longest cache needs
// more shared memory than the device has (4 bytes per entry).
bool DecodeAttention(const void* q, const DecodeSequence* sequences, int n, int max_len, int heads,
                     int kv_heads, int head_dim, float scale, bool bf16, void* out, int device,
                     void* stream);

}  // namespace llava::cuda
