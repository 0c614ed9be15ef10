// Status and StatusOr<T>: the error type at every engine boundary.
//
// No exception crosses the engine's public API. Functions that can fail on user input or on
// files return a Status whose message names the offending field, file or tensor.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace llava {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad user input: the message names the field
  kNotFound,         // a file or tensor is missing
  kDataLoss,         // a file is truncated or corrupt
  kResourceExhausted,
  kFailedPrecondition,
  kUnimplemented,
  kInternal,
  kUnavailable,       // shutting down
  kDeadlineExceeded,  // the request's deadline passed
  kCancelled,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: sampling.top_p must be in (0, 1], got 2"
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}

// Either a value or a non-OK Status. Accessing value() of an error is a programming error.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) { assert(!status_.ok()); }  // NOLINT
  StatusOr(T value) : value_(std::move(value)) {}                                  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

// Reads a whole file; false if it cannot be opened. (Small shared helper: configs, tokenizer
// models, images, datasets.)
bool ReadFileToString(const std::string& path, std::string* out);

#define LLAVA_RETURN_IF_ERROR(expr) \
  do {                              \
    ::llava::Status _st = (expr);   \
    if (!_st.ok()) return _st;      \
  } while (0)

#define LLAVA_CONCAT_INNER(a, b) a##b
#define LLAVA_CONCAT(a, b) LLAVA_CONCAT_INNER(a, b)
#define LLAVA_ASSIGN_OR_RETURN(lhs, expr) \
  LLAVA_ASSIGN_OR_RETURN_IMPL(LLAVA_CONCAT(_status_or_, __LINE__), lhs, expr)
#define LLAVA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

}  // namespace llava
