// The OpenAI Chat Completions wire format (https://platform.openai.com/docs/api-reference/chat):
// request JSON -> GenerationRequest, results -> response and chunk JSON, Status -> OpenAI's
// error object and HTTP status. No sockets here (openai_server.cc serves it) and no gRPC, so
// every mapping is testable on its own (tests/openai_api_test.cc).
//
// Field names in errors are the JSON paths the client sent ("messages[0].content[1].image_url",
// "top_p", "kv_cache.budget"): the range checks themselves are the engine's, shared with the
// gRPC API, and their "sampling." prefix is dropped here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "engine/serving/engine.h"
#include "server/request_gate.h"

namespace llava::server {

struct OpenAiRequest {
  GenerationRequest request;
  std::string model;  // as sent ("" when absent)
  bool stream = false;
  bool include_usage = false;             // stream_options.include_usage
  std::optional<double> timeout_seconds;  // extension: "timeout", the request's deadline
};

// Parses a POST /v1/chat/completions body. Unknown fields are ignored, as OpenAI does; known
// ones this service cannot honour (n > 1, tools, logprobs, audio, non-zero penalties, JSON
// response formats) are INVALID_ARGUMENT naming the field, as are wrong types, remote image
// URLs (the service never fetches URLs) and data URIs that are not base64 images.
//
// Extension fields (OpenAI SDKs send them through `extra_body`):
//   "kv_cache": {"policy": "elastic" | "elastic+paper" | "h2o" | ... (llava-generate's
//                --policy syntax), "budget": 0.2, "sink_tokens": 4, "recent_distance": 25,
//                "position_mode": "original" | "compressed"}
//   "timeout": seconds until the request's deadline (then 504)
//   "top_k", "repetition_penalty", "ignore_eos": as in the gRPC API's SamplingParams
StatusOr<OpenAiRequest> ParseChatCompletion(std::string_view body, const RequestDefaults& defaults);

// Decodes "data:image/png;base64,...." into the image bytes; `field` names it in errors.
StatusOr<std::string> DecodeImageDataUri(std::string_view uri, const std::string& field);

// The engine's field names as the OpenAI request spells them ("sampling.top_p must ..." ->
// "top_p must ...").
Status ToOpenAiFieldNames(const Status& status);

// What the response bodies need besides the result.
struct CompletionMeta {
  std::string id;       // "chatcmpl-..."
  std::string model;    // the served model's id
  int64_t created = 0;  // Unix seconds
};

// The non-streaming response (object "chat.completion"). Finish reasons are the engine's
// (FinishReasonName): "stop" and "length" as OpenAI's; "cancelled" and "error" have no OpenAI
// counterpart and reach no client (it left, or got an error body instead).
std::string CompletionJson(const CompletionMeta& meta, const std::string& text,
                           const GenerationResult& result, double queue_seconds);
// One streamed chunk (object "chat.completion.chunk"): the first carries the assistant role,
// later ones a text delta, the last of the choice its finish reason and an empty delta.
// `include_usage` adds "usage": null, as OpenAI does on every chunk but the usage chunk.
std::string ChunkJson(const CompletionMeta& meta, const std::string* role,
                      const std::string* content, const char* finish_reason, bool include_usage);
// The usage chunk sent last when stream_options.include_usage is set: no choices.
std::string UsageChunkJson(const CompletionMeta& meta, const GenerationResult& result,
                           double queue_seconds);

// OpenAI's error body {"error": {"message", "type", "param", "code"}} and its HTTP status: 400
// bad input, 404 unknown model, 413 body too large, 429 queue full, 503 draining, 504
// deadline, 500 otherwise. `param` is the field the message starts with, when it names one.
int HttpStatusOf(const Status& status);
std::string ErrorJson(const Status& status);

}  // namespace llava::server
