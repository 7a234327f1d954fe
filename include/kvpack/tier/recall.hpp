#pragma once
/// \file recall.hpp
/// \brief Closing the loop on eviction (issue 9, part 3): every token's K/V is also written to a
///        tier (write-through), so what an evictor drops is demoted, not destroyed; when attend's
///        certified bound says the tokens it did not read may hold more than ε of some head's
///        attention, those tokens are fetched back from the tier and that head's output is
///        recomputed exactly over what the cache holds plus what was recalled.
///
/// Synchronous in this version: the fetch happens inside attend_with_recall. A KV stream is
/// recalled only when one of its query heads fired, so a cache whose eviction was harmless pays
/// nothing but the bound; a fired head gets attention over every token ever written, the live
/// ones as the cache decodes them and the dropped ones as written (fp32).
///
/// Keys are written as attention reads them: after RoPE, at the tokens' own positions (what
/// KVCache::read_back returns). A cache that stores keys before RoPE is fine (read_back rotates
/// them); one whose evictor re-rotates by in-cache index (StreamingLLM's in_cache_positions) is
/// not: its live keys and the recalled ones would be rotated differently.
///
/// A RecallStore is not thread-safe: one per engine thread, or a lock around it.
///
/// Entries, one per write call and (layer, stream), chunked to at most `chunk_tokens`:
///   u32 tokens · u32 dim · i32 positions[tokens] · f32 keys[tokens][dim] · f32 values[tokens][dim]
/// under "<name>-s<seq>-l<layer>-h<stream>-c<chunk>".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

/// What recall has done (since the store was created).
struct RecallStats {
  std::uint64_t attends = 0;         ///< attend_with_recall calls
  std::uint64_t recalls = 0;         ///< calls in which some head fired and tokens were fetched
  std::uint64_t streams_recalled = 0;
  std::uint64_t tokens_recalled = 0;  ///< dropped tokens brought back into a head's attention
  std::uint64_t bytes_written = 0;    ///< entry bytes written through to the tier
  std::uint64_t bytes_fetched = 0;    ///< entry bytes read back from the tier
};

class RecallStore {
 public:
  /// \param name distinguishes this store's entries in a shared tier: a tier key of at most
  ///        kMaxNameBytes characters (the entry keys append sequence, layer, stream and chunk)
  static constexpr std::size_t kMaxNameBytes = 120;
  RecallStore(Tier& tier, std::string name, index_t chunk_tokens = 256)
      : tier_(tier), name_(std::move(name)), chunk_tokens_(chunk_tokens) {
    check_tier_key(name_, "RecallStore");
    KVPACK_CHECK(name_.size() <= kMaxNameBytes, kInvalidArgument,
                 detail::message("RecallStore: name is ", name_.size(), " characters, at most ", kMaxNameBytes));
    KVPACK_CHECK(chunk_tokens > 0, kInvalidArgument, "RecallStore: chunk_tokens must be > 0");
  }

  /// Writes tokens of (seq, layer): rows [T][streams][dim] in KVCache's input layout, keys after
  /// RoPE, at positions positions[0..T) (increasing, after any written before).
  /// \throws kvpack::Error kInvalidArgument for inconsistent sizes or positions; as Tier::put.
  ///         The store records the write only once every entry is in the tier, so a failed
  ///         write can be retried as it was (its entries are overwritten).
  void write(SeqId seq, index_t layer, index_t streams, index_t dim, std::span<const float> keys,
             std::span<const float> values, std::span<const std::int64_t> positions) {
    const std::size_t row = static_cast<std::size_t>(streams) * static_cast<std::size_t>(dim);
    KVPACK_CHECK(streams > 0 && dim > 0 && keys.size() == values.size() && keys.size() == row * positions.size(),
                 kInvalidArgument,
                 detail::message("RecallStore::write: ", keys.size(), " key and ", values.size(), " value floats for ",
                                 positions.size(), " tokens of ", streams, " streams x ", dim));
    const auto found = written_.find({seq, layer});
    Written written = found != written_.end() ? found->second : Written{streams, dim, 0, -1};
    KVPACK_CHECK(written.streams == streams && written.dim == dim, kInvalidArgument,
                 "RecallStore::write: streams or dim differ from an earlier write of this layer");
    for (std::size_t i = 0; i < positions.size(); ++i) {
      const std::int64_t previous = i == 0 ? written.last_position : positions[i - 1];
      KVPACK_CHECK(positions[i] > previous && positions[i] <= std::numeric_limits<std::int32_t>::max(),
                   kInvalidArgument, "RecallStore::write: positions must increase and fit 32 bits");
    }
    std::uint64_t bytes = 0;
    for (std::size_t first = 0; first < positions.size(); first += static_cast<std::size_t>(chunk_tokens_)) {
      const std::size_t n = std::min(positions.size() - first, static_cast<std::size_t>(chunk_tokens_));
      for (index_t s = 0; s < streams; ++s) {
        const std::vector<std::byte> entry = encode(keys, values, positions, first, n, s, streams, dim);
        tier_.put(key_of(seq, layer, s, written.chunks), entry);
        bytes += entry.size();
      }
      ++written.chunks;
      written.last_position = positions[first + n - 1];
    }
    written_[{seq, layer}] = written;
    stats_.bytes_written += bytes;
  }

  /// Every token written for (seq, layer, stream), in position order.
  /// \throws kvpack::Error kUnavailable when an entry the store wrote is gone from the tier (a
  ///         bounded tier dropped it) or the tier cannot be read; kInvalidArgument when damaged.
  [[nodiscard]] StoredTokens read(SeqId seq, index_t layer, index_t stream) {
    StoredTokens out;
    const auto found = written_.find({seq, layer});
    if (found == written_.end()) return out;
    const Written& written = found->second;
    KVPACK_CHECK(stream >= 0 && stream < written.streams, kInvalidArgument,
                 detail::message("RecallStore::read: stream ", stream, " of ", written.streams, " written"));
    out.key_dim = out.value_dim = written.dim;
    for (std::uint32_t chunk = 0; chunk < written.chunks; ++chunk) {
      const std::string key = key_of(seq, layer, stream, chunk);
      const std::optional<std::vector<std::byte>> entry = tier_.get(key);
      KVPACK_CHECK(entry.has_value(), kUnavailable,
                   detail::message("RecallStore: ", tier_.describe(), " no longer holds '", key, "'"));
      stats_.bytes_fetched += entry->size();
      decode(*entry, written.dim, key, out);
    }
    return out;
  }

  /// Removes `seq`'s entries from the tier.
  void forget(SeqId seq) {
    for (auto it = written_.lower_bound({seq, 0}); it != written_.end() && it->first.first == seq;) {
      for (std::uint32_t chunk = 0; chunk < it->second.chunks; ++chunk) {
        for (index_t s = 0; s < it->second.streams; ++s) tier_.erase(key_of(seq, it->first.second, s, chunk));
      }
      it = written_.erase(it);
    }
  }

  [[nodiscard]] const RecallStats& stats() const noexcept { return stats_; }
  [[nodiscard]] RecallStats& stats() noexcept { return stats_; }

 private:
  struct Written {
    index_t streams = 0, dim = 0;
    std::uint32_t chunks = 0;
    std::int64_t last_position = -1;
  };

  [[nodiscard]] std::string key_of(SeqId seq, index_t layer, index_t stream, std::uint32_t chunk) const {
    return detail::message(name_, "-s", seq, "-l", layer, "-h", stream, "-c", chunk);
  }

  static std::vector<std::byte> encode(std::span<const float> keys, std::span<const float> values,
                                       std::span<const std::int64_t> positions, std::size_t first, std::size_t n,
                                       index_t stream, index_t streams, index_t dim) {
    const std::size_t d = static_cast<std::size_t>(dim);
    std::vector<std::byte> entry(8 + n * 4 + 2 * n * d * sizeof(float));
    const std::uint32_t header[2] = {static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(dim)};
    std::memcpy(entry.data(), header, 8);
    std::byte* p = entry.data() + 8;
    for (std::size_t i = 0; i < n; ++i, p += 4) {
      const auto position = static_cast<std::int32_t>(positions[first + i]);
      std::memcpy(p, &position, 4);
    }
    const std::size_t row = static_cast<std::size_t>(streams) * d;
    for (const std::span<const float> plane : {keys, values}) {
      for (std::size_t i = 0; i < n; ++i, p += d * sizeof(float)) {
        std::memcpy(p, plane.data() + (first + i) * row + static_cast<std::size_t>(stream) * d, d * sizeof(float));
      }
    }
    return entry;
  }

  static void decode(std::span<const std::byte> entry, index_t dim, const std::string& key, StoredTokens& out) {
    std::uint32_t header[2] = {0, 0};
    KVPACK_CHECK(entry.size() >= 8, kInvalidArgument, detail::message("RecallStore: entry '", key, "' is truncated"));
    std::memcpy(header, entry.data(), 8);
    const std::size_t n = header[0], d = header[1];
    KVPACK_CHECK(d == static_cast<std::size_t>(dim) && entry.size() == 8 + n * 4 + 2 * n * d * sizeof(float),
                 kInvalidArgument, detail::message("RecallStore: entry '", key, "' does not match its header"));
    const std::byte* p = entry.data() + 8;
    for (std::size_t i = 0; i < n; ++i, p += 4) {
      std::int32_t position = 0;
      std::memcpy(&position, p, 4);
      out.positions.push_back(position);
    }
    for (std::vector<float>* plane : {&out.keys, &out.values}) {
      const std::size_t old = plane->size();
      plane->resize(old + n * d);
      std::memcpy(plane->data() + old, p, n * d * sizeof(float));
      p += n * d * sizeof(float);
    }
  }

  Tier& tier_;
  std::string name_;
  index_t chunk_tokens_;
  std::map<std::pair<SeqId, index_t>, Written> written_;  ///< by (seq, layer)
  RecallStats stats_;
};

namespace recall_detail {

/// out[q_heads_of_stream][d] = exact softmax attention of each query head over `tokens` (double).
inline void exact_heads(const StoredTokens& tokens, std::span<const float> query, index_t first_head, index_t heads,
                        index_t dim, float scale, std::span<float> out) {
  const std::size_t n = tokens.positions.size(), d = static_cast<std::size_t>(dim);
  std::vector<double> p(n), acc(d);
  for (index_t h = first_head; h < first_head + heads; ++h) {
    const float* q = query.data() + static_cast<std::size_t>(h) * d;
    double top = -std::numeric_limits<double>::infinity();
    for (std::size_t t = 0; t < n; ++t) {
      double dot = 0.0;
      for (std::size_t c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * tokens.keys[t * d + c];
      p[t] = dot * scale;
      top = std::max(top, p[t]);
    }
    double sum = 0.0;
    for (double& x : p) sum += (x = std::exp(x - top));
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t c = 0; c < d; ++c) acc[c] += p[t] / sum * tokens.values[t * d + c];
    }
    for (std::size_t c = 0; c < d; ++c) out[static_cast<std::size_t>(h) * d + c] = static_cast<float>(acc[c]);
  }
}

}  // namespace recall_detail

/// attend with the cache's certified bound; for every KV stream with a query head whose bound
/// exceeds report.epsilon, the stream's dropped tokens are fetched from `store` and its heads'
/// outputs recomputed exactly over live ∪ recalled tokens. `Cache` is a KVCache (attend with a
/// report) or an eval::AnyCache (attend_reported). Returns the streams recalled.
/// \throws kvpack::Error as attend and RecallStore::read (a tier that cannot deliver: `out` then
///         holds the cache's own output for the streams not yet recalled, and the report says
///         the bound fired).
template <class Cache>
index_t attend_with_recall(const Cache& cache, RecallStore& store, SeqId seq, index_t layer,
                           std::span<const float> query, std::span<float> out, float scale, AttendReport& report) {
  if constexpr (requires { cache.attend_reported(seq, layer, query, out, scale, report); }) {
    cache.attend_reported(seq, layer, query, out, scale, report);
  } else {
    cache.attend(seq, layer, query, out, scale, &report);
  }
  RecallStats& stats = store.stats();
  ++stats.attends;
  const ModelShape& shape = cache.shape();
  const index_t dim = shape.head_dim, group = shape.q_heads / shape.kv_heads;
  index_t recalled = 0;
  for (index_t s = 0; s < shape.kv_heads; ++s) {
    bool fired = false;
    for (index_t g = 0; g < group; ++g) fired |= report.heads[static_cast<std::size_t>(s * group + g)].fired(report.epsilon);
    if (!fired) continue;
    StoredTokens all = cache.read_back(seq, layer, s);
    const StoredTokens written = store.read(seq, layer, s);
    // Dropped = written and not live (both in position order): append them after the live ones.
    std::size_t live = 0;
    const std::size_t live_count = all.positions.size(), d = static_cast<std::size_t>(dim);
    for (std::size_t t = 0; t < written.positions.size(); ++t) {
      while (live < live_count && all.positions[live] < written.positions[t]) ++live;
      if (live < live_count && all.positions[live] == written.positions[t]) continue;
      all.positions.push_back(written.positions[t]);
      all.keys.insert(all.keys.end(), written.keys.begin() + t * d, written.keys.begin() + (t + 1) * d);
      all.values.insert(all.values.end(), written.values.begin() + t * d, written.values.begin() + (t + 1) * d);
      ++stats.tokens_recalled;
    }
    recall_detail::exact_heads(all, query, s * group, group, dim, scale, out);
    ++stats.streams_recalled;
    ++recalled;
  }
  if (recalled > 0) ++stats.recalls;
  return recalled;
}

}  // namespace kvpack::inline v0::tier
