// Base64 (RFC 4648, standard alphabet, padded): images as data URIs for the OpenAI-compatible
// API (llava-load --http, tests). The server's decoder is server/openai_api.cc's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace llava::client {

inline std::string Base64Encode(std::string_view in) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : in) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) out.push_back(kAlphabet[(acc >> (bits -= 6)) & 63]);
  }
  if (bits > 0) out.push_back(kAlphabet[(acc << (6 - bits)) & 63]);
  while (out.size() % 4 != 0) out.push_back('=');
  return out;
}

}  // namespace llava::client
