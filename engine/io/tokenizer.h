// A SentencePiece BPE tokenizer (the LLaMA / LLaVA kind), implemented here because
// libsentencepiece embeds its own protobuf and cannot share a process with gRPC and libtorch.
// Torch-free.
//
// Encoding follows sentencepiece's BPE model: normalise (identity rules, optional dummy "▁"
// prefix, spaces escaped as "▁"), split into UTF-8 characters (user-defined and added tokens
// stay whole), then repeatedly merge the adjacent pair whose merged piece has the highest score
// (ties: leftmost), and finally map pieces that are not in the vocabulary to byte pieces
// <0xNN> (byte fallback) or <unk>. Token ids match `spm_encode --output_format=id`.
//
// Thread safety: a loaded Tokenizer is immutable; all const methods may run concurrently.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/io/status.h"

namespace llava {

class Tokenizer {
 public:
  // Reads a SentencePiece `tokenizer.model`; also reads Hugging Face added tokens
  // (`added_tokens.json`, `tokenizer_config.json` "added_tokens_decoder") from the same folder.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& model_path);
  // From the serialized ModelProto bytes; `origin` names the source in errors.
  static StatusOr<std::unique_ptr<Tokenizer>> FromProtoBytes(const std::string& bytes,
                                                             const std::string& origin);

  struct EncodeOptions {
    bool add_bos = false;
    // Prepend "▁" as sentencepiece does at the start of a text. Off for text that continues
    // after a special token (the Hugging Face non-legacy behaviour).
    bool dummy_prefix = true;
    // Match added / user-defined tokens written in the text (e.g. "<image>"). Off for
    // untrusted user content, so that a user cannot forge image or control tokens.
    bool parse_special = true;
  };
  // Text -> ids. The defaults reproduce `spm_encode --output_format=id`.
  std::vector<int> Encode(std::string_view text, const EncodeOptions& options) const;
  std::vector<int> Encode(std::string_view text) const { return Encode(text, EncodeOptions()); }
  // Ids -> text, skipping control/special tokens, as `spm_decode` does.
  std::string Decode(const std::vector<int>& ids) const;

  // Adds a token outside the SentencePiece vocabulary (HF "added token"), matched whole in text.
  // `special` tokens decode to nothing. Fails if `id` is taken by another piece.
  Status AddToken(const std::string& piece, int id, bool special);

  int vocab_size() const { return static_cast<int>(id_to_piece_.size()); }
  int bos_id() const { return bos_id_; }
  int eos_id() const { return eos_id_; }
  int unk_id() const { return unk_id_; }
  // -1 when the piece is not in the vocabulary.
  int PieceToId(std::string_view piece) const;
  const std::string& IdToPiece(int id) const;
  bool IsSpecial(int id) const;  // control tokens and special added tokens

  // Appends the text of one token to `out`. Byte pieces append their raw byte. The leading
  // space of the first piece of a text is dropped when `at_start` (dummy prefix).
  void AppendPieceText(int id, bool at_start, std::string* out) const;

 private:
  enum class PieceType : uint8_t { kNormal, kUnknown, kControl, kUserDefined, kUnused, kByte };
  Tokenizer() = default;
  Status Init(const std::string& bytes, const std::string& origin);
  void EncodeNormalized(std::string_view normalized, bool parse_special,
                        std::vector<int>* ids) const;
  std::string Normalize(std::string_view text, const EncodeOptions& options) const;
  // Length of the added/user-defined token starting at text[pos], 0 if none or disabled.
  size_t MatchSpecial(std::string_view text, size_t pos, bool enabled, int* id) const;

  std::vector<std::string> id_to_piece_;
  std::vector<PieceType> types_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> mergeable_;  // NORMAL, USER_DEFINED, UNUSED pieces
  std::unordered_map<std::string, int> all_pieces_;
  std::vector<std::pair<std::string, int>> specials_;  // matched whole in text, longest first
  int byte_ids_[256];
  bool byte_fallback_ = false;
  bool add_dummy_prefix_ = true;
  bool remove_extra_whitespaces_ = false;
  bool escape_whitespaces_ = true;
  int unk_id_ = 0, bos_id_ = 1, eos_id_ = 2;
};

// Incremental detokenizer for streaming: never returns half a UTF-8 character.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  // Returns the text that became complete with this token (possibly empty).
  std::string Push(int id);
  // Returns whatever is held back; invalid trailing bytes become U+FFFD.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  std::string pending_;
  bool at_start_ = true;
};

}  // namespace llava
