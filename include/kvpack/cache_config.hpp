#pragma once
/// \file cache_config.hpp
/// \brief CacheConfig (how a KVCache pages and checks its data) and MemoryUsage (what it holds).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kvpack/core/rope.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/paging/page_pool.hpp"
#include "kvpack/select/unread_bound.hpp"

namespace kvpack::inline v0 {

/// A parallel-for: runs task(i) for every i in [0, count), possibly concurrently, and returns
/// when all are done. `attend` hands it one task per KV stream. See kvpack::ThreadPool.
using Executor = std::function<void(index_t count, const std::function<void(index_t)>& task)>;

/// Prefix sharing's options (CacheConfig::prefix_sharing). The rest of a paging::PrefixKey
/// comes from the cache (layout, shape, page size, codec and a fingerprint of its parameters,
/// the cache options that change page bytes) and from add_sequence (the salt, per request).
struct PrefixSharing {
  /// The model's weights and tokenizer: the same token ids mean other K/V under other weights.
  /// Required.
  std::string model_id;
};

/// How a cache stores its pages and how strictly it checks its inputs.
struct CacheConfig {
  /// Token slots per page: a multiple of 16 (one AVX-512 vector of tokens) in [16, 256]
  /// (integer kernels sum a page in int32, which 256 keeps exact).
  index_t page_size = 32;
  /// Newest tokens kept in full precision (fp32) before being encoded: a multiple of page_size,
  /// 0 allowed, at most kMaxTailTokens. The tail also holds up to page_size - 1 tokens that do
  /// not yet fill a page.
  index_t tail_tokens = 0;
  /// The largest tail_tokens: a window's row count (exact prefix + tail + a page) stays an int32.
  static constexpr index_t kMaxTailTokens = index_t{1} << 20;
  /// The first tokens of every layer of a sequence, kept in full precision (fp32) and never
  /// encoded or evicted: attention sinks. KVQuant keeps 1 exact; StreamingLLM keeps 4.
  index_t exact_prefix_tokens = 0;
  /// The most pages the pool hands out at once; beyond it writes throw kvpack::OutOfPages.
  std::size_t max_pages = paging::PagePool::kUnlimited;
  /// Reject NaN/Inf (and magnitudes the codec cannot store) in keys, values and queries with
  /// kvpack::Error. Engines that validate upstream may switch it off; results for such input
  /// are then unspecified (memory-safe, but an integer codec cannot represent NaN).
  bool check_inputs = true;
  /// Spreads `attend` over KV streams; empty means serial.
  Executor executor{};
  /// Set: keys are passed to prefill/append *before* RoPE, stored that way (per-channel key
  /// statistics stay stable: KVQuant), and rotated to each slot's stored position whenever they
  /// are read; queries are still passed after RoPE. Unset: keys are stored as given.
  std::optional<RopeSpec> key_rope{};
  /// Set: `add_sequence(tokens)` reuses the pages of a cached prompt prefix and sequences'
  /// whole prompt pages are cached for later ones (README "Prefix sharing"). Unset: no index is
  /// built and nothing else changes. Needs exact_prefix_tokens == 0 (else kUnsupported when the
  /// cache is built); with an evictor, shared prompt tokens are pinned in every holder.
  std::optional<PrefixSharing> prefix_sharing{};

  void validate() const {
    KVPACK_CHECK(page_size >= 16 && page_size <= 256 && page_size % 16 == 0, kInvalidConfig,
                 detail::message("CacheConfig.page_size must be a multiple of 16 in [16, 256], got ",
                                 page_size));
    KVPACK_CHECK(tail_tokens >= 0 && tail_tokens % page_size == 0 && tail_tokens <= kMaxTailTokens, kInvalidConfig,
                 detail::message("CacheConfig.tail_tokens must be a non-negative multiple of "
                                 "page_size (", page_size, "), at most ", kMaxTailTokens, ", got ", tail_tokens));
    KVPACK_CHECK(max_pages > 0, kInvalidConfig, "CacheConfig.max_pages must be at least 1");
    KVPACK_CHECK(exact_prefix_tokens >= 0 && exact_prefix_tokens <= 4096, kInvalidConfig,
                 detail::message("CacheConfig.exact_prefix_tokens must be in [0, 4096], got ", exact_prefix_tokens));
    KVPACK_CHECK(!prefix_sharing || !prefix_sharing->model_id.empty(), kInvalidConfig,
                 "CacheConfig.prefix_sharing.model_id must name the model (pages of other weights must never match)");
  }
};

/// Exact bytes a cache holds, by kind. Shared pages (after fork) count once.
struct MemoryUsage {
  std::size_t page_payload = 0;   ///< encoded K and V planes of pages in use (codec metadata too)
  std::size_t page_metadata = 0;  ///< per-slot positions, live masks, selector summaries
  std::size_t tails = 0;          ///< full-precision tail and exact-prefix buffers, as allocated
  std::size_t tables = 0;         ///< block tables, as allocated
  std::size_t codec_params = 0;   ///< per (layer, KV head) codec parameters (FP8 scales)
  /// Per-model tables shared with other caches and copies of the quantizer: RoPE's cos/sin
  /// (pre-RoPE keys), KVQuant's calibration. Fixed in size and not in total(): they do not grow
  /// with sequences or tokens.
  std::size_t shared_tables = 0;
  std::size_t pages_in_use = 0;
  /// K and V elements held, summed over sequences, layers and streams (a forked sequence counts
  /// its shared tokens again): the denominator of bits per element.
  std::size_t stored_elements = 0;

  [[nodiscard]] std::size_t total() const noexcept {
    return page_payload + page_metadata + tails + tables + codec_params;
  }
  /// All bytes, metadata, tails and tables included, per stored element.
  [[nodiscard]] double bits_per_element() const noexcept {
    return stored_elements == 0 ? 0.0 : 8.0 * static_cast<double>(total()) / static_cast<double>(stored_elements);
  }
};

/// One source of a KV stream's unread tokens in an AttendReport: a page attend did not read (or
/// the dead slots of one it read), the tokens of freed pages (kept as one summary), or a dead
/// tail row. What bound recall (tier/recall.hpp) fetches back, span by span.
struct UnreadSpan {
  std::int32_t first_position = 0;  ///< every unread token of the span is at a position in
  std::int32_t last_position = 0;   ///< [first_position, last_position] (tokens may be live there too)
  index_t tokens = 0;               ///< unread tokens in the span
  index_t live = 0;                 ///< of them, still live in the cache (a page select::Quest skipped)
};

/// What one `attend` left unread, and how much it could matter: the certified bound of
/// select/unread_bound.hpp per query head, over the pages select::Quest skipped, the slots an
/// evictor dropped (their pages' summaries are kept after the pages are freed) and dead tail rows.
struct AttendReport {
  double epsilon = 0.01;                   ///< in: the unread mass above which `fired` is set
  std::vector<select::UnreadBound> heads;  ///< out: [q_heads]
  bool fired = false;                      ///< out: some head's unread mass may exceed epsilon
  std::size_t pages_read = 0;              ///< out: pages read, over the layer's KV streams
  std::size_t pages_total = 0;             ///< out: pages held
  std::vector<std::vector<index_t>> read_pages;  ///< out: [streams] indices into pages() of the pages read
  /// out: [streams] the spans of unread tokens the bound covers (empty when nothing is unread or
  /// the cache certifies nothing), and [streams][group][spans] for each of the stream's query
  /// heads (`group` = q_heads / kv_heads) an upper bound U on q·k·scale over the span's tokens:
  /// the span adds at most tokens·e^{U} to the softmax sum the bound compares with.
  std::vector<std::vector<UnreadSpan>> unread_spans;
  std::vector<std::vector<float>> unread_score_bounds;
  [[nodiscard]] double max_mass() const noexcept {
    double top = 0.0;
    for (const select::UnreadBound& head : heads) top = top > head.mass ? top : head.mass;
    return top;
  }
};

/// The decoded contents of one (sequence, layer, stream), from KVCache::read_back.
struct StoredTokens {
  index_t key_dim = 0;
  index_t value_dim = 0;
  std::vector<std::int32_t> positions;  ///< [n], increasing
  std::vector<float> keys;              ///< [n][key_dim], as the kernels read them
  std::vector<float> values;            ///< [n][value_dim]
  [[nodiscard]] index_t size() const noexcept { return static_cast<index_t>(positions.size()); }
};

/// Tokens an evictor is about to drop from one KV stream, handed to a DemotionSink before they
/// are destroyed: decoded by the codec as read_back decodes them, keys after RoPE at their own
/// positions (also where StreamingLLM re-rotates live keys by their index in the cache).
struct DroppedTokens {
  SeqId seq = 0;
  index_t layer = 0;   ///< the layer that wrote them (KVCache::writing_layer)
  index_t stream = 0;  ///< KV stream
  const StoredTokens& tokens;
};

/// Where an evicting cache demotes what it drops (KVCache::set_demotion_sink; write-back, as
/// opposed to writing every token through). A sink that throws keeps the tokens in the cache:
/// nothing is dropped that was not demoted, and the next write tries again.
using DemotionSink = std::function<void(const DroppedTokens&)>;

}  // namespace kvpack::inline v0
