#pragma once
/// \file budget.hpp
/// \brief Token budgets per (layer, KV stream): evict::Uniform and evict::Pyramid (PyramidKV).

#include <algorithm>
#include <cstdint>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::evict {

/// Every layer keeps the same number of tokens per KV stream.
struct Uniform {
  index_t tokens = 1024;

  /// \param window tokens the evictor always keeps at the end (unused here)
  [[nodiscard]] index_t capacity(index_t /*layer*/, index_t /*layers*/, index_t /*context*/,
                                 index_t /*window*/) const noexcept {
    return tokens;
  }
  void validate(index_t window) const {
    KVPACK_CHECK(tokens > window, kInvalidConfig,
                 detail::message("evict::Uniform.tokens (", tokens, ") must exceed the evictor's window (", window, ")"));
  }
  friend constexpr bool operator==(const Uniform&, const Uniform&) = default;
};

/// PyramidKV's schedule (ALGORITHMS.md §9): lower layers keep more, linearly, with the same
/// mean as Uniform{tokens}. With B = tokens − window, min = ⌊B/β⌋, max = 2B − min (clipped to
/// the context's non-window part), layer l keeps max − l·⌊(max − min)/(layers − 1)⌋ plus the window.
struct Pyramid {
  index_t tokens = 1024;  ///< the mean capacity over layers, window included (C)
  index_t beta = 20;      ///< how steep: the top layer keeps about B/β

  [[nodiscard]] index_t capacity(index_t layer, index_t layers, index_t context, index_t window) const noexcept {
    if (context <= tokens) return tokens;  // nothing to compress
    // In 64 bits: 2B overflows index_t for budgets above 2^30.
    const std::int64_t budget = std::int64_t{tokens} - window;
    if (layers < 2 || context < 2 * budget) return tokens;  // too short to slope: uniform (the spec's T < 2B)
    std::int64_t low = budget / beta;
    std::int64_t high = 2 * budget - low;
    if (high >= std::int64_t{context} - window) {
      high = std::int64_t{context} - window;
      low = 2 * budget - high;
    }
    const std::int64_t step = (high - low) / (layers - 1);
    // At most high + window ≤ context: it fits index_t.
    return static_cast<index_t>(std::max<std::int64_t>(high - layer * step, 0) + window);
  }
  void validate(index_t window) const {
    KVPACK_CHECK(tokens > window && beta >= 1, kInvalidConfig,
                 detail::message("evict::Pyramid needs tokens (", tokens, ") > the evictor's window (", window,
                                 ") and beta >= 1 (", beta, ")"));
  }
  friend constexpr bool operator==(const Pyramid&, const Pyramid&) = default;
};

/// A budget: tokens one KV stream of `layer` keeps when it holds `context`, given the evictor's
/// protected `window`.
template <class B>
concept Budget = std::semiregular<B> && requires(const B b, index_t i) {
  { b.capacity(i, i, i, i) } -> std::same_as<index_t>;
  b.validate(i);
};

}  // namespace kvpack::inline v0::evict
