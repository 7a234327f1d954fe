#pragma once
/// \file page_file_decode.hpp
/// \brief Typed access to a verified page file: check that it holds a given Quantizer's pages,
///        get its codec parameters back, and decode a page with the codec's scalar reference.

#include <cstdint>
#include <string>

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

/// The codec parameters of (cache layer, stream), as KVCache::codec_params returns them.
template <quant::Quantizer Quantizer>
[[nodiscard]] auto read_codec_params(const PageFileView& file, index_t layer, index_t stream) {
  check_quantizer<Quantizer>(file.header());
  using KeyParams = typename Quantizer::key_codec::params_type;
  using ValueParams = typename Quantizer::value_codec::params_type;
  return std::pair<KeyParams, ValueParams>{ParamsFormat<KeyParams>::read(file.key_params(layer, stream).data()),
                                           ParamsFormat<ValueParams>::read(file.value_params(layer, stream).data())};
}

/// Decodes one page with the codecs' scalar reference: keys and values [page_size][head_dim].
template <quant::Quantizer Quantizer>
void decode_page(const PageFileView& file, index_t layer, index_t stream, std::uint32_t page, float* keys,
                 float* values, const Quantizer& quantizer = {}) {
  const auto [key_params, value_params] = read_codec_params<Quantizer>(file, layer, stream);
  const PageFileHeader& h = file.header();
  quantizer.key.decode({h.page_size, h.key_dim}, file.key_plane(layer, stream, page).data(), key_params, keys);
  quantizer.value.decode({h.page_size, h.value_dim}, file.value_plane(layer, stream, page).data(), value_params,
                         values);
}

}  // namespace kvpack::inline v0::io
