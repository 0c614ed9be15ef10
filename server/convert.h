// Conversions between the public API (llava.v1) and the engine's types. The only place that
// knows both; errors name the API field ("messages[1].content[0].image.mime_type").
#pragma once

#include <grpcpp/grpcpp.h>

#include "engine/serving/generator.h"
#include "llava/v1/llava.pb.h"
#include "server/request_gate.h"

namespace llava::server {

// Parses a request message (`message`'s type) from its wire bytes. Protobuf's parser says only
// that it failed; the error names the string field that is not UTF-8 ("messages[0].content[1]
// .text": proto3 strings must be), or says the bytes are not that message at all.
Status ParseRequest(std::string_view bytes, google::protobuf::Message* message);
// The error ParseRequest gives for `bytes` that protobuf refused to parse as `type`.
Status WhyUnparsable(std::string_view bytes, const google::protobuf::Descriptor& type);

StatusOr<GenerationRequest> ToGenerationRequest(const v1::ChatRequest& request,
                                                const RequestDefaults& defaults);

v1::FinishReason ToProto(FinishReason reason);
v1::CachePolicy ToProto(CachePolicy policy);
void FillUsage(const GenerationResult& result, double queue_seconds, v1::Usage* usage);
grpc::Status ToGrpcStatus(const Status& status);

}  // namespace llava::server
