#pragma once
/// \file q4_0.hpp
/// \brief quant::Q4_0: llama.cpp's q4_0 blocks (32 channels of one token, fp16 scale, 4-bit codes).
///
/// Quantization is ggml's reference (ggml_blocks.hpp), so the scales and codes are exactly those
/// llama.cpp stores; `to_ggml`/`from_ggml` convert a token's row to and from llama.cpp's
/// `block_q4_0[d/32]`. Byte format of a plane (P = page_size, d = head_dim, d % 32 == 0):
///   `uint8 nibbles[P·d/2]` in the nibble tiles of tile_layout.hpp, then `fp16 d[d/32][P]`
///   (block-major, tokens contiguous so a vector of per-token scales is one load).
/// Code q in 0..15 stands for (q - 8) · d.
/// Bits per element: 4.5 (18 bytes per 32 elements, as llama.cpp).

#include <cstring>
#include <string>

#include "kvpack/quant/ggml_blocks.hpp"
#include "kvpack/quant/tile_layout.hpp"

namespace kvpack::inline v0::quant {

/// One plane of quant::Q4_0; see the file comment for the byte format.
template <Plane kPlaneOf>
struct Q4_0Codec {
  using params_type = NoParams;
  static constexpr std::string_view kName = "q4_0";
  static constexpr Plane kPlane = kPlaneOf;

  void validate(PageGeometry g) const {
    KVPACK_CHECK(g.head_dim % ggml::kBlockSize == 0, kUnsupported,
                 ::kvpack::detail::message("q4_0 quantizes blocks of 32 channels: head_dim ",
                                           g.head_dim, " is not a multiple of 32"));
    // The value kernel keeps one scale maximum per block on the stack.
    KVPACK_CHECK(g.head_dim <= 2048, kUnsupported,
                 ::kvpack::detail::message("q4_0 supports head_dim up to 2048, got ", g.head_dim));
    KVPACK_CHECK(g.page_size % 4 == 0, kUnsupported,
                 ::kvpack::detail::message("q4_0 stores token quads: page_size ", g.page_size,
                                           " must be a multiple of 4"));
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return codes_bytes(g) + scale_count(g) * sizeof(std::uint16_t);
  }
  [[nodiscard]] double nominal_bits_per_element(index_t) const noexcept { return 4.5; }
  [[nodiscard]] float max_abs_input() const noexcept { return 65504.0f * 8.0f; }
  [[nodiscard]] params_type initial_params(index_t, index_t) const noexcept { return {}; }

  [[nodiscard]] static constexpr std::size_t codes_bytes(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(g.head_dim) / 2;
  }
  [[nodiscard]] static constexpr std::size_t scale_count(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.page_size) * (g.head_dim / ggml::kBlockSize);
  }
  /// Byte offset of the scale of (token t, block b).
  [[nodiscard]] static constexpr std::size_t scale_byte(PageGeometry g, index_t t, index_t b) noexcept {
    return codes_bytes(g) + (static_cast<std::size_t>(b) * g.page_size + t) * sizeof(std::uint16_t);
  }
  [[nodiscard]] static constexpr tile::NibbleAddress code_nibble(PageGeometry g, index_t t,
                                                                 index_t c) noexcept {
    return kPlane == Plane::kKey ? tile::key_nibble(g, t, c) : tile::value_nibble(g, t, c);
  }
  /// Block b of token t, as llama.cpp stores it. Both tiles put a block's elements j and j + 16
  /// in one byte, low and high nibble, as ggml's qs[j] holds them, so its 16 bytes move whole.
  [[nodiscard]] static ggml::BlockQ4_0 read_block(PageGeometry g, const std::byte* plane, index_t t,
                                                  index_t b) noexcept {
    ggml::BlockQ4_0 block;
    std::memcpy(&block.d, plane + scale_byte(g, t, b), sizeof(block.d));
    const index_t c0 = b * ggml::kBlockSize;
    for (index_t j = 0; j < ggml::kBlockSize / 2; ++j) {
      block.qs[j] = static_cast<std::uint8_t>(plane[code_nibble(g, t, c0 + j).byte]);
    }
    return block;
  }
  static void write_block(PageGeometry g, const ggml::BlockQ4_0& block, index_t t, index_t b,
                          std::byte* plane) noexcept {
    std::memcpy(plane + scale_byte(g, t, b), &block.d, sizeof(block.d));
    const index_t c0 = b * ggml::kBlockSize;
    for (index_t j = 0; j < ggml::kBlockSize / 2; ++j) {
      plane[code_nibble(g, t, c0 + j).byte] = static_cast<std::byte>(block.qs[j]);
    }
  }

  /// Stores token t from llama.cpp's row layout (`row` holds head_dim / 32 blocks).
  static void from_ggml(PageGeometry g, const ggml::BlockQ4_0* row, index_t t, std::byte* plane) noexcept {
    for (index_t b = 0; b < g.head_dim / ggml::kBlockSize; ++b) write_block(g, row[b], t, b, plane);
  }
  /// Reads token t back in llama.cpp's row layout (`row` receives head_dim / 32 blocks).
  static void to_ggml(PageGeometry g, const std::byte* plane, index_t t, ggml::BlockQ4_0* row) noexcept {
    for (index_t b = 0; b < g.head_dim / ggml::kBlockSize; ++b) row[b] = read_block(g, plane, t, b);
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, params_type,
              std::byte* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t b = 0; b < g.head_dim / ggml::kBlockSize; ++b) {
        write_block(g, ggml::quantize_q4_0(src + t * row_stride + b * ggml::kBlockSize), t, b, dst);
      }
    }
  }

  void decode(PageGeometry g, const std::byte* plane, params_type, float* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t b = 0; b < g.head_dim / ggml::kBlockSize; ++b) {
        ggml::dequantize_q4_0(read_block(g, plane, t, b),
                              dst + static_cast<std::size_t>(t) * g.head_dim + b * ggml::kBlockSize);
      }
    }
  }

  friend constexpr bool operator==(const Q4_0Codec&, const Q4_0Codec&) noexcept { return true; }

};

/// llama.cpp-compatible q4_0 keys and values.
struct Q4_0 {
  using key_codec = Q4_0Codec<Plane::kKey>;
  using value_codec = Q4_0Codec<Plane::kValue>;
  key_codec key{};
  value_codec value{};
  static std::string name() { return "q4_0"; }
  friend constexpr bool operator==(const Q4_0&, const Q4_0&) noexcept { return true; }
};

}  // namespace kvpack::inline v0::quant
