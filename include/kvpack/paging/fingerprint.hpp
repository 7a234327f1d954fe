#pragma once
/// \file fingerprint.hpp
/// \brief A 64-bit streaming fingerprint of numbers, byte ranges and strings: the part of a prefix
///        cache key that stands for a codec's parameters (scales, codebooks, rotation seeds), and
///        the hash of a page of token ids.
///
/// Not cryptographic, and never trusted alone for token ids: the prefix index compares the tokens
/// of every block it finds by hash. Parameter fingerprints are trusted (the parameters themselves
/// are not kept), so two parameter sets of one codec collide with probability about 2^-64.
/// Values are hashed by their object bytes on a little-endian host, so a fingerprint is stable
/// across runs of one build; it is not meant to be stored across machines.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

namespace kvpack::inline v0::paging {

/// Token ids as an engine's tokenizer issues them.
using TokenId = std::int32_t;

class Fingerprint {
 public:
  explicit constexpr Fingerprint(std::uint64_t seed = 0) noexcept : state_(seed ^ kOffset) {}

  /// One 64-bit word; every other `add` reduces to these.
  constexpr Fingerprint& add_word(std::uint64_t word) noexcept {
    // One xxHash64-style round: multiply spreads the word's low bits upward, the rotation brings
    // the high bits back down, the second multiply mixes them into the state.
    state_ = std::rotl(state_ ^ (word * kPrime1), 31) * kPrime2;
    ++words_;
    return *this;
  }

  /// A number or an enum, by its object bytes (so -0.0f and 0.0f differ: conservative for a key).
  template <class T>
  requires(std::is_arithmetic_v<T> || std::is_enum_v<T>) Fingerprint& add(T value) noexcept {
    static_assert(sizeof(T) <= 8);
    std::uint64_t word = 0;
    std::memcpy(&word, &value, sizeof(T));
    return add_word(word);
  }

  /// A run of numbers: its length first, so [a, b] + [c] differs from [a] + [b, c].
  template <class T>
  requires(std::is_arithmetic_v<T>) Fingerprint& add(std::span<const T> values) noexcept {
    add_word(values.size());
    return add_bytes(std::as_bytes(values));
  }

  /// Text, length first.
  Fingerprint& add(std::string_view text) noexcept {
    add_word(text.size());
    return add_bytes(std::as_bytes(std::span<const char>(text.data(), text.size())));
  }

  /// Raw bytes (no length prefix), 8 at a time; the last partial word is zero-padded.
  Fingerprint& add_bytes(std::span<const std::byte> bytes) noexcept {
    std::size_t i = 0;
    for (; i + 8 <= bytes.size(); i += 8) {
      std::uint64_t word = 0;
      std::memcpy(&word, bytes.data() + i, 8);
      add_word(word);
    }
    if (i < bytes.size()) {
      std::uint64_t word = 0;
      std::memcpy(&word, bytes.data() + i, bytes.size() - i);
      add_word(word);
    }
    return *this;
  }

  /// The fingerprint so far (adding more continues from the same state).
  [[nodiscard]] constexpr std::uint64_t value() const noexcept { return finalize(state_ ^ words_); }

 private:
  static constexpr std::uint64_t kOffset = 0x27D4EB2F165667C5ull;
  static constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
  static constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;

  // SplitMix64's finalizer: every input bit reaches every output bit.
  static constexpr std::uint64_t finalize(std::uint64_t x) noexcept {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  std::uint64_t state_;
  std::uint64_t words_ = 0;
};

/// The default hash of one page of token ids: two tokens per 64-bit word.
[[nodiscard]] inline std::uint64_t hash_token_block(std::span<const TokenId> tokens) noexcept {
  Fingerprint f;
  std::size_t i = 0;
  for (; i + 2 <= tokens.size(); i += 2) {
    f.add_word(static_cast<std::uint32_t>(tokens[i]) |
               (std::uint64_t{static_cast<std::uint32_t>(tokens[i + 1])} << 32));
  }
  if (i < tokens.size()) f.add_word(static_cast<std::uint32_t>(tokens[i]));
  return f.value();
}

}  // namespace kvpack::inline v0::paging
