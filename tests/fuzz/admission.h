// What the engine does with a converted request before it runs (torch-free): the sampling
// checks, then PrepareRequest with the shipped model's config and tokenizer (images decoded,
// template, tokenizer, lengths). Shared by the server-side fuzz targets: whatever a client
// sends, the request is either refused with INVALID_ARGUMENT naming a field, or it becomes a
// consistent model input.
#pragma once

#include "engine/serving/request.h"
#include "engine/serving/sampler.h"
#include "tests/fuzz/fuzz_util.h"

namespace llava::fuzz {

inline void CheckRefusal(const Status& status) {
  LLAVA_FUZZ_CHECK(status.code() == StatusCode::kInvalidArgument ||
                   status.code() == StatusCode::kResourceExhausted);
  LLAVA_FUZZ_CHECK(!status.message().empty());
}

inline void CheckAdmission(const GenerationRequest& request) {
  const Model& model = ShippedModel();
  EngineLimits limits;
  limits.image.max_pixels = 1 << 20;  // keep one execution in milliseconds
  const Status sampling = ValidateSamplingParams(request.sampling, limits.max_tokens_limit);
  if (!sampling.ok()) return CheckRefusal(sampling);
  auto prepared =
      PrepareRequest(request, model.config, *model.tokenizer, limits, request.sampling.max_tokens);
  if (!prepared.ok()) return CheckRefusal(prepared.status());
  const ImageProcessorConfig& image = model.config.image_processor;
  LLAVA_FUZZ_CHECK(!prepared->prompt.ids.empty());
  LLAVA_FUZZ_CHECK(static_cast<int64_t>(prepared->prompt.ids.size()) +
                       request.sampling.max_tokens <=
                   model.config.text.max_position_embeddings);
  LLAVA_FUZZ_CHECK(static_cast<int64_t>(prepared->images.size()) == prepared->num_images);
  for (const CroppedImage& crop : prepared->images) {
    LLAVA_FUZZ_CHECK(crop.height == image.crop_height && crop.width == image.crop_width);
    LLAVA_FUZZ_CHECK(static_cast<int64_t>(crop.rgb.size()) ==
                     int64_t{3} * image.crop_height * image.crop_width);
  }
}

}  // namespace llava::fuzz
