#pragma once
/// \file prefix_chunks.hpp
/// \brief Prompt prefixes in a tier, found by another cache or process (fetch_prefix), or after
///        the cache's own prefix index (add_sequence): a sequence is stored as
///        chunks of `chunk_tokens` tokens (whole pages), each under a key that names every token
///        up to its end, and a lookup loads chunks 0, 1, 2, ... until one is missing, damaged or
///        unreadable: the longest cached prefix of the prompt, at chunk granularity. The caller
///        prefills the rest. (LMCache's chunk-hash scheme; the in-memory prefix index finds
///        prefixes at page granularity.)
///
/// Each chunk is a page file of its pages (io::PageFileOptions::first_page) holding every token
/// id of the prefix up to its end and the model id; a lookup compares both with the prompt's, and
/// io::append_page_file loads the chunk after the ones before it, checking every byte, so a chunk
/// that does not belong (a key collision, another model or codec) stops the lookup, never
/// corrupts it.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/io/page_file.hpp"
#include "kvpack/layout/layout_concepts.hpp"
#include "kvpack/paging/fingerprint.hpp"
#include "kvpack/tier/cache_identity.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

namespace chunk_detail {

template <class Cache>
void check_chunk_tokens(const Cache& cache, index_t chunk_tokens, std::string_view who) {
  const index_t page = cache.config().page_size;
  KVPACK_CHECK(chunk_tokens > 0 && chunk_tokens % page == 0, kInvalidArgument,
               detail::message(who, ": chunk_tokens (", chunk_tokens, ") must be a positive multiple of the page size (",
                               page, ")"));
}

/// The pages every (layer, stream) of `seq` holds at least: the chunks that can be written.
template <class Cache>
std::size_t encoded_pages(const Cache& cache, SeqId seq) {
  const index_t layers = layout::cache_layers(cache.layout(), cache.shape());
  std::size_t fewest = std::numeric_limits<std::size_t>::max();
  for (index_t c = 0; c < layers; ++c) {
    const index_t writer = layout::writer_of(cache.layout(), cache.shape(), c);
    for (index_t s = 0; s < cache.streams_per_layer(); ++s) {
      fewest = std::min(fewest, cache.pages(seq, writer, s).size());
    }
  }
  return fewest;
}

}  // namespace chunk_detail

/// The keys of the whole chunks of `tokens`: key c ("kvpack-chunk-" and 32 hex digits) is two
/// independent fingerprints of the cache's identity (cache_identity.hpp), the chunk size and
/// every token up to the end of chunk c, so equal keys mean equal prefixes (up to fingerprint
/// collisions, which fetch_prefix's token comparison turns into a shorter hit).
template <class Cache>
[[nodiscard]] std::vector<std::string> chunk_keys(const Cache& cache, std::span<const std::int32_t> tokens,
                                                  std::string_view model_id, index_t chunk_tokens,
                                                  std::string_view salt = {}) {
  chunk_detail::check_chunk_tokens(cache, chunk_tokens, "chunk_keys");
  paging::Fingerprint chains[2] = {paging::Fingerprint(11), paging::Fingerprint(12)};
  for (paging::Fingerprint& f : chains) {
    add_cache_identity(f, cache, model_id, salt);
    f.add(chunk_tokens);
  }
  std::vector<std::string> keys;
  const std::size_t chunk = static_cast<std::size_t>(chunk_tokens);
  for (std::size_t end = chunk; end <= tokens.size(); end += chunk) {
    char text[48];
    for (paging::Fingerprint& f : chains) f.add(tokens.subspan(end - chunk, chunk));
    std::snprintf(text, sizeof text, "kvpack-chunk-%016llx%016llx", static_cast<unsigned long long>(chains[0].value()),
                  static_cast<unsigned long long>(chains[1].value()));
    keys.emplace_back(text);
  }
  return keys;
}

/// Stores the whole chunks of sequence `seq` (its first tokens.size() tokens) in `tier`, as far
/// as they are encoded in pages in every layer and stream: a chunk that reaches into the
/// full-precision tail (tokens not yet encoded, or the last page's worth that does not fill a
/// page) is not stored; a later call stores it once the sequence has grown past it.
/// \returns the chunks written, from chunk 0. \throws kUnsupported for a sequence whose pages
/// do not hold the tokens at positions 0, 1, … (an exact prefix, evicted tokens, positions that
/// skip); otherwise as io::write_page_file and Tier::put.
template <class Cache>
std::size_t store_chunks(Tier& tier, const Cache& cache, SeqId seq, std::span<const std::int32_t> tokens,
                         std::string_view model_id, index_t chunk_tokens, std::string_view salt = {}) {
  std::vector<std::string> keys = chunk_keys(cache, tokens, model_id, chunk_tokens, salt);
  const std::size_t pages_per_chunk = static_cast<std::size_t>(chunk_tokens / cache.config().page_size);
  const std::size_t chunk = static_cast<std::size_t>(chunk_tokens);
  keys.resize(std::min(keys.size(), chunk_detail::encoded_pages(cache, seq) / pages_per_chunk));
  for (std::size_t c = 0; c < keys.size(); ++c) {
    io::PageFileOptions options{std::string(model_id), tokens.first((c + 1) * chunk), c * pages_per_chunk,
                                pages_per_chunk};
    tier.put(keys[c], io::write_page_file(cache, seq, options));
  }
  return keys.size();
}

/// What fetch_prefix or add_sequence found.
struct PrefixFetch {
  SeqId seq{};                  ///< a new sequence holding the prefix found (maybe no token)
  index_t tokens = 0;           ///< tokens it holds: prefill the prompt from here
  index_t cached_tokens = 0;    ///< of them, pages shared from the cache's own prefix index (add_sequence)
  std::size_t chunks = 0;       ///< chunks loaded from the tier
  std::uint64_t bytes = 0;      ///< entry bytes read
  std::string stopped_because;  ///< why the next chunk was not loaded (empty: the prompt's whole chunks all were)
};

namespace chunk_detail {

/// Loads chunks result.tokens / chunk_tokens, … of `keys` (the chunks of `tokens`) after the
/// pages result.seq holds, until one is missing, unreadable, damaged, foreign or does not fit.
template <class Cache>
void load_chunks(Tier& tier, Cache& cache, PrefixFetch& result, const std::vector<std::string>& keys,
                 std::span<const std::int32_t> tokens, std::string_view model_id, index_t chunk_tokens,
                 PageCheck check) {
  const std::size_t chunk = static_cast<std::size_t>(chunk_tokens);
  for (std::size_t c = static_cast<std::size_t>(result.tokens) / chunk; c < keys.size(); ++c) {
    try {
      const std::optional<std::vector<std::byte>> entry = tier.get(keys[c]);
      if (!entry) {
        result.stopped_because = detail::message("chunk ", c, " ('", keys[c], "') is not in ", tier.describe());
        return;
      }
      const std::string what = tier.describe() + " chunk '" + keys[c] + "'";
      const io::PageFileView view = io::PageFileView::parse(*entry, what);
      const std::span<const std::int32_t> expected = tokens.first((c + 1) * chunk);
      KVPACK_CHECK(std::equal(view.tokens().begin(), view.tokens().end(), expected.begin(), expected.end()),
                   kInvalidArgument, detail::message(what, " holds another prefix's tokens"));
      KVPACK_CHECK(view.header().model_id == model_id, kInvalidArgument,
                   detail::message(what, " is model '", view.header().model_id, "', not '", std::string(model_id), "'"));
      const SeqId longer = io::append_page_file(cache, result.seq, view, check);
      // A chunk holds the tokens at positions c·chunk … (c + 1)·chunk − 1 (store_chunks refuses
      // others since 2026-12-07; an older writer's may skip positions): the caller prefills from
      // `tokens` on, so a prefix that ends elsewhere would be rotated to the wrong positions.
      const std::int64_t last = cache.last_position(longer, 0);
      if (last != static_cast<std::int64_t>((c + 1) * chunk) - 1) {
        cache.release(longer);
        result.stopped_because = detail::message(what, " ends at position ", last, ", not ", (c + 1) * chunk - 1);
        return;
      }
      cache.release(result.seq);
      result.seq = longer;
      result.tokens += chunk_tokens;
      ++result.chunks;
      result.bytes += entry->size();
    } catch (const Error& error) {
      if (error.code() == ErrorCode::kOutOfPages) {
        cache.release(result.seq);
        throw;
      }
      result.stopped_because = error.what();
      return;
    } catch (...) {
      cache.release(result.seq);
      throw;
    }
  }
}

}  // namespace chunk_detail

/// A new sequence in `cache` holding the longest prefix of `tokens` whose chunks are all in
/// `tier`: up to every whole chunk of `tokens`, so an engine that needs the last prompt token's
/// logits passes the prompt without it (add_sequence below leaves max(1, tail_tokens)). A chunk that is missing, cannot be read (kUnavailable), is damaged, holds another
/// prefix or model, or does not fit ends the prefix there, and `stopped_because` says which.
/// OutOfPages (the pool is full: an engine preempts) and exceptions that are not
/// kvpack::Error reach the caller, with the new sequence released. `check` is what the loader
/// verifies of each page (as in fetch_sequence).
template <class Cache>
[[nodiscard]] PrefixFetch fetch_prefix(Tier& tier, Cache& cache, std::span<const std::int32_t> tokens,
                                       std::string_view model_id, index_t chunk_tokens, std::string_view salt = {},
                                       PageCheck check = PageCheck::kReencode) {
  const std::vector<std::string> keys = chunk_keys(cache, tokens, model_id, chunk_tokens, salt);
  PrefixFetch result;
  result.seq = cache.add_sequence();
  chunk_detail::load_chunks(tier, cache, result, keys, tokens, model_id, chunk_tokens, check);
  return result;
}

/// A new sequence for `prompt` starting with as much of its K/V as the cache or `tier` holds:
/// first the cache's own prefix index (with CacheConfig::prefix_sharing: pages shared, not
/// copied, `cached_tokens`), then the tier's chunks (store_chunks) from where that hit ends, as
/// fetch_prefix loads them. The caller prefills the prompt from `tokens`. Like the cache's
/// add_sequence(prompt), it leaves at least max(1, tail_tokens) prompt tokens to prefill (the
/// engine needs the last token's logits). A cached prefix that ends inside a chunk is not
/// continued from the tier (a chunk's pages cannot be loaded in part); `stopped_because` says so.
/// The prompt is kept with the sequence, so share_prefix and release cache its pages in memory,
/// those loaded from the tier included. Errors as fetch_prefix; the cache's own for a prompt it
/// refuses.
template <class Cache>
[[nodiscard]] PrefixFetch add_sequence(Tier& tier, Cache& cache, std::span<const std::int32_t> prompt,
                                       std::string_view model_id, index_t chunk_tokens, std::string_view salt = {},
                                       PageCheck check = PageCheck::kReencode) {
  const std::size_t left = std::max<std::size_t>(1, static_cast<std::size_t>(cache.config().tail_tokens));
  const std::span<const std::int32_t> lookup = prompt.first(prompt.size() > left ? prompt.size() - left : 0);
  const std::vector<std::string> keys = chunk_keys(cache, lookup, model_id, chunk_tokens, salt);
  PrefixFetch result;
  if (cache.config().prefix_sharing) {
    const PrefixHit hit = cache.add_sequence(prompt, salt);
    result.seq = hit.seq;
    result.tokens = result.cached_tokens = hit.cached_tokens;
  } else {
    result.seq = cache.add_sequence();
  }
  if (result.tokens % chunk_tokens != 0) {
    result.stopped_because =
        detail::message("the cache's own prefix (", result.tokens, " tokens) ends inside chunk ",
                        result.tokens / chunk_tokens, "; the tier's chunks cannot continue it");
    return result;
  }
  chunk_detail::load_chunks(tier, cache, result, keys, lookup, model_id, chunk_tokens, check);
  return result;
}

}  // namespace kvpack::inline v0::tier
