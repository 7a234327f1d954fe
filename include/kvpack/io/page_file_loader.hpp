#pragma once
/// \file page_file_loader.hpp
/// \brief load_page_file: a page file back into a KVCache as a new sequence, through the cache's
///        public API, with every page checked to be byte-identical to the file's.
///
/// The loader decodes each page with the codec's scalar reference and writes the tokens with
/// `prefill` (`append` where positions skip), so the cache encodes them with its own encoder
/// and keeps every one of its invariants (tables, accounting, Quest summaries). A codec's
/// decode-then-encode is not the identity in general, so the loader then compares every page,
/// slot record and codec parameter with the file's: a mismatch releases the new sequence and
/// throws, and a loaded sequence is therefore always bit for bit what was written. Tested on
/// every codec it loads (test_page_file_round_trip.cpp): all reload exactly.
///
/// Not loaded (kUnsupported): FP8, whose calibrated scales the cache fixes from the first page
/// it encodes (a load would calibrate them from decoded values and could not take them back on
/// a mismatch); caches whose pages the file cannot fill exactly (a full-precision tail or exact
/// prefix, an evictor, prefix sharing). Token ids in the file are not attached to the sequence.
///
/// append_page_file puts a chunk (PageFileOptions::first_page) after the pages a sequence holds,
/// in a fork of it, so that a chunk that fails leaves the sequence as it was.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvpack/cache_config.hpp"
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
  using KeyFormat = ParamsFormat<typename Quantizer::key_codec::params_type>;
  using ValueFormat = ParamsFormat<typename Quantizer::value_codec::params_type>;
  check_quantizer<Quantizer>(h);
  KVPACK_CHECK(KeyFormat::kKind == ParamsKind::kNone && ValueFormat::kKind == ParamsKind::kNone, kUnsupported,
               detail::message("load_page_file: quantizer ", Quantizer::name(),
                               " calibrates its scales from the first page a cache encodes; loading its page "
                               "files is not supported yet"));
  const ModelShape& shape = cache.shape();
  KVPACK_CHECK(h.shape == shape, kInvalidArgument,
               detail::message("load_page_file: the file's shape (layers ", h.shape.layers, ", q_heads ",
                               h.shape.q_heads, ", kv_heads ", h.shape.kv_heads, ", head_dim ", h.shape.head_dim,
                               ") is not the cache's (", shape.layers, ", ", shape.q_heads, ", ", shape.kv_heads, ", ",
                               shape.head_dim, ")"));
  index_t layers_per_cache = 1;
  if constexpr (requires { Layout::kLayersPerCache; }) layers_per_cache = Layout::kLayersPerCache;
  KVPACK_CHECK(h.layout == Layout::kName && h.layers_per_cache == layers_per_cache, kInvalidArgument,
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
  KVPACK_CHECK(config.tail_tokens == 0 && config.exact_prefix_tokens == 0 && !config.prefix_sharing, kUnsupported,
               "load_page_file: the cache must hold every token in pages (tail_tokens = 0, exact_prefix_tokens "
               "= 0) and not share prefixes, so that its pages are the file's");
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

/// Decodes cache layer `c` of the file into token-major rows [tokens][streams][dim] and writes
/// them to model layer `writer` of `seq`: one prefill when positions continue the sequence's
/// (0, 1, 2, ... for a new one), otherwise one append per token at its recorded position.
template <class Cache>
void load_layer(Cache& cache, SeqId seq, const PageFileView& file, index_t c, index_t writer) {
  using Quantizer = typename Cache::quantizer_type;
  const PageFileHeader& h = file.header();
  const index_t streams = h.streams, page = h.page_size;
  const std::uint32_t pages = file.page_count(c, 0);
  for (index_t s = 1; s < streams; ++s) {
    KVPACK_CHECK(file.page_count(c, s) == pages, kInvalidArgument,
                 detail::message("load_page_file: cache layer ", c, " holds ", pages, " pages in stream 0 and ",
                                 file.page_count(c, s), " in stream ", s));
  }
  const std::size_t tokens = static_cast<std::size_t>(pages) * page;
  const std::size_t key_row = static_cast<std::size_t>(streams) * h.key_dim;
  const std::size_t value_row = static_cast<std::size_t>(streams) * h.value_dim;
  std::vector<float> keys(tokens * key_row), values(tokens * value_row);
  std::vector<std::int32_t> positions(tokens);
  std::vector<float> page_keys(static_cast<std::size_t>(page) * h.key_dim);
  std::vector<float> page_values(static_cast<std::size_t>(page) * h.value_dim);
  for (index_t s = 0; s < streams; ++s) {
    for (std::uint32_t p = 0; p < pages; ++p) {
      decode_page<Quantizer>(file, c, s, p, page_keys.data(), page_values.data());
      // The checksums passed, so these bytes were written this way: say where, rather than let
      // the cache's input check name a row of its own.
      const auto finite = [](const std::vector<float>& xs) {
        return std::all_of(xs.begin(), xs.end(), [](float x) { return std::isfinite(x); });
      };
      KVPACK_CHECK(finite(page_keys) && finite(page_values), kInvalidArgument,
                   detail::message("load_page_file: cache layer ", c, " stream ", s, " page ", p,
                                   " decodes to NaN or Inf"));
      for (index_t t = 0; t < page; ++t) {
        const std::size_t token = static_cast<std::size_t>(p) * page + t;
        KVPACK_CHECK(file.live(c, s, p, t), kUnsupported,
                     detail::message("load_page_file: cache layer ", c, " stream ", s, " page ", p, " slot ", t,
                                     " is dead (an evicted token); loading evicted sequences is not supported"));
        const std::int32_t position = file.position(c, s, p, t);
        KVPACK_CHECK(s == 0 || positions[token] == position, kInvalidArgument,
                     detail::message("load_page_file: cache layer ", c, " token ", token, " is at position ",
                                     positions[token], " in stream 0 but ", position, " in stream ", s));
        positions[token] = position;
        std::memcpy(keys.data() + token * key_row + static_cast<std::size_t>(s) * h.key_dim,
                    page_keys.data() + static_cast<std::size_t>(t) * h.key_dim, h.key_dim * sizeof(float));
        std::memcpy(values.data() + token * value_row + static_cast<std::size_t>(s) * h.value_dim,
                    page_values.data() + static_cast<std::size_t>(t) * h.value_dim, h.value_dim * sizeof(float));
      }
    }
  }
  const std::int64_t first = cache.last_position(seq, writer) + 1;
  bool consecutive = true;
  for (std::size_t i = 0; i < tokens && consecutive; ++i) {
    consecutive = positions[i] == first + static_cast<std::int64_t>(i);
  }
  if (tokens == 0) return;
  if (consecutive) {
    cache.prefill(seq, writer, std::span<const float>(keys), std::span<const float>(values));
    return;
  }
  for (std::size_t i = 0; i < tokens; ++i) {
    cache.append(seq, writer, std::span<const float>(keys).subspan(i * key_row, key_row),
                 std::span<const float>(values).subspan(i * value_row, value_row), positions[i]);
  }
}

/// Whether cache layer `c` of `seq`, past its first `pages_before` pages, holds exactly the
/// file's pages, slot records and parameters.
template <class Cache>
void check_identical(const Cache& cache, SeqId seq, const PageFileView& file, index_t c, index_t writer,
                     std::size_t pages_before) {
  using Quantizer = typename Cache::quantizer_type;
  const PageFileHeader& h = file.header();
  for (index_t s = 0; s < h.streams; ++s) {
    const std::span<const PageId> all = cache.pages(seq, writer, s);
    KVPACK_CHECK(all.size() == pages_before + file.page_count(c, s), kUnsupported,
                 detail::message("load_page_file: layer ", writer, " stream ", s, " holds ", all.size(),
                                 " pages after loading, ", pages_before, " before and ", file.page_count(c, s),
                                 " in the file"));
    const std::span<const PageId> ids = all.subspan(pages_before);
    KVPACK_CHECK(read_codec_params<Quantizer>(file, c, s) == cache.codec_params(writer, s), kUnsupported,
                 detail::message("load_page_file: layer ", writer, " stream ", s,
                                 " has other codec parameters than the file's"));
    for (std::uint32_t p = 0; p < ids.size(); ++p) {
      // The planes, not the padding between and after them (the writer zeroes it in the file;
      // the pool leaves whatever a recycled slab held).
      const std::byte* stored = file.payload(c, s, p).data();
      const std::byte* held = cache.pool().payload(ids[p]);
      const bool same_payload =
          std::memcmp(stored, held, h.key_plane_bytes) == 0 &&
          std::memcmp(stored + h.value_plane_offset, held + h.value_plane_offset, h.value_plane_bytes) == 0;
      const bool same_slots = std::memcmp(file.slots(c, s, p).data(), cache.pool().metadata(ids[p]),
                                          h.slot_bytes) == 0;
      KVPACK_CHECK(same_payload && same_slots, kUnsupported,
                   detail::message("load_page_file: re-encoding layer ", writer, " stream ", s, " page ", p,
                                   " with ", Quantizer::name(), " did not give the file's ",
                                   same_payload ? "slot record" : "bytes",
                                   " (this codec's encoder is not exact on its own decoded output here)"));
    }
  }
}

/// Loads `file` into `seq` (new, or a fork made for the load) and returns it; releases it if
/// anything fails.
template <class Cache>
SeqId load_into(Cache& cache, SeqId seq, const PageFileView& file) {
  const PageFileHeader& h = file.header();
  try {
    for (index_t c = 0; c < h.cache_layers; ++c) {
      const index_t writer = layout::writer_of(cache.layout(), h.shape, c);
      const std::size_t pages_before = cache.pages(seq, writer, 0).size();
      load_layer(cache, seq, file, c, writer);
      check_identical(cache, seq, file, c, writer, pages_before);
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
/// \throws kvpack::Error, leaving the cache as it was (no sequence added, memory unchanged):
///         kUnsupported for another quantizer, FP8, a cache with a tail, exact prefix, prefix
///         sharing or an evictor, dead slots in the file, or a page that did not re-encode to
///         the file's bytes; kInvalidArgument for another shape, layout, page size or RoPE, a
///         page that decodes to NaN or Inf, or positions that differ between streams; the
///         cache's own errors for what it refuses to store (positions that go backwards:
///         kInvalidArgument; values beyond the codec's range: kOutOfRange);
///         kvpack::OutOfPages when the pool cannot hold the pages.
template <class Cache>
SeqId load_page_file(Cache& cache, const PageFileView& file) {
  loader_detail::check_compatible(cache, file.header());
  return loader_detail::load_into(cache, cache.add_sequence(), file);
}

/// A new sequence: `seq`'s tokens followed by the chunk in `file` (written with
/// PageFileOptions::first_page = the pages `seq` holds per stream), every page checked as
/// load_page_file checks it. `seq` itself is left as it was (the new sequence starts as its
/// fork: its pages are shared, not copied); release it if it is no longer needed.
/// \throws kvpack::Error as load_page_file, leaving the cache as it was; kInvalidArgument
///         (from the cache) when the chunk's positions do not come after `seq`'s.
template <class Cache>
SeqId append_page_file(Cache& cache, SeqId seq, const PageFileView& file) {
  loader_detail::check_compatible(cache, file.header());
  return loader_detail::load_into(cache, cache.fork(seq), file);
}

}  // namespace kvpack::inline v0::io
