#pragma once
/// \file evict_concepts.hpp
/// \brief The Evictor concept (which tokens a cache may drop) and what an evictor sees of a stream.

#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::evict {

/// How the scores of the query heads sharing one KV stream become one score per token: pages
/// are per KV head, so a GQA group keeps or drops a token together (ALGORITHMS.md §14).
enum class GroupReduce : std::uint8_t { kMean, kMax, kSum };

/// What an evictor sees of one (layer, KV stream): the tokens it may drop, oldest first. The
/// cache's exact prefix (CacheConfig::exact_prefix_tokens) is never among them.
struct StreamTokens {
  std::span<const std::int32_t> positions;  ///< [n], increasing
  /// [n] attention each token received (summed probabilities, group-reduced): accumulated over
  /// every attend for H2O, from the observation window for SnapKV; empty for evictors that
  /// declare no scores.
  std::span<const float> scores;
  std::span<const std::uint8_t> pinned;  ///< [n] 1 for tokens in a pinned span: always kept
  index_t capacity = 0;                  ///< tokens of these n the stream may keep
  index_t exact_prefix = 0;              ///< tokens kept before them (the exact prefix)
  [[nodiscard]] index_t size() const noexcept { return static_cast<index_t>(positions.size()); }
};

/// An eviction policy.
/// - `kNeedsScores`: `attend` records the attention probabilities of every token it reads and
///   adds them to the token's score (H2O). Such a policy must see every token's score, which
///   rules out selectors that skip pages.
/// - `kDropsTokens`: false only for evict::KeepAll. A dropping policy also declares:
///   - `kUsesObservation`: `prefill`'s observation queries score the tokens (SnapKV, H2O);
///   - `kEvictsOnAppend`: it evicts after `append` too, not only after `prefill`;
///   - `capacity(layer, layers, context)`: tokens one KV stream of `layer` keeps, given the
///     `context` tokens written to the layer so far, dropped ones included (a budget:
///     evict::Uniform, evict::Pyramid);
///   - `reduce()`: how a GQA group's scores combine;
///   - `choose(tokens, keep)`: sets keep[i] = 1 for the tokens to keep (every pinned one, and
///     at most `capacity` unless pins force more), 0 for the rest. Called only when
///     tokens.size() > tokens.capacity. Ties break towards the lower position.
template <class E>
concept Evictor = std::semiregular<E> && requires {
  { E::kName } -> std::convertible_to<std::string_view>;
  { E::kNeedsScores } -> std::convertible_to<bool>;
  { E::kDropsTokens } -> std::convertible_to<bool>;
} && (!E::kDropsTokens || requires(const E e, const StreamTokens& tokens, std::span<std::uint8_t> keep,
                                   index_t layer) {
  { E::kUsesObservation } -> std::convertible_to<bool>;
  { E::kEvictsOnAppend } -> std::convertible_to<bool>;
  { e.capacity(layer, layer, layer) } -> std::same_as<index_t>;
  { e.reduce() } -> std::same_as<GroupReduce>;
  e.choose(tokens, keep);
  e.validate();
});

/// Whether an evictor asks the cache to rotate keys stored before RoPE by their index among the
/// stream's live tokens instead of their original positions (StreamingLLM's re-rotation,
/// ALGORITHMS.md §8.2). Optional: evictors without an `in_cache_positions` member keep positions.
template <class E>
[[nodiscard]] constexpr bool uses_in_cache_positions(const E& evictor) noexcept {
  if constexpr (requires { { evictor.in_cache_positions } -> std::convertible_to<bool>; }) {
    return evictor.in_cache_positions;
  } else {
    return false;
  }
}

}  // namespace kvpack::inline v0::evict
