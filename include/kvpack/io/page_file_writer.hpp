#pragma once
/// \file page_file_writer.hpp
/// \brief write_page_file: one sequence of a KVCache to page file bytes (or a file), through the
///        cache's public read API only (pages, pool, codec_params, shape, config).
///
/// Version 1 carries whole pages: a sequence with tokens outside pages (the full-precision tail
/// or exact prefix, or pages an evictor freed) is rejected with kUnsupported rather than written
/// short. Quest's page summaries are not written (a reader can recompute them from the pages).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/byte_cursor.hpp"
#include "kvpack/io/codec_registry.hpp"
#include "kvpack/io/page_file_container.hpp"
#include "kvpack/io/page_file_header_io.hpp"
#include "kvpack/layout/layout_concepts.hpp"

namespace kvpack::inline v0::io {

/// What the cache does not know about a sequence.
struct PageFileOptions {
  std::string model_id;                  ///< free text, at most 256 bytes
  /// Token ids, optional: the sequence's; for a chunk, whatever the caller needs to recognise it
  /// (tier::store_chunks stores every token up to the chunk's end).
  std::span<const std::int32_t> tokens;
  /// A chunk of the sequence: pages [first_page, first_page + page_count) of every stream
  /// (page_count 0: to the end). io::append_page_file puts such a chunk after the pages before it.
  std::size_t first_page = 0;
  std::size_t page_count = 0;
};

namespace writer_detail {

template <class Cache>
PageFileHeader header_of(const Cache& cache, SeqId seq, const PageFileOptions& options) {
  using Layout = typename Cache::layout_type;
  using Quantizer = typename Cache::quantizer_type;
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  const Layout& layout = cache.layout();
  const ModelShape& shape = cache.shape();
  PageFileHeader h;
  h.model_id = options.model_id;
  h.layout = std::string(Layout::kName);
  if constexpr (requires { Layout::kLayersPerCache; }) h.layers_per_cache = Layout::kLayersPerCache;
  h.shape = shape;
  h.cache_layers = layout::cache_layers(layout, shape);
  h.streams = layout.streams(shape);
  h.key_dim = layout.key_dim(shape);
  h.value_dim = layout.value_dim(shape);
  h.page_size = cache.config().page_size;
  if (const auto& rope = cache.config().key_rope) {
    h.keys_before_rope = true;
    h.rope_pairing = static_cast<std::uint32_t>(rope->pairing);
    h.rope_theta = rope->theta;
    h.rope_max_position = rope->max_position;
  }
  h.quantizer = Quantizer::name();
  h.key_codec = std::string(KeyCodec::kName);
  h.value_codec = std::string(ValueCodec::kName);
  h.key_group = codec_group<KeyCodec>();
  h.value_group = codec_group<ValueCodec>();
  // A codec whose parameters serialise but that the registry lacks would make files this build
  // cannot read back: refuse to write them.
  KVPACK_CHECK(find_codec(h.key_codec, Plane::kKey, h.key_group) != nullptr &&
                   find_codec(h.value_codec, Plane::kValue, h.value_group) != nullptr,
               kUnsupported,
               detail::message("write_page_file: codecs ", h.key_codec, "/", h.value_codec,
                               " are not in io/codec_registry.hpp"));
  const quant::PageGeometry geometry{h.page_size, h.key_dim};
  h.key_plane_bytes = KeyCodec{}.plane_bytes(geometry);
  h.value_plane_offset = cache.value_plane_offset();
  h.value_plane_bytes = ValueCodec{}.plane_bytes({h.page_size, h.value_dim});
  h.payload_bytes = cache.page_format_info().payload_bytes;
  h.slot_bytes = static_cast<std::uint64_t>(h.page_size) * 4 + h.live_mask_words() * 8;
  KVPACK_CHECK(cache.page_format_info().metadata_bytes >= h.slot_bytes, kInvalidArgument,
               "write_page_file: the pool's metadata is smaller than positions and live mask");
  std::size_t chunk_pages = 0;  // pages per stream written: the same in every stream
  for (index_t c = 0; c < h.cache_layers; ++c) {
    const index_t writer = layout::writer_of(layout, shape, c);
    const std::int64_t tokens = cache.length(seq, writer);
    for (index_t s = 0; s < h.streams; ++s) {
      const std::size_t pages = cache.pages(seq, writer, s).size();
      KVPACK_CHECK(static_cast<std::int64_t>(pages) * h.page_size == tokens, kUnsupported,
                   detail::message("write_page_file: layer ", writer, " stream ", s, " of sequence ", seq, " holds ",
                                   tokens, " tokens, ", pages * static_cast<std::size_t>(h.page_size),
                                   " of them in pages; page files carry whole pages only (no tail, exact prefix "
                                   "or evicted pages: use tail_tokens = 0, exact_prefix_tokens = 0, a length "
                                   "that is a multiple of page_size and no evictor)"));
      KVPACK_CHECK(options.first_page <= pages && options.page_count <= pages - options.first_page, kInvalidArgument,
                   detail::message("write_page_file: pages [", options.first_page, ", ",
                                   options.first_page + options.page_count, ") asked of layer ", writer, " stream ", s,
                                   ", which holds ", pages));
      chunk_pages = options.page_count > 0 ? options.page_count : pages - options.first_page;
      h.page_counts.push_back(static_cast<std::uint32_t>(chunk_pages));
    }
  }
  h.sequence_tokens = static_cast<std::uint64_t>(chunk_pages) * static_cast<std::uint64_t>(h.page_size);
  return h;
}

}  // namespace writer_detail

/// The page file of sequence `seq`, as bytes.
/// \throws kvpack::Error kUnsupported for a quantizer whose parameters page files cannot hold
///         (KVQuant, TurboQuant, QJL) or a sequence with tokens outside pages; kInvalidArgument
///         for an unknown sequence or options that do not fit (model_id over 256 bytes).
template <class Cache>
[[nodiscard]] std::vector<std::byte> write_page_file(const Cache& cache, SeqId seq, const PageFileOptions& options = {}) {
  using Quantizer = typename Cache::quantizer_type;
  using KeyFormat = ParamsFormat<typename Quantizer::key_codec::params_type>;
  using ValueFormat = ParamsFormat<typename Quantizer::value_codec::params_type>;
  if constexpr (!KeyFormat::kSupported || !ValueFormat::kSupported) {
    detail::throw_error(ErrorCode::kUnsupported,
                        detail::message("write_page_file: quantizer ", Quantizer::name(),
                                        " keeps parameters that point into tables (KVQuant's calibration, "
                                        "TurboQuant's rotations); page files do not carry them yet"));
  } else {
    KVPACK_CHECK(options.model_id.size() <= PageFileLimits::kMaxString, kInvalidArgument,
                 detail::message("write_page_file: model_id is ", options.model_id.size(), " bytes, at most ",
                                 PageFileLimits::kMaxString));
    KVPACK_CHECK(options.tokens.size() <= PageFileLimits::kMaxTokens, kInvalidArgument,
                 "write_page_file: too many token ids");
    const PageFileHeader h = writer_detail::header_of(cache, seq, options);
    const auto writer_of = [&](index_t c) { return layout::writer_of(cache.layout(), h.shape, c); };

    ContainerWriter file;
    const std::uint64_t pages = h.total_pages();
    file.reserve(kPreambleBytes + kSectionOrder.size() * (kSectionHeaderBytes + kPageFileAlignment) + 1024 +
                 h.page_counts.size() * (4 + 2 * sizeof(float)) + options.tokens.size_bytes() +
                 pages * (h.slot_bytes + h.payload_bytes));
    file.begin_section(SectionTag::kMeta);
    {
      ByteSink out(file.body());
      write_meta(out, h);
    }
    file.end_section();

    file.begin_section(SectionTag::kParams);
    {
      ByteSink out(file.body());
      out.put(static_cast<std::uint32_t>(KeyFormat::kKind));
      out.put(static_cast<std::uint32_t>(KeyFormat::kBytes));
      out.put(static_cast<std::uint32_t>(ValueFormat::kKind));
      out.put(static_cast<std::uint32_t>(ValueFormat::kBytes));
      for (index_t c = 0; c < h.cache_layers; ++c) {
        for (index_t s = 0; s < h.streams; ++s) {
          const auto [key, value] = cache.codec_params(writer_of(c), s);
          std::byte bytes[KeyFormat::kBytes + ValueFormat::kBytes + 1];
          KeyFormat::write(key, bytes);
          ValueFormat::write(value, bytes + KeyFormat::kBytes);
          out.put_bytes(std::span<const std::byte>(bytes, KeyFormat::kBytes + ValueFormat::kBytes));
        }
      }
    }
    file.end_section();

    file.begin_section(SectionTag::kTokens);
    {
      ByteSink out(file.body());
      out.put(static_cast<std::uint64_t>(options.tokens.size()));
      out.put_bytes(std::as_bytes(options.tokens));
    }
    file.end_section();

    // SLOT and PAGE in the same (layer, stream, page) order as META's page counts.
    const auto for_each_page = [&](auto&& visit) {
      for (index_t c = 0; c < h.cache_layers; ++c) {
        for (index_t s = 0; s < h.streams; ++s) {
          const std::size_t count = h.page_counts[static_cast<std::size_t>(c) * h.streams + s];
          for (const PageId id : cache.pages(seq, writer_of(c), s).subspan(options.first_page, count)) visit(id);
        }
      }
    };
    file.begin_section(SectionTag::kSlots);
    for_each_page([&](PageId id) {
      // The pool's metadata starts with exactly this record (slot positions, then the live mask).
      ByteSink(file.body()).put_bytes(std::span(cache.pool().metadata(id), h.slot_bytes));
    });
    file.end_section();
    file.begin_section(SectionTag::kPages);
    // The planes only: the gaps around them are padding the codecs never write, which holds
    // whatever a recycled slab held before (zeros in the file, so equal pages give equal files).
    for_each_page([&](PageId id) {
      const std::byte* payload = cache.pool().payload(id);
      std::vector<std::byte>& body = file.body();
      const std::size_t start = body.size();
      body.resize(start + h.payload_bytes);  // zero-filled
      std::memcpy(body.data() + start, payload, h.key_plane_bytes);
      std::memcpy(body.data() + start + h.value_plane_offset, payload + h.value_plane_offset, h.value_plane_bytes);
    });
    file.end_section();
    return std::move(file).finish();
  }
}

/// Writes the page file of `seq` to `path` (replacing it).
template <class Cache>
void write_page_file(const std::string& path, const Cache& cache, SeqId seq, const PageFileOptions& options = {}) {
  const std::vector<std::byte> bytes = write_page_file(cache, seq, options);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  KVPACK_CHECK(f != nullptr, kInvalidArgument, detail::message("page file '", path, "' cannot be created"));
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const bool closed = std::fclose(f) == 0;
  KVPACK_CHECK(written && closed, kInvalidArgument, detail::message("page file '", path, "': write failed"));
}

}  // namespace kvpack::inline v0::io
