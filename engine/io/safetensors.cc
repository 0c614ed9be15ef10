#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

namespace llava {
namespace {

// A header larger than this is certainly not a real checkpoint (7B models have ~300 KB).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

bool ParseDType(const std::string& s, DType* out) {
  if (s == "F32")
    *out = DType::kF32;
  else if (s == "F16")
    *out = DType::kF16;
  else if (s == "BF16")
    *out = DType::kBF16;
  else if (s == "U8")
    *out = DType::kU8;
  else
    return false;
  return true;
}

}  // namespace

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kU8:
      return 1;
  }
  return 4;
}

void SafetensorsFile::ReleasePages(const TensorInfo& t) const {
  const auto begin = reinterpret_cast<uintptr_t>(t.data), end = begin + t.nbytes;
  const auto map_begin = reinterpret_cast<uintptr_t>(map_);
  if (!owns_map_ || begin < map_begin || end > map_begin + map_size_) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Internal(path + ": fstat failed");
  }
  file->map_size_ = static_cast<size_t>(st.st_size);
  if (file->map_size_ < 8) {
    ::close(fd);
    return DataLoss(path + ": truncated: " + std::to_string(file->map_size_) +
                    " bytes, need at least 8 for the header length");
  }
  file->map_ = ::mmap(nullptr, file->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (file->map_ == MAP_FAILED) {
    file->map_ = nullptr;
    return Internal(path + ": mmap failed");
  }
  file->owns_map_ = true;
  LLAVA_RETURN_IF_ERROR(file->Parse());
  return file;
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(const void* data,
                                                                       size_t size,
                                                                       const std::string& name) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = name;
  if (size < 8) {
    return DataLoss(name + ": truncated: " + std::to_string(size) +
                    " bytes, need at least 8 for the header length");
  }
  file->map_ = const_cast<void*>(data);  // read only, as the mapping is
  file->map_size_ = size;
  LLAVA_RETURN_IF_ERROR(file->Parse());
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (owns_map_ && map_ != nullptr) ::munmap(map_, map_size_);
}

StatusOr<std::vector<std::string>> ParseSafetensorsIndex(const std::string& json,
                                                         const std::string& origin) {
  const auto j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return InvalidArgument(origin + ": weight_map missing or not an object");
  }
  std::vector<std::string> shards;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) return InvalidArgument(origin + ": bad entry " + it.key());
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos) {
      return InvalidArgument(origin + ": shard name '" + shard + "' must be a plain file name");
    }
    if (std::find(shards.begin(), shards.end(), shard) == shards.end()) shards.push_back(shard);
  }
  return shards;
}

Status SafetensorsFile::Parse() {
  const auto* bytes = static_cast<const uint8_t*>(map_);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > kMaxHeaderBytes) {
    return DataLoss(path_ + ": header length " + std::to_string(header_len) +
                    " is implausible (not a safetensors file?)");
  }
  if (8 + header_len > map_size_) {
    return DataLoss(path_ + ": truncated: header needs " + std::to_string(header_len) +
                    " bytes but the file has " + std::to_string(map_size_ - 8));
  }
  nlohmann::json header =
      nlohmann::json::parse(reinterpret_cast<const char*>(bytes + 8),
                            reinterpret_cast<const char*>(bytes + 8 + header_len),
                            /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return DataLoss(path_ + ": header is not a JSON object");
  }
  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_size = map_size_ - 8 - header_len;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return DataLoss(path_ + ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = path_ + ": tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return DataLoss(where + ": entry needs dtype, shape and data_offsets");
    }
    TensorInfo info;
    info.name = name;
    if (!v["dtype"].is_string() || !ParseDType(v["dtype"].get<std::string>(), &info.dtype)) {
      return InvalidArgument(where + ": unsupported dtype " + v["dtype"].dump() +
                             " (supported: F32, F16, BF16)");
    }
    if (!v["shape"].is_array()) return DataLoss(where + ": shape is not an array");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return DataLoss(where + ": bad shape " + v["shape"].dump());
      }
      const uint64_t dim = static_cast<uint64_t>(d.get<int64_t>());
      info.shape.push_back(d.get<int64_t>());
      // Checked before multiplying: [2^40, 2^24] must not wrap around to 0 elements.
      constexpr uint64_t kMaxElements = uint64_t{1} << 40;
      if (dim != 0 && numel > kMaxElements / dim) return DataLoss(where + ": shape too large");
      numel *= dim;
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return DataLoss(where + ": data_offsets must be two non-negative integers");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (end < begin) return DataLoss(where + ": data_offsets end < begin");
    if (end - begin != numel * DTypeSize(info.dtype)) {
      return DataLoss(where + ": " + std::to_string(end - begin) + " bytes for shape " +
                      v["shape"].dump() + " of " + DTypeName(info.dtype) + " (expected " +
                      std::to_string(numel * DTypeSize(info.dtype)) + ")");
    }
    if (end > data_size) {
      return DataLoss(where + ": data ends at byte " + std::to_string(end) +
                      " but the data section has " + std::to_string(data_size) +
                      " bytes (truncated file?)");
    }
    info.data = data + begin;
    info.nbytes = end - begin;
    tensors_.push_back(std::move(info));
  }

  // Overlap check: sort by start, every tensor must end before the next begins.
  std::vector<const TensorInfo*> order;
  for (const auto& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->data < b->data; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i - 1]->data + order[i - 1]->nbytes > order[i]->data) {
      return DataLoss(path_ + ": tensors '" + order[i - 1]->name + "' and '" + order[i]->name +
                      "' overlap");
    }
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  return Status::Ok();
}

const TensorInfo* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t nbytes = numel * DTypeSize(t.dtype);
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');  // align the data section to 8 bytes

  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return Internal("cannot write " + tmp);
  uint64_t len = text.size();
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(len >> (8 * i));
  out.write(reinterpret_cast<const char*>(len_bytes), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    out.write(static_cast<const char*>(t.data),
              static_cast<std::streamsize>(numel * DTypeSize(t.dtype)));
  }
  out.close();
  if (!out) return Internal("write failed: " + tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return Internal("rename failed: " + path);
  return Status::Ok();
}

}  // namespace llava
