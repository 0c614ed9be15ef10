// Conversions between the public API (llava.v1) and the engine's types. The only place that
// knows both; errors name the API field ("messages[1].content[0].image.mime_type").
#pragma once

#include <grpcpp/grpcpp.h>

#include "engine/serving/generator.h"
#include "llava/v1/llava.pb.h"
#include "server/request_gate.h"

namespace llava::server {

StatusOr<GenerationRequest> ToGenerationRequest(const v1::ChatRequest& request,
                                                const RequestDefaults& defaults);

v1::FinishReason ToProto(FinishReason reason);
v1::CachePolicy ToProto(CachePolicy policy);
void FillUsage(const GenerationResult& result, double queue_seconds, v1::Usage* usage);
grpc::Status ToGrpcStatus(const Status& status);

}  // namespace llava::server
