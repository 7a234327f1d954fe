#pragma once
/// \file q4_0_rows.hpp
/// \brief Where q4_0's kernels find a row of codes in a page plane (quant/tile_layout.hpp's quad
///        tiles), and the integer paths' query: shared by the portable, AVX-512 VNNI and AVX2
///        kernels.

#include <cstddef>
#include <cstdint>

#include "kvpack/quant/q4_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

namespace q4 {

using KeyCodec = quant::Q4_0Codec<Plane::kKey>;
using ValueCodec = quant::Q4_0Codec<Plane::kValue>;

/// Bytes of a (block, quad) key row for 16 tokens, and of a (token quad, block) value row.
inline constexpr std::size_t kRowBytes = 64;

KVPACK_ALWAYS_INLINE std::size_t key_row_offset(index_t page_size, index_t block, index_t quad, index_t t0) noexcept {
  return ((static_cast<std::size_t>(block) * 4 + quad) * page_size + t0) * 4;
}
KVPACK_ALWAYS_INLINE std::size_t value_row_offset(index_t blocks, index_t token_quad, index_t block) noexcept {
  return (static_cast<std::size_t>(token_quad) * blocks + block) * kRowBytes;
}

/// The query in int8 per 32-channel block (the integer paths): values[h][c] · step[h][b] ≈ q[h][c].
struct Int8Query {
  std::int8_t* values;       // [group][head_dim]
  float* step;               // [group][head_dim / 32]
  std::int32_t* block_sums;  // [group][head_dim / 32]: Σ values over the block (the -8 offset)
};

}  // namespace q4

}  // namespace kvpack::inline v0::kernels::cpu
