#pragma once
/// \file page_file_loader.hpp
/// \brief load_page_file: a page file back into a KVCache as a new sequence, its pages' bytes
///        copied into the pool as they are in the file.
///
/// The cache adopts the pages through KVCache::append_encoded_pages, which keeps its invariants
/// (tables, accounting, Quest summaries) and checks, before anything changes, the structure of
/// every page (sizes, full live masks, positions growing and equal across streams) and, by the
/// caller's PageCheck, its contents: by default that each page decodes to finite values and
/// re-encodes to its own bytes (a canonical encoding, as this build's encoder writes it), or
/// only that it decodes to finite values, or nothing more (kStructure: the fastest restore, for
/// files a kvpack cache wrote, whose checksums the reader verified). A loaded sequence is
/// therefore always bit for bit what was written.
///
/// Codec parameters: a layer whose codec calibrates them (FP8's scales) and that has none yet
/// takes the file's, as its first prefill would have set them; any other layer must already
/// have the file's (kInvalidArgument otherwise). Table codecs (KVQuant, TurboQuant, QJL) must
/// hold the file's tables: their PARM records are compared with the cache's, byte for byte. A
/// load that fails after a layer took them leaves that layer calibrated (the parameters are the
/// cache's, shared by its sequences), as a prefill of the same tokens would have.
/// Not loaded (kUnsupported): caches with an exact prefix (its rows are fp32, not pages) or an
/// evictor. A cache with a full-precision tail takes the pages as they are, its tail left empty
/// for the tokens decoded next. Token ids in the file are not attached to the sequence.
///
/// append_page_file puts a chunk (PageFileOptions::first_page) after the pages a sequence holds,
/// in a fork of it, so that a chunk that fails leaves the sequence as it was.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/encoded_page.hpp"
#include "kvpack/error.hpp"
#include "kvpack/io/codec_registry.hpp"
#include "kvpack/io/page_file_decode.hpp"
#include "kvpack/io/page_file_reader.hpp"
#include "kvpack/layout/layout_concepts.hpp"

namespace kvpack::inline v0::io {

namespace loader_detail {

/// Everything about `cache` that must match the file before a byte is written.
template <class Cache>
void check_compatible(const Cache& cache, const PageFileHeader& h) {
  using Layout = typename Cache::layout_type;
  using Quantizer = typename Cache::quantizer_type;
  check_quantizer<Quantizer>(h);
  const ModelShape& shape = cache.shape();
  KVPACK_CHECK(h.shape == shape, kInvalidArgument,
               detail::message("load_page_file: the file's shape (layers ", h.shape.layers, ", q_heads ",
                               h.shape.q_heads, ", kv_heads ", h.shape.kv_heads, ", head_dim ", h.shape.head_dim,
                               ") is not the cache's (", shape.layers, ", ", shape.q_heads, ", ", shape.kv_heads, ", ",
                               shape.head_dim, ")"));
  // The writer records min(K, layers) since 2026-12-07 (a K of at least the layer count is one
  // cache for all, and a reader refuses a K above its limit); K itself before.
  index_t layers_per_cache = 1, recorded = 1;
  if constexpr (requires { Layout::kLayersPerCache; }) {
    layers_per_cache = Layout::kLayersPerCache;
    recorded = std::min<index_t>(layers_per_cache, shape.layers);
  }
  KVPACK_CHECK(h.layout == Layout::kName && (h.layers_per_cache == recorded || h.layers_per_cache == layers_per_cache),
               kInvalidArgument,
               detail::message("load_page_file: the file's layout is ", h.layout, " (", h.layers_per_cache,
                               " layers per cache), the cache's ", Layout::kName, " (", layers_per_cache, ")"));
  const index_t key_dim = cache.layout().key_dim(shape);
  const index_t value_dim = cache.layout().value_dim(shape);
  KVPACK_CHECK(h.key_dim == key_dim && h.value_dim == value_dim, kInvalidArgument,
               detail::message("load_page_file: the file's key and value rows are ", h.key_dim, " and ", h.value_dim,
                               " wide, the cache's ", key_dim, " and ", value_dim));
  const CacheConfig& config = cache.config();
  KVPACK_CHECK(h.page_size == config.page_size, kInvalidArgument,
               detail::message("load_page_file: the file's page_size is ", h.page_size, ", the cache's ",
                               config.page_size));
  KVPACK_CHECK(config.exact_prefix_tokens == 0, kUnsupported,
               "load_page_file: the cache keeps its first tokens as fp32 rows (exact_prefix_tokens), which pages "
               "cannot fill");
  KVPACK_CHECK(!Cache::evictor_type::kDropsTokens, kUnsupported,
               "load_page_file: an evicting cache could drop loaded tokens; load into one that keeps all");
  const bool before_rope = config.key_rope.has_value();
  KVPACK_CHECK(h.keys_before_rope == before_rope, kInvalidArgument,
               detail::message("load_page_file: the file stores keys ", h.keys_before_rope ? "before" : "after",
                               " RoPE, the cache ", before_rope ? "before" : "after"));
  if (before_rope) {
    const RopeSpec& rope = *config.key_rope;
    KVPACK_CHECK(h.rope_theta == rope.theta && h.rope_pairing == static_cast<std::uint32_t>(rope.pairing) &&
                     h.rope_max_position == rope.max_position,
                 kInvalidArgument,
                 detail::message("load_page_file: the file's RoPE (theta ", h.rope_theta, ", pairing ", h.rope_pairing,
                                 ", max_position ", h.rope_max_position, ") is not the cache's (", rope.theta, ", ",
                                 static_cast<std::uint32_t>(rope.pairing), ", ", rope.max_position, ")"));
  }
}

/// Appends cache layer `c` of the file to model layer `writer` of `seq`: the pages' bytes, copied
/// into the pool by the cache, which checks their structure and `check`.
template <class Cache>
void load_layer(Cache& cache, SeqId seq, const PageFileView& file, index_t c, index_t writer, PageCheck check) {
  using Quantizer = typename Cache::quantizer_type;
  const PageFileHeader& h = file.header();
  const std::uint32_t pages = file.page_count(c, 0);
  std::vector<typename Cache::CodecParams> params;
  for (index_t s = 0; s < h.streams; ++s) {
    KVPACK_CHECK(file.page_count(c, s) == pages, kInvalidArgument,
                 detail::message("load_page_file: cache layer ", c, " holds ", pages, " pages in stream 0 and ",
                                 file.page_count(c, s), " in stream ", s));
    params.push_back(read_codec_params<Quantizer>(file, c, s, cache.quantizer()));
  }
  cache.append_encoded_pages(
      seq, writer, pages,
      [&](index_t s, std::size_t p) {
        const auto page = static_cast<std::uint32_t>(p);
        return EncodedPage{file.payload(c, s, page), file.slots(c, s, page)};
      },
      check, std::span<const typename Cache::CodecParams>(params));
}

/// Loads `file` into `seq` (new, or a fork made for the load) and returns it; releases it if
/// anything fails.
template <class Cache>
SeqId load_into(Cache& cache, SeqId seq, const PageFileView& file, PageCheck check) {
  const PageFileHeader& h = file.header();
  try {
    for (index_t c = 0; c < h.cache_layers; ++c) {
      load_layer(cache, seq, file, c, layout::writer_of(cache.layout(), h.shape, c), check);
    }
  } catch (...) {
    cache.release(seq);
    throw;
  }
  return seq;
}

}  // namespace loader_detail

/// Loads the sequence of page file `file` into `cache` as a new sequence and returns its id.
/// The cache must be of the file's quantizer, layout, shape, page size and RoPE storage; after
/// the call every page of the new sequence equals the file's, byte for byte.
/// \param check what is verified of each page's contents (see PageCheck); kReencode trusts
///        nothing, kStructure only the checksums the reader verified
/// \throws kvpack::Error, leaving the cache as it was (no sequence added, memory unchanged)
///         except for codec parameters a layer took from the file (see the file comment):
///         kUnsupported for another quantizer, a cache with an exact prefix or an evictor;
///         kInvalidArgument for other codec parameters than a calibrated layer's, another shape,
///         layout, page size or RoPE, dead slots, positions that do not grow or differ between streams, a page that
///         decodes to NaN or Inf or (kReencode) is not its codec's canonical encoding;
///         kOutOfRange for positions beyond the cache's max_position; kvpack::OutOfPages when
///         the pool cannot hold the pages.
template <class Cache>
SeqId load_page_file(Cache& cache, const PageFileView& file, PageCheck check = PageCheck::kReencode) {
  loader_detail::check_compatible(cache, file.header());
  return loader_detail::load_into(cache, cache.add_sequence(), file, check);
}

/// A new sequence: `seq`'s tokens followed by the chunk in `file` (written with
/// PageFileOptions::first_page = the pages `seq` holds per stream), every page checked as
/// load_page_file checks it. `seq` itself is left as it was (the new sequence starts as its
/// fork: its pages are shared, not copied); release it if it is no longer needed.
/// \throws kvpack::Error as load_page_file, leaving the cache as it was; kInvalidArgument
///         (from the cache) when the chunk's positions do not come after `seq`'s.
template <class Cache>
SeqId append_page_file(Cache& cache, SeqId seq, const PageFileView& file, PageCheck check = PageCheck::kReencode) {
  loader_detail::check_compatible(cache, file.header());
  return loader_detail::load_into(cache, cache.fork(seq), file, check);
}

}  // namespace kvpack::inline v0::io
