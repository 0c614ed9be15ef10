// Reading and writing the safetensors format. Torch-free.
//
// File layout: u64 little-endian header length N, N bytes of JSON header, then the data buffer.
// Header: {"__metadata__": {str: str}, "<name>": {"dtype": "BF16", "shape": [..],
//          "data_offsets": [begin, end]}} with offsets relative to the data buffer.
//
// Open() memory-maps the file read-only and validates the whole header before returning:
// known dtypes, non-negative shapes, end - begin == numel * element size, offsets inside the
// file, no two tensors overlapping. Errors name the file and the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/io/status.h"

namespace llava {

// kU8: raw bytes (quantized weights' values, engine/model/quantized_checkpoint.h), never a
// model's compute type.
enum class DType { kF32, kF16, kBF16, kU8 };

const char* DTypeName(DType dtype);  // "F32", "F16", "BF16", "U8" (safetensors spelling)
size_t DTypeSize(DType dtype);       // bytes per element

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapping; valid while the file is open
  size_t nbytes = 0;
  int64_t numel() const;
};

// A read-only memory-mapped safetensors file. Not copyable; thread-compatible (const methods
// may be called concurrently).
class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // The same checks on `size` bytes in memory, which the caller keeps alive and unchanged while
  // the object lives; `name` stands for the path in errors (the fuzz target's way in).
  static StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(const void* data, size_t size,
                                                               const std::string& name);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // nullptr when absent.
  const TensorInfo* Find(const std::string& name) const;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Drops the pages that lie wholly inside tensor `t`'s bytes from this process's resident
  // memory (madvise MADV_DONTNEED): for a tensor that was copied or converted and whose mapped
  // bytes are not read again. Reading them later is still correct (they fault in from the
  // file again). A no-op for a buffer (FromBuffer) or a tensor of another file.
  void ReleasePages(const TensorInfo& t) const;

 private:
  SafetensorsFile() = default;
  Status Parse();

  std::string path_;
  void* map_ = nullptr;  // the file's mapping, or the caller's buffer (FromBuffer)
  size_t map_size_ = 0;
  bool owns_map_ = false;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// The shard file names of a model.safetensors.index.json (`json`; `origin` names it in errors),
// in first-use order, each once: a "weight_map" object of tensor name -> plain file name.
StatusOr<std::vector<std::string>> ParseSafetensorsIndex(const std::string& json,
                                                         const std::string& origin);

// One tensor to write; `data` must hold numel * DTypeSize(dtype) bytes.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes tensors (in the given order) to `path`, atomically via a temporary file.
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

}  // namespace llava
