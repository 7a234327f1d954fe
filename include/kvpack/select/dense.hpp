#pragma once
/// \file dense.hpp
/// \brief select::DenseRead: decode attention reads every page.

#include <string_view>

#include "kvpack/select/select_concepts.hpp"

namespace kvpack::inline v0::select {

/// Reads every page; keeps no summary.
struct DenseRead {
  static constexpr std::string_view kName = "dense";
  static constexpr bool kReadsAllPages = true;
  [[nodiscard]] std::size_t summary_bytes(index_t, index_t) const noexcept { return 0; }
  friend constexpr bool operator==(DenseRead, DenseRead) noexcept { return true; }
};
static_assert(PageSelector<DenseRead>);

}  // namespace kvpack::inline v0::select
