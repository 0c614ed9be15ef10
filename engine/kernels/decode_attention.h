// Attention of one decode step for a batch of sequences in one call (CPU; CUDA in a CUDA build).
//
// During decoding every running sequence contributes one query row per layer, and each has its
// own KV cache of its own length. Run through ATen, that is a dozen small ops per sequence and
// layer, and with a small model those ops' fixed costs, not arithmetic, set the step time (the
// 8-stream batch was only 2x one stream: docs/BENCHMARKS.md). This kernel reads every cache in
// place (no padding, no gather) and computes all sequences and heads in one parallel loop.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace llava {

// q [B, H, hd <= 256] (float or bf16); keys[b] and values[b] [Hkv, L_b, hd], the same Hkv
// for every sequence with H % Hkv == 0, float or bf16, the last dimension contiguous. Query
// head h reads KV head h / (H / Hkv); the H / Hkv heads of a group share each row's load.
// Returns softmax(q k^T / sqrt(hd)) v as [B, H * hd] in q's dtype (no mask: every stored entry
// precedes the new row). When `probs` is not null, (*probs)[b] receives the probabilities of
// sequence b as a float [H, 1, L_b] tensor for each b with want_probs[b], and stays undefined
// otherwise. CPU tensors, and CUDA tensors in a build with LLAVA_WITH_CUDA (one kernel
// launch, float or bf16 caches of the same dtype, engine/kernels/cuda/).
at::Tensor DecodeAttention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values,
                           const std::vector<bool>& want_probs, std::vector<at::Tensor>* probs);

// One sequence's cache of one layer, read in place through its page table (engine/kv/kv_pool.h):
// entry j lives in page pages[j / page_rows] at row j % page_rows; KV head h of page p starts
// at keys + p * page_stride + h * key_head_stride elements (values likewise), and consecutive
// rows of a page are key_row_stride (value_row_stride) >= hd elements apart, the last dimension
// contiguous. An unpaged cache is one page of page_rows >= len. An int8 cache (kv_type kChar)
// has one fp32 scale per row, its value the scale times the stored integers: row r of page p of
// KV head h has its key's at key_scales + p * scale_page_stride + h * scale_head_stride + r.
struct DecodeKv {
  const void* keys = nullptr;
  const void* values = nullptr;
  const int32_t* pages = nullptr;  // [ceil(len / page_rows)]
  int64_t page_rows = 0;
  int64_t page_stride = 0;
  int64_t key_head_stride = 0, value_head_stride = 0;
  int64_t key_row_stride = 0, value_row_stride = 0;
  int64_t len = 0;                    // > 0
  const float* key_scales = nullptr;  // int8 caches only
  const float* value_scales = nullptr;
  int64_t scale_page_stride = 0, scale_head_stride = 0;
};

// The same attention over caches given as page tables: every cache of `kv_type` (float, bf16
// or, on the CPU, int8 with scales) with `kv_heads` KV heads, H % kv_heads == 0, on q's device. The
// page tables are host memory; for CUDA tensors (a CUDA build) they are copied to the device with
// the call, one copy for all sequences, and one kernel launch reads every cache through them. The
// tensor form above is this with one page per sequence.
at::Tensor DecodeAttention(const at::Tensor& q, const std::vector<DecodeKv>& caches,
                           at::ScalarType kv_type, int64_t kv_heads,
                           const std::vector<bool>& want_probs, std::vector<at::Tensor>* probs);

// Whether the model sends its decode rows to DecodeAttention on `device`: the CPU always; CUDA
// in a CUDA build with LLAVA_CUDA_ATTENTION=kernel (else ATen's attention per sequence).
bool DecodeAttentionRunsOn(const at::Device& device);

}  // namespace llava
