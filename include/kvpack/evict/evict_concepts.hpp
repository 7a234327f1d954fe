#pragma once
/// \file evict_concepts.hpp
/// \brief The Evictor concept: which tokens a cache may drop.

#include <concepts>
#include <string_view>

namespace kvpack::inline v0::evict {

/// An eviction policy. `kNeedsScores` says whether it consumes the attention probabilities that
/// `attend` computes (H2O, SnapKV) — such a policy must see every token's score, which constrains
/// the page selectors it can be combined with. `kDropsTokens` is false only for evict::KeepAll.
template <class E>
concept Evictor = std::semiregular<E> && requires {
  { E::kName } -> std::convertible_to<std::string_view>;
  { E::kNeedsScores } -> std::convertible_to<bool>;
  { E::kDropsTokens } -> std::convertible_to<bool>;
};

}  // namespace kvpack::inline v0::evict
