// safetensors files: the 8-byte header length, the JSON header and the tensors' byte ranges.
// Every tensor the parser accepts must lie inside the data section; its first and last bytes
// are read so that ASan sees any that does not.
#include <cstddef>
#include <cstdint>

#include "engine/io/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = llava::SafetensorsFile::FromBuffer(data, size, "fuzz.safetensors");
  if (!file.ok()) return 0;
  volatile uint8_t sink = 0;
  for (const llava::TensorInfo& t : (*file)->tensors()) {
    LLAVA_FUZZ_CHECK(t.data >= data + 8 && t.data + t.nbytes <= data + size);
    LLAVA_FUZZ_CHECK(t.nbytes == static_cast<size_t>(t.numel()) * llava::DTypeSize(t.dtype));
    LLAVA_FUZZ_CHECK((*file)->Find(t.name) == &t);
    if (t.nbytes > 0) sink = sink + t.data[0] + t.data[t.nbytes - 1];
  }
  return 0;
}
