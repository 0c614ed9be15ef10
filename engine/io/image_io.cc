#include "engine/io/image_io.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

namespace llava {
namespace {

uint32_t Be16(const uint8_t* p) { return (uint32_t{p[0]} << 8) | p[1]; }
uint32_t Be32(const uint8_t* p) { return (Be16(p) << 16) | Be16(p + 2); }
uint32_t Le16(const uint8_t* p) { return uint32_t{p[0]} | (uint32_t{p[1]} << 8); }
uint32_t Le24(const uint8_t* p) { return Le16(p) | (uint32_t{p[2]} << 16); }
uint32_t Le32(const uint8_t* p) { return Le16(p) | (Le16(p + 2) << 16); }

Status Truncated(const std::string& field, const char* fmt) {
  return InvalidArgument(field + ": truncated or corrupt " + fmt + " header");
}

StatusOr<ImageInfo> ProbeJpeg(const uint8_t* d, size_t n, const std::string& field) {
  size_t i = 2;
  while (i + 4 <= n) {
    if (d[i] != 0xFF) return Truncated(field, "JPEG");
    uint8_t marker = d[i + 1];
    if (marker == 0xFF) {  // fill byte
      ++i;
      continue;
    }
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) {  // standalone markers
      i += 2;
      continue;
    }
    const uint32_t len = Be16(d + i + 2);
    if (len < 2) return Truncated(field, "JPEG");
    const bool sof =
        marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (sof) {
      if (i + 9 > n) return Truncated(field, "JPEG");
      ImageInfo info{ImageFormat::kJpeg, static_cast<int>(Be16(d + i + 7)),
                     static_cast<int>(Be16(d + i + 5))};
      return info;
    }
    i += 2 + len;
  }
  return Truncated(field, "JPEG");
}

StatusOr<ImageInfo> ProbeWebp(const uint8_t* d, size_t n, const std::string& field) {
  if (n < 30) return Truncated(field, "WebP");
  ImageInfo info{ImageFormat::kWebp, 0, 0};
  if (std::memcmp(d + 12, "VP8 ", 4) == 0) {
    info.width = static_cast<int>(Le16(d + 26) & 0x3FFF);
    info.height = static_cast<int>(Le16(d + 28) & 0x3FFF);
  } else if (std::memcmp(d + 12, "VP8L", 4) == 0) {
    if (d[20] != 0x2F) return Truncated(field, "WebP");
    const uint32_t bits = Le32(d + 21);
    info.width = static_cast<int>((bits & 0x3FFF) + 1);
    info.height = static_cast<int>(((bits >> 14) & 0x3FFF) + 1);
  } else if (std::memcmp(d + 12, "VP8X", 4) == 0) {
    info.width = static_cast<int>(Le24(d + 24) + 1);
    info.height = static_cast<int>(Le24(d + 27) + 1);
  } else {
    return Truncated(field, "WebP");
  }
  return info;
}

}  // namespace

const char* ImageFormatName(ImageFormat f) {
  switch (f) {
    case ImageFormat::kJpeg:
      return "JPEG";
    case ImageFormat::kPng:
      return "PNG";
    case ImageFormat::kWebp:
      return "WebP";
    case ImageFormat::kBmp:
      return "BMP";
    case ImageFormat::kUnknown:
      break;
  }
  return "unknown";
}

StatusOr<ImageInfo> ProbeImage(const std::string& bytes, const std::string& field) {
  const auto* d = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  if (n == 0) return InvalidArgument(field + " is empty");
  static const uint8_t kPngSig[8] = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  if (n >= 8 && std::memcmp(d, kPngSig, 8) == 0) {
    if (n < 26 || std::memcmp(d + 12, "IHDR", 4) != 0) return Truncated(field, "PNG");
    ImageInfo info;
    info.format = ImageFormat::kPng;
    info.width = static_cast<int>(std::min<uint32_t>(Be32(d + 16), 1u << 30));
    info.height = static_cast<int>(std::min<uint32_t>(Be32(d + 20), 1u << 30));
    // Colour type 0 is grey, 2 RGB; the others (palette, grey + alpha, RGBA) may decode to 4
    // channels.
    const int channels = d[25] == 0 ? 1 : d[25] == 2 ? 3 : 4;
    info.decoded_bytes_per_pixel = channels * (d[24] == 16 ? 2 : 1);
    return info;
  }
  if (n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF) return ProbeJpeg(d, n, field);
  if (n >= 12 && std::memcmp(d, "RIFF", 4) == 0 && std::memcmp(d + 8, "WEBP", 4) == 0) {
    return ProbeWebp(d, n, field);
  }
  if (n >= 2 && d[0] == 'B' && d[1] == 'M') {
    if (n < 26) return Truncated(field, "BMP");
    const uint32_t dib = Le32(d + 14);
    ImageInfo info{ImageFormat::kBmp, 0, 0};
    if (dib == 12) {
      info.width = static_cast<int>(Le16(d + 18));
      info.height = static_cast<int>(Le16(d + 20));
    } else if (dib >= 40) {
      const int32_t w = static_cast<int32_t>(Le32(d + 18));
      const int32_t h = static_cast<int32_t>(Le32(d + 22));
      if (w == INT32_MIN || h == INT32_MIN) return Truncated(field, "BMP");
      info.width = std::abs(w);
      info.height = std::abs(h);
    } else {
      return Truncated(field, "BMP");
    }
    return info;
  }
  return InvalidArgument(field + ": unsupported image format (expected JPEG, PNG, WebP or BMP)");
}

int64_t ImageDecodeBytes(const ImageInfo& info) {
  return int64_t{info.width} * info.height * (info.decoded_bytes_per_pixel + 3);
}

StatusOr<ImageInfo> CheckImage(const std::string& bytes, const ImageLimits& limits,
                               const std::string& field) {
  if (bytes.size() > limits.max_encoded_bytes) {
    return InvalidArgument(field + " is " + std::to_string(bytes.size()) +
                           " bytes, more than the limit " +
                           std::to_string(limits.max_encoded_bytes));
  }
  LLAVA_ASSIGN_OR_RETURN(ImageInfo info, ProbeImage(bytes, field));
  if (info.width <= 0 || info.height <= 0) {
    return InvalidArgument(field + ": " + ImageFormatName(info.format) + " header has zero size");
  }
  if (info.width > limits.max_side || info.height > limits.max_side ||
      int64_t{info.width} * info.height > limits.max_pixels) {
    return InvalidArgument(field + ": " + std::to_string(info.width) + "x" +
                           std::to_string(info.height) + " pixels exceeds the limit of " +
                           std::to_string(limits.max_pixels) + " pixels (side " +
                           std::to_string(limits.max_side) + ")");
  }
  if (info.format == ImageFormat::kJpeg) {
    // Every start-of-scan marker: in entropy-coded data a 0xFF byte is followed by 0x00 or a
    // restart marker, so FF DA occurs only as a marker (an embedded thumbnail's count too).
    int scans = 0;
    for (size_t i = 0; i + 1 < bytes.size(); ++i) {
      if (static_cast<uint8_t>(bytes[i]) == 0xFF && static_cast<uint8_t>(bytes[i + 1]) == 0xDA &&
          ++scans > limits.max_jpeg_scans) {
        return InvalidArgument(field + ": JPEG of more than " +
                               std::to_string(limits.max_jpeg_scans) +
                               " scans (each is a pass over the whole image)");
      }
    }
  }
  const int long_side = std::max(info.width, info.height);
  const int short_side = std::min(info.width, info.height);
  if (int64_t{long_side} > int64_t{limits.max_aspect_ratio} * short_side) {
    return InvalidArgument(field + ": " + std::to_string(info.width) + "x" +
                           std::to_string(info.height) + " pixels is more elongated than the " +
                           "limit of " + std::to_string(limits.max_aspect_ratio) + ":1");
  }
  return info;
}

StatusOr<RgbImage> DecodeImage(const std::string& bytes, const ImageLimits& limits,
                               const std::string& field) {
  LLAVA_ASSIGN_OR_RETURN(ImageInfo info, CheckImage(bytes, limits, field));
  cv::Mat decoded;
  try {
    cv::Mat raw(1, static_cast<int>(bytes.size()), CV_8UC1, const_cast<char*>(bytes.data()));
    decoded = cv::imdecode(raw, cv::IMREAD_UNCHANGED);
  } catch (const cv::Exception& e) {
    return InvalidArgument(field + ": corrupt " + ImageFormatName(info.format) + " data");
  }
  if (decoded.empty()) {
    return InvalidArgument(field + ": corrupt " + ImageFormatName(info.format) + " data");
  }
  if (decoded.cols != info.width || decoded.rows != info.height) {
    return InvalidArgument(field + ": decoded size differs from the header (corrupt data)");
  }
  const int channels = decoded.channels();
  const bool wide = decoded.depth() == CV_16U;
  if (!wide && decoded.depth() != CV_8U) {
    return InvalidArgument(field + ": unsupported pixel depth");
  }
  if (channels != 1 && channels != 3 && channels != 4) {
    return InvalidArgument(field + ": unsupported channel count");
  }
  // Row by row into the result, so that the decoder's buffer is the only other full-size one
  // (a 16-bit RGBA image is 8 bytes a pixel; converting it whole held three copies).
  RgbImage out;
  out.width = decoded.cols;
  out.height = decoded.rows;
  out.pixels.resize(static_cast<size_t>(out.width) * out.height * 3);
  cv::Mat rgb(out.height, out.width, CV_8UC3, out.pixels.data());
  cv::Mat narrow;
  for (int y = 0; y < decoded.rows; ++y) {
    cv::Mat src = decoded.row(y);
    if (wide) {
      src.convertTo(narrow, CV_MAKETYPE(CV_8U, channels), 1.0 / 257.0);
      src = narrow;
    }
    cv::Mat dst = rgb.row(y);  // a view: written in place
    if (channels == 1) {
      cv::cvtColor(src, dst, cv::COLOR_GRAY2RGB);
    } else if (channels == 3) {
      cv::cvtColor(src, dst, cv::COLOR_BGR2RGB);
    } else {
      // Composite on white, as transformers' convert_to_rgb does.
      const uint8_t* s = src.ptr<uint8_t>(0);
      uint8_t* t = dst.ptr<uint8_t>(0);
      for (int x = 0; x < decoded.cols; ++x, s += 4, t += 3) {
        const int a = s[3];
        for (int c = 0; c < 3; ++c) {  // BGRA -> RGB
          t[c] = static_cast<uint8_t>((s[2 - c] * a + 255 * (255 - a) + 127) / 255);
        }
      }
    }
  }
  return out;
}

// Bicubic resampling as Pillow does it (transformers resizes through PIL.Image.resize):
// separable, horizontal pass first, Keys kernel with a = -0.5, support widened by the scale
// factor when shrinking (antialiasing), 22-bit fixed-point weights and 8-bit rounding after each
// pass. cv::resize(INTER_CUBIC) uses a = -0.75 and no antialiasing, which on a 3x downscale
// moved normalised pixels by 0.13 on average from what CLIPImageProcessor produces.
namespace {

double PilBicubic(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

struct ResampleTaps {
  std::vector<int> first, count;  // input window per output index
  std::vector<int32_t> weights;   // [out, ksize] fixed point
  int ksize = 0;
};

constexpr int kPrecisionBits = 32 - 8 - 2;

ResampleTaps PilTaps(int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = 2.0 * filter_scale;
  ResampleTaps t;
  t.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(out_size);
  t.count.resize(out_size);
  t.weights.assign(static_cast<size_t>(out_size) * t.ksize, 0);
  std::vector<double> k(t.ksize);
  for (int o = 0; o < out_size; ++o) {
    const double center = (o + 0.5) * scale;
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
    double sum = 0;
    for (int x = 0; x < hi - lo; ++x) {
      k[x] = PilBicubic((x + lo - center + 0.5) / filter_scale);
      sum += k[x];
    }
    for (int x = 0; x < hi - lo; ++x) {
      const double w = sum != 0 ? k[x] / sum : k[x];
      t.weights[static_cast<size_t>(o) * t.ksize + x] = static_cast<int32_t>(
          w < 0 ? -0.5 + w * (1 << kPrecisionBits) : 0.5 + w * (1 << kPrecisionBits));
    }
    t.first[o] = lo;
    t.count[o] = hi - lo;
  }
  return t;
}

uint8_t Clip8(int64_t v) {
  v >>= kPrecisionBits;
  return static_cast<uint8_t>(std::clamp<int64_t>(v, 0, 255));
}

cv::Mat ResizeBicubicLikePil(const cv::Mat& src, int out_w, int out_h) {
  const ResampleTaps hx = PilTaps(src.cols, out_w), vy = PilTaps(src.rows, out_h);
  cv::Mat mid(src.rows, out_w, CV_8UC3);
  for (int y = 0; y < src.rows; ++y) {
    const uint8_t* in = src.ptr<uint8_t>(y);
    uint8_t* out = mid.ptr<uint8_t>(y);
    for (int x = 0; x < out_w; ++x) {
      const int32_t* w = &hx.weights[static_cast<size_t>(x) * hx.ksize];
      for (int c = 0; c < 3; ++c) {
        int64_t acc = 1 << (kPrecisionBits - 1);
        for (int i = 0; i < hx.count[x]; ++i) acc += in[3 * (hx.first[x] + i) + c] * int64_t{w[i]};
        out[3 * x + c] = Clip8(acc);
      }
    }
  }
  cv::Mat dst(out_h, out_w, CV_8UC3);
  for (int y = 0; y < out_h; ++y) {
    const int32_t* w = &vy.weights[static_cast<size_t>(y) * vy.ksize];
    uint8_t* out = dst.ptr<uint8_t>(y);
    for (int x = 0; x < 3 * out_w; ++x) {
      int64_t acc = 1 << (kPrecisionBits - 1);
      for (int i = 0; i < vy.count[y]; ++i)
        acc += mid.ptr<uint8_t>(vy.first[y] + i)[x] * int64_t{w[i]};
      out[x] = Clip8(acc);
    }
  }
  return dst;
}

}  // namespace

CroppedImage CropImage(const RgbImage& image, const ImageProcessorConfig& cfg) {
  cv::Mat src(image.height, image.width, CV_8UC3, const_cast<uint8_t*>(image.pixels.data()));
  cv::Mat img = src;
  if (cfg.pad_to_square && image.width != image.height) {
    const int side = std::max(image.width, image.height);
    cv::Scalar mean(std::round(cfg.image_mean[0] * 255), std::round(cfg.image_mean[1] * 255),
                    std::round(cfg.image_mean[2] * 255));
    cv::Mat square(side, side, CV_8UC3, mean);
    src.copyTo(square(
        cv::Rect((side - image.width) / 2, (side - image.height) / 2, image.width, image.height)));
    img = square;
  }
  // Shorter side -> shortest_edge, longer side scaled and truncated as transformers does.
  const int s = cfg.shortest_edge;
  int new_w, new_h;
  if (img.cols <= img.rows) {
    new_w = s;
    new_h = static_cast<int>(static_cast<int64_t>(s) * img.rows / img.cols);
  } else {
    new_h = s;
    new_w = static_cast<int>(static_cast<int64_t>(s) * img.cols / img.rows);
  }
  cv::Mat resized;
  if (new_w != img.cols || new_h != img.rows) {
    resized = ResizeBicubicLikePil(img, new_w, new_h);
  } else {
    resized = img;
  }
  const int ch = cfg.crop_height, cw = cfg.crop_width;
  CroppedImage out;
  out.height = ch;
  out.width = cw;
  out.rgb.assign(static_cast<size_t>(3) * ch * cw, 0);
  const int top = (resized.rows - ch) / 2, left = (resized.cols - cw) / 2;
  out.top = std::max(0, -top);
  out.left = std::max(0, -left);
  out.bottom = std::min(ch, resized.rows - top);
  out.right = std::min(cw, resized.cols - left);
  for (int y = out.top; y < out.bottom; ++y) {
    std::memcpy(out.rgb.data() + (static_cast<size_t>(y) * cw + out.left) * 3,
                resized.ptr<uint8_t>(top + y) + 3 * (left + out.left),
                static_cast<size_t>(out.right - out.left) * 3);
  }
  return out;
}

std::vector<float> NormalizeImage(const CroppedImage& crop, const ImageProcessorConfig& cfg) {
  const int ch = crop.height, cw = crop.width;
  std::vector<float> out(static_cast<size_t>(3) * ch * cw);
  for (int y = 0; y < ch; ++y) {
    for (int x = 0; x < cw; ++x) {
      const bool inside = y >= crop.top && y < crop.bottom && x >= crop.left && x < crop.right;
      const uint8_t* px = crop.rgb.data() + (static_cast<size_t>(y) * cw + x) * 3;
      for (int c = 0; c < 3; ++c) {
        const float v = inside ? px[c] * static_cast<float>(cfg.rescale_factor) : 0.f;
        out[(static_cast<size_t>(c) * ch + y) * cw + x] =
            (v - cfg.image_mean[c]) / cfg.image_std[c];
      }
    }
  }
  return out;
}

std::vector<float> PreprocessImage(const RgbImage& image, const ImageProcessorConfig& cfg) {
  return NormalizeImage(CropImage(image, cfg), cfg);
}

}  // namespace llava
