#pragma once
/// \file group_blocks.hpp
/// \brief Splits a GQA group of query heads into blocks with a compile-time size.

#include <type_traits>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Calls `body(std::integral_constant<int, G>{}, first_head)` over blocks of 8, 4, 2 and 1 heads
/// (no block above kMaxHeads) covering [0, group). Accumulators of a block live in registers
/// (8 × 2 fit the 32 AVX-512 registers), and each key or value vector loaded is reused by every
/// head of the block. Kernels with more accumulators per head lower kMaxHeads.
template <int kMaxHeads = 8, class Body>
KVPACK_ALWAYS_INLINE void for_each_head_block(index_t group, Body&& body) {
  static_assert(kMaxHeads == 1 || kMaxHeads == 2 || kMaxHeads == 4 || kMaxHeads == 8, "blocks of 1, 2, 4 or 8 heads");
  index_t h = 0;
  if constexpr (kMaxHeads >= 8) {
    for (; h + 8 <= group; h += 8) body(std::integral_constant<int, 8>{}, h);
  }
  if constexpr (kMaxHeads >= 4) {
    for (; h + 4 <= group; h += 4) body(std::integral_constant<int, 4>{}, h);
  }
  if constexpr (kMaxHeads >= 2) {
    for (; h + 2 <= group; h += 2) body(std::integral_constant<int, 2>{}, h);
  }
  for (; h < group; ++h) body(std::integral_constant<int, 1>{}, h);
}

}  // namespace kvpack::inline v0::kernels::cpu
