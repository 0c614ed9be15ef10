#include "server/auth.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

namespace llava::server {
namespace {

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("--auth-tokens-file " + path + ": cannot read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool SameStat(const struct stat& st, const timespec& mtime, off_t size) {
  return st.st_mtim.tv_sec == mtime.tv_sec && st.st_mtim.tv_nsec == mtime.tv_nsec &&
         st.st_size == size;
}

}  // namespace

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

StatusOr<std::vector<std::pair<std::string, std::string>>> TokenStore::Parse(
    std::string_view text, const std::string& source) {
  std::vector<std::pair<std::string, std::string>> out;
  int line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find_first_of("\n,", pos);
    if (end == std::string_view::npos) end = text.size();
    std::string line(text.substr(pos, end - pos));
    pos = end + 1;
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string word; words >> word;) w.push_back(word);
    if (w.empty()) continue;
    if (w.size() > 2) {
      return InvalidArgument(source + " entry " + std::to_string(line_no) +
                             ": expected TOKEN or NAME TOKEN");
    }
    const std::string& token = w.back();
    if (token.size() < 16) {
      return InvalidArgument(source + " entry " + std::to_string(line_no) +
                             ": tokens must have at least 16 characters");
    }
    out.emplace_back(w.size() == 2 ? w[0] : "token-" + std::to_string(line_no), token);
  }
  return out;
}

StatusOr<std::unique_ptr<TokenStore>> TokenStore::Create(std::string file,
                                                         std::string_view inline_tokens) {
  std::unique_ptr<TokenStore> store(new TokenStore());
  store->file_ = std::move(file);
  LLAVA_ASSIGN_OR_RETURN(store->inline_, Parse(inline_tokens, "LLAVA_AUTH_TOKENS"));
  std::lock_guard<std::mutex> lock(store->mu_);
  store->tokens_ = store->inline_;
  if (!store->file_.empty()) {
    struct stat st {};
    if (::stat(store->file_.c_str(), &st) != 0) {
      return NotFound("--auth-tokens-file " + store->file_ + ": cannot read");
    }
    LLAVA_ASSIGN_OR_RETURN(std::string text, ReadFile(store->file_));
    LLAVA_ASSIGN_OR_RETURN(auto from_file, Parse(text, "--auth-tokens-file"));
    store->tokens_.insert(store->tokens_.end(), from_file.begin(), from_file.end());
    store->file_mtime_ = st.st_mtim;
    store->file_size_ = st.st_size;
  }
  if (store->tokens_.empty()) {
    return InvalidArgument("--auth-tokens-file / LLAVA_AUTH_TOKENS: no tokens");
  }
  return store;
}

void TokenStore::ReloadIfChangedLocked() {
  if (file_.empty()) return;
  struct stat st {};
  if (::stat(file_.c_str(), &st) != 0 || SameStat(st, file_mtime_, file_size_)) return;
  StatusOr<std::string> text = ReadFile(file_);
  StatusOr<std::vector<std::pair<std::string, std::string>>> parsed =
      text.ok() ? Parse(*text, "--auth-tokens-file")
                : StatusOr<std::vector<std::pair<std::string, std::string>>>(text.status());
  file_mtime_ = st.st_mtim;
  file_size_ = st.st_size;
  if (!parsed.ok()) {
    spdlog::warn("auth tokens not reloaded, keeping the previous ones: {}",
                 parsed.status().ToString());
    return;
  }
  std::vector<std::pair<std::string, std::string>> next = inline_;
  next.insert(next.end(), parsed->begin(), parsed->end());
  if (next.empty()) {
    // Start-up refuses an empty set; a reload must not lock everyone out either (a rotation
    // that truncates the file, then writes it, is read in between).
    spdlog::error("auth tokens not reloaded: {} has no tokens; keeping the previous {}", file_,
                  tokens_.size());
    return;
  }
  tokens_ = std::move(next);
  spdlog::info("auth tokens reloaded from {}: {} tokens", file_, tokens_.size());
}

std::optional<std::string> TokenStore::Authenticate(std::string_view authorization) {
  constexpr std::string_view kScheme = "Bearer ";
  if (authorization.size() <= kScheme.size() ||
      authorization.substr(0, kScheme.size()) != kScheme) {
    return std::nullopt;
  }
  const std::string_view candidate = authorization.substr(kScheme.size());
  std::lock_guard<std::mutex> lock(mu_);
  ReloadIfChangedLocked();
  std::optional<std::string> name;
  for (const auto& [n, token] : tokens_) {  // every token is compared: no early exit
    if (ConstantTimeEquals(candidate, token) && !name) name = n;
  }
  return name;
}

size_t TokenStore::size() {
  std::lock_guard<std::mutex> lock(mu_);
  ReloadIfChangedLocked();
  return tokens_.size();
}

}  // namespace llava::server
