// Image decoding (OpenCV) and CLIPImageProcessor preprocessing. Torch-free.
//
// Safety: the header is parsed first and the pixel count checked against the limits before
// any pixel is decoded, so a small file that claims a huge canvas (a decompression bomb) is
// refused without allocating it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/status.h"

namespace llava {

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp, kBmp };
const char* ImageFormatName(ImageFormat f);

struct ImageLimits {
  size_t max_encoded_bytes = 20u << 20;  // 20 MiB
  int64_t max_pixels = 40'000'000;       // width * height
  int max_side = 16384;
  // Longer side / shorter side. Preprocessing scales the shorter side to the vision tower's
  // input, so a 1 x 16384 image would become a 336 x 5.5M intermediate (7 GB): refused first.
  int max_aspect_ratio = 20;
  // Scans of a (progressive) JPEG: each is a pass over every coefficient, so a file of
  // thousands of tiny scans costs seconds of CPU per megabyte (one of 2,090 scans took ~20 s).
  // Encoders write 1 (baseline) to ~10 (progressive).
  int max_jpeg_scans = 64;
};

struct ImageInfo {
  ImageFormat format = ImageFormat::kUnknown;
  int width = 0, height = 0;
  // What the decoder allocates per pixel, at most (PNG: from its bit depth and colour type, 16-bit
  // RGBA is 8; the other formats 4).
  int decoded_bytes_per_pixel = 4;
};

// The memory DecodeImage holds at its peak for an image of this header: the decoder's buffer
// and the RGB copy.
int64_t ImageDecodeBytes(const ImageInfo& info);

// Reads the format and dimensions from the header without decoding pixels.
StatusOr<ImageInfo> ProbeImage(const std::string& bytes, const std::string& field);

struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;  // [height, width, 3] RGB, row-major
};

// What DecodeImage checks before it decodes a pixel: the encoded size, a header it can read,
// the side, pixel count and aspect ratio within `limits`. Reads only the header, so a request's
// images can all be checked before any of them is decoded.
StatusOr<ImageInfo> CheckImage(const std::string& bytes, const ImageLimits& limits,
                               const std::string& field);

// Decodes JPEG, PNG, WebP or BMP into 8-bit RGB (grey expanded, alpha composited on white,
// 16-bit scaled down). `field` names the input in errors ("messages[0].content[1].image").
StatusOr<RgbImage> DecodeImage(const std::string& bytes, const ImageLimits& limits,
                               const std::string& field);

// An image resized and center-cropped to the vision tower's input, before rescaling and
// normalisation: the bytes a request keeps until its images are encoded (a quarter of the
// floats). Crop pixels that fall outside the resized image (a crop larger than it) lie outside
// rows [top, bottom) x columns [left, right) and are normalised as black.
struct CroppedImage {
  int height = 0, width = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3]
  int top = 0, left = 0, bottom = 0, right = 0;
};

// CLIPImageProcessor's geometry: [pad to square with the mean colour], bicubic resize of the
// shorter side to `shortest_edge`, center crop.
CroppedImage CropImage(const RgbImage& image, const ImageProcessorConfig& config);
// Its arithmetic: rescale and normalize. Returns [3, crop_h, crop_w] floats (CHW).
std::vector<float> NormalizeImage(const CroppedImage& crop, const ImageProcessorConfig& config);
// Both: CLIPImageProcessor's output for `image`.
std::vector<float> PreprocessImage(const RgbImage& image, const ImageProcessorConfig& config);

}  // namespace llava
