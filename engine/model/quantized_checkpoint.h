// Checkpoints with quantized weights: what `llava-quantize` writes, so that a server starts
// without requantizing (engine/kernels/quant.h has the formats).
//
// A quantized checkpoint is a llava-hf folder whose quantized linear layers store, in place of
// `<layer>.weight`, three tensors under the same prefix (QuantizedMatrix's arrays as they are):
//   <layer>.qweight  U8  [rows, cols padded to 32]     int8: two's complement values
//                    U8  [rows, cols padded to 32 / 2] int4: byte j of a group holds value j
//                                                      (low nibble) and j + 16 (high nibble)
//   <layer>.scales   F16 [rows, groups]                one scale per group of 32 weights
//   <layer>.mins     F16 [rows, groups]                int4 only: each group's minimum
// (w ~ scale * q for int8, scale * q + min for int4). The format follows from the shapes; the
// file's metadata also says it ("llava.weights": "int8" | "int4", "llava.quant_group": "32").
// Quantized: the decoder's q/k/v/o/gate/up/down projections in the chosen format, and the
// output projection in int8 (stored as `lm_head.*`, also when the embeddings are tied, which
// then stay in the file as they were). Everything else is copied unchanged, under its own name
// and dtype; the folder's other files (config, tokenizer, preprocessor) are copied too.
// Torch-free.
#pragma once

#include <string>

#include "engine/io/status.h"
#include "engine/kernels/quant.h"

namespace llava {

class WeightSource;

// True for the canonical name of a linear layer (no `.weight` suffix) that a quantized model
// holds quantized: the decoder's projections (also the stacked `qkv_proj` / `gate_up_proj`)
// and `lm_head`.
bool IsQuantizedLinear(const std::string& canonical_layer);

// Takes `<layer>.qweight`, `.scales` (and `.mins`) from `source` when it stores them: *found
// false (and nothing taken) when it does not. The shapes must fit a [rows, cols] matrix; the
// format is read from them. Errors name the tensor.
Status TakeStoredQuantized(WeightSource* source, const std::string& canonical_layer, int64_t rows,
                           int64_t cols, QuantizedMatrix* out, bool* found);

// Writes the quantized checkpoint of the llava-hf folder `src` to the folder `out` (created;
// it must not hold safetensors files yet) with the decoder's projections in `format` (kInt8 or
// kInt4). `summary` (optional) receives a line of what was written.
Status WriteQuantizedCheckpoint(const std::string& src, const std::string& out, WeightFormat format,
                                std::string* summary = nullptr);

}  // namespace llava
