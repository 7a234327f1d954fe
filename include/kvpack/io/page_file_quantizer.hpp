#pragma once
/// \file page_file_quantizer.hpp
/// \brief quantizer_from_file: the quantizer a page file was written with, rebuilt from its PARM
///        records, so that a file decodes and loads with nothing but its own bytes.
///
/// Codecs without tables come back default-constructed (their parameters are read per stream).
/// TurboQuant and QJL come back with the file's rate, rotation and base seed, from which their
/// rotations and sketches are regenerated. KVQuant comes back with tables holding the file's key
/// ranges, codebooks and outlier fraction; model layers that write no cache layer (CrossLayer)
/// get a copy of their group writer's tables, which no page of theirs ever reads.

#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>

#include "kvpack/error.hpp"
#include "kvpack/io/page_file_decode.hpp"
#include "kvpack/io/page_file_reader.hpp"
#include "kvpack/quant/kvquant.hpp"

namespace kvpack::inline v0::io {

namespace quantizer_detail {

template <class Codec>
inline constexpr bool kKVQuant = std::is_same_v<typename Codec::params_type, quant::KVQuantKeyParams> ||
                                 std::is_same_v<typename Codec::params_type, quant::KVQuantValueParams>;

/// The layer's codebook as every stream of it records it (the tables keep one per layer).
inline quant::nuq::Codebook layer_codebook(const PageFileView& file, bool keys, index_t c, std::size_t at) {
  const auto record = [&](index_t s) { return keys ? file.key_params(c, s) : file.value_params(c, s); };
  const quant::nuq::Codebook book = params_detail::read_codebook(record(0), at);
  for (index_t s = 1; s < file.header().streams; ++s) {
    KVPACK_CHECK(params_detail::read_codebook(record(s), at) == book, kInvalidArgument,
                 detail::message("page file: cache layer ", c, " records different ", keys ? "key" : "value",
                                 " codebooks in streams 0 and ", s, "; KVQuant keeps one per layer"));
  }
  return book;
}

/// Fills one plane's part of `tables` from the file (the records were checked by the reader).
template <class Codec>
void fill_kvquant_tables(const PageFileView& file, quant::KVQuantTables& tables) {
  using Format = ParamsFormat<Codec>;
  constexpr bool kKeys = Format::kKeys;
  const PageFileHeader& h = file.header();
  const auto layers = static_cast<std::size_t>(h.shape.layers);
  const auto streams = static_cast<std::size_t>(h.streams);
  const auto d = static_cast<std::size_t>(h.key_dim);
  auto& codebooks = kKeys ? tables.key_codebook : tables.value_codebook;
  auto& rounding = kKeys ? tables.key_encode_codebook : tables.value_encode_codebook;
  const auto record0 = kKeys ? file.key_params(0, 0) : file.value_params(0, 0);
  const bool q_norm = params_detail::load<std::uint32_t>(record0, 8) == 1;
  codebooks.resize(layers);
  if (q_norm) rounding.resize(layers);
  if (kKeys) {
    tables.key_offset.resize(layers * streams * d);
    tables.key_half_range.resize(layers * streams * d);
  }
  for (std::size_t layer = 0; layer < layers; ++layer) {
    // The cache layer whose pages this model layer's parameters decode.
    const auto c = static_cast<index_t>(layer / static_cast<std::size_t>(h.layers_per_cache));
    for (index_t s = 0; s < h.streams; ++s) {
      const auto record = kKeys ? file.key_params(c, s) : file.value_params(c, s);
      KVPACK_CHECK((params_detail::load<std::uint32_t>(record, 8) == 1) == q_norm, kInvalidArgument,
                   detail::message("page file: cache layer ", c, " stream ", s, " ",
                                   q_norm ? "lacks" : "has", " Q-Norm rounding levels; the first record ",
                                   q_norm ? "has" : "lacks", " them, and KVQuant's tables have them for every layer "
                                   "or none"));
      if constexpr (kKeys) {
        const std::size_t at = (layer * streams + static_cast<std::size_t>(s)) * d;
        std::memcpy(tables.key_offset.data() + at, record.data() + Format::kRanges, d * sizeof(float));
        std::memcpy(tables.key_half_range.data() + at, record.data() + Format::kRanges + 4 * d, d * sizeof(float));
      }
    }
    codebooks[layer] = layer_codebook(file, kKeys, c, Format::kCodebooks);
    if (q_norm) rounding[layer] = layer_codebook(file, kKeys, c, Format::kCodebooks + params_detail::kCodebookBytes);
  }
}

/// The plane codec the file's records describe; KVQuant's takes `tables` (filled by the caller).
template <class Codec>
Codec codec_from_file(const PageFileView& file, std::span<const std::byte> record,
                      const std::shared_ptr<const quant::KVQuantTables>& tables) {
  if constexpr (kKVQuant<Codec>) {
    Codec codec = ParamsFormat<Codec>::codec_of(record);
    codec.tables = tables;
    return codec;
  } else if constexpr (ParamsFormat<Codec>::kReadable) {
    (void)file;
    return Codec{};
  } else {
    return ParamsFormat<Codec>::codec_of(record);
  }
}

}  // namespace quantizer_detail

/// The quantizer `file` was written with: decode_page, read_codec_params and a cache built with
/// it take the file's pages as they are. A cache built with it (same shape, layout, page size
/// and RoPE storage) loads the file with load_page_file.
/// \throws kvpack::Error kUnsupported when the file holds another quantizer; kInvalidArgument
///         when KVQuant records disagree within a layer (codebooks) or on Q-Norm
template <quant::Quantizer Quantizer>
[[nodiscard]] Quantizer quantizer_from_file(const PageFileView& file) {
  using namespace quantizer_detail;
  using K = typename Quantizer::key_codec;
  using V = typename Quantizer::value_codec;
  const PageFileHeader& h = file.header();
  check_quantizer<Quantizer>(h);
  std::shared_ptr<const quant::KVQuantTables> tables;
  if constexpr (kKVQuant<K> || kKVQuant<V>) {
    // One table for both planes, as KVQuant's constructor shares one between them.
    if constexpr (kKVQuant<K> && kKVQuant<V>) {
      static_assert(K::kBits == V::kBits, "one KVQuant table holds one bit width");
    }
    KVPACK_CHECK(!(kKVQuant<K> && kKVQuant<V>) || h.key_dim == h.value_dim, kUnsupported,
                 "quantizer_from_file: KVQuant tables hold one head_dim for keys and values");
    auto built = std::make_shared<quant::KVQuantTables>();
    built->layers = h.shape.layers;
    built->kv_heads = h.streams;
    built->head_dim = kKVQuant<K> ? h.key_dim : h.value_dim;
    if constexpr (kKVQuant<K>) {
      built->bits = K::kBits;
      fill_kvquant_tables<K>(file, *built);
    }
    if constexpr (kKVQuant<V>) {
      built->bits = V::kBits;
      fill_kvquant_tables<V>(file, *built);
    }
    tables = std::move(built);
  }
  Quantizer quantizer{};
  quantizer.key = codec_from_file<K>(file, file.key_params(0, 0), tables);
  quantizer.value = codec_from_file<V>(file, file.value_params(0, 0), tables);
  return quantizer;
}

}  // namespace kvpack::inline v0::io
