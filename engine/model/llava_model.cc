// The LLaVA forward pass in one file (~640 lines) on purpose: loading, the vision tower, the
// decoder layers, cached and decode attention and the batched Forward are one data flow that
// reads top to bottom in the order of the papers; the kernels it calls live in engine/kernels.
#include "engine/model/llava_model.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <unordered_map>

#include "engine/io/aten_dtype.h"
#include "engine/io/weight_manifest.h"
#include "engine/kernels/cpu_gemv.h"
#include "engine/kernels/cpu_ops.h"
#include "engine/kernels/decode_attention.h"
#include "engine/model/autograd_ops.h"
#include "engine/model/quantized_checkpoint.h"
#include "engine/model/weights.h"

#ifdef LLAVA_WITH_CUDA
#include "engine/kernels/cuda/rms_norm.h"
#endif

namespace llava {
namespace {

// The prefill attention processes queries in blocks of at most kQueryBlock rows, fewer where a
// block's fp32 probabilities [H, rows, len] would pass kQueryBlockBytes (a 256-row block of a
// 7B-wide 291-token prompt was 9.5 MB of probabilities plus 4.8 of bf16 scores: the largest
// part of a pass's live tensors), but at least kMinQueryBlock.
constexpr int64_t kQueryBlock = 256;
constexpr int64_t kMinQueryBlock = 16;
constexpr int64_t kQueryBlockBytes = int64_t{4} << 20;

// A bf16 CPU tensor outside autograd: eligible for the fused loops below (the trainer's
// forward keeps the ATen ops, whose backward it needs).
bool IsPlainCpuBf16(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.scalar_type() == at::kBFloat16 && !t.requires_grad();
}

// A contiguous CPU tensor of `type` under autograd: the trainer's forward, which takes the fused
// ops of autograd_ops.h.
bool IsTrainingCpu(const at::Tensor& t, at::ScalarType type) {
  return t.requires_grad() && t.is_cpu() && t.scalar_type() == type && t.is_contiguous();
}

// False for a bf16 CPU tensor outside autograd on a CPU path without AVX512-BF16, whose
// products ATen (oneDNN) runs 10-50x slower than in fp32: the caller converts them.
bool FastBf16Matmul(const at::Tensor& t) {
  return !IsPlainCpuBf16(t) || CpuPathAtLeast(CpuPath::kAvx512Bf16);
}

// at::gelu and at::silu; in fp32 where FastBf16Matmul is false, since ATen also hands bf16
// activations to oneDNN, which has no bf16 kernels below AVX512-BF16.
at::Tensor Gelu(const at::Tensor& x) {
  return FastBf16Matmul(x) ? at::gelu(x) : at::gelu(x.to(at::kFloat)).to(x.scalar_type());
}
at::Tensor Silu(const at::Tensor& x) {
  return FastBf16Matmul(x) ? at::silu(x) : at::silu(x.to(at::kFloat)).to(x.scalar_type());
}

// silu(gate) * up of a fused gate/up projection's output [N, 2F]; one pass forward and one
// backward in the trainer (autograd_ops.h). Serving, the gate half is overwritten with its
// silu (in blocks of rows where it is computed in fp32): the same values as a separate silu
// tensor, one [N, F] tensor fewer at the pass's peak (5.4 MB at 256 rows, 7B widths).
at::Tensor SwiGlu(at::Tensor gate_up, int64_t f) {
  if (IsTrainingCpu(gate_up, at::kBFloat16) && gate_up.dim() == 2) {
    return TrainSwiGlu(gate_up);
  }
  at::Tensor gate = gate_up.narrow(-1, 0, f);
  const at::Tensor up = gate_up.narrow(-1, f, f);
  if (gate_up.requires_grad()) return Silu(gate) * up;
  if (FastBf16Matmul(gate)) {
    at::silu_(gate);
  } else {
    constexpr int64_t kRows = 64;
    const at::Tensor rows = gate.reshape({-1, f});  // a view: gate_up is [.., 2F]
    TORCH_INTERNAL_ASSERT(rows.is_alias_of(gate));
    for (int64_t r0 = 0; r0 < rows.size(0); r0 += kRows) {
      at::Tensor g = rows.narrow(0, r0, std::min(kRows, rows.size(0) - r0));
      g.copy_(Silu(g));
    }
  }
  return gate * up;
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Loader helper: takes tensors under a prefix with shapes derived from the config.
// Takes the tensors of the weight manifest (engine/io/weight_manifest.h), each with its shape
// there, in the model's dtype (norms in fp32) on its device.
class Taker {
 public:
  Taker(WeightSource* r, const ModelOptions& o, const LlavaConfig& c) : r_(r), o_(o) {
    for (WeightSpec& s : LlavaWeightManifest(c)) shapes_[s.name] = std::move(s.shape);
  }
  Status Get(const std::string& name, at::Tensor* out, bool fp32 = false) {
    auto it = shapes_.find(name);
    if (it == shapes_.end()) return Internal("'" + name + "' is not in the weight manifest");
    return r_->Take(name, it->second, fp32 ? DType::kF32 : o_.dtype, o_.device, out);
  }
  // `name`.bias where the manifest has one (else `out` is left as it is).
  Status GetBias(const std::string& name, at::Tensor* out) {
    if (shapes_.count(name + ".bias") == 0) return Status::Ok();
    return Get(name + ".bias", out);
  }
  // The manifest's shape of `name` (which must be in it).
  const std::vector<int64_t>& Shape(const std::string& name) const { return shapes_.at(name); }
  Status GetLayerNorm(const std::string& name, double eps, LayerNorm* ln) {
    ln->eps = eps;
    LLAVA_RETURN_IF_ERROR(Get(name + ".weight", &ln->weight, /*fp32=*/true));
    return Get(name + ".bias", &ln->bias, /*fp32=*/true);
  }

 private:
  WeightSource* r_;
  ModelOptions o_;
  std::unordered_map<std::string, std::vector<int64_t>> shapes_;
};

}  // namespace

namespace {

// Linear with quantized weights (CPU, outside autograd): see Linear::packed.
at::Tensor QuantLinear(const at::Tensor& x, const PackedQuant& w, const at::Tensor& bias) {
  const int64_t k = w.cols, n = w.rows, rows = x.numel() / k;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (!bf16 && x.scalar_type() != at::kFloat) {
    throw std::invalid_argument("quantized linear: x must be bf16 or fp32");
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.defined() ? bias.to(x.scalar_type()).contiguous() : at::Tensor();
  // Without oneDNN's bf16 GEMM (the AVX2 and AVX-512 paths), a prefill runs the decode's
  // integer products too, its activations quantized as llama.cpp's Q8_0 x Q8_0: int8 1.29x the
  // dequantized panels' speed on AVX2 at 7B shapes, int4 1.8x with AVX512-VNNI
  // (docs/BENCHMARKS.md, "Quantized weights"); int4 on AVX2 gained nothing and keeps the
  // panels, which quantize no activations.
  const bool onednn = bf16 && CpuPathAtLeast(CpuPath::kAvx512Bf16);
  const bool integer =
      !onednn && CpuPathAtLeast(CpuPath::kAvx2) &&
      (w.format == WeightFormat::kInt8 || (CpuPathAtLeast(CpuPath::kAvx512) && HasAvx512Vnni()));
  if (rows <= kStreamedMaxRows || integer) {
    at::Tensor y = at::empty(shape, x.options());
    if (bf16) {
      QuantGemv(static_cast<const uint16_t*>(xc.data_ptr()), w,
                b.defined() ? static_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                static_cast<uint16_t*>(y.data_ptr()), rows);
    } else {
      QuantGemv(xc.data_ptr<float>(), w, b.defined() ? b.data_ptr<float>() : nullptr,
                y.data_ptr<float>(), rows);
    }
    return y;
  }
  // A prefill: panels of rows dequantized (at most kLinearPanelFloats values, whole tiles),
  // each multiplied by this path's GEMM (oneDNN's bf16 on AVX512-BF16, PanelLinear elsewhere).
  const at::Tensor x2 = xc.reshape({rows, k});
  at::Tensor y = at::empty({rows, n}, x.options());
  const int64_t panel =
      std::max(kPackRows, kLinearPanelFloats / std::max<int64_t>(k, 1) / kPackRows * kPackRows);
  for (int64_t r0 = 0; r0 < n; r0 += panel) {
    const int64_t count = std::min(panel, n - r0);
    at::Tensor wp = at::empty({count, k}, onednn ? at::kBFloat16 : at::kFloat);
    if (onednn) {
      DequantizeRows(w, r0, count, static_cast<uint16_t*>(wp.data_ptr()));
    } else {
      DequantizeRows(w, r0, count, wp.data_ptr<float>());
    }
    y.narrow(1, r0, count).copy_(onednn ? at::linear(x2, wp) : PanelLinear(x2, wp, at::Tensor()));
  }
  if (b.defined()) y.add_(b);
  return y.view(shape);
}

}  // namespace

Status QuantizeLinear(Linear* l, WeightFormat format) {
  if (!l->weight.defined() || l->weight.dim() != 2 || !l->weight.is_cpu()) {
    return InvalidArgument("only a 2-D CPU weight can be quantized");
  }
  const at::Tensor w = l->weight.to(at::kFloat).contiguous();
  LLAVA_ASSIGN_OR_RETURN(QuantizedMatrix q,
                         QuantizeMatrix(w.data_ptr<float>(), w.size(0), w.size(1), format));
  l->packed = std::make_shared<const PackedQuant>(PackQuantized(q));
  l->weight = at::Tensor();
  return Status::Ok();
}

at::Tensor Linear::operator()(const at::Tensor& x) const {
  if (packed != nullptr) return QuantLinear(x, *packed, bias);
  const int64_t k = weight.size(1), rows = x.numel() / std::max<int64_t>(k, 1);
  // Under autograd (the trainer's forward) or off the CPU: at::linear, whose backward and
  // device kernels those need.
  if (!x.is_cpu() || !weight.is_cpu() || x.requires_grad() || weight.requires_grad() ||
      (bias.defined() && bias.requires_grad()) || k < 1 || rows < 1 || !weight.is_contiguous()) {
    return at::linear(x, weight, bias);
  }
  const bool bf16 =
      IsPlainCpuBf16(x) && IsPlainCpuBf16(weight) && (!bias.defined() || IsPlainCpuBf16(bias));
  const bool f32 = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                   (!bias.defined() || bias.scalar_type() == at::kFloat);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = weight.size(0);
  if (bf16 && rows <= GemvMaxRows(/*bf16=*/true)) {
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty(shape, x.options());
    Bf16Gemv(static_cast<const uint16_t*>(xc.data_ptr()),
             static_cast<const uint16_t*>(weight.data_ptr()),
             bias.defined() ? static_cast<const uint16_t*>(bias.contiguous().data_ptr()) : nullptr,
             static_cast<uint16_t*>(y.data_ptr()), rows, weight.size(0), k);
    return y;
  }
  if (f32 && rows <= GemvMaxRows(/*bf16=*/false)) {
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty(shape, x.options());
    F32Gemv(xc.data_ptr<float>(), weight.data_ptr<float>(),
            bias.defined() ? bias.contiguous().data_ptr<float>() : nullptr, y.data_ptr<float>(),
            rows, weight.size(0), k);
    return y;
  }
  if (bf16 && CpuPathAtLeast(CpuPath::kAvx512Bf16)) return at::linear(x, weight, bias);  // oneDNN
  if (bf16 || f32) return PanelLinear(x.reshape({rows, k}), weight, bias).view(shape);
  return at::linear(x, weight, bias);
}

at::Tensor PanelLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t rows = x.size(0), n = weight.size(0), k = weight.size(1);
  const bool f32 = x.scalar_type() == at::kFloat;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  // fp32 results are written in place; bf16 ones pass through a panel of fp32 first.
  at::Tensor y = at::empty({rows, n}, x.options());
  const at::Tensor b = bias.defined() ? bias.to(at::kFloat) : at::Tensor();
  // Long rows are split into chunks of at most kLinearChunkColumns columns, each chunk's product
  // added to the panel's outputs: panels then keep ~1,000 weight rows however long the rows are
  // (7B down, k = 11008, ran at half the speed of the other projections in panels of 342 rows).
  const int64_t chunks = (k + kLinearChunkColumns - 1) / kLinearChunkColumns;
  const int64_t chunk = (k + chunks - 1) / chunks;
  // At least one panel per thread, and panels of at most kLinearPanelFloats widened weights.
  const int64_t threads = at::get_num_threads();
  int64_t panels =
      std::max<int64_t>(threads, (n * chunk + kLinearPanelFloats - 1) / kLinearPanelFloats);
  panels = (panels + threads - 1) / threads * threads;
  const int64_t panel = (n + panels - 1) / panels;
  // Each thread's widened panel and fp32 outputs are tensors of this call: freed when it
  // returns, their memory is the next product's (the activation allocator, or glibc's heap
  // under its fixed threshold, hands the same pages back without faults; runtime.h).
  at::parallel_for(0, (n + panel - 1) / panel, 1, [&](int64_t p0, int64_t p1) {
    at::Tensor outs, widened;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * panel, width = std::min(panel, n - n0);
      if (!f32 && !outs.defined()) outs = at::empty({rows * panel}, at::kFloat);
      at::Tensor out =
          f32 ? y.narrow(1, n0, width) : outs.narrow(0, 0, rows * width).view({rows, width});
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        const int64_t cols = std::min(chunk, k - k0);
        at::Tensor w = weight.narrow(0, n0, width).narrow(1, k0, cols);
        if (w.scalar_type() != at::kFloat) {
          if (!widened.defined()) widened = at::empty({panel * chunk}, at::kFloat);
          w = widened.narrow(0, 0, width * cols).view({width, cols}).copy_(w);
        }
        if (k0 == 0) {
          at::mm_out(out, xf.narrow(1, k0, cols), w.t());
        } else {
          out.addmm_(xf.narrow(1, k0, cols), w.t());
        }
      }
      if (b.defined()) out.add_(b.narrow(0, n0, width));
      if (!f32) y.narrow(1, n0, width).copy_(out);
    }
  });
  return y;
}

at::Tensor LayerNorm::operator()(const at::Tensor& x) const {
  if (IsPlainCpuBf16(x) && IsPlainCpuBf16(weight) && IsPlainCpuBf16(bias) && x.is_contiguous()) {
    // at::layer_norm's arithmetic (fp32, biased variance) in one pass per row.
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    at::Tensor y = at::empty_like(x);
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < rows; ++r) {
      const at::BFloat16* xr = xp + r * dim;
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) sum += static_cast<float>(xr[d]);
      const float mean = sum / static_cast<float>(dim);
      float var = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        const float c = static_cast<float>(xr[d]) - mean;
        var += c * c;
      }
      const float rstd = 1.f / std::sqrt(var / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) {
        yp[r * dim + d] =
            at::BFloat16((static_cast<float>(xr[d]) - mean) * rstd * static_cast<float>(wp[d]) +
                         static_cast<float>(bp[d]));
      }
    }
    return y;
  }
  return at::layer_norm(x.to(at::kFloat), {weight.size(0)}, weight, bias, eps).to(x.scalar_type());
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#ifdef LLAVA_WITH_CUDA
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) {
    at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty_like(xc);
    const int64_t dim = xc.size(-1);
    if (cuda::RmsNormBf16(xc.data_ptr(), weight.data_ptr(), y.data_ptr(), xc.numel() / dim, dim,
                          static_cast<float>(eps), /*stream=*/nullptr)) {
      return y;
    }
  }
#endif
  if ((x.requires_grad() || weight.requires_grad()) && x.is_cpu() &&
      x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_contiguous() &&
      weight.is_contiguous()) {
    return TrainRmsNorm(x, weight, eps);  // the trainer: one pass forward, one backward
  }
  if (IsPlainCpuBf16(x) && IsPlainCpuBf16(weight) && x.is_contiguous()) {
    // The same arithmetic as below in one pass per row, without the six temporaries.
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    at::Tensor y = at::empty_like(x);
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < rows; ++r) {
      const at::BFloat16* xr = xp + r * dim;
      float ss = 0.f;
      for (int64_t d = 0; d < dim; ++d) ss += static_cast<float>(xr[d]) * static_cast<float>(xr[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) {
        const at::BFloat16 normed(static_cast<float>(xr[d]) * inv);
        yp[r * dim + d] = at::BFloat16(static_cast<float>(wp[d]) * static_cast<float>(normed));
      }
    }
    return y;
  }
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

RotaryTable MakeRotaryTable(const at::Tensor& positions, const at::Tensor& inv_freq) {
  // angles [n, hd/2] -> [n, 1, hd], broadcast over heads
  at::Tensor angles = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  at::Tensor emb = at::cat({angles, angles}, -1).unsqueeze(1);
  return {emb.cos(), emb.sin()};
}

void RotateHeadRow(const at::BFloat16* x, const float* c, const float* s, at::BFloat16* y,
                   int64_t hd, float sign) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; ++j) {  // both halves' values read before either is written
    const float a = static_cast<float>(x[j]), b = static_cast<float>(x[j + half]);
    y[j] = at::BFloat16(a * c[j] - sign * (b * s[j]));
    y[j + half] = at::BFloat16(b * c[j + half] + sign * (a * s[j + half]));
  }
}

at::Tensor ApplyRotary(const at::Tensor& x, const RotaryTable& table, bool may_overwrite) {
  if (IsPlainCpuBf16(x) && x.dim() == 3 && x.stride(2) == 1 && table.cos.is_contiguous() &&
      table.sin.is_contiguous() && table.cos.scalar_type() == at::kFloat &&
      table.cos.size(0) == x.size(0) && table.cos.size(2) == x.size(2)) {
    // x [n, heads, hd] (a strided view of the fused q/k/v rows) -> rotated in one pass, into a
    // contiguous tensor or over x itself.
    const int64_t n = x.size(0), heads = x.size(1), hd = x.size(2);
    at::Tensor y = may_overwrite ? x : at::empty({n, heads, hd}, x.options());
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    const float* cp = table.cos.data_ptr<float>();
    const float* sp = table.sin.data_ptr<float>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        RotateHeadRow(xp + i * x.stride(0) + h * x.stride(1), cp + i * hd, sp + i * hd,
                      yp + i * y.stride(0) + h * y.stride(1), hd);
      }
    }
    return y;
  }
  at::Tensor xf = x.to(at::kFloat);
  return (xf * table.cos + RotateHalf(xf) * table.sin).to(x.scalar_type());
}

LlavaModel::~LlavaModel() = default;

at::TensorOptions LlavaModel::tensor_options() const {
  return at::TensorOptions()
      .dtype(ScalarTypeOf(options_.dtype))
      .device(at::Device(options_.device));
}

KvLayout LlavaModel::kv_layout() const {
  KvLayout l;
  l.num_layers = config_.text.num_hidden_layers;
  l.kv_heads = config_.text.num_key_value_heads;
  l.head_dim = config_.text.head_dim;
  l.dtype = options_.dtype;
  l.device = options_.device;
  l.entries = options_.kv_dtype;
  return l;
}

StatusOr<std::unique_ptr<LlavaModel>> LlavaModel::Load(const std::string& dir,
                                                       const ModelOptions& options) {
  LLAVA_ASSIGN_OR_RETURN(LlavaConfig config, LoadLlavaConfig(dir));
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  return FromWeights(config, std::move(reader), options);
}

StatusOr<std::unique_ptr<LlavaModel>> LlavaModel::FromWeights(const LlavaConfig& config,
                                                              std::unique_ptr<WeightSource> weights,
                                                              const ModelOptions& options) {
  std::unique_ptr<LlavaModel> m(new LlavaModel());
  m->options_ = options;
  m->config_ = config;
  try {
    at::Device dev(options.device);
    if (dev.is_cuda() && !at::hasCUDA()) {
      return FailedPrecondition("device '" + options.device +
                                "' requested but this libtorch has no CUDA support or no GPU");
    }
  } catch (const c10::Error&) {
    return InvalidArgument("device '" + options.device + "' is not a valid device name");
  }
  m->weights_ = std::move(weights);
  try {
    LLAVA_RETURN_IF_ERROR(m->LoadWeights(m->weights_.get()));
  } catch (const c10::Error& e) {
    return Internal(std::string("loading weights failed: ") + e.what_without_backtrace());
  }
  return m;
}

// A tensor of the model: a plain one, a Linear, a LayerNorm, or a Linear whose weight (and
// bias) stacks the checkpoint's `parts` along the output rows.
struct LlavaModel::Slot {
  std::string name;
  at::Tensor* tensor = nullptr;
  Linear* linear = nullptr;
  LayerNorm* norm = nullptr;
  std::vector<std::string> parts;
};

std::vector<LlavaModel::Slot> LlavaModel::Slots() {
  std::vector<Slot> out;
  auto tensor = [&out](std::string name, at::Tensor* t) {
    out.push_back({std::move(name), t, nullptr, nullptr, {}});
  };
  auto linear = [&out](std::string name, Linear* l, std::vector<std::string> parts = {}) {
    out.push_back({std::move(name), nullptr, l, nullptr, std::move(parts)});
  };
  auto norm = [&out](std::string name, LayerNorm* n) {
    out.push_back({std::move(name), nullptr, nullptr, n, {}});
  };
  tensor("vision.embeddings.patch_embedding.weight", &patch_embedding_);
  tensor("vision.embeddings.class_embedding", &class_embedding_);
  tensor("vision.embeddings.position_embedding.weight", &position_embedding_);
  norm("vision.pre_layrnorm", &pre_layernorm_);
  for (size_t i = 0; i < clip_layers_.size(); ++i) {
    const std::string p = "vision.encoder.layers." + std::to_string(i);
    ClipLayer& l = clip_layers_[i];
    norm(p + ".layer_norm1", &l.ln1);
    norm(p + ".layer_norm2", &l.ln2);
    linear(p + ".self_attn.q_proj", &l.q);
    linear(p + ".self_attn.k_proj", &l.k);
    linear(p + ".self_attn.v_proj", &l.v);
    linear(p + ".self_attn.out_proj", &l.out);
    linear(p + ".mlp.fc1", &l.fc1);
    linear(p + ".mlp.fc2", &l.fc2);
  }
  linear("projector.linear_1", &proj1_);
  linear("projector.linear_2", &proj2_);
  tensor("lm.embed_tokens.weight", &embed_tokens_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = "lm.layers." + std::to_string(i);
    LlamaLayer& l = layers_[i];
    tensor(p + ".input_layernorm.weight", &l.input_norm);
    tensor(p + ".post_attention_layernorm.weight", &l.post_norm);
    // Stacked projections: one pass over the activations, one long weight stream per GEMM.
    linear(p + ".self_attn.qkv_proj", &l.qkv,
           {p + ".self_attn.q_proj", p + ".self_attn.k_proj", p + ".self_attn.v_proj"});
    linear(p + ".self_attn.o_proj", &l.o);
    linear(p + ".mlp.gate_up_proj", &l.gate_up, {p + ".mlp.gate_proj", p + ".mlp.up_proj"});
    linear(p + ".mlp.down_proj", &l.down);
  }
  tensor("lm.norm.weight", &final_norm_);
  return out;
}

Status LlavaModel::LoadWeights(WeightSource* reader) {
  const TextConfig& t = config_.text;
  Taker take(reader, options_, config_);
  clip_layers_.resize(config_.vision_layers_needed());
  layers_.resize(t.num_hidden_layers);
  if (options_.weights != WeightFormat::kBf16 && !at::Device(options_.device).is_cpu()) {
    return InvalidArgument(std::string("weights ") + WeightFormatName(options_.weights) +
                           " run on the CPU only (device '" + options_.device + "')");
  }
  if (options_.kv_dtype == KvDtype::kInt8 && !at::Device(options_.device).is_cpu()) {
    return InvalidArgument("an int8 KV cache runs on the CPU only (device '" + options_.device +
                           "')");
  }
  // The decoder's projections: stored quantized (llava-quantize: quantized_checkpoint.h), or
  // quantized here from fp32 when options_.weights asks for it, one layer at a time.
  std::optional<WeightFormat> stored;
  int plain = 0;
  for (const Slot& s : Slots()) {
    if (s.tensor != nullptr) {
      LLAVA_RETURN_IF_ERROR(take.Get(s.name, s.tensor));
      continue;
    }
    if (s.norm != nullptr) {
      LLAVA_RETURN_IF_ERROR(take.GetLayerNorm(s.name, config_.vision.layer_norm_eps, s.norm));
      continue;
    }
    const std::vector<std::string> parts =
        s.parts.empty() ? std::vector<std::string>{s.name} : s.parts;
    if (IsQuantizedLinear(s.name)) {
      QuantizedMatrix all;
      int found = 0;
      for (const std::string& part : parts) {
        QuantizedMatrix m;
        bool here = false;
        const std::vector<int64_t>& shape = take.Shape(part + ".weight");
        LLAVA_RETURN_IF_ERROR(TakeStoredQuantized(reader, part, shape[0], shape[1], &m, &here));
        if (!here) continue;
        if (found++ > 0 && m.format != all.format) {
          return InvalidArgument("quantized weights: '" + part + "' is " +
                                 WeightFormatName(m.format) + ", the layer's others " +
                                 WeightFormatName(all.format));
        }
        all.format = m.format;
        all.cols = m.cols;
        all.rows += m.rows;
        all.data.insert(all.data.end(), m.data.begin(), m.data.end());
        all.scale.insert(all.scale.end(), m.scale.begin(), m.scale.end());
        all.min.insert(all.min.end(), m.min.begin(), m.min.end());
      }
      if (found > 0) {
        if (found != static_cast<int>(parts.size()) || (stored && *stored != all.format)) {
          return InvalidArgument("quantized weights: '" + s.name +
                                 "' mixes formats, or quantized and plain parts");
        }
        stored = all.format;
        s.linear->packed = std::make_shared<const PackedQuant>(PackQuantized(all));
        std::vector<at::Tensor> biases;
        for (const std::string& part : parts) {
          at::Tensor b;
          LLAVA_RETURN_IF_ERROR(take.GetBias(part, &b));
          if (b.defined()) biases.push_back(b);
        }
        if (!biases.empty()) s.linear->bias = at::cat(biases, 0);
        continue;
      }
      ++plain;
    }
    const bool quantize = IsQuantizedLinear(s.name) && options_.weights != WeightFormat::kBf16;
    std::vector<at::Tensor> weights, biases;
    for (const std::string& part : parts) {
      at::Tensor w, b;
      LLAVA_RETURN_IF_ERROR(take.Get(part + ".weight", &w, /*fp32=*/quantize));
      LLAVA_RETURN_IF_ERROR(take.GetBias(part, &b));
      weights.push_back(w);
      if (b.defined()) biases.push_back(b);
    }
    s.linear->weight = weights.size() == 1 ? weights[0] : at::cat(weights, 0);
    if (weights.size() > 1) {  // stacked into a copy: the parts' mapped pages are not read again
      for (const std::string& part : parts) reader->ReleaseStored(part + ".weight");
    }
    if (!biases.empty()) s.linear->bias = biases.size() == 1 ? biases[0] : at::cat(biases, 0);
    if (quantize) LLAVA_RETURN_IF_ERROR(QuantizeLinear(s.linear, options_.weights));
  }
  if (stored) {
    if (plain > 0) {
      return InvalidArgument("quantized weights: the checkpoint holds " + std::to_string(plain) +
                             " decoder projections unquantized beside quantized ones");
    }
    if (options_.weights != WeightFormat::kBf16 && options_.weights != *stored) {
      return InvalidArgument(std::string("--weights ") + WeightFormatName(options_.weights) +
                             ": the checkpoint holds " + WeightFormatName(*stored) +
                             " weights (requantizing them is not supported)");
    }
    if (!at::Device(options_.device).is_cpu()) {
      return InvalidArgument(std::string("the checkpoint's ") + WeightFormatName(*stored) +
                             " weights run on the CPU only (device '" + options_.device + "')");
    }
    options_.weights = *stored;  // the format the model runs in
  }

  // The output projection: stored quantized, or lm_head (or the tied embeddings), quantized to
  // int8 when the decoder is (llama.cpp's Q4_K_M keeps it at 6 bits).
  QuantizedMatrix head;
  bool head_stored = false;
  LLAVA_RETURN_IF_ERROR(
      TakeStoredQuantized(reader, "lm_head", t.vocab_size, t.hidden_size, &head, &head_stored));
  if (head_stored) {
    if (!at::Device(options_.device).is_cpu()) {
      return InvalidArgument("the checkpoint's quantized lm_head runs on the CPU only");
    }
    logits_ = Linear{};
    logits_.packed = std::make_shared<const PackedQuant>(PackQuantized(head));
    return FinishLoad(reader);
  }
  if (!t.tie_word_embeddings) {
    LLAVA_RETURN_IF_ERROR(take.Get("lm_head.weight", &lm_head_));
  } else if (reader->Has("lm_head.weight")) {  // tied, but saved anyway: take it as it is
    LLAVA_RETURN_IF_ERROR(reader->Take("lm_head.weight", {t.vocab_size, t.hidden_size},
                                       options_.dtype, options_.device, &lm_head_));
  } else {
    lm_head_ = embed_tokens_;
  }
  logits_ = Linear{lm_head_, at::Tensor()};
  if (options_.weights != WeightFormat::kBf16) {
    LLAVA_RETURN_IF_ERROR(QuantizeLinear(&logits_, WeightFormat::kInt8));
    if (!lm_head_.is_same(embed_tokens_)) lm_head_ = at::Tensor();
  }
  return FinishLoad(reader);
}

Status LlavaModel::FinishLoad(WeightSource* reader) {
  const TextConfig& t = config_.text;
  const int64_t hd = t.head_dim;
  inv_freq_ = at::pow(t.rope_theta, at::arange(0, hd, 2, at::kDouble) / static_cast<double>(hd))
                  .reciprocal()
                  .to(at::kFloat)
                  .to(at::Device(options_.device));

  const LlavaConfig& cfg = config_;
  return reader->CheckAllTaken(
      [&cfg](const std::string& name) { return IgnorableTensor(name, cfg); });
}

std::vector<std::pair<std::string, at::Tensor*>> LlavaModel::MutableParameters() {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  auto add = [&out](const std::string& name, at::Tensor* t) {
    if (t->defined()) out.emplace_back(name, t);
  };
  for (const Slot& s : Slots()) {
    if (s.tensor != nullptr) {
      add(s.name, s.tensor);
    } else if (s.norm != nullptr) {
      add(s.name + ".weight", &s.norm->weight);
      add(s.name + ".bias", &s.norm->bias);
    } else {
      add(s.name + ".weight", &s.linear->weight);
      add(s.name + ".bias", &s.linear->bias);
    }
  }
  if (!lm_head_.is_same(embed_tokens_)) add("lm_head.weight", &lm_head_);
  return out;
}

at::Tensor LlavaModel::EncodeImages(const at::Tensor& pixel_values) const {
  const VisionConfig& v = config_.vision;
  const int64_t b = pixel_values.size(0), dv = v.hidden_size, heads = v.num_attention_heads;
  const int64_t hd = dv / heads;
  at::Tensor px = pixel_values.to(tensor_options());
  // [B, Dv, g, g] -> [B, N, Dv]
  at::Tensor x = FastBf16Matmul(px) ? at::conv2d(px, patch_embedding_, {}, v.patch_size)
                                    : at::conv2d(px.to(at::kFloat), patch_embedding_.to(at::kFloat),
                                                 {}, v.patch_size)
                                          .to(px.scalar_type());
  x = x.flatten(2).transpose(1, 2);
  x = at::cat({class_embedding_.view({1, 1, dv}).expand({b, 1, dv}), x}, 1) + position_embedding_;
  x = pre_layernorm_(x);  // [B, N+1, Dv]
  const int64_t s = x.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (const ClipLayer& l : clip_layers_) {
    at::Tensor h = l.ln1(x);
    auto heads_view = [&](const at::Tensor& t) {
      return t.view({b, s, heads, hd}).transpose(1, 2);
    };
    at::Tensor q = heads_view(l.q(h) * scale), k = heads_view(l.k(h)), vv = heads_view(l.v(h));
    if (!FastBf16Matmul(q)) {  // fp32 products, back to bf16 after the attention
      q = q.to(at::kFloat), k = k.to(at::kFloat), vv = vv.to(at::kFloat);
    }
    at::Tensor scores = at::matmul(q, k.transpose(-1, -2));
    at::Tensor probs;
    if (scores.is_cpu() && !scores.requires_grad()) {
      probs = scores.to(at::kFloat).contiguous();  // softmax rows in place (cpu_ops.h)
      SoftmaxRows(probs.data_ptr<float>(), probs.numel() / s, s);
    } else if (scores.is_cpu()) {  // the trainer: no mask (every row sees all s columns)
      probs = TrainCausalSoftmax(scores, 1.0, s);
    } else {
      probs = at::softmax(scores, -1, at::kFloat);
    }
    at::Tensor attn = at::matmul(probs.to(vv.scalar_type()), vv)
                          .to(x.scalar_type())
                          .transpose(1, 2)
                          .reshape({b, s, dv});
    x = x + l.out(attn);
    h = l.fc1(l.ln2(x));
    if (v.hidden_act == "quick_gelu" && IsPlainCpuBf16(h) && h.is_contiguous()) {
      QuickGeluBf16(reinterpret_cast<const uint16_t*>(h.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>()), h.numel());
    } else if (v.hidden_act == "quick_gelu" && IsTrainingCpu(h, at::kBFloat16)) {
      h = TrainQuickGelu(h);  // the trainer: one pass forward, one backward
    } else {
      h = v.hidden_act == "quick_gelu" ? h * at::sigmoid(1.702 * h) : Gelu(h);
    }
    x = x + l.fc2(h);
  }
  if (config_.vision_feature_select_strategy == "default") x = x.narrow(1, 1, s - 1);
  return proj2_(Gelu(proj1_(x)));  // [B, N, D]
}

at::Tensor LlavaModel::Embed(const at::Tensor& ids) const {
  return at::embedding(embed_tokens_, ids.to(at::Device(options_.device)));
}

at::Tensor LlavaModel::EmbedPrompt(const std::vector<int>& ids,
                                   const std::vector<int>& image_offsets,
                                   const at::Tensor& image_features) const {
  std::vector<int64_t> ids64(ids.begin(), ids.end());
  const int64_t n_img = config_.image_tokens();
  for (int off : image_offsets) {
    for (int64_t i = off; i < off + n_img; ++i) ids64[i] = 0;  // placeholder row, overwritten
  }
  at::Tensor x = Embed(at::tensor(ids64, at::kLong));  // [T, D]
  for (size_t i = 0; i < image_offsets.size(); ++i) {
    x.narrow(0, image_offsets[i], n_img).copy_(image_features[static_cast<int64_t>(i)]);
  }
  return x;
}

at::Tensor CachedAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const ProbsObserver* observer) {
  if (!FastBf16Matmul(q)) {  // the same attention in fp32 (the cache stays bf16)
    return CachedAttention(q.to(at::kFloat), keys.to(at::kFloat), values.to(at::kFloat), observer)
        .to(q.scalar_type());
  }
  const int64_t n = q.size(0), h = q.size(1), hd = q.size(2);
  const int64_t hkv = keys.size(0), len = keys.size(1), g = h / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  // Query heads sharing a KV head are stacked: [Hkv, G, n, hd].
  at::Tensor q4 = q.permute({1, 0, 2}).reshape({hkv, g, n, hd});
  at::Tensor keys_t = keys.transpose(1, 2);  // [Hkv, hd, L]
  std::vector<at::Tensor> outs;
  const int64_t block =
      std::clamp<int64_t>(kQueryBlockBytes / std::max<int64_t>(1, h * len * int64_t{sizeof(float)}),
                          kMinQueryBlock, kQueryBlock);
  // (A split rather than a narrow per block: under autograd, one concatenation backward.)
  const std::vector<at::Tensor> blocks = q4.split(block, 2);
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    const int64_t bn = std::min(block, n - i0);
    at::Tensor qb = blocks[i0 / block].reshape({hkv, g * bn, hd});
    at::Tensor scores = at::matmul(qb, keys_t).view({hkv, g, bn, len});  // not yet scaled
    // Row i0+r sits at cache index len-n+i0+r and may see keys up to there.
    at::Tensor probs;                                 // [Hkv, G, bn, L] fp32
    if (scores.is_cpu() && scores.requires_grad()) {  // the trainer: scale, mask and softmax fused
      probs = TrainCausalSoftmax(scores, scale, len - n + i0 + 1);
    } else if (scores.is_cpu()) {
      scores.mul_(scale);
      probs = scores.to(at::kFloat).contiguous();  // masked softmax in place (cpu_ops.h)
      scores = at::Tensor();
      float* pp = probs.data_ptr<float>();
      for (int64_t blk = 0; blk < hkv * g; ++blk) {
        CausalSoftmaxRows(pp + blk * bn * len, bn, len, len - n + i0 + 1);
      }
    } else {
      scores.mul_(scale);
      if (n > 1) {
        const at::TensorOptions idx = at::TensorOptions(at::kLong).device(scores.device());
        at::Tensor rows = at::arange(i0, i0 + bn, idx).unsqueeze(1) + (len - n);
        at::Tensor cols = at::arange(len, idx).unsqueeze(0);
        at::Tensor masked = cols > rows;  // [bn, L], made where the scores are
        scores = scores.masked_fill(masked, -std::numeric_limits<float>::infinity());
      }
      probs = at::softmax(scores, -1, at::kFloat);
    }
    if (observer != nullptr) (*observer)(i0, probs.view({h, bn, len}));
    outs.push_back(at::matmul(probs.to(values.scalar_type()).view({hkv, g * bn, len}), values)
                       .view({hkv, g, bn, hd}));
  }
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 2);  // [Hkv, G, n, hd]
  return out.reshape({h, n, hd}).transpose(0, 1).reshape({n, h * hd});
}

at::Tensor LlavaModel::Attention(const at::Tensor& q, const at::Tensor& k_new,
                                 const at::Tensor& v_new, int layer, SequenceKv* kv) const {
  // q [n, H, hd], k_new/v_new [n, Hkv, hd] (rotated) -> out [n, H*hd]
  const at::Tensor kt = k_new.transpose(0, 1), vt = v_new.transpose(0, 1);  // [Hkv, n, hd]
  // A prompt fed whole attends to its own rows: no need to read them back out of the pool.
  const bool fresh = kv->Length(layer) == 0;
  kv->Append(layer, kt, vt);
  const at::Tensor keys = fresh ? kt : kv->Keys(layer);
  const at::Tensor values = fresh ? vt : kv->Values(layer);
  if (!kv->WantsAttentionProbs(layer)) return CachedAttention(q, keys, values, nullptr);
  // Each query block's probabilities go to the cache as they are computed, so at most
  // [H, 256, len] of them exist at a time.
  const ProbsObserver observe = [kv, layer](int64_t, const at::Tensor& probs) {
    kv->ObserveAttention(layer, probs);
  };
  return CachedAttention(q, keys, values, &observe);
}

at::Tensor LlavaModel::AllAttention(const std::vector<SequenceChunk>& chunks,
                                    const std::vector<int64_t>& offsets,
                                    const std::vector<size_t>& decode_rows, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v, int layer) const {
  std::vector<at::Tensor> attn(chunks.size());
  if (!decode_rows.empty()) {
    const size_t b = decode_rows.size();
    std::vector<at::Tensor> probs;
    std::vector<DecodeKv> stored;
    std::vector<bool> want(b);
    std::vector<int64_t> rows(b);
    bool any_want = false;
    // The kernel (CPU or CUDA) reads each cache where it is, through its page table.
    // [Hkv, N, hd] views made once: each sequence's row is then a single narrow.
    const at::Tensor kt = k.transpose(0, 1), vt = v.transpose(0, 1);
    for (size_t i = 0; i < b; ++i) {
      SequenceKv* kv = chunks[decode_rows[i]].kv;
      rows[i] = offsets[decode_rows[i]];
      kv->Append(layer, kt.narrow(1, rows[i], 1), vt.narrow(1, rows[i], 1));
      const KvStorage st = kv->Storage(layer);
      DecodeKv d;
      d.keys = st.keys;
      d.values = st.values;
      d.pages = st.pages;
      d.page_rows = st.page_rows;
      d.page_stride = st.page_stride;
      d.key_head_stride = st.key_head_stride;
      d.value_head_stride = st.value_head_stride;
      d.key_row_stride = d.value_row_stride = st.row_stride;
      d.len = st.len;
      d.key_scales = st.key_scales;
      d.value_scales = st.value_scales;
      d.scale_page_stride = st.scale_page_stride;
      d.scale_head_stride = st.scale_head_stride;
      stored.push_back(d);
      want[i] = kv->WantsAttentionProbs(layer);
      any_want = any_want || want[i];
    }
    const bool all = b == chunks.size();  // then rows are 0..b-1 in order
    const at::Tensor qd = all ? q : q.index_select(0, at::tensor(rows, at::kLong).to(q.device()));
    const at::ScalarType kv_type =
        chunks[decode_rows[0]].kv->layout().int8() ? at::kChar : k.scalar_type();
    at::Tensor out =
        DecodeAttention(qd, stored, kv_type, k.size(1), want, any_want ? &probs : nullptr);
    for (size_t i = 0; i < b; ++i) {
      if (want[i]) chunks[decode_rows[i]].kv->ObserveAttention(layer, probs[i]);
    }
    if (all) return out;
    for (size_t i = 0; i < b; ++i) attn[decode_rows[i]] = out.narrow(0, static_cast<int64_t>(i), 1);
  }
  // One split into the chunks' rows rather than a narrow per chunk: the same views, but under
  // autograd a narrow's backward makes a zero tensor of all N rows for each chunk and adds it
  // up (5% of a training step at 16 sequences), where a split's backward is one concatenation.
  std::vector<int64_t> sizes;
  for (const SequenceChunk& c : chunks) sizes.push_back(c.embeds.size(0));
  const std::vector<at::Tensor> qs = q.split_with_sizes(sizes), ks = k.split_with_sizes(sizes),
                                vs = v.split_with_sizes(sizes);
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (attn[c].defined()) continue;
    attn[c] = Attention(qs[c], ks[c], vs[c], layer, chunks[c].kv);
  }
  return attn.size() == 1 ? attn[0] : at::cat(attn, 0);
}

at::Tensor LlavaModel::Forward(const std::vector<SequenceChunk>& chunks,
                               std::vector<at::Tensor>* layer_outputs) const {
  const TextConfig& t = config_.text;
  const int64_t nh = t.num_attention_heads, nkv = t.num_key_value_heads, hd = t.head_dim;
  std::vector<at::Tensor> embeds;
  std::vector<int64_t> offsets, logit_rows, positions;
  int64_t total = 0;
  for (const SequenceChunk& c : chunks) {
    const int64_t n = c.embeds.size(0);
    embeds.push_back(c.embeds);
    for (int64_t i = 0; i < n; ++i) positions.push_back(c.start_position + i);
    offsets.push_back(total);
    if (!c.logit_rows.empty()) {
      for (int64_t i : c.logit_rows) logit_rows.push_back(total + i);
    } else if (c.all_logits) {
      for (int64_t i = 0; i < n; ++i) logit_rows.push_back(total + i);
    } else {
      logit_rows.push_back(total + n - 1);
    }
    total += n;
  }
  const at::Device dev(options_.device);
  // Chunks of one new token (decoding) share one DecodeAttention call per layer (CPU, CUDA).
  std::vector<size_t> decode_rows;
  // (The trainer's forward, whose weights require grad, keeps ATen's differentiable path.)
  if (DecodeAttentionRunsOn(dev) && !embed_tokens_.requires_grad()) {
    for (size_t c = 0; c < chunks.size(); ++c) {
      if (chunks[c].embeds.size(0) == 1) decode_rows.push_back(c);
    }
  }
  at::Tensor x = embeds.size() == 1 ? embeds[0] : at::cat(embeds, 0);  // [N, D]
  at::Tensor pos = at::tensor(positions, at::kLong).to(dev);           // [N]
  const RotaryTable rope = MakeRotaryTable(pos, inv_freq_);

  // Each temporary is dropped as soon as the next step has read it: at 7B widths a 256-row
  // pass holds ~25 MB at its peak instead of ~50 (docs/BENCHMARKS.md, "The paged KV pool").
  for (int li = 0; li < t.num_hidden_layers; ++li) {
    const LlamaLayer& l = layers_[li];
    at::Tensor qkv = l.qkv(RmsNorm(x, l.input_norm, t.rms_norm_eps));  // [N, (H + 2 Hkv) hd]
    at::Tensor q, k, v;
    if (IsTrainingCpu(qkv, at::kBFloat16) && rope.cos.scalar_type() == at::kFloat &&
        rope.cos.is_contiguous() &&
        rope.sin.is_contiguous()) {  // the trainer: split and rotation in one pass each way
      const std::vector<at::Tensor> qkv3 = TrainQkvRotary(qkv, rope.cos, rope.sin, nh, nkv);
      q = qkv3[0];
      k = qkv3[1];
      v = qkv3[2];
    } else {
      // Rotated over their rows of qkv: q, k and v stay views of it.
      q = ApplyRotary(qkv.narrow(1, 0, nh * hd).view({total, nh, hd}), rope, true);
      k = ApplyRotary(qkv.narrow(1, nh * hd, nkv * hd).view({total, nkv, hd}), rope, true);
      v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view({total, nkv, hd});
    }
    at::Tensor attn = AllAttention(chunks, offsets, decode_rows, q, k, v, li);
    qkv = q = k = v = at::Tensor();
    x = x + l.o(attn);
    attn = at::Tensor();
    at::Tensor gate_up = l.gate_up(RmsNorm(x, l.post_norm, t.rms_norm_eps));  // [N, 2F]
    at::Tensor act = SwiGlu(std::move(gate_up), t.intermediate_size);
    at::Tensor down = l.down(act);
    act = at::Tensor();
    x = x + down;
    if (layer_outputs != nullptr) layer_outputs->push_back(x);
  }
  at::Tensor rows = at::tensor(logit_rows, at::kLong).to(dev);
  at::Tensor last = RmsNorm(x.index_select(0, rows), final_norm_, t.rms_norm_eps);
  // The kernels of every other Linear: a decode step's few rows take the GEMV on every CPU
  // path (oneDNN ran one row at a quarter of its speed; docs/BENCHMARKS.md).
  return logits_(last).to(at::kFloat);  // [rows, V]
}

}  // namespace llava
