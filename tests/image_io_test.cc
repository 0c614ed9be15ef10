#include "engine/io/image_io.h"

#include <gtest/gtest.h>

#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>

namespace llava {
namespace {

// Encodes a BGR(A)/grey cv::Mat with OpenCV into the given format (".png", ".jpg", ...).
std::string Encode(const cv::Mat& m, const std::string& ext) {
  std::vector<uint8_t> buf;
  EXPECT_TRUE(cv::imencode(ext, m, buf)) << ext;
  return std::string(buf.begin(), buf.end());
}

cv::Mat Solid(int w, int h, cv::Scalar bgr) { return cv::Mat(h, w, CV_8UC3, bgr); }

TEST(ImageIo, ProbesAndDecodesEveryFormat) {
  const cv::Mat img = Solid(40, 24, cv::Scalar(30, 60, 200));  // BGR: R=200
  for (const char* ext : {".png", ".jpg", ".bmp", ".webp"}) {
    const std::string bytes = Encode(img, ext);
    auto info = ProbeImage(bytes, "img");
    ASSERT_TRUE(info.ok()) << ext << ": " << info.status().ToString();
    EXPECT_EQ(info->width, 40) << ext;
    EXPECT_EQ(info->height, 24) << ext;
    auto rgb = DecodeImage(bytes, ImageLimits{}, "img");
    ASSERT_TRUE(rgb.ok()) << ext << ": " << rgb.status().ToString();
    ASSERT_EQ(rgb->pixels.size(), 40u * 24u * 3u);
    EXPECT_NEAR(rgb->pixels[0], 200, 4) << ext << " red channel first";
    EXPECT_NEAR(rgb->pixels[1], 60, 4) << ext;
    EXPECT_NEAR(rgb->pixels[2], 30, 4) << ext;
  }
}

TEST(ImageIo, GreyAndAlphaBecomeRgb) {
  auto grey = DecodeImage(Encode(cv::Mat(8, 8, CV_8UC1, cv::Scalar(77)), ".png"), {}, "img");
  ASSERT_TRUE(grey.ok());
  EXPECT_EQ(grey->pixels[0], 77);
  EXPECT_EQ(grey->pixels[1], 77);
  EXPECT_EQ(grey->pixels[2], 77);
  // Fully transparent pixels composite to white; opaque ones keep their colour.
  cv::Mat rgba(2, 2, CV_8UC4, cv::Scalar(0, 0, 255, 0));
  rgba.at<cv::Vec4b>(0, 1) = cv::Vec4b(0, 0, 255, 255);
  auto out = DecodeImage(Encode(rgba, ".png"), {}, "img");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(std::vector<uint8_t>(out->pixels.begin(), out->pixels.begin() + 6),
            (std::vector<uint8_t>{255, 255, 255, 255, 0, 0}));
}

// 16-bit PNGs decode row by row into 8-bit RGB (v / 257, rounded), alpha composited on white;
// the header tells what the decode costs before any pixel is read.
TEST(ImageIo, SixteenBitImagesDecodeAndTheirCostIsKnownFromTheHeader) {
  cv::Mat rgba16(3, 5, CV_16UC4, cv::Scalar(0x0101 * 10, 0x0101 * 20, 0x0101 * 200, 0xFFFF));
  rgba16.at<cv::Vec4w>(2, 4) = cv::Vec4w(0, 0, 0, 0);  // transparent: white
  const std::string png16 = Encode(rgba16, ".png");
  auto info = ProbeImage(png16, "img");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->decoded_bytes_per_pixel, 8);
  EXPECT_EQ(ImageDecodeBytes(*info), 5 * 3 * (8 + 3));
  auto out = DecodeImage(png16, {}, "img");
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->pixels.size(), 5u * 3u * 3u);
  for (int p = 0; p < 14; ++p) {  // BGR (10, 20, 200) as RGB
    EXPECT_EQ(out->pixels[3 * p], 200) << p;
    EXPECT_EQ(out->pixels[3 * p + 1], 20) << p;
    EXPECT_EQ(out->pixels[3 * p + 2], 10) << p;
  }
  EXPECT_EQ(std::vector<uint8_t>(out->pixels.end() - 3, out->pixels.end()),
            (std::vector<uint8_t>{255, 255, 255}));

  const std::string grey8 = Encode(cv::Mat(4, 4, CV_8UC1, cv::Scalar(9)), ".png");
  EXPECT_EQ(ProbeImage(grey8, "img")->decoded_bytes_per_pixel, 1);
  const std::string rgb16 = Encode(cv::Mat(4, 4, CV_16UC3, cv::Scalar(0, 0, 0xFFFF)), ".png");
  EXPECT_EQ(ProbeImage(rgb16, "img")->decoded_bytes_per_pixel, 6);
  auto red = DecodeImage(rgb16, {}, "img");
  ASSERT_TRUE(red.ok());
  EXPECT_EQ(std::vector<uint8_t>(red->pixels.begin(), red->pixels.begin() + 3),
            (std::vector<uint8_t>{255, 0, 0}));
}

// A progressive JPEG is several scans, each a pass over the image: counted from the markers
// before decoding, and refused past the limit.
TEST(ImageIo, JpegScansAreCountedBeforeDecoding) {
  std::vector<uint8_t> buf;
  ASSERT_TRUE(cv::imencode(".jpg", Solid(64, 48, cv::Scalar(10, 120, 240)), buf,
                           {cv::IMWRITE_JPEG_PROGRESSIVE, 1}));
  const std::string progressive(buf.begin(), buf.end());
  int scans = 0;
  for (size_t i = 0; i + 1 < buf.size(); ++i) scans += buf[i] == 0xFF && buf[i + 1] == 0xDA;
  ASSERT_GT(scans, 3) << "libjpeg's progressive script has several scans";
  EXPECT_TRUE(DecodeImage(progressive, ImageLimits{}, "img").ok());
  ImageLimits few;
  few.max_jpeg_scans = 3;
  auto r = CheckImage(progressive, few, "images[0]");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("images[0]: JPEG of more than 3 scans"), std::string::npos)
      << r.status().ToString();
  EXPECT_TRUE(CheckImage(Encode(Solid(64, 48, cv::Scalar(1, 2, 3)), ".jpg"), few, "img").ok())
      << "a baseline JPEG is one scan";
}

TEST(ImageIo, RefusesBadInputWithoutCrashing) {
  const std::string png = Encode(Solid(16, 16, cv::Scalar(1, 2, 3)), ".png");
  const std::string jpg = Encode(Solid(16, 16, cv::Scalar(1, 2, 3)), ".jpg");
  struct Case {
    std::string bytes;
    const char* part;
  } cases[] = {
      {"", "is empty"},
      {"GIF89a not supported", "unsupported image format"},
      {png.substr(0, 20), "truncated or corrupt PNG header"},
      {png.substr(0, png.size() / 2), "corrupt PNG data"},
      {jpg.substr(0, 40), "JPEG"},
      {std::string("\xFF\xD8\xFF", 3) + std::string(100, '\0'), "JPEG"},
      {"BM" + std::string(10, '\0'), "BMP"},
  };
  for (const auto& c : cases) {
    auto r = DecodeImage(c.bytes, {}, "messages[0].content[1].image");
    ASSERT_FALSE(r.ok()) << c.part;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("messages[0].content[1].image"), std::string::npos);
    EXPECT_NE(r.status().message().find(c.part), std::string::npos) << r.status().message();
  }
}

TEST(ImageIo, DecompressionBombRefusedFromHeader) {
  // A valid PNG whose IHDR claims 60000 x 60000 pixels: refused before decoding.
  std::string png = Encode(Solid(4, 4, cv::Scalar(0, 0, 0)), ".png");
  const uint32_t side = 60000;
  for (int off : {16, 20}) {
    for (int i = 0; i < 4; ++i) png[off + i] = static_cast<char>(side >> (24 - 8 * i));
  }
  auto r = DecodeImage(png, {}, "img");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("60000x60000 pixels exceeds the limit"), std::string::npos)
      << r.status().message();
  ImageLimits small;
  small.max_encoded_bytes = 10;
  EXPECT_NE(DecodeImage(Encode(Solid(4, 4, cv::Scalar(0, 0, 0)), ".png"), small, "img")
                .status()
                .message()
                .find("more than the limit 10"),
            std::string::npos);
}

TEST(ImageIo, ElongatedImagesRefusedFromHeader) {
  // 1 x 16384 passes the pixel and side limits but would be scaled to 336 x 5.5M pixels.
  std::string png = Encode(Solid(4, 4, cv::Scalar(0, 0, 0)), ".png");
  const uint32_t width = 1, height = 16384;
  for (int i = 0; i < 4; ++i) png[16 + i] = static_cast<char>(width >> (24 - 8 * i));
  for (int i = 0; i < 4; ++i) png[20 + i] = static_cast<char>(height >> (24 - 8 * i));
  auto r = DecodeImage(png, {}, "img");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("1x16384 pixels is more elongated than the limit of 20:1"),
            std::string::npos)
      << r.status().message();
  // 20:1 itself is accepted.
  auto ok = DecodeImage(Encode(Solid(100, 5, cv::Scalar(1, 2, 3)), ".png"), {}, "img");
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(ImageIo, PreprocessNormalizesAndCentreCrops) {
  // 96 x 32 image: left third red, middle half-and-half, right third blue. The shorter side is
  // already 32, so no resize: the crop takes columns [32, 64).
  RgbImage img;
  img.width = 96;
  img.height = 32;
  img.pixels.resize(96 * 32 * 3);
  for (int y = 0; y < 32; ++y) {
    for (int x = 0; x < 96; ++x) {
      uint8_t* p = &img.pixels[(y * 96 + x) * 3];
      const bool left = x < 48;
      p[0] = left ? 255 : 0;
      p[1] = 0;
      p[2] = left ? 0 : 255;
    }
  }
  ImageProcessorConfig cfg;
  cfg.shortest_edge = cfg.crop_height = cfg.crop_width = 32;
  std::vector<float> out = PreprocessImage(img, cfg);
  ASSERT_EQ(out.size(), 3u * 32u * 32u);
  auto at = [&](int c, int y, int x) { return out[(c * 32 + y) * 32 + x]; };
  const float red_one = (1.f - cfg.image_mean[0]) / cfg.image_std[0];
  const float red_zero = (0.f - cfg.image_mean[0]) / cfg.image_std[0];
  const float blue_one = (1.f - cfg.image_mean[2]) / cfg.image_std[2];
  EXPECT_NEAR(at(0, 5, 15), red_one, 1e-5);   // crop column 15 = source column 47: red
  EXPECT_NEAR(at(0, 5, 16), red_zero, 1e-5);  // crop column 16 = source column 48: blue
  EXPECT_NEAR(at(2, 31, 31), blue_one, 1e-5);
  EXPECT_NEAR(at(1, 0, 0), (0.f - cfg.image_mean[1]) / cfg.image_std[1], 1e-5);
}

TEST(ImageIo, PadToSquareUsesMeanColour) {
  RgbImage img;
  img.width = 32;
  img.height = 16;
  img.pixels.assign(32 * 16 * 3, 0);
  ImageProcessorConfig cfg;
  cfg.shortest_edge = cfg.crop_height = cfg.crop_width = 32;
  cfg.pad_to_square = true;
  std::vector<float> out = PreprocessImage(img, cfg);
  // Row 0 is padding: mean colour (rounded to 8 bit) normalises to about 0.
  for (int c = 0; c < 3; ++c) EXPECT_NEAR(out[(c * 32 + 0) * 32 + 10], 0.f, 0.01f);
  // Row 16 is the black image.
  EXPECT_NEAR(out[(0 * 32 + 16) * 32 + 10], -cfg.image_mean[0] / cfg.image_std[0], 1e-5);
}

// A crop larger than the resized image: the crop bytes hold the image in its middle, and what
// lies outside it is normalised as a black pixel (transformers pads the crop with zeros before
// rescaling and normalising).
TEST(ImageIo, CropLargerThanTheImageIsZeroOutside) {
  RgbImage img;
  img.width = img.height = 16;
  img.pixels.assign(16 * 16 * 3, 200);
  ImageProcessorConfig cfg;
  cfg.shortest_edge = 16;
  cfg.crop_height = cfg.crop_width = 20;
  const CroppedImage crop = CropImage(img, cfg);
  EXPECT_EQ(crop.rgb.size(), 20u * 20u * 3u) << "3 bytes per crop pixel";
  EXPECT_EQ(crop.top, 2);
  EXPECT_EQ(crop.left, 2);
  EXPECT_EQ(crop.bottom, 18);
  EXPECT_EQ(crop.right, 18);
  const std::vector<float> out = NormalizeImage(crop, cfg);
  ASSERT_EQ(out, PreprocessImage(img, cfg));
  auto at = [&](int c, int y, int x) { return out[(c * 20 + y) * 20 + x]; };
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(at(c, 0, 10), (0.f - cfg.image_mean[c]) / cfg.image_std[c]) << "row 0 is outside";
    EXPECT_EQ(at(c, 10, 19), (0.f - cfg.image_mean[c]) / cfg.image_std[c]) << "column 19 too";
    EXPECT_NEAR(at(c, 10, 10), (200.f / 255.f - cfg.image_mean[c]) / cfg.image_std[c], 1e-5);
  }
}

}  // namespace
}  // namespace llava
