#pragma once
/// \file snapkv.hpp
/// \brief evict::SnapKV: once per prefill, keep what the observation window attends to.

#include <algorithm>
#include <string_view>
#include <vector>

#include "kvpack/evict/budget.hpp"
#include "kvpack/evict/evict_concepts.hpp"
#include "kvpack/evict/ranking.hpp"

namespace kvpack::inline v0::evict {

enum class Pooling : std::uint8_t { kMax, kAvg };

/// SnapKV (ALGORITHMS.md §7): when `prefill` is given observation queries (the last W prompt
/// queries), each token is scored by the attention those queries give it (causal inside the
/// window, group-reduced), the scores are pooled along tokens (kernel `kernel`, stride 1, zero
/// padding kernel/2), and a stream over its budget keeps the last `window` tokens plus the best
/// pooled ones. A prefill without observation queries and every `append` evict nothing: decode
/// tokens are added uncompressed, as in the reference. Defaults: the paper's LongBench
/// configuration (w = 32, k = 7, max pooling, C = 1024).
template <Budget B = Uniform>
struct SnapKV {
  static constexpr std::string_view kName = "snapkv";
  static constexpr bool kNeedsScores = false;
  static constexpr bool kDropsTokens = true;
  static constexpr bool kUsesObservation = true;
  static constexpr bool kEvictsOnAppend = false;

  index_t window = 32;
  index_t kernel = 7;
  Pooling pooling = Pooling::kMax;
  B budget{};
  GroupReduce group_reduce = GroupReduce::kMean;

  [[nodiscard]] index_t capacity(index_t layer, index_t layers, index_t context) const noexcept {
    return budget.capacity(layer, layers, context, window);
  }
  [[nodiscard]] GroupReduce reduce() const noexcept { return group_reduce; }
  void validate() const {
    KVPACK_CHECK(window >= 0 && kernel >= 1 && kernel % 2 == 1, kInvalidConfig,
                 detail::message("evict::SnapKV needs window >= 0 and an odd kernel >= 1, got window ", window,
                                 " and kernel ", kernel));
    budget.validate(window);
  }
  void choose(const StreamTokens& tokens, std::span<std::uint8_t> keep) const {
    const index_t n = tokens.size();
    const index_t kept = ranking::keep_fixed(tokens, 0, window, keep);
    // Pool the scores of the tokens before the window; the window itself is kept whole.
    const index_t prefix = std::max<index_t>(0, n - window);
    thread_local std::vector<float> pooled;
    pooled.assign(static_cast<std::size_t>(n), 0.0f);
    const index_t half = kernel / 2;
    for (index_t i = 0; i < prefix; ++i) {
      float value = pooling == Pooling::kMax ? tokens.scores[i] : 0.0f;
      for (index_t j = std::max<index_t>(0, i - half); j <= std::min<index_t>(prefix - 1, i + half); ++j) {
        value = pooling == Pooling::kMax ? std::max(value, tokens.scores[j]) : value + tokens.scores[j];
      }
      // Average pooling divides by the kernel: the zero padding counts, as in the reference.
      pooled[i] = pooling == Pooling::kMax ? value : value / static_cast<float>(kernel);
    }
    ranking::keep_best(pooled, tokens.capacity - kept, keep);
  }
  friend constexpr bool operator==(const SnapKV&, const SnapKV&) = default;
};

}  // namespace kvpack::inline v0::evict
