#pragma once
/// \file tile_layout.hpp
/// \brief Where each codec puts each element inside a page plane.
///
/// For the 8-bit integer codecs the kernels multiply 16-bit pairs (AVX-512 VNNI `vpdpwssd`: two
/// products per 32-bit lane), so codes are stored as pairs that a widening load turns straight
/// into such lanes:
/// - key plane: pairs of adjacent *channels*, tokens along the vector: for channel pair j and
///   token t, bytes (t, 2j) and (t, 2j+1) sit side by side, and 16 tokens are 32 consecutive bytes.
///   A score then needs no horizontal sum: lane t accumulates q_2j·k_t,2j + q_2j+1·k_t,2j+1.
/// - value plane: pairs of adjacent *tokens*, channels along the vector: for token pair i and
///   channel c, bytes (2i, c) and (2i+1, c) sit side by side, 16 channels = 32 consecutive bytes.
///   Lane c accumulates w_2i·v_2i,c + w_2i+1·v_2i+1,c.
/// 4-bit codes (q4_0) are the kernels' `vpdpbusd` operands (four u8·s8 products per 32-bit lane), so
/// they come in quads instead of pairs: four channels of a token (keys) or four tokens of a channel
/// (values) per 32-bit lane. The low nibbles hold channels 0–15 of a 32-channel block and the high
/// nibbles channels 16–31, as ggml's own q4_0 nibble order does, so one 64-byte load gives two
/// 16-lane tiles.

#include <cstddef>

#include "kvpack/config.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::quant::tile {

/// Element index of (token t, channel c) in a plane of the element-wise formats (Float, FP8):
/// keys channel-major (one channel of consecutive tokens per vector load, no horizontal sums
/// when scoring), values token-major (accumulating w_t·v_t is a row-wise AXPY).
[[nodiscard]] KVPACK_HOST_DEVICE constexpr std::size_t element(PageGeometry g, Plane plane, index_t t, index_t c) noexcept {
  return plane == Plane::kKey ? static_cast<std::size_t>(c) * g.page_size + t
                              : static_cast<std::size_t>(t) * g.head_dim + c;
}

/// Byte offset of the 8-bit code of (token t, channel c) in a key plane.
[[nodiscard]] KVPACK_HOST_DEVICE constexpr std::size_t key_byte(PageGeometry g, index_t t, index_t c) noexcept {
  return (static_cast<std::size_t>(c / 2) * g.page_size + t) * 2 + c % 2;
}

/// Byte offset of the 8-bit code of (token t, channel c) in a value plane.
[[nodiscard]] KVPACK_HOST_DEVICE constexpr std::size_t value_byte(PageGeometry g, index_t t, index_t c) noexcept {
  return (static_cast<std::size_t>(t / 2) * g.head_dim + c) * 2 + t % 2;
}

/// A 4-bit code's byte offset and nibble (0 = low, 1 = high).
struct NibbleAddress {
  std::size_t byte;
  int nibble;
};

/// q4_0 key plane: for block b (32 channels), channel quad j (0–3) of each half of the block,
/// and token t: four bytes, byte k holding channel 32b+4j+k (low nibble) and 32b+16+4j+k (high).
/// 16 tokens of a (block, quad) row are 64 consecutive bytes. Needs page_size % 4 == 0.
[[nodiscard]] KVPACK_HOST_DEVICE constexpr NibbleAddress key_nibble(PageGeometry g, index_t t, index_t c) noexcept {
  const index_t block = c / 32;
  const index_t in_block = c % 32;
  const std::size_t row = static_cast<std::size_t>(block) * 4 + (in_block % 16) / 4;
  return {(row * g.page_size + t) * 4 + in_block % 4, in_block / 16};
}

/// q4_0 value plane: for token quad i, block b, channel k (0–15) of each half of the block: four
/// bytes (token 4i+s), low nibble channel 32b+k, high nibble channel 32b+16+k. One (quad, block)
/// row is 64 consecutive bytes.
[[nodiscard]] KVPACK_HOST_DEVICE constexpr NibbleAddress value_nibble(PageGeometry g, index_t t, index_t c) noexcept {
  const index_t in_block = c % 32;
  const std::size_t row = static_cast<std::size_t>(t / 4) * (g.head_dim / 32) + c / 32;
  return {(row * 16 + in_block % 16) * 4 + t % 4, in_block / 16};
}

}  // namespace kvpack::inline v0::quant::tile
