// Bearer-token authentication for both APIs (gRPC `authorization` metadata, HTTP
// `Authorization` header). Tokens come from a file (`--auth-tokens-file`), re-read when it
// changes, and/or an environment variable; each line is `TOKEN` or `NAME TOKEN`, `#` starts a
// comment. The name (never the token) labels the request's log line; unnamed tokens are
// "token-<line>".
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <sys/types.h>

#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/io/status.h"

namespace llava::server {

class TokenStore {
 public:
  // `file` may be empty (then only `inline_tokens` count); `inline_tokens` uses the file's syntax
  // with ',' also separating entries (for an environment variable).
  static StatusOr<std::unique_ptr<TokenStore>> Create(std::string file,
                                                      std::string_view inline_tokens);

  // The token's name if `authorization` is "Bearer <a known token>"; nullopt otherwise. Compares
  // in time independent of where a candidate first differs. Re-reads the file if it changed
  // (keeps the last good tokens if the new file cannot be read).
  std::optional<std::string> Authenticate(std::string_view authorization);

  size_t size();  // tokens known now

  // Parses the token syntax; `source` names it in errors.
  static StatusOr<std::vector<std::pair<std::string, std::string>>> Parse(
      std::string_view text, const std::string& source);

 private:
  TokenStore() = default;
  void ReloadIfChangedLocked();

  std::string file_;
  std::vector<std::pair<std::string, std::string>> inline_;  // name, token
  std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> tokens_;  // guarded by mu_
  timespec file_mtime_{};                                    // guarded by mu_
  off_t file_size_ = -1;                                     // guarded by mu_
};

// True if `a` and `b` are equal; the time taken depends on their lengths only.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace llava::server
