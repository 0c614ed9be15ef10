// A llava-hf checkpoint folder: tensor lookup under canonical names, shape checks, dtype
// conversion, and the "every tensor used exactly once" check.
//
// Files: `model.safetensors`, or shards listed in `model.safetensors.index.json`, or (without
// an index) every `*.safetensors` in the folder.
// Tensors are looked up under the canonical names of engine/io/weight_manifest.h.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/io/safetensors.h"
#include "engine/io/status.h"
#include "engine/io/weight_manifest.h"

namespace at {
class Tensor;
}

namespace llava {

// Where model weights come from, under canonical names: a checkpoint folder, or tensors in
// memory (benchmarks, the trainer). The model takes each tensor once, then checks that
// nothing unexpected is left over.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool Has(const std::string& canonical) const = 0;
  // Loads tensor `canonical`, which must have `shape`, as `dtype` on `device` ("cpu",
  // "cuda", "cuda:1"). The result may alias memory the source owns, so the source must
  // outlive the tensor.
  virtual Status Take(const std::string& canonical, const std::vector<int64_t>& shape, DType dtype,
                      const std::string& device, at::Tensor* out) = 0;
  // Tensor `canonical` as the file stores it (any dtype, no conversion), marked taken; nullptr
  // when absent or when the source holds no stored bytes (in-memory tensors). The quantized
  // weights' way in (engine/model/quantized_checkpoint.h); valid while the source lives.
  virtual const TensorInfo* TakeStored(const std::string& canonical) { return nullptr; }
  // The caller has copied what TakeStored gave and will not read it again: its mapped pages may
  // leave the process's resident memory (SafetensorsFile::ReleasePages).
  virtual void ReleaseStored(const std::string& canonical) {}
  // Fails, naming them, if tensors remain that were never taken and `ignorable` rejects.
  virtual Status CheckAllTaken(const std::function<bool(const std::string&)>& ignorable) const = 0;
};

// In-memory tensors with canonical names (stored in any floating dtype).
std::unique_ptr<WeightSource> NewTensorMapSource(
    std::vector<std::pair<std::string, at::Tensor>> tensors);

class CheckpointReader final : public WeightSource {
 public:
  static StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& dir);

  // nullptr when absent.
  const TensorInfo* Find(const std::string& canonical) const;
  bool Has(const std::string& canonical) const override { return Find(canonical) != nullptr; }

  // When the stored dtype already matches and the device is the CPU, the tensor aliases the
  // read-only memory mapping (no copy); otherwise the copy is made and the mapped bytes' pages
  // are released from resident memory (ReleaseStored).
  Status Take(const std::string& canonical, const std::vector<int64_t>& shape, DType dtype,
              const std::string& device, at::Tensor* out) override;
  const TensorInfo* TakeStored(const std::string& canonical) override;
  void ReleaseStored(const std::string& canonical) override;
  Status CheckAllTaken(const std::function<bool(const std::string&)>& ignorable) const override;

  const std::string& dir() const { return dir_; }
  // Every tensor's canonical name, sorted, and the name the file gives it.
  std::vector<std::string> CanonicalNames() const;
  const std::string& OriginalName(const std::string& canonical) const {
    return original_names_.at(canonical);
  }
  // The number of elements of every tensor in the folder (read from the headers).
  int64_t ParameterCount() const;

 private:
  CheckpointReader() = default;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const TensorInfo*> tensors_;  // canonical -> info
  std::unordered_map<std::string, std::string> original_names_;
  std::unordered_map<std::string, const SafetensorsFile*> files_by_tensor_;  // canonical -> file
  std::set<std::string> taken_;
};

// ParameterCount() of the checkpoint folder `dir`, from the safetensors headers alone (the
// files are mapped, not read): what `--dtype auto` needs before the weights are loaded.
StatusOr<int64_t> CheckpointParameterCount(const std::string& dir);

}  // namespace llava
