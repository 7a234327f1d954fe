#pragma once
/// \file streaming_llm.hpp
/// \brief evict::StreamingLLM: the first tokens (attention sinks) and a recent window.

#include <string_view>

#include "kvpack/evict/budget.hpp"
#include "kvpack/evict/evict_concepts.hpp"
#include "kvpack/evict/ranking.hpp"

namespace kvpack::inline v0::evict {

/// StreamingLLM (ALGORITHMS.md §8): keeps `sinks` first tokens and the most recent ones up to the
/// budget, after every write (pinned tokens count towards the budget and shorten the window).
/// Positions, two ways:
/// - default: the slots keep the positions they were written with, so keys stored after RoPE
///   stay exactly as the model rotated them (the "prefill-only" variant of §8.2);
/// - `in_cache_positions`: the original method. Keys must be stored before RoPE
///   (CacheConfig::key_rope); at every read the cache rotates each kept key by its index among the
///   stream's live tokens (0 … live − 1), and the engine rotates its query by
///   `KVCache::query_position` (the newest token's index), so distances never exceed the budget.
template <Budget B = Uniform>
struct StreamingLLM {
  static constexpr std::string_view kName = "streaming_llm";
  static constexpr bool kNeedsScores = false;
  static constexpr bool kDropsTokens = true;
  static constexpr bool kUsesObservation = false;
  static constexpr bool kEvictsOnAppend = true;

  index_t sinks = 4;                ///< first tokens always kept (the exact prefix counts towards them)
  B budget{4 + 512};                ///< tokens kept per KV stream: sinks + recent window
  bool in_cache_positions = false;  ///< rotate pre-RoPE keys by their index in the cache (§8.2)

  [[nodiscard]] index_t capacity(index_t layer, index_t layers, index_t context) const noexcept {
    return budget.capacity(layer, layers, context, sinks);
  }
  [[nodiscard]] GroupReduce reduce() const noexcept { return GroupReduce::kMean; }
  void validate() const {
    KVPACK_CHECK(sinks >= 0, kInvalidConfig, detail::message("evict::StreamingLLM.sinks must be >= 0, got ", sinks));
    budget.validate(sinks);
  }
  /// The sinks, the pinned tokens and the token just written (its step's query reads it), then
  /// the most recent ones until the budget is full: pins count towards it, as with the other
  /// evictors, so pins that fill it leave only the newest token besides them.
  void choose(const StreamTokens& tokens, std::span<std::uint8_t> keep) const {
    const index_t first = std::max<index_t>(0, sinks - tokens.exact_prefix);
    index_t kept = ranking::keep_fixed(tokens, first, 1, keep);
    for (index_t i = tokens.size() - 1; i >= 0 && kept < tokens.capacity; --i) {
      if (keep[i] != 0) continue;
      keep[i] = 1;
      ++kept;
    }
  }
  friend constexpr bool operator==(const StreamingLLM&, const StreamingLLM&) = default;
};

}  // namespace kvpack::inline v0::evict
