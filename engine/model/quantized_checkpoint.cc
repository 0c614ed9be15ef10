#include "engine/model/quantized_checkpoint.h"

#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/safetensors.h"
#include "engine/io/weight_manifest.h"
#include "engine/model/weights.h"

namespace llava {
namespace {

namespace fs = std::filesystem;

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A stored F16 [rows, groups] tensor into `out`, every value finite.
Status TakeHalves(WeightSource* source, const std::string& name, int64_t rows, int64_t groups,
                  std::vector<uint16_t>* out) {
  const TensorInfo* t = source->TakeStored(name);
  if (t == nullptr) return InvalidArgument("quantized weights: tensor '" + name + "' is missing");
  const std::vector<int64_t> want = {rows, groups};
  if (t->dtype != DType::kF16 || t->shape != want) {
    return InvalidArgument("quantized weights: tensor '" + name + "' is " + DTypeName(t->dtype) +
                           " " + ShapeString(t->shape) + ", expected F16 " + ShapeString(want));
  }
  out->resize(rows * groups);
  std::memcpy(out->data(), t->data, t->nbytes);
  source->ReleaseStored(name);
  for (uint16_t h : *out) {
    if ((h & 0x7c00) == 0x7c00) {
      return InvalidArgument("quantized weights: tensor '" + name + "' holds a NaN or infinity");
    }
  }
  return Status::Ok();
}

// A stored floating matrix as floats (the quantizer's input).
StatusOr<std::vector<float>> ToFloats(const TensorInfo& t) {
  std::vector<float> out(t.numel());
  const uint8_t* p = t.data;
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(out.data(), p, t.nbytes);
      break;
    case DType::kBF16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const uint32_t bits = uint32_t{h} << 16;
        std::memcpy(&out[i], &bits, 4);
      }
      break;
    case DType::kF16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case DType::kU8:
      return InvalidArgument("tensor '" + t.name + "' is U8, not a floating matrix");
  }
  for (float v : out) {
    if (!std::isfinite(v)) return InvalidArgument("tensor '" + t.name + "' is not finite");
  }
  return out;
}

}  // namespace

bool IsQuantizedLinear(const std::string& layer) {
  if (layer == "lm_head") return true;
  if (layer.rfind("lm.layers.", 0) != 0) return false;
  for (const char* p : {".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj",
                        ".self_attn.qkv_proj", ".self_attn.o_proj", ".mlp.gate_proj",
                        ".mlp.up_proj", ".mlp.gate_up_proj", ".mlp.down_proj"}) {
    if (EndsWith(layer, p)) return true;
  }
  return false;
}

Status TakeStoredQuantized(WeightSource* source, const std::string& layer, int64_t rows,
                           int64_t cols, QuantizedMatrix* out, bool* found) {
  *found = false;
  const std::string qname = layer + ".qweight";
  if (!source->Has(qname)) return Status::Ok();
  *found = true;
  const TensorInfo* q = source->TakeStored(qname);
  if (q == nullptr) {
    return InvalidArgument("quantized weights: tensor '" + qname + "' has no stored bytes");
  }
  QuantizedMatrix m;
  m.rows = rows;
  m.cols = cols;
  const int64_t padded = m.padded_cols();
  if (q->dtype != DType::kU8 || q->shape.size() != 2 || q->shape[0] != rows ||
      (q->shape[1] != padded && q->shape[1] != padded / 2)) {
    return InvalidArgument("quantized weights: tensor '" + qname + "' is " + DTypeName(q->dtype) +
                           " " + ShapeString(q->shape) + ", expected U8 [" + std::to_string(rows) +
                           ", " + std::to_string(padded) + "] (int8) or [" + std::to_string(rows) +
                           ", " + std::to_string(padded / 2) + "] (int4)");
  }
  m.format = q->shape[1] == padded ? WeightFormat::kInt8 : WeightFormat::kInt4;
  m.data.assign(q->data, q->data + q->nbytes);
  source->ReleaseStored(qname);
  LLAVA_RETURN_IF_ERROR(TakeHalves(source, layer + ".scales", rows, m.groups_per_row(), &m.scale));
  const bool has_mins = source->Has(layer + ".mins");
  if (m.format == WeightFormat::kInt4) {
    LLAVA_RETURN_IF_ERROR(TakeHalves(source, layer + ".mins", rows, m.groups_per_row(), &m.min));
  } else if (has_mins) {
    return InvalidArgument("quantized weights: tensor '" + layer +
                           ".mins' belongs to int4 values, but '" + qname + "' holds int8 ones");
  }
  *out = std::move(m);
  return Status::Ok();
}

Status WriteQuantizedCheckpoint(const std::string& src, const std::string& out, WeightFormat format,
                                std::string* summary) {
  if (format != WeightFormat::kInt8 && format != WeightFormat::kInt4) {
    return InvalidArgument(std::string("--weights: a quantized checkpoint is int8 or int4, not ") +
                           WeightFormatName(format));
  }
  LLAVA_ASSIGN_OR_RETURN(LlavaConfig config, LoadLlavaConfig(src));
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(src));
  std::error_code ec;
  if (fs::exists(out, ec) && fs::equivalent(src, out, ec)) {
    return InvalidArgument("--out must be another folder than --model");
  }
  fs::create_directories(out, ec);
  if (ec) return InvalidArgument("--out " + out + ": " + ec.message());
  for (const fs::directory_entry& e : fs::directory_iterator(out)) {
    if (EndsWith(e.path().filename().string(), ".safetensors")) {
      return InvalidArgument("--out " + out + " already holds " + e.path().filename().string());
    }
  }

  const std::vector<std::string> names = reader->CanonicalNames();
  const std::string embed = "lm.embed_tokens.weight";
  if (reader->Find(embed) == nullptr) return InvalidArgument(src + ": no '" + embed + "'");
  const TensorNaming naming = reader->OriginalName(embed).rfind("language_model.", 0) == 0
                                  ? TensorNaming::kOld
                                  : TensorNaming::kNew;

  std::deque<QuantizedMatrix> quantized;  // stable addresses for the writer
  std::vector<TensorToWrite> tensors;
  int64_t layers = 0, source_bytes = 0, written_bytes = 0;
  auto quantize = [&](const TensorInfo& t, const std::string& layer, WeightFormat f) -> Status {
    if (t.shape.size() != 2) return InvalidArgument(src + ": '" + t.name + "' is not a matrix");
    LLAVA_ASSIGN_OR_RETURN(std::vector<float> w, ToFloats(t));
    LLAVA_ASSIGN_OR_RETURN(QuantizedMatrix q, QuantizeMatrix(w.data(), t.shape[0], t.shape[1], f));
    const QuantizedMatrix& m = quantized.emplace_back(std::move(q));
    const std::vector<int64_t> groups = {m.rows, m.groups_per_row()};
    const std::string base = CheckpointTensorName(layer, naming);
    tensors.push_back({base + ".qweight", DType::kU8, {m.rows, m.row_bytes()}, m.data.data()});
    tensors.push_back({base + ".scales", DType::kF16, groups, m.scale.data()});
    if (!m.min.empty()) tensors.push_back({base + ".mins", DType::kF16, groups, m.min.data()});
    written_bytes += m.bytes();
    ++layers;
    return Status::Ok();
  };
  for (const std::string& name : names) {
    const TensorInfo& t = *reader->Find(name);
    source_bytes += static_cast<int64_t>(t.nbytes);
    if (EndsWith(name, ".qweight")) {
      return InvalidArgument(src + ": already quantized ('" + reader->OriginalName(name) + "')");
    }
    const std::string layer =
        EndsWith(name, ".weight") ? name.substr(0, name.size() - 7) : std::string();
    if (!layer.empty() && IsQuantizedLinear(layer)) {
      LLAVA_RETURN_IF_ERROR(quantize(t, layer, layer == "lm_head" ? WeightFormat::kInt8 : format));
    } else {
      tensors.push_back({reader->OriginalName(name), t.dtype, t.shape, t.data});
      written_bytes += static_cast<int64_t>(t.nbytes);
    }
  }
  // Tied embeddings: the output projection is their quantization; the embeddings stay.
  if (reader->Find("lm_head.weight") == nullptr) {
    if (!config.text.tie_word_embeddings) return InvalidArgument(src + ": no lm_head.weight");
    LLAVA_RETURN_IF_ERROR(quantize(*reader->Find(embed), "lm_head", WeightFormat::kInt8));
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"llava.weights", WeightFormatName(format)},
      {"llava.quant_group", std::to_string(kQuantGroup)}};
  LLAVA_RETURN_IF_ERROR(WriteSafetensors(out + "/model.safetensors", tensors, metadata));

  // The folder's other files: config, tokenizer, preprocessor, chat template.
  for (const fs::directory_entry& e : fs::directory_iterator(src)) {
    const std::string file = e.path().filename().string();
    if (!e.is_regular_file() || EndsWith(file, ".safetensors") ||
        file == "model.safetensors.index.json") {
      continue;
    }
    fs::copy_file(e.path(), fs::path(out) / file, fs::copy_options::overwrite_existing, ec);
    if (ec) return InvalidArgument("copying " + e.path().string() + ": " + ec.message());
  }
  if (summary != nullptr) {
    *summary = out + "/model.safetensors: " + std::to_string(layers) + " linear layers in " +
               WeightFormatName(format) + " (the output projection in int8), " +
               std::to_string(written_bytes >> 20) +
               " MiB of tensors (the source's: " + std::to_string(source_bytes >> 20) + " MiB)";
  }
  return Status::Ok();
}

}  // namespace llava
