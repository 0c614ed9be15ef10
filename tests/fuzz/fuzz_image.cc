// Image decoding (JPEG, PNG, WebP, BMP through OpenCV, behind our header probe and limits) and
// the preprocessing into the vision tower's input. A decoded image must respect the limits and
// preprocess to exactly 3 x crop_height x crop_width floats.
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/io/image_io.h"
#include "engine/io/model_config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  llava::ImageLimits limits;
  limits.max_pixels = 1 << 20;  // keep one execution in milliseconds
  limits.max_side = 4096;
  auto image = llava::DecodeImage(bytes, limits, "image");
  if (!image.ok()) return 0;
  LLAVA_FUZZ_CHECK(image->width > 0 && image->height > 0);
  LLAVA_FUZZ_CHECK(int64_t{image->width} * image->height <= limits.max_pixels);
  LLAVA_FUZZ_CHECK(image->pixels.size() == size_t{3} * image->width * image->height);
  for (bool pad : {false, true}) {
    llava::ImageProcessorConfig config;
    config.shortest_edge = config.crop_height = config.crop_width = 32;
    config.pad_to_square = pad;
    const std::vector<float> input = llava::PreprocessImage(*image, config);
    LLAVA_FUZZ_CHECK(input.size() == size_t{3} * 32 * 32);
  }
  return 0;
}
