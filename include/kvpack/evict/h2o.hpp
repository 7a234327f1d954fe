#pragma once
/// \file h2o.hpp
/// \brief evict::H2O: heavy hitters by accumulated attention, plus a recent window.

#include <algorithm>
#include <cmath>
#include <string_view>

#include "kvpack/evict/budget.hpp"
#include "kvpack/evict/evict_concepts.hpp"
#include "kvpack/evict/ranking.hpp"

namespace kvpack::inline v0::evict {

/// H2O (ALGORITHMS.md §6): every token's score is the attention probability it has received,
/// summed over every query that read it — the observation queries given to `prefill` (pass all
/// prompt queries to reproduce the reference's column sums) and every `attend` since. After each
/// write, a stream over its budget keeps its most recent `recent_fraction` of the budget and fills
/// the rest with the highest scores. Scores of a GQA group are reduced by `group_reduce` (mean,
/// as KVCache-Factory's default). Evicted tokens are gone for good.
template <Budget B = Uniform>
struct H2O {
  static constexpr std::string_view kName = "h2o";
  static constexpr bool kNeedsScores = true;
  static constexpr bool kDropsTokens = true;
  static constexpr bool kUsesObservation = true;
  static constexpr bool kEvictsOnAppend = true;

  B budget{};
  /// Share of the budget kept as the recent window; the reference's simulation uses equal heavy
  /// and recent parts (0.1 + 0.1 of the prompt).
  double recent_fraction = 0.5;
  GroupReduce group_reduce = GroupReduce::kMean;

  [[nodiscard]] index_t recent(index_t capacity) const noexcept {
    return static_cast<index_t>(std::lround(recent_fraction * capacity));
  }
  [[nodiscard]] index_t capacity(index_t layer, index_t layers, index_t context) const noexcept {
    const index_t uniform = budget.capacity(0, 1, 0, 0);
    return budget.capacity(layer, layers, context, recent(uniform));
  }
  [[nodiscard]] GroupReduce reduce() const noexcept { return group_reduce; }
  void validate() const {
    KVPACK_CHECK(recent_fraction >= 0.0 && recent_fraction <= 1.0, kInvalidConfig,
                 detail::message("evict::H2O.recent_fraction must be in [0, 1], got ", recent_fraction));
    budget.validate(0);
  }
  /// The recent window is recent_fraction of the uniform budget, the window Pyramid sized each
  /// layer's budget around, and at least the token just written: it has no score yet (no query
  /// has read it), so it would rank last, and the query of its own step would not see it.
  void choose(const StreamTokens& tokens, std::span<std::uint8_t> keep) const {
    const index_t window = std::max<index_t>(1, recent(budget.capacity(0, 1, 0, 0)));
    const index_t kept = ranking::keep_fixed(tokens, 0, std::min(window, tokens.capacity), keep);
    ranking::keep_best(tokens.scores, tokens.capacity - kept, keep);
  }
  friend constexpr bool operator==(const H2O&, const H2O&) = default;
};

}  // namespace kvpack::inline v0::evict
