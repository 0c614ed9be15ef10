// LLaVA: CLIP vision tower -> two-layer projector -> LLaMA decoder, on libtorch (ATen ops).
//
// forward() reads in the order of the papers; shapes are written where tensors are declared.
// Notation: D = text hidden size, Dv = vision hidden size, H = attention heads, Hkv = KV heads,
// hd = head dim, V = vocab, N = image tokens per image.
//
// Thread safety: weights are immutable after Load(); Forward() mutates only the KvCaches it is
// given, so one engine thread drives it (the engine loop owns all caches).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/safetensors.h"
#include "engine/io/status.h"
#include "engine/kernels/quant_gemv.h"
#include "engine/kv/kv_cache.h"
#include "engine/model/model_options.h"

namespace llava {

class WeightSource;

struct Linear {
  Linear() = default;
  Linear(at::Tensor w, at::Tensor b) : weight(std::move(w)), bias(std::move(b)) {}
  at::Tensor weight;  // [out, in]; undefined when `packed` holds the weights
  at::Tensor bias;    // [out] or undefined
  // Quantized weights (ModelOptions::weights): up to kStreamedMaxRows rows of x take QuantGemv,
  // more rows (a prefill) a bf16 or fp32 GEMM over panels of dequantized rows.
  std::shared_ptr<const PackedQuant> packed;
  // x [.., in] -> [.., out]. On the CPU outside autograd: up to GemvMaxRows() rows (8 on
  // AVX512-BF16 for bf16 and on generic, 64 on the other paths: cpu_gemv.h) take our
  // weight-streaming kernel in bf16 (Bf16Gemv) or fp32 (F32Gemv); more bf16 rows take oneDNN's
  // bf16 GEMM on AVX512-BF16, and everything else PanelLinear.
  // Everything else (the trainer's autograd, CUDA) takes at::linear.
  at::Tensor operator()(const at::Tensor& x) const;
};

// y = x W^T (+ b) on the CPU in fp32, split into panels of W's rows that the intra-op threads
// share (OpenBLAS runs on the calling thread: engine/kernels/runtime.h). bf16 weights stay bf16 in
// memory and are widened one panel at a time, at most kLinearPanelFloats floats: the prefill
// product of the CPU paths without AVX512-BF16, where ATen's bf16 matmul has no fast path.
// x [rows, in], weight [out, in], bias [out] or undefined; bf16 or fp32 -> [rows, out] in x's
// dtype. Each intra-op thread widens into a panel of at most kLinearPanelFloats floats and
// writes a panel of fp32 outputs (bf16 rows), tensors of the call. 8 MiB: 16 MiB per thread was
// most of a 7B-wide prefill's workspace, and in an interleaved A/B at 7B prefill shapes (512
// rows, AVX2 path) 8 MiB panels ran within 2% of 16 MiB ones where 4 MiB ones lost 2-4%
// (docs/BENCHMARKS.md, "The paged KV pool").
constexpr int64_t kLinearPanelFloats = int64_t{1} << 21;  // 8 MiB of fp32 weights
constexpr int64_t kLinearChunkColumns = 4096;             // longer rows are added in chunks
at::Tensor PanelLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// Replaces l's weight (CPU, 2-D) by its quantization to `format` (kInt8 or kInt4); the bias
// stays. InvalidArgument for a weight it cannot quantize.
Status QuantizeLinear(Linear* l, WeightFormat format);

struct LayerNorm {
  at::Tensor weight, bias;  // [dim]
  double eps = 1e-5;
  at::Tensor operator()(const at::Tensor& x) const;
};

struct ClipLayer {
  LayerNorm ln1, ln2;
  Linear q, k, v, out;  // [Dv, Dv] with bias
  Linear fc1, fc2;      // [Dff, Dv], [Dv, Dff]
};

struct LlamaLayer {
  at::Tensor input_norm;  // [D]
  at::Tensor post_norm;   // [D]
  Linear qkv;             // [(H + 2 Hkv) hd, D]: q, k, v projections stacked (one GEMM)
  Linear o;               // [D, H hd]
  Linear gate_up;         // [2F, D]: gate then up (one GEMM)
  Linear down;            // [D, F]
};

// One sequence's share of a decoder forward pass.
struct SequenceChunk {
  at::Tensor embeds;           // [n, D] input rows (token embeddings or image features)
  int64_t start_position = 0;  // rotary position of row 0; rows are consecutive
  // Receives the n new K/V rows per layer, in slots reserved before the pass; not owned. The
  // caller commits the pass to the cache after Forward returns (KvCache::Commit).
  SequenceKv* kv = nullptr;
  bool all_logits = false;  // logits for every row (true) or only the last (false)
  // More rows of this prompt follow in later passes (chunked prefill): the caller commits the
  // pass with OnPromptChunkDone instead of OnForwardDone, so the cache does not compress yet.
  bool prompt_continues = false;
  // When not empty: logits for exactly these rows of the chunk (ascending indices into its n
  // rows), whatever all_logits says. The trainer asks only for the rows its loss reads.
  std::vector<int64_t> logit_rows{};
};

class LlavaModel {
 public:
  // Loads a llava-hf folder (config.json, preprocessor_config.json, safetensors).
  static StatusOr<std::unique_ptr<LlavaModel>> Load(const std::string& dir,
                                                    const ModelOptions& options);
  // Builds the model from `config` and weights under canonical names (benchmarks, trainer).
  static StatusOr<std::unique_ptr<LlavaModel>> FromWeights(const LlavaConfig& config,
                                                           std::unique_ptr<WeightSource> weights,
                                                           const ModelOptions& options);
  ~LlavaModel();

  const LlavaConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  at::TensorOptions tensor_options() const;
  KvLayout kv_layout() const;
  std::unique_ptr<KvCache> NewFullCache() const { return NewFullKvCache(kv_layout()); }

  // pixel_values [B, 3, S, S] float (preprocessed) -> projected features [B, N, D] (model dtype).
  at::Tensor EncodeImages(const at::Tensor& pixel_values) const;
  // ids [T] int64 -> [T, D]
  at::Tensor Embed(const at::Tensor& ids) const;
  // Prompt embeddings: text rows from `ids` [T], image rows from `image_features` [B, N, D]
  // at `image_offsets` (B entries).
  at::Tensor EmbedPrompt(const std::vector<int>& ids, const std::vector<int>& image_offsets,
                         const at::Tensor& image_features) const;

  // Every weight the forward pass reads, under its canonical name, for the trainer
  // (train/train_main.cc). The decoder's stacked projections appear as
  // "lm.layers.N.self_attn.qkv_proj.weight" ([q; k; v] rows) and "lm.layers.N.mlp.gate_up_proj
  // .weight" ([gate; up] rows). Not for serving: weights are immutable once a model serves.
  std::vector<std::pair<std::string, at::Tensor*>> MutableParameters();

  // Runs the decoder over several sequences at once: linear layers on all rows together,
  // attention against each sequence's own cache (caches are ragged): one DecodeAttention call
  // for all one-token chunks on the CPU, CachedAttention per chunk otherwise. Writes each chunk's
  // K/V rows to its reserved slots and hands it the attention its policy asks for; committing
  // the pass is the caller's (KvCache::Commit), so a failed pass commits nothing. Returns fp32
  // logits, one row per chunk (or
  // n rows for chunks with all_logits, or its logit_rows), in chunk order: [rows, V]. With
  // `layer_outputs` (the trainer's probes), it also receives the residual stream after every
  // decoder layer, [N, D] with all chunks' rows in chunk order.
  at::Tensor Forward(const std::vector<SequenceChunk>& chunks,
                     std::vector<at::Tensor>* layer_outputs = nullptr) const;

 private:
  LlavaModel() = default;
  Status LoadWeights(WeightSource* source);
  Status FinishLoad(WeightSource* source);  // rotary frequencies, the unused-tensor check
  // Where each tensor the forward pass reads lives in this model, under its parameter name:
  // the one walk that the loader and the trainer's parameter list share (lm_head apart: it
  // may alias the token embeddings). Layers must be sized first.
  struct Slot;
  std::vector<Slot> Slots();
  at::Tensor Attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                       int layer, SequenceKv* kv) const;
  // Attention output of every chunk of one layer, [N, H*hd] in row order; `decode_rows` are
  // the chunks that go through DecodeAttention together.
  at::Tensor AllAttention(const std::vector<SequenceChunk>& chunks,
                          const std::vector<int64_t>& offsets,
                          const std::vector<size_t>& decode_rows, const at::Tensor& q,
                          const at::Tensor& k, const at::Tensor& v, int layer) const;

  LlavaConfig config_;
  ModelOptions options_;
  std::unique_ptr<WeightSource> weights_;  // keeps aliased weight memory alive

  // Vision tower
  at::Tensor patch_embedding_;     // [Dv, 3, P, P]
  at::Tensor class_embedding_;     // [Dv]
  at::Tensor position_embedding_;  // [N+1, Dv]
  LayerNorm pre_layernorm_;
  std::vector<ClipLayer> clip_layers_;  // only the layers the feature layer needs
  // Projector
  Linear proj1_, proj2_;  // [D, Dv], [D, D]
  // Decoder
  at::Tensor embed_tokens_;  // [V, D]
  std::vector<LlamaLayer> layers_;
  at::Tensor final_norm_;  // [D]
  at::Tensor lm_head_;     // [V, D] (aliases embed_tokens_ when tied)
  Linear logits_;          // lm_head_, or its quantization (ModelOptions::weights)
  at::Tensor inv_freq_;    // [hd/2] fp32 rotary frequencies
};

// Rotary embedding (rotate-half form, as HF LLaMA). The cos/sin table [n, 1, hd] (fp32) for
// positions [n] is built once per forward pass and applied to q and k of every layer.
struct RotaryTable {
  at::Tensor cos, sin;
};
RotaryTable MakeRotaryTable(const at::Tensor& positions, const at::Tensor& inv_freq);
// x [n, heads, hd] -> rotated, same dtype. With `may_overwrite`, x's values may be replaced
// by the result (a bf16 CPU tensor outside autograd is rotated in place and returned; the
// decoder rotates q and k over their rows of the fused q/k/v output).
at::Tensor ApplyRotary(const at::Tensor& x, const RotaryTable& table, bool may_overwrite = false);
// One head row of hd bf16 values rotated by one position's cos / sin row, fp32 arithmetic and
// one rounding: y[j] = x[j] c[j] - x[j + half] s[j] in the first half, x[j] c[j] + x[j - half]
// s[j] in the second. sign = -1 applies the transposed rotation (the trainer's backward pass).
// y may be x.
void RotateHeadRow(const at::BFloat16* x, const float* c, const float* s, at::BFloat16* y,
                   int64_t hd, float sign = 1.f);
// Receives the softmax probabilities of query rows [first, first + rows): [H, rows, len], fp32.
using ProbsObserver = std::function<void(int64_t first, const at::Tensor& probs)>;

// Causal attention of n new queries against a cache of len >= n entries whose last n rows
// belong to these queries (grouped KV heads allowed). q [n, H, hd]; keys, values [Hkv, len, hd].
// Returns [n, H*hd]. Queries run in blocks of 256; `observer` (optional) sees each block's
// probabilities, so no more than one block's [H, 256, len] is ever materialised.
at::Tensor CachedAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const ProbsObserver* observer);
// RMSNorm computed in fp32, result in x's dtype times weight: x [.., D], weight [D].
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace llava
