#pragma once
/// \file page_file_decode.hpp
/// \brief Typed access to a verified page file: check that it holds a given Quantizer's pages,
///        get its codec parameters back, and decode a page with the codec's scalar reference.
///
/// Codecs whose parameters are values (none, FP8's scale) decode with the file's own. Codecs
/// whose parameters point into tables (KVQuant, TurboQuant, QJL) decode with a quantizer that
/// holds those tables: the cache's, or quantizer_from_file's (page_file_quantizer.hpp); its
/// parameters are used only after their PARM records are checked to be the file's, byte for byte.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/codec_registry.hpp"
#include "kvpack/io/page_file_reader.hpp"
#include "kvpack/quant/quant_concepts.hpp"

namespace kvpack::inline v0::io {

/// Throws kUnsupported unless the file's pages are Quantizer's (names, groups, plane sizes).
template <quant::Quantizer Quantizer>
void check_quantizer(const PageFileHeader& h) {
  using K = typename Quantizer::key_codec;
  using V = typename Quantizer::value_codec;
  const bool same = h.quantizer == Quantizer::name() && h.key_codec == K::kName && h.value_codec == V::kName &&
                    h.key_group == codec_group<K>() && h.value_group == codec_group<V>();
  KVPACK_CHECK(same, kUnsupported,
               detail::message("page file holds quantizer ", h.quantizer, " (", h.key_codec, "/", h.value_codec,
                               "), not ", Quantizer::name()));
}

namespace decode_detail {

/// One plane's parameters for (cache layer, stream): read from `record`, or `codec`'s own for
/// the model layer that writes the cache layer, checked against `record`.
template <class Codec>
typename Codec::params_type plane_params(const Codec& codec, const PageFileHeader& h, index_t layer, index_t stream,
                                         std::span<const std::byte> record, index_t dim) {
  using Format = ParamsFormat<Codec>;
  if constexpr (Format::kReadable) {
    return Format::read(record);
  } else {
    const quant::PageGeometry g{h.page_size, dim};
    const typename Codec::params_type params = codec.initial_params(layer * h.layers_per_cache, stream);
    std::vector<std::byte> expected(Format::bytes(g));
    Format::write(codec, params, g, expected.data());
    KVPACK_CHECK(std::ranges::equal(expected, record), kInvalidArgument,
                 detail::message("page file: cache layer ", layer, " stream ", stream, " was written with other ",
                                 Codec::kName, " parameters (", Codec::kPlane == Plane::kKey ? "calibration, " : "",
                                 "options or seeds) than the quantizer given; pass the cache's or "
                                 "io::quantizer_from_file's"));
    return params;
  }
}

}  // namespace decode_detail

/// The codec parameters of (cache layer, stream), as KVCache::codec_params returns them.
/// \param quantizer for table codecs (KVQuant, TurboQuant, QJL): the quantizer whose tables the
///        parameters point into; ignored by the others
/// \throws kvpack::Error kUnsupported for another quantizer; kInvalidArgument when `quantizer`'s
///         tables are not the file's; kInvalidConfig (the codec's) when KVQuant has no tables
template <quant::Quantizer Quantizer>
[[nodiscard]] auto read_codec_params(const PageFileView& file, index_t layer, index_t stream,
                                     const Quantizer& quantizer = {}) {
  const PageFileHeader& h = file.header();
  check_quantizer<Quantizer>(h);
  using KeyParams = typename Quantizer::key_codec::params_type;
  using ValueParams = typename Quantizer::value_codec::params_type;
  return std::pair<KeyParams, ValueParams>{
      decode_detail::plane_params(quantizer.key, h, layer, stream, file.key_params(layer, stream), h.key_dim),
      decode_detail::plane_params(quantizer.value, h, layer, stream, file.value_params(layer, stream), h.value_dim)};
}

/// Decodes one page with the codecs' scalar reference: keys and values [page_size][head_dim].
/// `quantizer` as for read_codec_params.
template <quant::Quantizer Quantizer>
void decode_page(const PageFileView& file, index_t layer, index_t stream, std::uint32_t page, float* keys,
                 float* values, const Quantizer& quantizer = {}) {
  // Not a structured binding: clang 14 rejects naming one inside the requires-expressions below.
  const auto params = read_codec_params<Quantizer>(file, layer, stream, quantizer);
  const auto& key_params = params.first;
  const auto& value_params = params.second;
  const PageFileHeader& h = file.header();
  const quant::PageGeometry key_geometry{h.page_size, h.key_dim}, value_geometry{h.page_size, h.value_dim};
  // Seeded tables (TurboQuant, QJL) are built on first use.
  if constexpr (requires { quantizer.key.prepare(key_geometry, key_params); }) {
    quantizer.key.prepare(key_geometry, key_params);
  }
  if constexpr (requires { quantizer.value.prepare(value_geometry, value_params); }) {
    quantizer.value.prepare(value_geometry, value_params);
  }
  quantizer.key.decode(key_geometry, file.key_plane(layer, stream, page).data(), key_params, keys);
  quantizer.value.decode(value_geometry, file.value_plane(layer, stream, page).data(), value_params, values);
}

}  // namespace kvpack::inline v0::io
