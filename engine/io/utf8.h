// Small UTF-8 helpers shared by the tokenizer and streaming decoders. Torch-free.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace llava {

// Length in bytes of the UTF-8 sequence that starts with `lead`; 1 for invalid lead bytes
// (so malformed input advances byte by byte instead of looping).
size_t Utf8CharLen(unsigned char lead);

// Number of bytes at the end of `s` that form an incomplete (but so far valid) UTF-8
// sequence. Streaming decoders hold these back until the rest arrives.
size_t Utf8IncompleteTail(std::string_view s);

// True if `s` is entirely well-formed UTF-8.
bool IsValidUtf8(std::string_view s);

}  // namespace llava
