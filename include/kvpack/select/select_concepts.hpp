#pragma once
/// \file select_concepts.hpp
/// \brief The PageSelector concept: which pages decode attention reads (nothing is dropped).

#include <concepts>
#include <cstddef>
#include <string_view>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::select {

/// A page selector. `kReadsAllPages` is true when every page is read (select::DenseRead); a
/// selector that skips pages keeps a per-page summary of `summary_bytes(page_size, head_dim)`
/// bytes in each page's metadata.
template <class S>
concept PageSelector = std::semiregular<S> && requires(const S s, index_t page_size, index_t head_dim) {
  { S::kName } -> std::convertible_to<std::string_view>;
  { S::kReadsAllPages } -> std::convertible_to<bool>;
  { s.summary_bytes(page_size, head_dim) } noexcept -> std::same_as<std::size_t>;
};

}  // namespace kvpack::inline v0::select
