#pragma once
/// \file int8.hpp
/// \brief quant::Int8: per-token symmetric int8 with one fp16 scale per (token, KV head).
///
/// Per token: s = max_c |x_c| / 127, code = round(x / s) in [-127, 127], x̂ = code · s
/// (ALGORITHMS.md §5.2; the code is computed with 1/s in fp32 and s is stored as fp16, as ggml's
/// q8_0 does). Byte format of a plane (P = page_size, d = head_dim, d % 8 == 0):
///   `int8 codes[P·d]` in the pair tiles of tile_layout.hpp, then `fp16 scale[P]`.
/// Bits per element: 8 + 16/d (8.125 at d = 128).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kvpack/core/half.hpp"
#include "kvpack/quant/ggml_blocks.hpp"
#include "kvpack/quant/tile_layout.hpp"

namespace kvpack::inline v0::quant {

/// One plane of quant::Int8; see the file comment for the byte format.
template <Plane kPlaneOf>
struct Int8Codec {
  using params_type = NoParams;
  static constexpr std::string_view kName = "int8";
  static constexpr Plane kPlane = kPlaneOf;

  void validate(PageGeometry g) const {
    // Pairs of channels and tokens are stored together, and the SIMD value kernels step over
    // channels 8 at a time.
    KVPACK_CHECK(g.head_dim % 8 == 0 && g.page_size % 2 == 0, kUnsupported,
                 ::kvpack::detail::message("int8 needs head_dim a multiple of 8 (got ", g.head_dim,
                                           ") and an even page_size (got ", g.page_size, ")"));
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return codes_bytes(g) + static_cast<std::size_t>(g.page_size) * sizeof(std::uint16_t);
  }
  [[nodiscard]] double nominal_bits_per_element(index_t head_dim) const noexcept {
    return 8.0 + 16.0 / head_dim;
  }
  /// The fp16 scale max|x|/127 must stay finite.
  [[nodiscard]] float max_abs_input() const noexcept { return 65504.0f * 127.0f; }
  [[nodiscard]] params_type initial_params(index_t, index_t) const noexcept { return {}; }

  [[nodiscard]] static constexpr std::size_t codes_bytes(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(g.head_dim);
  }
  [[nodiscard]] static constexpr std::size_t code_byte(PageGeometry g, index_t t, index_t c) noexcept {
    return kPlane == Plane::kKey ? tile::key_byte(g, t, c) : tile::value_byte(g, t, c);
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, params_type,
              std::byte* dst) const noexcept {
    std::byte* scales = dst + codes_bytes(g);
    for (index_t t = 0; t < g.page_size; ++t) {
      const float* row = src + t * row_stride;
      float amax = 0.0f;
      for (index_t c = 0; c < g.head_dim; ++c) amax = std::max(amax, std::fabs(row[c]));
      const float scale = amax / 127.0f;
      const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      const std::uint16_t scale_bits = half(scale).bits;
      std::memcpy(scales + t * sizeof(scale_bits), &scale_bits, sizeof(scale_bits));
      for (index_t c = 0; c < g.head_dim; ++c) {
        const std::int8_t code = ggml::round_to_int8_code(row[c] * inverse);
        dst[code_byte(g, t, c)] = static_cast<std::byte>(code);
      }
    }
  }

  void decode(PageGeometry g, const std::byte* plane, params_type, float* dst) const noexcept {
    const std::byte* scales = plane + codes_bytes(g);
    for (index_t t = 0; t < g.page_size; ++t) {
      std::uint16_t scale_bits;
      std::memcpy(&scale_bits, scales + t * sizeof(scale_bits), sizeof(scale_bits));
      const float scale = half::from_bits(scale_bits);
      for (index_t c = 0; c < g.head_dim; ++c) {
        const auto code = static_cast<std::int8_t>(plane[code_byte(g, t, c)]);
        dst[static_cast<std::size_t>(t) * g.head_dim + c] = static_cast<float>(code) * scale;
      }
    }
  }

  friend constexpr bool operator==(const Int8Codec&, const Int8Codec&) noexcept { return true; }
};

/// Per-token symmetric int8 keys and values.
struct Int8 {
  using key_codec = Int8Codec<Plane::kKey>;
  using value_codec = Int8Codec<Plane::kValue>;
  key_codec key{};
  value_codec value{};
  static std::string name() { return "int8"; }
  friend constexpr bool operator==(const Int8&, const Int8&) noexcept { return true; }
};

}  // namespace kvpack::inline v0::quant
