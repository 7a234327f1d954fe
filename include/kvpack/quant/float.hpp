#pragma once
/// \file float.hpp
/// \brief quant::Float<T>: keys and values stored as fp32, fp16 or bf16.
///
/// Byte format (little-endian, T = float / half / bfloat16, P = page_size, d = head_dim):
/// - key plane:   `T k[d][P]`  channel-major, so one vector load covers one channel of 16
///                consecutive tokens and scoring needs no horizontal sums;
/// - value plane: `T v[P][d]`  token-major, so accumulating p_t·v_t is a row-wise AXPY.
/// Bits per element: 8·sizeof(T) (32, 16, 16); no metadata.

#include <cstring>
#include <limits>
#include <string>

#include "kvpack/core/half.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "kvpack/quant/tile_layout.hpp"

namespace kvpack::inline v0::quant {

namespace detail {

template <class T>
struct FloatStorage;
template <>
struct FloatStorage<float> {
  static constexpr std::string_view kName = "f32";
  static constexpr float kMaxAbs = std::numeric_limits<float>::max();
};
template <>
struct FloatStorage<half> {
  static constexpr std::string_view kName = "f16";
  static constexpr float kMaxAbs = 65504.0f;  // larger inputs would round to inf
};
template <>
struct FloatStorage<bfloat16> {
  static constexpr std::string_view kName = "bf16";
  static constexpr float kMaxAbs = 3.38953139e38f;  // the largest finite bfloat16
};

}  // namespace detail

/// One plane of quant::Float<T>; see the file comment for the byte format.
template <class T, Plane kPlaneOf>
struct FloatCodec {
  using params_type = NoParams;
  using storage_type = T;
  static constexpr std::string_view kName = detail::FloatStorage<T>::kName;
  static constexpr Plane kPlane = kPlaneOf;

  void validate(PageGeometry) const noexcept {}
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(g.head_dim) * sizeof(T);
  }
  [[nodiscard]] double nominal_bits_per_element(index_t) const noexcept { return 8.0 * sizeof(T); }
  [[nodiscard]] float max_abs_input() const noexcept { return detail::FloatStorage<T>::kMaxAbs; }
  [[nodiscard]] params_type initial_params(index_t, index_t) const noexcept { return {}; }

  [[nodiscard]] static constexpr std::size_t index(PageGeometry g, index_t t, index_t c) noexcept {
    return tile::element(g, kPlane, t, c);
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, params_type,
              std::byte* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        const T value = static_cast<T>(src[t * row_stride + c]);
        std::memcpy(dst + index(g, t, c) * sizeof(T), &value, sizeof(T));
      }
    }
  }

  void decode(PageGeometry g, const std::byte* plane, params_type, float* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        T value;
        std::memcpy(&value, plane + index(g, t, c) * sizeof(T), sizeof(T));
        dst[static_cast<std::size_t>(t) * g.head_dim + c] = static_cast<float>(value);
      }
    }
  }

  friend constexpr bool operator==(const FloatCodec&, const FloatCodec&) noexcept { return true; }
};

/// Keys and values stored uncompressed as T (float, half or bfloat16).
template <class T>
struct Float {
  using key_codec = FloatCodec<T, Plane::kKey>;
  using value_codec = FloatCodec<T, Plane::kValue>;
  key_codec key{};
  value_codec value{};
  static std::string name() { return std::string(key_codec::kName); }
  friend constexpr bool operator==(const Float&, const Float&) noexcept { return true; }
};

}  // namespace kvpack::inline v0::quant
