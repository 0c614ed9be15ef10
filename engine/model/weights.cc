#include "engine/model/weights.h"

#include <ATen/ATen.h>
#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/io/aten_dtype.h"

namespace llava {
namespace {

bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string ShapeMismatch(const std::string& where, const std::string& name,
                          const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
  return where + ": tensor '" + name + "' has shape " + ShapeString(got) + ", config implies " +
         ShapeString(want);
}

std::string UnusedList(std::vector<std::string> unused) {
  std::sort(unused.begin(), unused.end());
  std::string list;
  for (size_t i = 0; i < unused.size() && i < 8; ++i) list += (i ? ", " : "") + unused[i];
  if (unused.size() > 8) list += ", ... (" + std::to_string(unused.size()) + " in all)";
  return list;
}

class TensorMapSource final : public WeightSource {
 public:
  explicit TensorMapSource(std::vector<std::pair<std::string, at::Tensor>> tensors) {
    for (auto& [name, t] : tensors) tensors_[name] = std::move(t);
  }
  bool Has(const std::string& name) const override { return tensors_.count(name) > 0; }
  Status Take(const std::string& name, const std::vector<int64_t>& shape, DType dtype,
              const std::string& device, at::Tensor* out) override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return NotFound("missing tensor '" + name + "'");
    if (it->second.sizes().vec() != shape) {
      return InvalidArgument(ShapeMismatch("weights", name, it->second.sizes().vec(), shape));
    }
    taken_.insert(name);
    *out = it->second.to(at::Device(device), ScalarTypeOf(dtype)).contiguous();
    return Status::Ok();
  }
  Status CheckAllTaken(const std::function<bool(const std::string&)>& ignorable) const override {
    std::vector<std::string> unused;
    for (const auto& [name, t] : tensors_) {
      if (!taken_.count(name) && !ignorable(name)) unused.push_back(name);
    }
    if (unused.empty()) return Status::Ok();
    return InvalidArgument("unexpected tensors not used by the model: " + UnusedList(unused));
  }

 private:
  std::unordered_map<std::string, at::Tensor> tensors_;
  std::set<std::string> taken_;
};

}  // namespace

std::unique_ptr<WeightSource> NewTensorMapSource(
    std::vector<std::pair<std::string, at::Tensor>> tensors) {
  return std::make_unique<TensorMapSource>(std::move(tensors));
}

StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& dir) {
  std::unique_ptr<CheckpointReader> r(new CheckpointReader());
  r->dir_ = dir;
  std::vector<std::string> shards;
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (FileExists(index_path)) {
    std::ifstream in(index_path);
    std::stringstream ss;
    ss << in.rdbuf();
    LLAVA_ASSIGN_OR_RETURN(shards, ParseSafetensorsIndex(ss.str(), index_path));
  } else if (FileExists(dir + "/model.safetensors")) {
    shards.push_back("model.safetensors");
  } else {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return NotFound(dir + ": model folder not found");
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) shards.push_back(n);
    }
    closedir(d);
    std::sort(shards.begin(), shards.end());
  }
  if (shards.empty()) return NotFound(dir + ": no .safetensors files");

  for (const auto& shard : shards) {
    LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f,
                           SafetensorsFile::Open(dir + "/" + shard));
    for (const auto& t : f->tensors()) {
      auto canonical = CanonicalTensorName(t.name);
      if (!canonical.ok()) return InvalidArgument(f->path() + ": " + canonical.status().message());
      if (r->tensors_.count(*canonical)) {
        return InvalidArgument(f->path() + ": tensor '" + t.name + "' duplicates '" +
                               r->original_names_[*canonical] + "'");
      }
      r->tensors_[*canonical] = &t;
      r->original_names_[*canonical] = t.name;
      r->files_by_tensor_[*canonical] = f.get();
    }
    r->files_.push_back(std::move(f));
  }
  return r;
}

int64_t CheckpointReader::ParameterCount() const {
  int64_t n = 0;
  for (const auto& [name, info] : tensors_) n += info->numel();
  return n;
}

StatusOr<int64_t> CheckpointParameterCount(const std::string& dir) {
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  return reader->ParameterCount();
}

const TensorInfo* CheckpointReader::Find(const std::string& canonical) const {
  auto it = tensors_.find(canonical);
  return it == tensors_.end() ? nullptr : it->second;
}

Status CheckpointReader::Take(const std::string& canonical, const std::vector<int64_t>& shape,
                              DType dtype, const std::string& device, at::Tensor* out) {
  const TensorInfo* info = Find(canonical);
  if (info == nullptr) return NotFound(dir_ + ": missing tensor '" + canonical + "'");
  if (info->shape != shape) {
    return InvalidArgument(ShapeMismatch(dir_, original_names_[canonical], info->shape, shape));
  }
  taken_.insert(canonical);
  const at::ScalarType src_type = ScalarTypeOf(info->dtype);
  const bool aligned = reinterpret_cast<uintptr_t>(info->data) % DTypeSize(info->dtype) == 0;
  at::Tensor t;
  if (aligned) {
    t = at::from_blob(const_cast<uint8_t*>(info->data), shape, at::TensorOptions().dtype(src_type));
  } else {
    t = at::empty(shape, at::TensorOptions().dtype(src_type));
    std::memcpy(t.data_ptr(), info->data, info->nbytes);
  }
  const at::Device dev(device);
  if (info->dtype == dtype && dev.is_cpu() && aligned) {
    *out = t;  // aliases the read-only mapping: never written to
  } else {
    *out = t.to(dev, ScalarTypeOf(dtype), /*non_blocking=*/false, /*copy=*/true).contiguous();
    ReleaseStored(canonical);
  }
  return Status::Ok();
}

const TensorInfo* CheckpointReader::TakeStored(const std::string& canonical) {
  const TensorInfo* info = Find(canonical);
  if (info != nullptr) taken_.insert(canonical);
  return info;
}

void CheckpointReader::ReleaseStored(const std::string& canonical) {
  auto it = files_by_tensor_.find(canonical);
  if (it != files_by_tensor_.end()) it->second->ReleasePages(*tensors_.at(canonical));
}

std::vector<std::string> CheckpointReader::CanonicalNames() const {
  std::vector<std::string> names;
  for (const auto& [name, info] : tensors_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Status CheckpointReader::CheckAllTaken(
    const std::function<bool(const std::string&)>& ignorable) const {
  std::vector<std::string> unused;
  for (const auto& [name, info] : tensors_) {
    if (!taken_.count(name) && !ignorable(name)) unused.push_back(original_names_.at(name));
  }
  if (unused.empty()) return Status::Ok();
  return InvalidArgument(dir_ +
                         ": unexpected tensors not used by the model: " + UnusedList(unused));
}

}  // namespace llava
