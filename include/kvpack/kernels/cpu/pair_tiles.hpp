#pragma once
/// \file pair_tiles.hpp
/// \brief What the kernels of the 8-bit integer codecs (int8, q8_0; pair tiles of
///        quant/tile_layout.hpp) share across their portable, AVX-512 VNNI and AVX2 paths.

#include <cstdint>
#include <type_traits>

#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Channels that share one fp16 scale: the whole head for int8, 32 for q8_0.
template <class Codec>
constexpr index_t scale_block(index_t head_dim) noexcept {
  return std::is_same_v<Codec, quant::Int8Codec<Codec::kPlane>> ? head_dim : 32;
}

/// Largest |int16| used: symmetric, so negation never overflows.
inline constexpr float kInt16Max = 32767.0f;
/// Channels summed in int32 before converting: 256 · 32767 · 127 < 2^31.
inline constexpr index_t kMaxInt32Channels = 256;

/// The query as int16 pairs, per head: pairs[h][c/2] = (q16[c], q16[c+1]); value = q16 · scale[h].
struct Int16Query {
  std::int32_t* pairs;  // [group][head_dim / 2]
  float* scale;         // [group]
};

}  // namespace kvpack::inline v0::kernels::cpu
