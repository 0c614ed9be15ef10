#include "engine/io/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "engine/io/utf8.h"
#include "sentencepiece_model.pb.h"  // generated into the build folder

namespace llava {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";       // U+2581 "▁"
constexpr std::string_view kUnknownSurface = " \xE2\x81\x87 ";  // " ⁇ ", as spm_decode prints

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& model_path) {
  std::string bytes;
  if (!ReadFileToString(model_path, &bytes))
    return NotFound(model_path + ": cannot read tokenizer");
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, FromProtoBytes(bytes, model_path));

  // Hugging Face added tokens (e.g. LLaVA's <image> = 32000, <pad> = 32001).
  const std::string dir = DirOf(model_path);
  std::string text;
  if (ReadFileToString(dir + "/added_tokens.json", &text)) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object()) return InvalidArgument(dir + "/added_tokens.json is not a JSON object");
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it.value().is_number_integer()) {
        return InvalidArgument(dir + "/added_tokens.json: id of '" + it.key() + "' not an integer");
      }
      const int id = it.value().get<int>();
      if (tok->PieceToId(it.key()) == id) continue;
      LLAVA_RETURN_IF_ERROR(tok->AddToken(it.key(), id, /*special=*/true));
    }
  }
  if (ReadFileToString(dir + "/tokenizer_config.json", &text)) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_object() && j.contains("added_tokens_decoder") &&
        j["added_tokens_decoder"].is_object()) {
      for (auto it = j["added_tokens_decoder"].begin(); it != j["added_tokens_decoder"].end();
           ++it) {
        const auto& v = it.value();
        if (!v.is_object() || !v.contains("content") || !v["content"].is_string()) continue;
        int id = -1;
        try {
          id = std::stoi(it.key());
        } catch (...) {
          return InvalidArgument(dir + "/tokenizer_config.json: bad added token id '" + it.key() +
                                 "'");
        }
        const std::string piece = v["content"].get<std::string>();
        if (tok->PieceToId(piece) == id) continue;
        const bool special = !v.contains("special") || v["special"] == true;
        LLAVA_RETURN_IF_ERROR(tok->AddToken(piece, id, special));
      }
    }
  }
  return tok;
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromProtoBytes(const std::string& bytes,
                                                               const std::string& origin) {
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  LLAVA_RETURN_IF_ERROR(tok->Init(bytes, origin));
  return tok;
}

Status Tokenizer::Init(const std::string& bytes, const std::string& origin) {
  spm::ModelProto proto;
  if (!proto.ParseFromString(bytes)) {
    return DataLoss(origin + ": not a SentencePiece model (protobuf parse failed)");
  }
  if (proto.pieces_size() == 0) return DataLoss(origin + ": the model has no pieces");
  const auto& trainer = proto.trainer_spec();
  if (trainer.model_type() != spm::TrainerSpec::BPE) {
    return Unimplemented(origin + ": only BPE SentencePiece models are supported (model_type " +
                         std::to_string(trainer.model_type()) + ")");
  }
  if (trainer.treat_whitespace_as_suffix()) {
    return Unimplemented(origin + ": treat_whitespace_as_suffix is not supported");
  }
  const auto& norm = proto.normalizer_spec();
  if (!norm.precompiled_charsmap().empty()) {
    return Unimplemented(origin + ": normalizer '" + norm.name() +
                         "' (precompiled charsmap) is not supported; use the identity rule");
  }
  byte_fallback_ = trainer.byte_fallback();
  add_dummy_prefix_ = norm.add_dummy_prefix();
  remove_extra_whitespaces_ = norm.remove_extra_whitespaces();
  escape_whitespaces_ = norm.escape_whitespaces();
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);

  unk_id_ = -1;
  bos_id_ = eos_id_ = -1;
  for (int i = 0; i < proto.pieces_size(); ++i) {
    const auto& p = proto.pieces(i);
    PieceType type = PieceType::kNormal;
    switch (p.type()) {
      case spm::ModelProto::SentencePiece::NORMAL:
        type = PieceType::kNormal;
        break;
      case spm::ModelProto::SentencePiece::UNKNOWN:
        type = PieceType::kUnknown;
        break;
      case spm::ModelProto::SentencePiece::CONTROL:
        type = PieceType::kControl;
        break;
      case spm::ModelProto::SentencePiece::USER_DEFINED:
        type = PieceType::kUserDefined;
        break;
      case spm::ModelProto::SentencePiece::UNUSED:
        type = PieceType::kUnused;
        break;
      case spm::ModelProto::SentencePiece::BYTE:
        type = PieceType::kByte;
        break;
    }
    id_to_piece_.push_back(p.piece());
    types_.push_back(type);
    scores_.push_back(p.score());
    if (!all_pieces_.emplace(p.piece(), i).second) {
      return DataLoss(origin + ": duplicate piece '" + p.piece() + "'");
    }
    if (type == PieceType::kNormal || type == PieceType::kUserDefined ||
        type == PieceType::kUnused) {
      mergeable_[p.piece()] = i;
    }
    if (type == PieceType::kUserDefined) specials_.emplace_back(p.piece(), i);
    if (type == PieceType::kUnknown) unk_id_ = i;
    if (type == PieceType::kByte) {
      unsigned v = 0;
      if (p.piece().size() != 6 || std::sscanf(p.piece().c_str(), "<0x%02X>", &v) != 1 || v > 255) {
        return DataLoss(origin + ": malformed byte piece '" + p.piece() + "'");
      }
      byte_ids_[v] = i;
    }
    if (p.piece() == "<s>" && type == PieceType::kControl) bos_id_ = i;
    if (p.piece() == "</s>" && type == PieceType::kControl) eos_id_ = i;
  }
  if (unk_id_ < 0) return DataLoss(origin + ": the model has no <unk> piece");
  if (trainer.has_bos_id() && trainer.bos_id() >= 0) bos_id_ = trainer.bos_id();
  if (trainer.has_eos_id() && trainer.eos_id() >= 0) eos_id_ = trainer.eos_id();
  if (byte_fallback_) {
    for (int b = 0; b < 256; ++b) {
      if (byte_ids_[b] < 0)
        return DataLoss(origin + ": byte_fallback set but <0xNN> pieces missing");
    }
  }
  std::sort(specials_.begin(), specials_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return Status::Ok();
}

Status Tokenizer::AddToken(const std::string& piece, int id, bool special) {
  if (piece.empty())
    return InvalidArgument("added token with id " + std::to_string(id) + " is empty");
  if (id < 0 || id > (1 << 24)) return InvalidArgument("added token '" + piece + "' has a bad id");
  if (id < vocab_size() && id_to_piece_[id] != piece) {
    return InvalidArgument("added token '" + piece + "' id " + std::to_string(id) +
                           " is already '" + id_to_piece_[id] + "'");
  }
  while (vocab_size() <= id) {  // fill holes with unused placeholders
    id_to_piece_.push_back("");
    types_.push_back(PieceType::kUnused);
    scores_.push_back(0.f);
  }
  id_to_piece_[id] = piece;
  types_[id] = special ? PieceType::kControl : PieceType::kUserDefined;
  all_pieces_[piece] = id;
  specials_.emplace_back(piece, id);
  std::sort(specials_.begin(), specials_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return Status::Ok();
}

int Tokenizer::PieceToId(std::string_view piece) const {
  auto it = all_pieces_.find(std::string(piece));
  return it == all_pieces_.end() ? -1 : it->second;
}

const std::string& Tokenizer::IdToPiece(int id) const {
  static const std::string kEmpty;
  return id >= 0 && id < vocab_size() ? id_to_piece_[id] : kEmpty;
}

bool Tokenizer::IsSpecial(int id) const {
  return id >= 0 && id < vocab_size() && types_[id] == PieceType::kControl;
}

size_t Tokenizer::MatchSpecial(std::string_view text, size_t pos, bool enabled, int* id) const {
  if (!enabled) return 0;
  for (const auto& [piece, pid] : specials_) {  // longest first
    if (text.compare(pos, piece.size(), piece) == 0) {
      *id = pid;
      return piece.size();
    }
  }
  return 0;
}

std::string Tokenizer::Normalize(std::string_view text, const EncodeOptions& options) const {
  // Identity rules: only the handling of U+0020 changes the text.
  std::string out;
  out.reserve(text.size() + 8);
  std::string_view space = escape_whitespaces_ ? kSpaceSymbol : std::string_view(" ");
  size_t begin = 0, end = text.size();
  if (remove_extra_whitespaces_) {
    while (begin < end && text[begin] == ' ') ++begin;
    while (end > begin && text[end - 1] == ' ') --end;
  }
  if (begin == end) return out;
  if (add_dummy_prefix_ && options.dummy_prefix) out.append(space);
  bool prev_space = false;
  for (size_t i = begin; i < end; ++i) {
    // Added/user-defined tokens are copied verbatim (their spaces are not escaped).
    int id;
    if (size_t len = MatchSpecial(text, i, options.parse_special, &id); len > 0) {
      out.append(text.substr(i, len));
      i += len - 1;
      prev_space = false;
      continue;
    }
    if (text[i] == ' ') {
      if (remove_extra_whitespaces_ && prev_space) continue;
      out.append(space);
      prev_space = true;
    } else {
      out.push_back(text[i]);
      prev_space = false;
    }
  }
  return out;
}

std::vector<int> Tokenizer::Encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<int> ids;
  if (options.add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  const std::string normalized = Normalize(text, options);
  EncodeNormalized(normalized, options.parse_special, &ids);
  return ids;
}

void Tokenizer::EncodeNormalized(std::string_view text, bool parse_special,
                                 std::vector<int>* ids) const {
  // Doubly linked list of symbols over `text`; merged symbols grow in place.
  struct Symbol {
    int prev, next;
    size_t begin, len;  // byte range in `text`; len == 0 once merged away
    bool frozen;        // added/user-defined token: never merged
  };
  std::vector<Symbol> symbols;
  for (size_t pos = 0; pos < text.size();) {
    int sid;
    size_t len = MatchSpecial(text, pos, parse_special, &sid);
    const bool frozen = len > 0;
    if (!frozen)
      len = std::min(Utf8CharLen(static_cast<unsigned char>(text[pos])), text.size() - pos);
    const int idx = static_cast<int>(symbols.size());
    symbols.push_back({idx - 1, -1, pos, len, frozen});
    if (idx > 0) symbols[idx - 1].next = idx;
    pos += len;
  }

  struct Pair {
    int left, right;
    float score;
    size_t size;  // merged length, to detect stale entries
  };
  auto cmp = [](const Pair& a, const Pair& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(cmp)> agenda(cmp);
  // Unused pieces that a merge produced: resegmented into their parts afterwards.
  std::unordered_map<std::string, std::pair<std::string, std::string>> rev_merge;

  auto maybe_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const Symbol& l = symbols[left];
    const Symbol& r = symbols[right];
    if (l.frozen || r.frozen) return;
    const std::string piece(text.substr(l.begin, l.len + r.len));
    auto it = mergeable_.find(piece);
    if (it == mergeable_.end()) return;
    agenda.push({left, right, scores_[it->second], piece.size()});
    if (types_[it->second] == PieceType::kUnused) {
      rev_merge[piece] = {std::string(text.substr(l.begin, l.len)),
                          std::string(text.substr(r.begin, r.len))};
    }
  };
  for (size_t i = 1; i < symbols.size(); ++i)
    maybe_add(static_cast<int>(i) - 1, static_cast<int>(i));

  while (!agenda.empty()) {
    const Pair top = agenda.top();
    agenda.pop();
    Symbol& l = symbols[top.left];
    Symbol& r = symbols[top.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != top.size || l.next != top.right) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = top.left;
    maybe_add(l.prev, top.left);
    maybe_add(top.left, l.next);
  }

  // Emits `piece`, resegmenting unused pieces and falling back to bytes or <unk>.
  std::function<void(const std::string&)> emit = [&](const std::string& piece) {
    auto it = all_pieces_.find(piece);
    if (it != all_pieces_.end() && types_[it->second] == PieceType::kUnused) {
      auto rm = rev_merge.find(piece);
      if (rm != rev_merge.end()) {
        emit(rm->second.first);
        emit(rm->second.second);
        return;
      }
    }
    if (it != all_pieces_.end() && types_[it->second] != PieceType::kByte) {
      ids->push_back(it->second);
      return;
    }
    if (byte_fallback_) {
      for (unsigned char c : piece) ids->push_back(byte_ids_[c]);
      return;
    }
    // Consecutive unknown symbols collapse into one <unk>, as in sentencepiece.
    if (ids->empty() || ids->back() != unk_id_) ids->push_back(unk_id_);
  };
  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) {
    emit(std::string(text.substr(symbols[i].begin, symbols[i].len)));
  }
}

void Tokenizer::AppendPieceText(int id, bool at_start, std::string* out) const {
  if (id < 0 || id >= vocab_size()) return;
  switch (types_[id]) {
    case PieceType::kControl:
      return;
    case PieceType::kUnknown:
      out->append(kUnknownSurface);
      return;
    case PieceType::kByte: {
      unsigned v = 0;
      std::sscanf(id_to_piece_[id].c_str(), "<0x%02X>", &v);
      out->push_back(static_cast<char>(v));
      return;
    }
    default:
      break;
  }
  std::string_view piece = id_to_piece_[id];
  if (at_start && add_dummy_prefix_ && piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
    piece.remove_prefix(kSpaceSymbol.size());
  }
  while (!piece.empty()) {
    if (piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
      out->push_back(' ');
      piece.remove_prefix(kSpaceSymbol.size());
    } else {
      out->push_back(piece.front());
      piece.remove_prefix(1);
    }
  }
}

std::string Tokenizer::Decode(const std::vector<int>& ids) const {
  StreamDecoder decoder(*this);
  std::string out;
  for (int id : ids) out += decoder.Push(id);
  out += decoder.Flush();
  return out;
}

std::string StreamDecoder::Push(int id) {
  // Only the first real piece loses its dummy-prefix space (as spm_decode does), even when
  // that piece is nothing but the space.
  tokenizer_.AppendPieceText(id, at_start_, &pending_);
  if (!tokenizer_.IsSpecial(id)) at_start_ = false;
  const size_t hold = Utf8IncompleteTail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  // Bytes that can never become valid (stray continuation bytes etc.) are replaced.
  if (!IsValidUtf8(ready)) {
    std::string fixed;
    for (size_t i = 0; i < ready.size();) {
      const size_t len = Utf8CharLen(static_cast<unsigned char>(ready[i]));
      if (i + len <= ready.size() && IsValidUtf8(std::string_view(ready).substr(i, len))) {
        fixed.append(ready, i, len);
        i += len;
      } else {
        fixed.append("\xEF\xBF\xBD");
        ++i;
      }
    }
    ready.swap(fixed);
  }
  return ready;
}

std::string StreamDecoder::Flush() {
  std::string out;
  for (size_t i = 0; i < pending_.size(); ++i) out.append("\xEF\xBF\xBD");
  pending_.clear();
  return out;
}

}  // namespace llava
