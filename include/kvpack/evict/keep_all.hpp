#pragma once
/// \file keep_all.hpp
/// \brief evict::KeepAll: the full cache, no token is ever dropped.

#include <string_view>

#include "kvpack/evict/evict_concepts.hpp"

namespace kvpack::inline v0::evict {

/// Keeps every token: the reference every eviction policy is measured against.
struct KeepAll {
  static constexpr std::string_view kName = "keep_all";
  static constexpr bool kNeedsScores = false;
  static constexpr bool kDropsTokens = false;
  friend constexpr bool operator==(KeepAll, KeepAll) noexcept { return true; }
};
static_assert(Evictor<KeepAll>);

}  // namespace kvpack::inline v0::evict
