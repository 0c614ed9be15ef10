#include "engine/serving/warmup.h"

#include <cstdint>
#include <future>
#include <memory>
#include <string>

namespace llava {
namespace {

// A 24-bit bottom-up BMP of `side` x `side` white pixels: rows padded to 4 bytes.
std::string WhiteBmp(int side) {
  const uint32_t row = (static_cast<uint32_t>(side) * 3 + 3) & ~3u;
  const uint32_t pixels = row * static_cast<uint32_t>(side), size = 54 + pixels;
  std::string b(size, '\0');
  auto put = [&b](size_t at, uint32_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  };
  b[0] = 'B';
  b[1] = 'M';
  put(2, size, 4);
  put(10, 54, 4);  // pixel data offset
  put(14, 40, 4);  // BITMAPINFOHEADER
  put(18, static_cast<uint32_t>(side), 4);
  put(22, static_cast<uint32_t>(side), 4);
  put(26, 1, 2);   // planes
  put(28, 24, 2);  // bits per pixel
  put(34, pixels, 4);
  for (int y = 0; y < side; ++y) {
    for (int x = 0; x < side * 3; ++x) b[54 + static_cast<size_t>(y) * row + x] = '\xff';
  }
  return b;
}

class WarmUpObserver final : public RequestObserver {
 public:
  void OnText(const std::string&) override {}
  void OnFinished(const StatusOr<GenerationResult>& result) override { done_.set_value(result); }
  std::future<StatusOr<GenerationResult>> Result() { return done_.get_future(); }

 private:
  std::promise<StatusOr<GenerationResult>> done_;
};

}  // namespace

Status WarmUp(EngineApi* engine, const LlavaConfig& config, const CacheParams& kv, uint64_t id,
              std::chrono::milliseconds timeout, double* ttft_seconds) {
  GenerationRequest request;
  request.images = {WhiteBmp(config.vision.image_size)};
  request.messages = {
      {"user",
       {{ContentPart::Kind::kImage, "", 0}, {ContentPart::Kind::kText, "Describe the image.", 0}}}};
  request.sampling.max_tokens = 2;
  request.kv_cache = kv;
  auto observer = std::make_shared<WarmUpObserver>();
  std::future<StatusOr<GenerationResult>> result = observer->Result();
  LLAVA_RETURN_IF_ERROR(engine->Submit(id, request, observer, std::nullopt));
  if (result.wait_for(timeout) != std::future_status::ready) {
    engine->Cancel(id);
    result.wait();  // OnFinished comes exactly once; the observer must outlive it
    return DeadlineExceeded("warm-up request: no answer within " + std::to_string(timeout.count()) +
                            " ms");
  }
  const StatusOr<GenerationResult> r = result.get();
  if (!r.ok()) return r.status();
  if (ttft_seconds != nullptr) *ttft_seconds = r->ttft_seconds;
  return Status::Ok();
}

}  // namespace llava
