#pragma once
/// \file kivi.hpp
/// \brief quant::KIVI<Bits, Group>: KIVI's asymmetric 2- or 4-bit codes (ALGORITHMS.md §1) — keys
///        per channel over groups of `Group` tokens, values per token over groups of `Group`
///        channels.
///
/// Per group: mn = min, mx = max, s = (mx − mn) / (2^b − 1), both stored as fp16; code =
/// clamp(round((x − mn) / s), 0, 2^b − 1) computed with the stored (rounded) s and mn, so decode
/// x̂ = code · s + mn sees the numbers encode used; s == 0 (a constant group) stores code 0 and
/// reconstructs mn. Codes are packed little-end first: element j of a packed row sits at bit b·j.
///
/// Key plane (P = page_size, a multiple of Group; d = head_dim):
///   `codes[d][P·b/8]` (channel-major: a channel's P tokens packed along tokens),
///   then `fp16 scale[P/Group][d]`, then `fp16 min[P/Group][d]`.
/// Value plane (d a multiple of Group):
///   `codes[P][d·b/8]` (token-major: a token's d channels packed along channels),
///   then `fp16 scale[P][d/Group]`, then `fp16 min[P][d/Group]`.
/// Bits per element: b + 32/Group (KIVI-2 at Group 32: 3; KIVI-4: 5).
///
/// Deviation from the reference: KIVI keeps a full-precision residual of R tokens, flushing keys
/// R at a time and values one at a time. Here the residual is the cache's fp32 tail
/// (CacheConfig::tail_tokens = R, a multiple of page_size): keys and values alike keep between R
/// and R + page_size − 1 newest tokens exact, never fewer than KIVI's values and more than its
/// keys (0 … R − 1).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include "kvpack/core/half.hpp"
#include "kvpack/error.hpp"
#include "kvpack/quant/packed_codes.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::quant {

namespace kivi_detail {

/// (scale, min) of a group as stored: fp16-rounded; the scale 0 for a constant group.
struct GroupRange {
  float scale = 0.0f;
  float min = 0.0f;
};

template <int Bits>
GroupRange group_range(float lo, float hi) noexcept {
  const float min = half(lo);
  return {static_cast<float>(half((hi - lo) / static_cast<float>((1 << Bits) - 1))), min};
}

/// std::nearbyint in the default rounding mode (nearest, ties to even) for a float in [0, 255].
/// At the x86-64 baseline GCC calls nearbyintf out of line (SSE4.1 has the instruction, SSE2
/// does not), and with fminf/fmaxf those calls took 30 % of a KIVI append; cvtss2si rounds by
/// MXCSR, nearest-even unless the caller changed it — as nearbyint follows the current mode.
inline int round_to_nearest_even(float x) noexcept {
#if defined(__SSE2__) || defined(_M_X64)
  return _mm_cvtss_si32(_mm_set_ss(x));
#else
  return static_cast<int>(std::nearbyint(x));
#endif
}

template <int Bits>
std::uint8_t to_code(float x, GroupRange r) noexcept {
  if (r.scale == 0.0f) return 0;
  constexpr float kTop = static_cast<float>((1 << Bits) - 1);
  // Comparisons rather than std::clamp: a NaN (check_inputs off) fails them and becomes code 0,
  // not an out-of-range float-to-integer conversion (undefined behaviour).
  const float q = (x - r.min) / r.scale;
  const float clamped = q > 0.0f ? (q < kTop ? q : kTop) : 0.0f;
  return static_cast<std::uint8_t>(round_to_nearest_even(clamped));
}

template <int Bits>
std::uint8_t get_code(const std::byte* row, index_t j) noexcept {
  const std::size_t bit = static_cast<std::size_t>(j) * Bits;
  return static_cast<std::uint8_t>((static_cast<unsigned>(row[bit / 8]) >> (bit % 8)) & ((1u << Bits) - 1));
}

inline void put_half(std::byte* at, float x) noexcept {
  const std::uint16_t bits = half(x).bits;
  std::memcpy(at, &bits, sizeof(bits));
}
inline float get_half(const std::byte* at) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  return half::from_bits(bits);
}

}  // namespace kivi_detail

/// The shared part of KIVI's two planes: bit width, group size, limits.
template <int Bits, int Group>
struct KiviTraits {
  static_assert(Bits == 2 || Bits == 4, "KIVI stores 2- or 4-bit codes");
  static_assert(Group == 32 || Group == 64 || Group == 128, "KIVI groups 32, 64 or 128 elements");
  static constexpr int kBits = Bits;
  static constexpr int kGroup = Group;
  [[nodiscard]] double nominal_bits_per_element(index_t) const noexcept { return Bits + 32.0 / Group; }
  /// The fp16 min and the scale (max − min) / (2^b − 1) must stay finite.
  [[nodiscard]] float max_abs_input() const noexcept { return 32752.0f; }
  [[nodiscard]] NoParams initial_params(index_t, index_t) const noexcept { return {}; }
};

/// KIVI's key plane: per channel, groups of Group tokens.
template <int Bits, int Group>
struct KiviKeyCodec : KiviTraits<Bits, Group> {
  using params_type = NoParams;
  static constexpr std::string_view kName = Bits == 2 ? "kivi2_key" : "kivi4_key";
  static constexpr Plane kPlane = Plane::kKey;

  void validate(PageGeometry g) const {
    KVPACK_CHECK(g.page_size % Group == 0, kUnsupported,
                 ::kvpack::detail::message("KIVI keys are quantized in groups of ", Group,
                                           " tokens: page_size ", g.page_size, " must be a multiple of it"));
  }
  [[nodiscard]] static constexpr std::size_t row_bytes(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.page_size) * Bits / 8;
  }
  [[nodiscard]] static constexpr std::size_t scales_offset(PageGeometry g) noexcept {
    return row_bytes(g) * static_cast<std::size_t>(g.head_dim);
  }
  [[nodiscard]] static constexpr std::size_t mins_offset(PageGeometry g) noexcept {
    return scales_offset(g) + static_cast<std::size_t>(g.page_size / Group) * g.head_dim * 2;
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return mins_offset(g) + static_cast<std::size_t>(g.page_size / Group) * g.head_dim * 2;
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, params_type, std::byte* dst) const noexcept {
    std::fill(dst, dst + plane_bytes(g), std::byte{0});
    for (index_t group = 0; group < g.page_size / Group; ++group) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        float lo = INFINITY, hi = -INFINITY;
        for (index_t t = group * Group; t < (group + 1) * Group; ++t) {
          lo = std::min(lo, src[t * row_stride + c]);
          hi = std::max(hi, src[t * row_stride + c]);
        }
        const auto range = kivi_detail::group_range<Bits>(lo, hi);
        const std::size_t meta = (static_cast<std::size_t>(group) * g.head_dim + c) * 2;
        kivi_detail::put_half(dst + scales_offset(g) + meta, range.scale);
        kivi_detail::put_half(dst + mins_offset(g) + meta, range.min);
        std::byte* row = dst + row_bytes(g) * c;
        put_codes<Bits>(row, group * Group, Group, [&](index_t t) {
          return kivi_detail::to_code<Bits>(src[t * row_stride + c], range);
        });
      }
    }
  }

  void decode(PageGeometry g, const std::byte* plane, params_type, float* dst) const noexcept {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const std::byte* row = plane + row_bytes(g) * c;
      for (index_t t = 0; t < g.page_size; ++t) {
        const std::size_t meta = (static_cast<std::size_t>(t / Group) * g.head_dim + c) * 2;
        dst[static_cast<std::size_t>(t) * g.head_dim + c] =
            static_cast<float>(kivi_detail::get_code<Bits>(row, t)) * kivi_detail::get_half(plane + scales_offset(g) + meta) +
            kivi_detail::get_half(plane + mins_offset(g) + meta);
      }
    }
  }

  friend constexpr bool operator==(const KiviKeyCodec&, const KiviKeyCodec&) noexcept { return true; }
};

/// A KIVI plane quantized per token, groups of Group channels: KIVI's values, and (on the key
/// plane) the per-token keys of its ablation, which per-channel keys beat.
template <int Bits, int Group, Plane kPlaneOf>
struct KiviTokenCodec : KiviTraits<Bits, Group> {
  using params_type = NoParams;
  static constexpr std::string_view kName = kPlaneOf == Plane::kValue ? (Bits == 2 ? "kivi2_value" : "kivi4_value")
                                                                      : (Bits == 2 ? "kivi2_token_key" : "kivi4_token_key");
  static constexpr Plane kPlane = kPlaneOf;

  void validate(PageGeometry g) const {
    KVPACK_CHECK(g.head_dim % Group == 0, kUnsupported,
                 ::kvpack::detail::message("KIVI ", kPlaneOf == Plane::kValue ? "values" : "per-token keys",
                                           " are quantized in groups of ", Group, " channels: head_dim ", g.head_dim,
                                           " must be a multiple of it"));
  }
  [[nodiscard]] static constexpr std::size_t row_bytes(PageGeometry g) noexcept {
    return static_cast<std::size_t>(g.head_dim) * Bits / 8;
  }
  [[nodiscard]] static constexpr std::size_t scales_offset(PageGeometry g) noexcept {
    return row_bytes(g) * static_cast<std::size_t>(g.page_size);
  }
  [[nodiscard]] static constexpr std::size_t mins_offset(PageGeometry g) noexcept {
    return scales_offset(g) + static_cast<std::size_t>(g.page_size) * (g.head_dim / Group) * 2;
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return mins_offset(g) + static_cast<std::size_t>(g.page_size) * (g.head_dim / Group) * 2;
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, params_type, std::byte* dst) const noexcept {
    std::fill(dst, dst + plane_bytes(g), std::byte{0});
    for (index_t t = 0; t < g.page_size; ++t) {
      const float* x = src + t * row_stride;
      std::byte* row = dst + row_bytes(g) * t;
      for (index_t group = 0; group < g.head_dim / Group; ++group) {
        const auto [lo, hi] = std::minmax_element(x + group * Group, x + (group + 1) * Group);
        const auto range = kivi_detail::group_range<Bits>(*lo, *hi);
        const std::size_t meta = (static_cast<std::size_t>(t) * (g.head_dim / Group) + group) * 2;
        kivi_detail::put_half(dst + scales_offset(g) + meta, range.scale);
        kivi_detail::put_half(dst + mins_offset(g) + meta, range.min);
        put_codes<Bits>(row, group * Group, Group, [&](index_t c) { return kivi_detail::to_code<Bits>(x[c], range); });
      }
    }
  }

  void decode(PageGeometry g, const std::byte* plane, params_type, float* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      const std::byte* row = plane + row_bytes(g) * t;
      for (index_t group = 0; group < g.head_dim / Group; ++group) {
        const std::size_t meta = (static_cast<std::size_t>(t) * (g.head_dim / Group) + group) * 2;
        const float scale = kivi_detail::get_half(plane + scales_offset(g) + meta);
        const float min = kivi_detail::get_half(plane + mins_offset(g) + meta);
        for (index_t c = group * Group; c < (group + 1) * Group; ++c) {
          dst[static_cast<std::size_t>(t) * g.head_dim + c] =
              static_cast<float>(kivi_detail::get_code<Bits>(row, c)) * scale + min;
        }
      }
    }
  }

  friend constexpr bool operator==(const KiviTokenCodec&, const KiviTokenCodec&) noexcept { return true; }
};

template <int Bits, int Group>
using KiviValueCodec = KiviTokenCodec<Bits, Group, Plane::kValue>;

/// KIVI: 2- or 4-bit keys per channel and values per token, fp16 scale and minimum per group.
template <int Bits, int Group = 32>
struct KIVI {
  using key_codec = KiviKeyCodec<Bits, Group>;
  using value_codec = KiviValueCodec<Bits, Group>;
  key_codec key{};
  value_codec value{};
  static std::string name() { return "kivi" + std::to_string(Bits) + "_g" + std::to_string(Group); }
  friend constexpr bool operator==(const KIVI&, const KIVI&) noexcept { return true; }
};

/// KIVI's ablation: keys per token (like its values) instead of per channel. Outlier key
/// channels then set every channel's step; the asymmetry experiment measures what that costs.
template <int Bits, int Group = 32>
struct KiviPerTokenKeys {
  using key_codec = KiviTokenCodec<Bits, Group, Plane::kKey>;
  using value_codec = KiviValueCodec<Bits, Group>;
  key_codec key{};
  value_codec value{};
  static std::string name() { return "kivi" + std::to_string(Bits) + "_g" + std::to_string(Group) + "_token_keys"; }
  friend constexpr bool operator==(const KiviPerTokenKeys&, const KiviPerTokenKeys&) noexcept { return true; }
};

}  // namespace kvpack::inline v0::quant
