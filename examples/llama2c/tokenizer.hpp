#pragma once
/// \file tokenizer.hpp
/// \brief The llama2.c byte-fallback BPE tokenizer (tok512.bin): encode and decode.
///
/// File layout (little-endian): int32 max_token_length, then per token: float32 merge score,
/// int32 byte length n, n bytes. Ids 0 unk, 1 BOS, 2 EOS, 3..258 the byte pieces <0x00>..<0xFF>,
/// then the merged pieces.

#include <fmt/core.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "binary_file.hpp"

namespace llama2c {

class Tokenizer {
 public:
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  /// Byte b with no piece of its own is token b + kFirstByteToken.
  static constexpr int kFirstByteToken = 3;

  /// Loads `path`, which must hold exactly `vocab_size` tokens (the checkpoint's vocabulary).
  /// Throws kvpack::Error naming the file and the problem.
  static Tokenizer load(const std::filesystem::path& path, int vocab_size) {
    BinaryReader in(path);
    Tokenizer tokenizer;
    const std::int32_t max_length = in.read_i32("max_token_length");
    if (max_length <= 0) fail_file(path, fmt::format("max_token_length {} must be positive", max_length));
    for (int id = 0; id < vocab_size; ++id) {
      const float score = in.read_f32("a token score");
      const std::int32_t length = in.read_i32("a token length");
      if (length < 0 || length > max_length) {
        fail_file(path,
                  fmt::format("token {} has length {}, outside [0, max_token_length {}]", id, length, max_length));
      }
      // A NaN score never compares greater, so merges would depend on the order pairs are met.
      if (!std::isfinite(score)) fail_file(path, fmt::format("token {} has a merge score that is not finite", id));
      tokenizer.scores_.push_back(score);
      tokenizer.pieces_.push_back(in.read_string(static_cast<std::size_t>(length), "a token's bytes"));
      tokenizer.ids_.emplace(tokenizer.pieces_.back(), id);  // a duplicate piece keeps its first id
    }
    if (in.remaining() != 0) {
      fail_file(path, fmt::format("{} bytes follow the last of the {} tokens the checkpoint expects", in.remaining(),
                                  vocab_size));
    }
    if (vocab_size < kFirstByteToken + 256) {
      fail_file(path, fmt::format("vocabulary of {} tokens lacks the 256 byte pieces", vocab_size));
    }
    // Byte fallback encodes byte b as token b + kFirstByteToken and decodes it back as that byte.
    for (int b = 0; b < 256; ++b) {
      const std::string expected = fmt::format("<0x{:02X}>", b);
      if (tokenizer.pieces_[static_cast<std::size_t>(kFirstByteToken + b)] != expected) {
        fail_file(path, fmt::format("token {} is '{}', not the byte piece {} byte fallback needs", kFirstByteToken + b,
                                    tokenizer.pieces_[static_cast<std::size_t>(kFirstByteToken + b)], expected));
      }
    }
    if (!tokenizer.ids_.contains(" ")) fail_file(path, "no ' ' piece, which encoding prepends to text");
    return tokenizer;
  }

  [[nodiscard]] int vocab_size() const noexcept { return static_cast<int>(pieces_.size()); }

  /// A prompt as the model saw text in training: BOS, a dummy-prefix space when `text` is not
  /// empty, then the text merged into pieces.
  [[nodiscard]] std::vector<int> encode(std::string_view text) const {
    std::vector<int> tokens{kBos};
    if (text.empty()) return tokens;
    // The prefix takes part in the merges (" Once" is one piece), so it is encoded with the text.
    const std::vector<int> body = encode_fragment(" " + std::string(text));
    tokens.insert(tokens.end(), body.begin(), body.end());
    return tokens;
  }

  /// `text` alone, to append to tokens already there (no BOS, no prefix): each UTF-8 code point
  /// is its own piece or falls back to byte tokens, then the adjacent pair whose concatenation
  /// has the highest merge score is merged (the leftmost on a tie) until no pair is a piece.
  [[nodiscard]] std::vector<int> encode_fragment(std::string_view text) const {
    std::vector<int> tokens;
    for (std::size_t begin = 0; begin < text.size();) {
      std::size_t end = begin + 1;
      while (end < text.size() && end - begin < 4 && is_continuation_byte(text[end])) ++end;
      if (const auto found = ids_.find(std::string(text.substr(begin, end - begin))); found != ids_.end()) {
        tokens.push_back(found->second);
      } else {
        for (std::size_t i = begin; i < end; ++i) {
          tokens.push_back(static_cast<unsigned char>(text[i]) + kFirstByteToken);
        }
      }
      begin = end;
    }
    while (merge_best_pair(tokens)) {
    }
    return tokens;
  }

  /// What `token` prints as after `previous`: the piece after BOS loses its leading space (the
  /// dummy prefix), and byte pieces "<0xHH>" become the raw byte.
  [[nodiscard]] std::string piece(int previous, int token) const {
    if (token >= kFirstByteToken && token < kFirstByteToken + 256) {
      return std::string(1, static_cast<char>(token - kFirstByteToken));
    }
    std::string_view text = pieces_.at(static_cast<std::size_t>(token));
    if (previous == kBos && text.starts_with(' ')) text.remove_prefix(1);
    return std::string(text);
  }

  /// Text of `tokens`. A leading BOS is the start marker and prints nothing; a BOS later on
  /// (a new story) prints as its piece.
  [[nodiscard]] std::string decode(std::span<const int> tokens) const {
    std::string text;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i == 0 && tokens[i] == kBos) continue;
      text += piece(i == 0 ? -1 : tokens[i - 1], tokens[i]);
    }
    return text;
  }

 private:
  static bool is_continuation_byte(char c) noexcept { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

  /// Merges the best adjacent pair in place; false when no pair forms a piece.
  bool merge_best_pair(std::vector<int>& tokens) const {
    float best_score = 0;
    int best_id = -1;
    std::size_t best_at = 0;
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
      const auto found =
          ids_.find(pieces_[static_cast<std::size_t>(tokens[i])] + pieces_[static_cast<std::size_t>(tokens[i + 1])]);
      if (found == ids_.end()) continue;
      const float score = scores_[static_cast<std::size_t>(found->second)];
      if (best_id < 0 || score > best_score) {
        best_score = score;
        best_id = found->second;
        best_at = i;
      }
    }
    if (best_id < 0) return false;
    tokens[best_at] = best_id;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    return true;
  }

  std::vector<std::string> pieces_;           ///< [vocab] raw bytes of each token
  std::vector<float> scores_;                 ///< [vocab] merge priority
  std::unordered_map<std::string, int> ids_;  ///< piece -> id
};

}  // namespace llama2c
