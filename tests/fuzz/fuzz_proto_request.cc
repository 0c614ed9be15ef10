// gRPC ChatRequest bytes (llava.v1) -> the engine's GenerationRequest (server/convert.h), as a
// client can send them: the server's parse first (ParseRequest, which says why protobuf refused
// the bytes), then our conversion and its field checks, then the
// engine's admission (admission.h).
#include <cstddef>
#include <cstdint>

#include "llava/v1/llava.pb.h"
#include "server/convert.h"
#include "tests/fuzz/admission.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  llava::v1::ChatRequest request;
  const llava::Status parsed = llava::server::ParseRequest(
      std::string_view(reinterpret_cast<const char*>(data), size), &request);
  if (!parsed.ok()) {
    llava::fuzz::CheckRefusal(parsed);
    return 0;
  }
  llava::server::RequestDefaults defaults;
  auto converted = llava::server::ToGenerationRequest(request, defaults);
  if (!converted.ok()) {
    llava::fuzz::CheckRefusal(converted.status());
    return 0;
  }
  llava::fuzz::CheckAdmission(*converted);
  return 0;
}
