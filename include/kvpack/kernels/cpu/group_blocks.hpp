#pragma once
/// \file group_blocks.hpp
/// \brief Splits a GQA group of query heads into blocks with a compile-time size.

#include <type_traits>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Calls `body(std::integral_constant<int, G>{}, first_head)` over blocks of 8, 4, 2 and 1 heads
/// covering [0, group). Accumulators of a block live in registers (8 × 2 fit the 32 AVX-512
/// registers), and each key or value vector loaded is reused by every head of the block.
template <class Body>
KVPACK_ALWAYS_INLINE void for_each_head_block(index_t group, Body&& body) {
  index_t h = 0;
  for (; h + 8 <= group; h += 8) body(std::integral_constant<int, 8>{}, h);
  if (h + 4 <= group) {
    body(std::integral_constant<int, 4>{}, h);
    h += 4;
  }
  if (h + 2 <= group) {
    body(std::integral_constant<int, 2>{}, h);
    h += 2;
  }
  if (h < group) body(std::integral_constant<int, 1>{}, h);
}

}  // namespace kvpack::inline v0::kernels::cpu
