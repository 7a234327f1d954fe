#pragma once
/// \file ranking.hpp
/// \brief The selection steps evictors share: keep the pinned, the first and the last tokens,
///        then the best-scored of the rest with ties towards the lower position.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <vector>

#include "kvpack/evict/evict_concepts.hpp"

namespace kvpack::inline v0::evict::ranking {

/// keep[i] = 1 for pinned tokens and for the first `first` and the last `last` tokens; returns
/// how many are kept.
inline index_t keep_fixed(const StreamTokens& tokens, index_t first, index_t last, std::span<std::uint8_t> keep) {
  const index_t n = tokens.size();
  index_t kept = 0;
  for (index_t i = 0; i < n; ++i) {
    keep[i] = (i < first || i >= n - last || (!tokens.pinned.empty() && tokens.pinned[i] != 0)) ? 1 : 0;
    kept += keep[i];
  }
  return kept;
}

/// Keeps, among tokens not yet kept, the `count` with the highest `scores`; equal scores go to
/// the lower position (the earlier token), so results are deterministic. A NaN score (non-finite
/// input with check_inputs off) ranks as +inf: a token of unknown importance is kept, and the
/// order stays a strict weak one, as partial_sort needs.
inline void keep_best(std::span<const float> scores, index_t count, std::span<std::uint8_t> keep) {
  if (count <= 0) return;
  thread_local std::vector<index_t> candidates;
  candidates.clear();
  for (index_t i = 0; i < static_cast<index_t>(keep.size()); ++i) {
    if (keep[i] == 0) candidates.push_back(i);
  }
  const auto score = [&](index_t i) { return std::isnan(scores[i]) ? INFINITY : scores[i]; };
  const auto better = [&](index_t a, index_t b) { return score(a) > score(b) || (score(a) == score(b) && a < b); };
  const auto end = candidates.begin() + std::min<std::ptrdiff_t>(count, static_cast<std::ptrdiff_t>(candidates.size()));
  std::partial_sort(candidates.begin(), end, candidates.end(), better);
  for (auto it = candidates.begin(); it != end; ++it) keep[*it] = 1;
}

}  // namespace kvpack::inline v0::evict::ranking
