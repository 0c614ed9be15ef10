#include "server/openai_api.h"

#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>

#include "engine/io/image_io.h"

namespace llava::server {
namespace {

using nlohmann::json;

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

// Nesting and size that a chat request never needs; the DOM of what passes costs a bounded
// multiple of its bytes (30 MB of '[' cost 1.5 GB as a DOM).
constexpr int kMaxJsonDepth = 32;
constexpr int64_t kMaxJsonValues = 65536;

// Checks the body's nesting and number of values before any DOM is built: one pass over the
// bytes, no allocation. What is not JSON is left to the parser.
Status CheckJsonShape(std::string_view body) {
  int depth = 0;
  int64_t values = 1;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > kMaxJsonDepth) {
          return InvalidArgument("the request body nests deeper than " +
                                 std::to_string(kMaxJsonDepth) + " levels");
        }
        break;
      case ']':
      case '}':
        --depth;
        break;
      case ',':
        if (++values > kMaxJsonValues) {
          return InvalidArgument("the request body has more than " +
                                 std::to_string(kMaxJsonValues) + " JSON values");
        }
        break;
      default:
        break;
    }
  }
  return Status::Ok();
}

Status WrongType(const std::string& field, const char* want, const json& v) {
  return InvalidArgument(field + " must be " + want + ", got " + TypeName(v));
}

// Field readers: absent and null both mean "not set", as OpenAI's own API treats them.
const json* Find(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

StatusOr<std::optional<double>> Number(const json& obj, const char* key, const std::string& field) {
  const json* v = Find(obj, key);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_number()) return WrongType(field, "a number", *v);
  return std::optional<double>(v->get<double>());
}

StatusOr<std::optional<int64_t>> Integer(const json& obj, const char* key,
                                         const std::string& field) {
  const json* v = Find(obj, key);
  if (v == nullptr) return std::optional<int64_t>();
  if (v->is_number_integer()) return std::optional<int64_t>(v->get<int64_t>());
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15)
      return std::optional<int64_t>(static_cast<int64_t>(d));
  }
  return WrongType(field, "an integer", *v);
}

StatusOr<std::optional<bool>> Bool(const json& obj, const char* key, const std::string& field) {
  const json* v = Find(obj, key);
  if (v == nullptr) return std::optional<bool>();
  if (!v->is_boolean()) return WrongType(field, "a boolean", *v);
  return std::optional<bool>(v->get<bool>());
}

StatusOr<std::optional<std::string>> String(const json& obj, const char* key,
                                            const std::string& field) {
  const json* v = Find(obj, key);
  if (v == nullptr) return std::optional<std::string>();
  if (!v->is_string()) return WrongType(field, "a string", *v);
  return std::optional<std::string>(v->get<std::string>());
}

// An int field of the engine from a JSON integer, refusing values that do not fit.
StatusOr<int> ToInt(int64_t v, const std::string& field) {
  if (v < INT32_MIN || v > INT32_MAX) {
    return InvalidArgument(field + " is out of range, got " + std::to_string(v));
  }
  return static_cast<int>(v);
}

int Base64Value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+' || c == '-') return 62;  // '-' and '_': the URL-safe alphabet
  if (c == '/' || c == '_') return 63;
  return -1;
}

StatusOr<ContentPart> ImagePart(const json& part, const std::string& field,
                                GenerationRequest* out) {
  const json* url_obj = Find(part, "image_url");
  if (url_obj == nullptr) return InvalidArgument(field + ".image_url is missing");
  std::string url;
  std::string url_field = field + ".image_url";
  if (url_obj->is_string()) {  // some clients send the URL itself
    url = url_obj->get<std::string>();
  } else if (url_obj->is_object()) {
    url_field += ".url";
    LLAVA_ASSIGN_OR_RETURN(std::optional<std::string> u, String(*url_obj, "url", url_field));
    if (!u) return InvalidArgument(url_field + " is missing");
    url = *u;
    LLAVA_ASSIGN_OR_RETURN(std::optional<std::string> detail,
                           String(*url_obj, "detail", field + ".image_url.detail"));
    if (detail && *detail != "auto" && *detail != "low" && *detail != "high") {
      return InvalidArgument(field + ".image_url.detail must be auto, low or high, got '" +
                             *detail + "'");
    }
  } else {
    return WrongType(url_field, "an object with a url", *url_obj);
  }
  if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) {
    return InvalidArgument(url_field +
                           ": remote image URLs are not fetched by this service; send the image "
                           "inline as a data URI (data:image/png;base64,...)");
  }
  LLAVA_ASSIGN_OR_RETURN(std::string bytes, DecodeImageDataUri(url, url_field));
  ContentPart p{ContentPart::Kind::kImage, "", static_cast<int>(out->images.size())};
  out->images.push_back(std::move(bytes));
  out->image_fields.push_back(url_field);
  return p;
}

Status ParseMessages(const json& body, GenerationRequest* out) {
  const json* messages = Find(body, "messages");
  if (messages == nullptr) return InvalidArgument("messages is missing");
  if (!messages->is_array()) return WrongType("messages", "an array", *messages);
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string field = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return WrongType(field, "an object", m);
    LLAVA_ASSIGN_OR_RETURN(std::optional<std::string> role, String(m, "role", field + ".role"));
    if (!role) return InvalidArgument(field + ".role is missing");
    ChatMessage msg;
    if (*role == "system" || *role == "developer") {
      msg.role = "system";
    } else if (*role == "user" || *role == "assistant") {
      msg.role = *role;
    } else {
      return InvalidArgument(field + ".role '" + *role +
                             "' is not supported (system, developer, user, assistant)");
    }
    const json* content = Find(m, "content");
    if (content == nullptr) return InvalidArgument(field + ".content is missing");
    if (content->is_string()) {
      msg.content.push_back({ContentPart::Kind::kText, content->get<std::string>(), 0});
    } else if (content->is_array()) {
      for (size_t j = 0; j < content->size(); ++j) {
        const json& part = (*content)[j];
        const std::string pfield = field + ".content[" + std::to_string(j) + "]";
        if (!part.is_object()) return WrongType(pfield, "an object", part);
        LLAVA_ASSIGN_OR_RETURN(std::optional<std::string> type,
                               String(part, "type", pfield + ".type"));
        if (!type) return InvalidArgument(pfield + ".type is missing");
        if (*type == "text") {
          LLAVA_ASSIGN_OR_RETURN(std::optional<std::string> text,
                                 String(part, "text", pfield + ".text"));
          if (!text) return InvalidArgument(pfield + ".text is missing");
          msg.content.push_back({ContentPart::Kind::kText, *text, 0});
        } else if (*type == "image_url") {
          if (msg.role != "user") {
            return InvalidArgument(pfield + ": images are allowed in user messages only");
          }
          LLAVA_ASSIGN_OR_RETURN(ContentPart p, ImagePart(part, pfield, out));
          msg.content.push_back(std::move(p));
        } else {
          return InvalidArgument(pfield + ".type '" + *type +
                                 "' is not supported (text, image_url)");
        }
      }
    } else {
      return WrongType(field + ".content", "a string or an array of parts", *content);
    }
    out->messages.push_back(std::move(msg));
  }
  return Status::Ok();
}

Status ParseSampling(const json& body, const RequestDefaults& defaults, SamplingParams* sp) {
  sp->max_tokens = defaults.max_tokens;
  LLAVA_ASSIGN_OR_RETURN(auto max_tokens, Integer(body, "max_tokens", "max_tokens"));
  LLAVA_ASSIGN_OR_RETURN(auto max_completion,
                         Integer(body, "max_completion_tokens", "max_completion_tokens"));
  // The newer name wins when both are sent.
  if (max_completion) {
    LLAVA_ASSIGN_OR_RETURN(sp->max_tokens, ToInt(*max_completion, "max_completion_tokens"));
  } else if (max_tokens) {
    LLAVA_ASSIGN_OR_RETURN(sp->max_tokens, ToInt(*max_tokens, "max_tokens"));
  }
  LLAVA_ASSIGN_OR_RETURN(auto temperature, Number(body, "temperature", "temperature"));
  if (temperature) sp->temperature = static_cast<float>(*temperature);
  LLAVA_ASSIGN_OR_RETURN(auto top_p, Number(body, "top_p", "top_p"));
  if (top_p) sp->top_p = static_cast<float>(*top_p);
  LLAVA_ASSIGN_OR_RETURN(auto top_k, Integer(body, "top_k", "top_k"));
  if (top_k) {
    LLAVA_ASSIGN_OR_RETURN(sp->top_k, ToInt(*top_k, "top_k"));
  }
  LLAVA_ASSIGN_OR_RETURN(auto seed, Integer(body, "seed", "seed"));
  if (seed) sp->seed = static_cast<uint64_t>(*seed);
  LLAVA_ASSIGN_OR_RETURN(auto rep, Number(body, "repetition_penalty", "repetition_penalty"));
  if (rep) sp->repetition_penalty = static_cast<float>(*rep);
  LLAVA_ASSIGN_OR_RETURN(auto ignore_eos, Bool(body, "ignore_eos", "ignore_eos"));
  if (ignore_eos) sp->ignore_eos = *ignore_eos;
  if (const json* stop = Find(body, "stop")) {
    if (stop->is_string()) {
      sp->stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string()) {
          return WrongType("stop[" + std::to_string(i) + "]", "a string", (*stop)[i]);
        }
        sp->stop.push_back((*stop)[i].get<std::string>());
      }
    } else {
      return WrongType("stop", "a string or an array of strings", *stop);
    }
  }
  return Status::Ok();
}

// Fields OpenAI defines that this service cannot honour: refused rather than silently ignored,
// since ignoring them would change what the client gets.
Status RefuseUnsupported(const json& body) {
  LLAVA_ASSIGN_OR_RETURN(auto n, Integer(body, "n", "n"));
  if (n && *n != 1)
    return InvalidArgument("n must be 1 (one choice per request), got " + std::to_string(*n));
  for (const char* key : {"frequency_penalty", "presence_penalty"}) {
    LLAVA_ASSIGN_OR_RETURN(auto v, Number(body, key, key));
    if (v && *v != 0) return InvalidArgument(std::string(key) + " is not supported (use 0)");
  }
  LLAVA_ASSIGN_OR_RETURN(auto logprobs, Bool(body, "logprobs", "logprobs"));
  if (logprobs && *logprobs) return InvalidArgument("logprobs is not supported");
  for (const char* key : {"tools", "functions", "audio", "prediction"}) {
    const json* v = Find(body, key);
    if (v != nullptr && !(v->is_array() && v->empty())) {
      return InvalidArgument(std::string(key) + " is not supported");
    }
  }
  if (const json* modalities = Find(body, "modalities")) {
    if (!modalities->is_array()) return WrongType("modalities", "an array", *modalities);
    for (const json& m : *modalities) {
      if (m != "text") return InvalidArgument("modalities: only \"text\" output is supported");
    }
  }
  if (const json* format = Find(body, "response_format")) {
    if (!format->is_object()) return WrongType("response_format", "an object", *format);
    LLAVA_ASSIGN_OR_RETURN(auto type, String(*format, "type", "response_format.type"));
    if (type && *type != "text") {
      return InvalidArgument("response_format.type '" + *type + "' is not supported (text)");
    }
  }
  return Status::Ok();
}

Status ParseKvCache(const json& body, const RequestDefaults& defaults, CacheParams* cp) {
  *cp = defaults.kv;
  const json* kv = Find(body, "kv_cache");
  if (kv == nullptr) return Status::Ok();
  if (!kv->is_object()) return WrongType("kv_cache", "an object", *kv);
  LLAVA_ASSIGN_OR_RETURN(auto policy, String(*kv, "policy", "kv_cache.policy"));
  if (policy) {
    StatusOr<CacheParams> parsed = ParseCacheSpec(*policy, *cp);
    if (!parsed.ok()) {
      const std::string& m = parsed.status().message();
      return InvalidArgument(m.rfind("kv_cache.", 0) == 0 ? m : "kv_cache.policy: " + m);
    }
    *cp = *parsed;
  }
  LLAVA_ASSIGN_OR_RETURN(auto budget, Number(*kv, "budget", "kv_cache.budget"));
  if (budget) cp->budget = *budget;
  LLAVA_ASSIGN_OR_RETURN(auto sinks, Integer(*kv, "sink_tokens", "kv_cache.sink_tokens"));
  if (sinks) {
    if (*sinks < 0) {
      return InvalidArgument("kv_cache.sink_tokens must be >= 0, got " + std::to_string(*sinks));
    }
    LLAVA_ASSIGN_OR_RETURN(cp->sink_tokens, ToInt(*sinks, "kv_cache.sink_tokens"));
  }
  LLAVA_ASSIGN_OR_RETURN(auto recent, Integer(*kv, "recent_distance", "kv_cache.recent_distance"));
  if (recent) {
    LLAVA_ASSIGN_OR_RETURN(cp->elastic.recent_distance, ToInt(*recent, "kv_cache.recent_distance"));
  }
  LLAVA_ASSIGN_OR_RETURN(auto position, String(*kv, "position_mode", "kv_cache.position_mode"));
  if (position) {
    LLAVA_ASSIGN_OR_RETURN(cp->position_mode, ParsePositionMode(*position));
  }
  return ValidateCacheParams(*cp);
}

json UsageObject(const GenerationResult& r, double queue_seconds) {
  json u;
  u["prompt_tokens"] = r.prompt_tokens;
  u["completion_tokens"] = r.completion_tokens;
  u["total_tokens"] = r.prompt_tokens + r.completion_tokens;
  // Extensions: the image's share of the prompt and what the KV policy saved.
  u["image_tokens"] = r.image_tokens;
  u["kv_bytes_used"] = r.kv.bytes_kept;
  u["kv_bytes_full"] = r.kv.full_equivalent_bytes;
  u["kv_saved_ratio"] = r.kv.full_equivalent_bytes > 0
                            ? 1.0 - double(r.kv.bytes_kept) / r.kv.full_equivalent_bytes
                            : 0.0;
  u["tokens_merged"] = r.kv.tokens_merged;
  u["tokens_evicted"] = r.kv.tokens_evicted;
  u["queue_seconds"] = queue_seconds;
  u["time_to_first_token_seconds"] = r.ttft_seconds;
  u["total_seconds"] = r.total_seconds;
  return u;
}

json Envelope(const CompletionMeta& meta, const char* object) {
  json j;
  j["id"] = meta.id;
  j["object"] = object;
  j["created"] = meta.created;
  j["model"] = meta.model;
  j["system_fingerprint"] = nullptr;
  return j;
}

// JSON text; invalid UTF-8 (never produced by the engine, but a client's stop string could cut
// one) is replaced instead of throwing.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

StatusOr<std::string> DecodeImageDataUri(std::string_view uri, const std::string& field) {
  if (uri.rfind("data:", 0) != 0) {
    return InvalidArgument(field + " must be a data URI (data:image/png;base64,...)");
  }
  const size_t comma = uri.find(',');
  if (comma == std::string_view::npos) return InvalidArgument(field + ": data URI has no ','");
  const std::string_view header = uri.substr(5, comma - 5);
  const size_t semi = header.find(';');
  const std::string_view mime = header.substr(0, semi);
  if (semi == std::string_view::npos || header.substr(semi + 1) != "base64") {
    return InvalidArgument(field + ": data URI must be base64 (data:image/png;base64,...)");
  }
  if (!mime.empty() && mime.rfind("image/", 0) != 0) {
    return InvalidArgument(field + ": data URI media type '" + std::string(mime) +
                           "' is not an image");
  }
  const std::string_view data = uri.substr(comma + 1);
  std::string out;
  out.reserve(data.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  size_t padding = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(data[i]);
    if (c == '=') {
      ++padding;
      continue;
    }
    if (c == '\n' || c == '\r' || c == ' ') continue;
    const int v = Base64Value(c);
    if (v < 0 || padding > 0) {
      return InvalidArgument(field + ": data URI is not valid base64 (byte " +
                             std::to_string(comma + 1 + i) + ")");
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  if (padding > 2 || bits >= 6) {
    return InvalidArgument(field + ": data URI is not valid base64 (bad length or padding)");
  }
  if (out.empty()) return InvalidArgument(field + ": data URI holds no data");
  // The declared type must match the bytes, as the gRPC API checks mime_type.
  LLAVA_ASSIGN_OR_RETURN(ImageInfo info, ProbeImage(out, field));
  const std::string declared(mime);
  std::string actual = ImageFormatName(info.format);
  for (char& c : actual) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!declared.empty() && declared != "image/" + actual &&
      !(declared == "image/jpg" && actual == "jpeg")) {
    return InvalidArgument(field + ": data URI says " + declared + " but the data is " + actual);
  }
  return out;
}

StatusOr<OpenAiRequest> ParseChatCompletion(std::string_view body,
                                            const RequestDefaults& defaults) {
  LLAVA_RETURN_IF_ERROR(CheckJsonShape(body));
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("the request body is not valid JSON");
  if (!j.is_object()) return WrongType("the request body", "a JSON object", j);
  OpenAiRequest out;
  LLAVA_ASSIGN_OR_RETURN(auto model, String(j, "model", "model"));
  if (model) out.model = *model;
  LLAVA_RETURN_IF_ERROR(RefuseUnsupported(j));
  LLAVA_RETURN_IF_ERROR(ParseMessages(j, &out.request));
  LLAVA_RETURN_IF_ERROR(ParseSampling(j, defaults, &out.request.sampling));
  LLAVA_RETURN_IF_ERROR(ParseKvCache(j, defaults, &out.request.kv_cache));
  LLAVA_ASSIGN_OR_RETURN(auto stream, Bool(j, "stream", "stream"));
  out.stream = stream.value_or(false);
  if (const json* options = Find(j, "stream_options")) {
    if (!options->is_object()) return WrongType("stream_options", "an object", *options);
    LLAVA_ASSIGN_OR_RETURN(auto usage,
                           Bool(*options, "include_usage", "stream_options.include_usage"));
    out.include_usage = usage.value_or(false);
  }
  LLAVA_ASSIGN_OR_RETURN(auto timeout, Number(j, "timeout", "timeout"));
  if (timeout) {
    if (!(*timeout > 0) || *timeout > 86400) {
      return InvalidArgument("timeout must be in (0, 86400] seconds");
    }
    out.timeout_seconds = *timeout;
  }
  return out;
}

Status ToOpenAiFieldNames(const Status& status) {
  std::string m = status.message();
  for (size_t at = m.find("sampling."); at != std::string::npos; at = m.find("sampling.", at)) {
    m.erase(at, 9);
  }
  return Status(status.code(), m);
}

std::string CompletionJson(const CompletionMeta& meta, const std::string& text,
                           const GenerationResult& result, double queue_seconds) {
  json j = Envelope(meta, "chat.completion");
  json choice;
  choice["index"] = 0;
  choice["message"] = {{"role", "assistant"}, {"content", text}, {"refusal", nullptr}};
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = FinishReasonName(result.finish);
  j["choices"] = json::array({choice});
  j["usage"] = UsageObject(result, queue_seconds);
  return Dump(j);
}

std::string ChunkJson(const CompletionMeta& meta, const std::string* role,
                      const std::string* content, const char* finish_reason, bool include_usage) {
  json j = Envelope(meta, "chat.completion.chunk");
  json delta = json::object();
  if (role != nullptr) delta["role"] = *role;
  if (content != nullptr) delta["content"] = *content;
  json choice;
  choice["index"] = 0;
  choice["delta"] = delta;
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason == nullptr ? json(nullptr) : json(finish_reason);
  j["choices"] = json::array({choice});
  if (include_usage) j["usage"] = nullptr;
  return Dump(j);
}

std::string UsageChunkJson(const CompletionMeta& meta, const GenerationResult& result,
                           double queue_seconds) {
  json j = Envelope(meta, "chat.completion.chunk");
  j["choices"] = json::array();
  j["usage"] = UsageObject(result, queue_seconds);
  return Dump(j);
}

int HttpStatusOf(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return 200;
    case StatusCode::kInvalidArgument:
      return 400;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kResourceExhausted:
      return 429;
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kDeadlineExceeded:
      return 504;
    case StatusCode::kCancelled:
      return 499;  // the client went away (nginx's code); nobody reads it
    default:
      return 500;
  }
}

std::string ErrorJson(const Status& status) {
  const std::string& m = status.message();
  const int http = HttpStatusOf(status);
  // The field the message starts with: "messages[0].content[1].image_url: ...", "top_p must
  // be ...", "tools is not supported", "kv_cache.policy 'x' is unknown".
  json param = nullptr;
  const size_t end = m.find_first_of(" :");
  if (http == 400 && end != std::string::npos && end > 0 &&
      m.find_first_not_of("abcdefghijklmnopqrstuvwxyz_[].0123456789") >= end) {
    const std::string rest = m.substr(end);
    for (const char* verb : {":", " must ", " is ", " '", " says "}) {
      if (rest.rfind(verb, 0) == 0) param = m.substr(0, end);
    }
  }
  const char* type = http == 400   ? "invalid_request_error"
                     : http == 404 ? "not_found_error"
                     : http == 429 ? "rate_limit_error"
                     : http == 503 ? "service_unavailable"
                     : http == 504 ? "timeout"
                                   : "server_error";
  json code = nullptr;
  if (http == 404) code = "model_not_found";
  if (http == 429) code = "queue_full";
  json j;
  j["error"] = {{"message", m}, {"type", type}, {"param", param}, {"code", code}};
  return Dump(j);
}

}  // namespace llava::server
