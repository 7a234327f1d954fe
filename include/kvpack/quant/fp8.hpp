#pragma once
/// \file fp8.hpp
/// \brief quant::FP8<Format>: OCP FP8 (E4M3FN or E5M2) with a per-tensor or per-head fp32 scale.
///
/// Byte format (P = page_size, d = head_dim), one byte per element:
/// - key plane:   `uint8 k[d][P]` channel-major;
/// - value plane: `uint8 v[P][d]` token-major.
/// Element = fp8 code of x / scale, rounded to nearest even with saturation to ±max (satfinite,
/// as vLLM's KV path); x̂ = float(code) · scale. The scale is not in the page: it is one fp32 per
/// layer (per-tensor) or per (layer, KV head), kept by the cache. Bits per element: 8.
///
/// Scales are either static (given in FP8Options) or calibrated from the first prefill of each
/// layer as in vLLM: scale = max|x| / 200 for keys and max|x| / 100 for values, which leaves
/// headroom for later tokens larger than the prompt's. A later token beyond it saturates.

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvpack/core/fp8.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "kvpack/quant/tile_layout.hpp"

namespace kvpack::inline v0::quant {

using E4M3FN = fp8_e4m3fn;  ///< OCP E4M3 "FN": max 448, no infinities (not AMD's FNUZ, max 240)
using E5M2 = fp8_e5m2;      ///< OCP E5M2: max 57344, IEEE-style inf/NaN

/// How an FP8 plane gets its scale.
struct FP8Options {
  ScaleGranularity granularity = ScaleGranularity::kPerTensor;
  bool calibrate = true;  ///< derive scales from the first prefill; otherwise use the static ones
  float static_scale = 1.0f;  ///< per-tensor static scale (used when `calibrate` is false)
  /// Per-head static scales, [layers][kv_heads] row-major, used with kPerHead and no calibration.
  std::vector<float> static_head_scales{};
  index_t kv_heads = 0;  ///< row length of static_head_scales

  friend bool operator==(const FP8Options&, const FP8Options&) = default;
};

/// The per (layer, KV head) parameter of an FP8 plane.
struct FP8Params {
  float scale = 1.0f;
  friend constexpr bool operator==(FP8Params, FP8Params) noexcept = default;
};

/// One plane of quant::FP8<Format>; see the file comment for the byte format.
template <class Format, Plane kPlaneOf>
struct FP8Codec {
  using params_type = FP8Params;
  using storage_type = Format;
  static constexpr std::string_view kName =
      std::is_same_v<Format, E4M3FN> ? std::string_view("fp8_e4m3fn") : std::string_view("fp8_e5m2");
  static constexpr Plane kPlane = kPlaneOf;
  /// vLLM's calibration constants: max|K| lands on 200, max|V| on 100.
  static constexpr float kCalibrationTarget = kPlaneOf == Plane::kKey ? 200.0f : 100.0f;

  FP8Options options{};

  void validate(PageGeometry) const {
    if (!options.calibrate && options.granularity == ScaleGranularity::kPerHead) {
      KVPACK_CHECK(options.kv_heads > 0 && !options.static_head_scales.empty() &&
                       options.static_head_scales.size() % options.kv_heads == 0,
                   kInvalidConfig,
                   "FP8Options: per-head static scales need kv_heads > 0 and "
                   "static_head_scales of size layers * kv_heads");
    }
    for (float s : options.static_head_scales) {
      KVPACK_CHECK(s > 0.0f && s <= std::numeric_limits<float>::max(), kInvalidConfig,
                   ::kvpack::detail::message("FP8Options: scale must be finite and > 0, got ", s));
    }
    KVPACK_CHECK(options.static_scale > 0.0f &&
                     options.static_scale <= std::numeric_limits<float>::max(),
                 kInvalidConfig,
                 ::kvpack::detail::message("FP8Options.static_scale must be finite and > 0, got ",
                                           options.static_scale));
  }
  /// Per-head static scales are rows of the model's shape: a table for other KV heads would give
  /// one head the scale of another, or of the next layer.
  void check_model(index_t layers, index_t kv_heads) const {
    if (options.calibrate || options.granularity != ScaleGranularity::kPerHead) return;
    KVPACK_CHECK(options.kv_heads == kv_heads &&
                     options.static_head_scales.size() == static_cast<std::size_t>(layers) * kv_heads,
                 kInvalidConfig,
                 ::kvpack::detail::message("FP8Options: static_head_scales hold ", options.static_head_scales.size(),
                                           " scales in rows of ", options.kv_heads, "; the cache's model has ", layers,
                                           " layers x ", kv_heads, " KV heads"));
  }
  [[nodiscard]] std::size_t plane_bytes(PageGeometry g) const noexcept {
    return static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(g.head_dim);
  }
  [[nodiscard]] double nominal_bits_per_element(index_t) const noexcept { return 8.0; }
  /// Saturation stores any magnitude, but x / scale rounded up by half an fp8 step (1/8 at most)
  /// times the scale must stay finite: beyond half of fp32's max, a calibrated scale (absmax / 200)
  /// or a static one could decode to Inf.
  [[nodiscard]] float max_abs_input() const noexcept { return std::numeric_limits<float>::max() / 2; }

  [[nodiscard]] ScaleGranularity granularity() const noexcept { return options.granularity; }
  [[nodiscard]] bool calibrates() const noexcept { return options.calibrate; }
  [[nodiscard]] params_type params_from_absmax(float absmax) const noexcept {
    // An all-zero batch says nothing about scale: keep 1. A tiny one must not round the scale
    // to 0 (then 0/0 would encode NaN): floor it at the smallest normal float.
    if (!(absmax > 0.0f)) return {1.0f};
    return {std::max(absmax / kCalibrationTarget, std::numeric_limits<float>::min())};
  }
  [[nodiscard]] params_type initial_params(index_t layer, index_t head) const {
    if (!options.calibrate && options.granularity == ScaleGranularity::kPerHead) {
      const std::size_t i = static_cast<std::size_t>(layer) * options.kv_heads + head;
      KVPACK_CHECK(i < options.static_head_scales.size(), kInvalidConfig,
                   ::kvpack::detail::message("FP8Options.static_head_scales has no entry for layer ",
                                             layer, " head ", head));
      return {options.static_head_scales[i]};
    }
    return {options.static_scale};
  }

  [[nodiscard]] static constexpr std::size_t index(PageGeometry g, index_t t, index_t c) noexcept {
    return tile::element(g, kPlane, t, c);
  }

  void encode(PageGeometry g, const float* src, std::ptrdiff_t row_stride, params_type params,
              std::byte* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        dst[index(g, t, c)] = std::byte{Format(src[t * row_stride + c] / params.scale).bits};
      }
    }
  }

  void decode(PageGeometry g, const std::byte* plane, params_type params, float* dst) const noexcept {
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        const auto code = static_cast<std::uint8_t>(plane[index(g, t, c)]);
        dst[static_cast<std::size_t>(t) * g.head_dim + c] =
            static_cast<float>(Format::from_bits(code)) * params.scale;
      }
    }
  }

  friend bool operator==(const FP8Codec&, const FP8Codec&) = default;
};

/// FP8 keys and values (Format = E4M3FN or E5M2) with per-tensor or per-head scales.
template <class Format>
struct FP8 {
  using key_codec = FP8Codec<Format, Plane::kKey>;
  using value_codec = FP8Codec<Format, Plane::kValue>;
  key_codec key{};
  value_codec value{};

  FP8() = default;
  /// The same options for keys and values (static scales then apply to both planes).
  explicit FP8(const FP8Options& options) : key{options}, value{options} {}
  FP8(const FP8Options& key_options, const FP8Options& value_options)
      : key{key_options}, value{value_options} {}

  static std::string name() { return std::string(key_codec::kName); }
  friend bool operator==(const FP8&, const FP8&) = default;
};

}  // namespace kvpack::inline v0::quant
