#pragma once
/// \file quant_concepts.hpp
/// \brief The Codec and Quantizer concepts: how K and V become page bytes.
///
/// A *codec* owns the byte format of one plane (keys or values) of one page of one KV head:
/// `page_size` token slots of `head_dim` channels. Its scalar `encode`/`decode` are the reference
/// (the test oracle); the SIMD kernels in kernels/cpu/ read the same bytes. A *quantizer* is the
/// policy the cache is templated on: a pair of codecs, one per plane, because keys (scored against
/// queries, outlier channels) and values (averaged, flat) want different treatment.

#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::quant {

/// The shape of one plane of one page.
struct PageGeometry {
  index_t page_size = 0;  ///< token slots per page
  index_t head_dim = 0;   ///< channels per token
};

/// Parameters of a codec that has none.
struct NoParams {
  friend constexpr bool operator==(NoParams, NoParams) noexcept { return true; }
};

/// How widely one calibrated codec parameter (an FP8 scale) is shared.
enum class ScaleGranularity : std::uint8_t {
  kPerTensor,  ///< one per layer for K and one for V (vLLM's default)
  kPerHead,    ///< one per (layer, KV head)
};

/// One plane's byte format with its scalar reference encoder and decoder.
///
/// - `params_type`: per (layer, KV head) parameters kept by the cache (FP8 scale), trivially
///   copyable so kernels take them by value; `NoParams` when the page is self-describing.
/// - `validate(g)` throws kvpack::Error when the codec cannot store this geometry.
/// - `plane_bytes(g)`: exact bytes of the plane, metadata (scales) included.
/// - `nominal_bits_per_element(d)`: the documented rate, metadata included.
/// - `max_abs_input()`: the largest |x| the format can store without overflowing; larger inputs
///   are rejected before any state changes.
/// - `encode(g, src, row_stride, params, dst)`: `src` holds `page_size` rows of `head_dim` floats,
///   consecutive rows `row_stride` floats apart; writes `plane_bytes(g)` bytes.
/// - `decode(g, plane, params, dst)`: writes `[page_size][head_dim]` floats.
template <class C>
concept Codec =
    std::semiregular<C> &&
    requires(const C c, PageGeometry g, const float* src, std::ptrdiff_t row_stride,
             const typename C::params_type& params, std::byte* dst, const std::byte* plane,
             float* out) {
      requires std::is_trivially_copyable_v<typename C::params_type>;
      { C::kName } -> std::convertible_to<std::string_view>;
      { C::kPlane } -> std::convertible_to<Plane>;
      c.validate(g);
      { c.plane_bytes(g) } noexcept -> std::same_as<std::size_t>;
      { c.nominal_bits_per_element(g.head_dim) } noexcept -> std::same_as<double>;
      { c.max_abs_input() } noexcept -> std::same_as<float>;
      { c.initial_params(index_t{}, index_t{}) } -> std::same_as<typename C::params_type>;
      c.encode(g, src, row_stride, params, dst);
      c.decode(g, plane, params, out);
    };

/// A codec whose parameters are calibrated from data: from the absolute maximum of the first
/// prefill of a layer (or of the first page encoded when tokens arrive by append only).
template <class C>
concept CalibratedCodec = Codec<C> && requires(const C c, float absmax) {
  { c.granularity() } -> std::same_as<ScaleGranularity>;
  { c.calibrates() } -> std::same_as<bool>;
  { c.params_from_absmax(absmax) } -> std::same_as<typename C::params_type>;
};

/// The cache's quantization policy: a key codec and a value codec, held as `key` and `value`.
template <class Q>
concept Quantizer = std::semiregular<Q> && requires(const Q q) {
  typename Q::key_codec;
  typename Q::value_codec;
  requires Codec<typename Q::key_codec>;
  requires Codec<typename Q::value_codec>;
  { q.key } -> std::convertible_to<const typename Q::key_codec&>;
  { q.value } -> std::convertible_to<const typename Q::value_codec&>;
  { Q::name() } -> std::convertible_to<std::string>;
};

}  // namespace kvpack::inline v0::quant
