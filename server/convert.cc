#include "server/convert.h"

#include <google/protobuf/stubs/common.h>
#include <google/protobuf/unknown_field_set.h>
#if GOOGLE_PROTOBUF_VERSION < 4022000
#include <google/protobuf/stubs/logging.h>
#endif

#include <climits>
#include <cmath>
#include <map>

#include "engine/io/image_io.h"
#include "engine/io/utf8.h"

namespace llava::server {
namespace {

StatusOr<ImageFormat> MimeFormat(const std::string& mime, const std::string& field) {
  if (mime == "image/jpeg" || mime == "image/jpg") return ImageFormat::kJpeg;
  if (mime == "image/png") return ImageFormat::kPng;
  if (mime == "image/webp") return ImageFormat::kWebp;
  if (mime == "image/bmp") return ImageFormat::kBmp;
  return InvalidArgument(field + " '" + mime +
                         "' is not supported (image/jpeg, image/png, image/webp, image/bmp)");
}

// The API path of the first string field (depth first) in `bytes`, read as `type`, that is not
// UTF-8. The bytes are walked as protobuf's unknown fields, which keeps strings unchecked.
std::optional<std::string> FindInvalidUtf8(std::string_view bytes,
                                           const google::protobuf::Descriptor& type,
                                           const std::string& prefix, int depth) {
  using google::protobuf::FieldDescriptor;
  using google::protobuf::UnknownField;
  if (depth > 16) return std::nullopt;  // the API nests four deep
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return std::nullopt;
  std::map<int, int> occurrences;
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& field = fields.field(i);
    const int index = occurrences[field.number()]++;
    const FieldDescriptor* described = type.FindFieldByNumber(field.number());
    if (described == nullptr || field.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    std::string path = prefix + described->name();
    if (described->is_repeated()) path += "[" + std::to_string(index) + "]";
    if (described->type() == FieldDescriptor::TYPE_STRING &&
        !IsValidUtf8(field.length_delimited())) {
      return path;
    }
    if (described->type() == FieldDescriptor::TYPE_MESSAGE) {
      if (auto inner = FindInvalidUtf8(field.length_delimited(), *described->message_type(),
                                       path + ".", depth + 1)) {
        return inner;
      }
    }
  }
  return std::nullopt;
}

}  // namespace

Status ParseRequest(std::string_view bytes, google::protobuf::Message* message) {
#if GOOGLE_PROTOBUF_VERSION < 4022000
  // protobuf writes an ERROR line to stderr for every string that is not UTF-8: a client could
  // write to the server's log at will. The answer names the field instead.
  google::protobuf::LogSilencer quiet;
#endif
  if (bytes.size() <= static_cast<size_t>(INT_MAX) &&
      message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return Status();
  }
  return WhyUnparsable(bytes, *message->GetDescriptor());
}

Status WhyUnparsable(std::string_view bytes, const google::protobuf::Descriptor& type) {
  if (bytes.size() <= static_cast<size_t>(INT_MAX)) {
    if (auto field = FindInvalidUtf8(bytes, type, "", 0)) {
      return InvalidArgument(*field + " is not valid UTF-8");
    }
  }
  return InvalidArgument("the request is not a " + type.full_name() +
                         " message (protobuf wire format)");
}

StatusOr<GenerationRequest> ToGenerationRequest(const v1::ChatRequest& request,
                                                const RequestDefaults& defaults) {
  if (request.request_id().size() > 128) {
    return InvalidArgument("request_id is longer than 128 bytes");
  }
  // It is written into log lines: a newline or other control byte could forge one.
  for (size_t i = 0; i < request.request_id().size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(request.request_id()[i]);
    if (c < 0x20 || c > 0x7e) {
      return InvalidArgument("request_id must be printable ASCII (byte " + std::to_string(i) +
                             " is " + std::to_string(c) + ")");
    }
  }
  GenerationRequest out;
  for (int i = 0; i < request.messages_size(); ++i) {
    const v1::Message& m = request.messages(i);
    const std::string field = "messages[" + std::to_string(i) + "]";
    ChatMessage msg;
    switch (m.role()) {
      case v1::ROLE_SYSTEM:
        msg.role = "system";
        break;
      case v1::ROLE_USER:
        msg.role = "user";
        break;
      case v1::ROLE_ASSISTANT:
        msg.role = "assistant";
        break;
      default:
        return InvalidArgument(field + ".role must be ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT");
    }
    for (int j = 0; j < m.content_size(); ++j) {
      const v1::ContentPart& part = m.content(j);
      const std::string pfield = field + ".content[" + std::to_string(j) + "]";
      if (part.has_image()) {
        if (msg.role != "user") {
          return InvalidArgument(pfield + ".image: images are allowed in user messages only");
        }
        const std::string ifield = pfield + ".image.data";
        if (part.image().data().empty()) return InvalidArgument(ifield + " is empty");
        if (!part.image().mime_type().empty()) {
          LLAVA_ASSIGN_OR_RETURN(ImageFormat declared,
                                 MimeFormat(part.image().mime_type(), pfield + ".image.mime_type"));
          LLAVA_ASSIGN_OR_RETURN(ImageInfo info, ProbeImage(part.image().data(), ifield));
          if (info.format != declared) {
            return InvalidArgument(pfield + ".image.mime_type says " + part.image().mime_type() +
                                   " but the data is " + ImageFormatName(info.format));
          }
        }
        msg.content.push_back({ContentPart::Kind::kImage, "", static_cast<int>(out.images.size())});
        out.images.push_back(part.image().data());
        out.image_fields.push_back(ifield);
      } else if (part.has_text()) {
        msg.content.push_back({ContentPart::Kind::kText, part.text(), 0});
      } else {
        return InvalidArgument(pfield + " has neither text nor image");
      }
    }
    out.messages.push_back(std::move(msg));
  }

  const v1::SamplingParams& s = request.sampling();
  SamplingParams& sp = out.sampling;
  sp.max_tokens = s.has_max_tokens() ? s.max_tokens() : defaults.max_tokens;
  if (s.has_temperature()) sp.temperature = s.temperature();
  if (s.has_top_p()) sp.top_p = s.top_p();
  if (s.has_top_k()) sp.top_k = s.top_k();
  if (s.has_seed()) sp.seed = s.seed();
  if (s.has_repetition_penalty()) sp.repetition_penalty = s.repetition_penalty();
  if (s.has_ignore_eos()) sp.ignore_eos = s.ignore_eos();
  sp.stop.assign(s.stop().begin(), s.stop().end());

  const v1::KvCacheConfig& kv = request.kv_cache();
  CacheParams& cp = out.kv_cache;
  cp = defaults.kv;
  switch (kv.policy()) {
    case v1::CACHE_POLICY_UNSPECIFIED:
      break;
    case v1::CACHE_POLICY_FULL:
      cp.policy = CachePolicy::kFull;
      break;
    case v1::CACHE_POLICY_ELASTIC:
      cp.policy = CachePolicy::kElastic;
      break;
    case v1::CACHE_POLICY_H2O:
      cp.policy = CachePolicy::kH2O;
      break;
    case v1::CACHE_POLICY_STREAMING_LLM:
      cp.policy = CachePolicy::kStreamingLLM;
      break;
    case v1::CACHE_POLICY_SNAPKV:
      cp.policy = CachePolicy::kSnapKV;
      break;
    default:
      return InvalidArgument("kv_cache.policy " + std::to_string(kv.policy()) + " is unknown");
  }
  if (kv.has_budget()) cp.budget = kv.budget();
  if (kv.has_recent_distance()) cp.elastic.recent_distance = kv.recent_distance();
  cp.sink_tokens = kv.has_sink_tokens() ? kv.sink_tokens() : -1;
  if (kv.has_sink_tokens() && kv.sink_tokens() < 0) {
    return InvalidArgument("kv_cache.sink_tokens must be >= 0, got " +
                           std::to_string(kv.sink_tokens()));
  }
  switch (kv.position_mode()) {
    case v1::POSITION_MODE_UNSPECIFIED:
    case v1::POSITION_MODE_ORIGINAL:
      cp.position_mode = PositionMode::kOriginal;
      break;
    case v1::POSITION_MODE_COMPRESSED:
      cp.position_mode = PositionMode::kCompressed;
      break;
    default:
      return InvalidArgument("kv_cache.position_mode is unknown");
  }
  const v1::ElasticOptions& e = kv.elastic();
  switch (e.variant()) {
    case v1::ELASTIC_VARIANT_UNSPECIFIED:
      break;  // the server's default Elastic
    case v1::ELASTIC_VARIANT_PRODUCT:
    case v1::ELASTIC_VARIANT_PAPER:
    case v1::ELASTIC_VARIANT_LOOK_M: {
      const int recent = cp.elastic.recent_distance;
      cp.elastic_variant = e.variant() == v1::ELASTIC_VARIANT_PAPER    ? ElasticVariant::kPaper
                           : e.variant() == v1::ELASTIC_VARIANT_LOOK_M ? ElasticVariant::kLookM
                                                                       : ElasticVariant::kProduct;
      cp.elastic = ElasticPreset(cp.elastic_variant);
      cp.elastic.recent_distance = recent;
      break;
    }
    default:
      return InvalidArgument("kv_cache.elastic.variant " + std::to_string(e.variant()) +
                             " is unknown");
  }
  if (e.has_protect_instruction()) cp.elastic.protect_instruction = e.protect_instruction();
  if (e.has_protect_system()) cp.elastic.protect_system = e.protect_system();
  if (e.has_weighted_merge()) cp.elastic.weighted_merge = e.weighted_merge();
  if (e.has_merge_keys()) cp.elastic.merge_keys = e.merge_keys();
  if (e.has_evict_age_exponent()) cp.elastic.evict_age_exponent = e.evict_age_exponent();
  if (e.has_evict_answer_first()) cp.elastic.evict_answer_first = e.evict_answer_first();
  if (e.has_decode_merge()) cp.elastic.decode_merge = e.decode_merge();
  if (e.has_text_prior()) cp.elastic.text_prior = e.text_prior();
  if (e.has_protect_tail()) cp.elastic.protect_tail = e.protect_tail();
  if (kv.h2o().has_recent_window()) cp.h2o.recent_window = kv.h2o().recent_window();
  if (kv.h2o().has_shared_scores()) cp.h2o.shared_scores = kv.h2o().shared_scores();
  if (kv.snapkv().has_window()) cp.snapkv.window = kv.snapkv().window();
  if (kv.snapkv().has_kernel()) cp.snapkv.kernel = kv.snapkv().kernel();
  switch (e.importance()) {
    case v1::IMPORTANCE_MODE_UNSPECIFIED:
      break;
    case v1::IMPORTANCE_MODE_SUM:
      cp.elastic.importance = ImportanceMode::kSum;
      break;
    case v1::IMPORTANCE_MODE_MEAN:
      cp.elastic.importance = ImportanceMode::kMean;
      break;
    case v1::IMPORTANCE_MODE_INSTRUCTION:
      cp.elastic.importance = ImportanceMode::kInstruction;
      break;
    case v1::IMPORTANCE_MODE_HYBRID:
      cp.elastic.importance = ImportanceMode::kHybrid;
      break;
    default:
      return InvalidArgument("kv_cache.elastic.importance " + std::to_string(e.importance()) +
                             " is unknown");
  }
  switch (e.merge_scope()) {
    case v1::MERGE_SCOPE_UNSPECIFIED:
      break;
    case v1::MERGE_SCOPE_NEAREST:
      cp.elastic.merge_scope = MergeScope::kNearest;
      break;
    case v1::MERGE_SCOPE_SEGMENT:
      cp.elastic.merge_scope = MergeScope::kSegment;
      break;
    case v1::MERGE_SCOPE_KEY:
      cp.elastic.merge_scope = MergeScope::kKey;
      break;
    default:
      return InvalidArgument("kv_cache.elastic.merge_scope " + std::to_string(e.merge_scope()) +
                             " is unknown");
  }
  switch (e.key_merge()) {
    case v1::KEY_MERGE_UNSPECIFIED:
      break;
    case v1::KEY_MERGE_AVERAGED:
      cp.elastic.key_merge = KeyMerge::kAveraged;
      break;
    case v1::KEY_MERGE_PIVOTAL:
      cp.elastic.key_merge = KeyMerge::kPivotal;
      break;
    case v1::KEY_MERGE_WEIGHTED:
      cp.elastic.key_merge = KeyMerge::kWeighted;
      break;
    default:
      return InvalidArgument("kv_cache.elastic.key_merge " + std::to_string(e.key_merge()) +
                             " is unknown");
  }
  switch (e.eviction()) {
    case v1::DECODE_EVICTION_UNSPECIFIED:
      break;
    case v1::DECODE_EVICTION_FIXED_POINT:
      cp.elastic.eviction = DecodeEviction::kFixedPoint;
      break;
    case v1::DECODE_EVICTION_SCORED:
      cp.elastic.eviction = DecodeEviction::kScored;
      break;
    default:
      return InvalidArgument("kv_cache.elastic.eviction " + std::to_string(e.eviction()) +
                             " is unknown");
  }
  LLAVA_RETURN_IF_ERROR(ValidateCacheParams(cp));
  return out;
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kError:
      return v1::FINISH_REASON_ERROR;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

v1::CachePolicy ToProto(CachePolicy policy) {
  switch (policy) {
    case CachePolicy::kFull:
      return v1::CACHE_POLICY_FULL;
    case CachePolicy::kElastic:
      return v1::CACHE_POLICY_ELASTIC;
    case CachePolicy::kH2O:
      return v1::CACHE_POLICY_H2O;
    case CachePolicy::kStreamingLLM:
      return v1::CACHE_POLICY_STREAMING_LLM;
    case CachePolicy::kSnapKV:
      return v1::CACHE_POLICY_SNAPKV;
  }
  return v1::CACHE_POLICY_UNSPECIFIED;
}

void FillUsage(const GenerationResult& r, double queue_seconds, v1::Usage* u) {
  u->set_prompt_tokens(r.prompt_tokens);
  u->set_image_tokens(r.image_tokens);
  u->set_completion_tokens(r.completion_tokens);
  u->set_kv_bytes_used(r.kv.bytes_kept);
  u->set_kv_bytes_full(r.kv.full_equivalent_bytes);
  u->set_tokens_merged(r.kv.tokens_merged);
  u->set_tokens_evicted(r.kv.tokens_evicted);
  u->set_time_to_first_token_seconds(r.ttft_seconds);
  u->set_total_seconds(r.total_seconds);
  u->set_queue_seconds(queue_seconds);
}

grpc::Status ToGrpcStatus(const Status& s) {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  switch (s.code()) {
    case StatusCode::kOk:
      return grpc::Status::OK;
    case StatusCode::kInvalidArgument:
      code = grpc::StatusCode::INVALID_ARGUMENT;
      break;
    case StatusCode::kNotFound:
      code = grpc::StatusCode::NOT_FOUND;
      break;
    case StatusCode::kDataLoss:
      code = grpc::StatusCode::DATA_LOSS;
      break;
    case StatusCode::kResourceExhausted:
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      break;
    case StatusCode::kFailedPrecondition:
      code = grpc::StatusCode::FAILED_PRECONDITION;
      break;
    case StatusCode::kUnimplemented:
      code = grpc::StatusCode::UNIMPLEMENTED;
      break;
    case StatusCode::kInternal:
      code = grpc::StatusCode::INTERNAL;
      break;
    case StatusCode::kUnavailable:
      code = grpc::StatusCode::UNAVAILABLE;
      break;
    case StatusCode::kDeadlineExceeded:
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
      break;
    case StatusCode::kCancelled:
      code = grpc::StatusCode::CANCELLED;
      break;
  }
  return grpc::Status(code, s.message());
}

}  // namespace llava::server
