#pragma once
/// \file recall.hpp
/// \brief Closing the loop on eviction (issue 9, part 3): what an evictor drops is demoted to a
///        tier, not destroyed; when attend's certified bound says the tokens it did not read may
///        hold more than ε of some head's attention, those tokens are fetched back from the tier
///        and that head's output is recomputed exactly over what the cache holds plus what was
///        recalled.
///
/// Two ways into the tier: write-through (RecallStore::write, every token as the engine produces
/// it, fp32 as given) and write-back (RecallStore::demote as the cache's DemotionSink: only the
/// tokens an evictor drops, when it drops them, as the cache decodes them). A layer uses one.
///
/// Synchronous in this version: the fetch happens inside attend_with_recall. A KV stream is
/// recalled only when one of its query heads fired, so a cache whose eviction was harmless pays
/// nothing but the bound. Of a fired stream, only the unread spans the bound implicates are
/// fetched (AttendReport::unread_spans: the pages not read, the summaries of freed pages, dead
/// tail rows): the fewest spans, highest bound first, without which every head's bound over the
/// rest is at most ε. Its heads are recomputed over the live tokens (as the cache decodes them)
/// plus the dropped tokens fetched (as stored); what stays unread is certified ≤ ε.
///
/// Keys are written as attention reads them: after RoPE, at the tokens' own positions (what
/// KVCache::read_back returns). A cache that stores keys before RoPE is fine (read_back rotates
/// them); one whose evictor re-rotates by in-cache index (StreamingLLM's in_cache_positions) is
/// not: its live keys and the recalled ones would be rotated differently.
///
/// A RecallStore is not thread-safe: one per engine thread, or a lock around it.
///
/// Entries, one per write or demote call and (layer, stream), chunked to at most `chunk_tokens`:
///   u32 tokens · u16 dim · u16 element bytes (4: f32, 2: fp16; EntryPrecision) ·
///   i32 positions[tokens] · keys[tokens][dim] · values[tokens][dim]
/// under "<name>-s<seq>-l<layer>-h<stream>-c<chunk>".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/select/unread_bound.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

/// What recall has done (since the store was created).
struct RecallStats {
  std::uint64_t attends = 0;         ///< attend_with_recall calls
  std::uint64_t recalls = 0;         ///< calls in which some head fired and tokens were fetched
  std::uint64_t streams_recalled = 0;
  std::uint64_t tokens_recalled = 0;  ///< dropped tokens brought back into a head's attention
  std::uint64_t spans_recalled = 0;   ///< unread spans fetched (AttendReport::unread_spans)
  std::uint64_t spans_left = 0;       ///< unread spans of recalled streams left in the tier
  /// The largest certified unread mass a recalled head was left with (≤ the report's epsilon).
  double max_mass_left = 0.0;
  std::uint64_t bytes_written = 0;    ///< entry bytes written to the tier (through or demoted)
  std::uint64_t bytes_fetched = 0;    ///< entry bytes read back from the tier
  std::uint64_t tokens_demoted = 0;   ///< tokens written by demote
  std::uint64_t demotions_failed = 0; ///< demote calls the tier refused (the cache kept the tokens)
};

/// How a RecallStore's entries hold K and V.
enum class EntryPrecision {
  kF32,  ///< as given
  /// fp16: half the bytes. Exact for what an fp16 cache demotes; anything else is rounded to
  /// nearest (relative error at most 2^-11, subnormals absolutely at most 2^-25). An entry with a
  /// value fp16 cannot hold finitely (|x| ≥ 65520) is written in fp32 instead, so nothing
  /// overflows.
  kF16,
};

class RecallStore {
 public:
  /// \param name distinguishes this store's entries in a shared tier: a tier key of at most
  ///        kMaxNameBytes characters (the entry keys append sequence, layer, stream and chunk)
  static constexpr std::size_t kMaxNameBytes = 120;
  static constexpr index_t kMaxDim = 65535;  ///< an entry's header holds dim in 16 bits
  RecallStore(Tier& tier, std::string name, index_t chunk_tokens = 256, EntryPrecision precision = EntryPrecision::kF32)
      : tier_(tier), name_(std::move(name)), chunk_tokens_(chunk_tokens), precision_(precision) {
    check_tier_key(name_, "RecallStore");
    KVPACK_CHECK(name_.size() <= kMaxNameBytes, kInvalidArgument,
                 detail::message("RecallStore: name is ", name_.size(), " characters, at most ", kMaxNameBytes));
    KVPACK_CHECK(chunk_tokens > 0, kInvalidArgument, "RecallStore: chunk_tokens must be > 0");
  }

  /// Write-through: writes tokens of (seq, layer), rows [T][streams][dim] in KVCache's input
  /// layout, keys after RoPE, at positions positions[0..T) (increasing, after any written before).
  /// \throws kvpack::Error kInvalidArgument for inconsistent sizes or positions, or a layer
  ///         whose tokens are demoted; as Tier::put. The store records the write only once every
  ///         entry is in the tier; a failed write erases the entries it put and can be retried.
  /// Each call writes its own entries (chunks of chunk_tokens within the call): one token per
  /// call is one entry per stream, and one tier round trip each when recalled.
  void write(SeqId seq, index_t layer, index_t streams, index_t dim, std::span<const float> keys,
             std::span<const float> values, std::span<const std::int64_t> positions) {
    const auto stream_count = static_cast<std::size_t>(streams);
    const std::size_t row = stream_count * static_cast<std::size_t>(dim);
    KVPACK_CHECK(streams > 0 && dim > 0 && keys.size() == values.size() && keys.size() == row * positions.size(),
                 kInvalidArgument,
                 detail::message("RecallStore::write: ", keys.size(), " key and ", values.size(), " value floats for ",
                                 positions.size(), " tokens of ", streams, " streams x ", dim));
    KVPACK_CHECK(dim <= kMaxDim, kInvalidArgument, detail::message("RecallStore::write: dim ", dim, " > ", kMaxDim));
    const auto found = layers_.find({seq, layer});
    const bool fresh = found == layers_.end();
    if (!fresh) {
      KVPACK_CHECK(found->second.mode == Mode::kThrough, kInvalidArgument,
                   "RecallStore::write: this layer's dropped tokens are demoted; a store either writes a layer "
                   "through or takes its demotions");
      KVPACK_CHECK(found->second.streams.size() == static_cast<std::size_t>(streams) && found->second.dim == dim,
                   kInvalidArgument, "RecallStore::write: streams or dim differ from an earlier write of this layer");
    }
    for (std::size_t i = 0; i < positions.size(); ++i) {
      const std::int64_t previous = i == 0 ? (fresh ? -1 : found->second.last_position) : positions[i - 1];
      KVPACK_CHECK(positions[i] > previous && positions[i] <= std::numeric_limits<std::int32_t>::max(),
                   kInvalidArgument, "RecallStore::write: positions must increase and fit 32 bits");
    }
    if (positions.empty()) return;
    // The layer's record is changed in place (a copy per call made a decode loop's writes
    // quadratic), and only once every entry is in the tier: room for the ranges is reserved
    // first, and a failed put takes back the entries this call put.
    auto at = found;
    if (fresh) {
      at = layers_.emplace(std::pair{seq, layer}, Layer{Mode::kThrough, dim, -1, std::vector<Entries>(stream_count)})
               .first;
    }
    Layer& written = at->second;
    const std::size_t chunk = static_cast<std::size_t>(chunk_tokens_);
    const std::size_t chunks = (positions.size() + chunk - 1) / chunk;
    const std::size_t before = written.streams.front().size();  // every stream holds as many entries
    std::size_t put = 0;  // entries this call put, chunk-major
    std::uint64_t bytes = 0;
    try {
      for (Entries& entries : written.streams) entries.reserve(before + chunks);
      for (std::size_t c = 0; c < chunks; ++c) {
        const std::size_t first = c * chunk, n = std::min(positions.size() - first, chunk);
        for (index_t s = 0; s < streams; ++s) {
          const std::vector<std::byte> entry =
              encode(n, dim, [&](std::size_t i) { return static_cast<std::int32_t>(positions[first + i]); },
                     [&](std::size_t i, bool value) {
                       return (value ? values : keys).data() + (first + i) * row + static_cast<std::size_t>(s) * dim;
                     });
          tier_.put(key_of(seq, layer, s, before + c), entry);
          ++put;
          bytes += entry.size();
        }
      }
    } catch (...) {
      for (std::size_t i = 0; i < put; ++i) {  // best effort: a retry overwrites them anyway
        try {
          (void)tier_.erase(key_of(seq, layer, static_cast<index_t>(i % static_cast<std::size_t>(streams)),
                                   before + i / static_cast<std::size_t>(streams)));
        } catch (...) {
        }
      }
      if (fresh) layers_.erase({seq, layer});
      throw;
    }
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t first = c * chunk, last = std::min(positions.size(), first + chunk) - 1;
      for (Entries& entries : written.streams) {
        entries.emplace_back(static_cast<std::int32_t>(positions[first]), static_cast<std::int32_t>(positions[last]));
      }
    }
    written.last_position = positions.back();
    stats_.bytes_written += bytes;
  }

  /// Write-back: stores the tokens an evicting KVCache is about to drop (its DemotionSink:
  /// `cache.set_demotion_sink([&](const DroppedTokens& d) { store.demote(d); })`), so that only
  /// what leaves the cache is written, at the cache's precision.
  /// \throws kvpack::Error kInvalidArgument for a layer written through or dims that differ from
  ///         an earlier demotion; as Tier::put (counted in stats().demotions_failed; the cache
  ///         then keeps the tokens, see KVCache::set_demotion_sink). Recorded only once every
  ///         entry is in the tier; the entries of a failed call are erased again.
  void demote(const DroppedTokens& dropped) {
    const StoredTokens& tokens = dropped.tokens;
    const std::size_t n = tokens.positions.size(), d = static_cast<std::size_t>(tokens.key_dim);
    KVPACK_CHECK(tokens.key_dim > 0 && tokens.key_dim == tokens.value_dim && dropped.stream >= 0 &&
                     tokens.keys.size() == n * d && tokens.values.size() == n * d,
                 kInvalidArgument, "RecallStore::demote: tokens' dims or sizes are inconsistent");
    KVPACK_CHECK(tokens.key_dim <= kMaxDim, kInvalidArgument,
                 detail::message("RecallStore::demote: dim ", tokens.key_dim, " > ", kMaxDim));
    for (std::size_t i = 1; i < n; ++i) {
      KVPACK_CHECK(tokens.positions[i] > tokens.positions[i - 1], kInvalidArgument,
                   "RecallStore::demote: positions must increase");
    }
    const auto found = layers_.find({dropped.seq, dropped.layer});
    KVPACK_CHECK(found == layers_.end() || (found->second.mode == Mode::kDemoted && found->second.dim == tokens.key_dim),
                 kInvalidArgument, "RecallStore::demote: this layer is written through, or was demoted with another dim");
    const bool fresh = found == layers_.end();
    const auto stream = static_cast<std::size_t>(dropped.stream);
    Entries* entries = nullptr;
    std::size_t before = 0;
    std::uint64_t bytes = 0;
    try {
      auto at = found;
      if (fresh) {
        const std::pair key{dropped.seq, dropped.layer};
        at = layers_.emplace(key, Layer{Mode::kDemoted, tokens.key_dim, -1, {}}).first;
      }
      Layer& layer = at->second;
      if (layer.streams.size() <= stream) layer.streams.resize(stream + 1);
      entries = &layer.streams[stream];
      before = entries->size();
      for (std::size_t first = 0; first < n; first += static_cast<std::size_t>(chunk_tokens_)) {
        const std::size_t count = std::min(n - first, static_cast<std::size_t>(chunk_tokens_));
        const std::vector<std::byte> entry =
            encode(count, tokens.key_dim, [&](std::size_t i) { return tokens.positions[first + i]; },
                   [&](std::size_t i, bool value) { return (value ? tokens.values : tokens.keys).data() + (first + i) * d; });
        tier_.put(key_of(dropped.seq, dropped.layer, dropped.stream, entries->size()), entry);
        entries->push_back({tokens.positions[first], tokens.positions[first + count - 1]});
        bytes += entry.size();
      }
    } catch (...) {
      // Take back what was put (best effort: the next demotion overwrites those keys anyway).
      for (std::size_t entry = before; entries != nullptr && entry < entries->size(); ++entry) {
        try {
          (void)tier_.erase(key_of(dropped.seq, dropped.layer, dropped.stream, entry));
        } catch (...) {
        }
      }
      if (entries != nullptr) entries->resize(before);
      if (fresh) layers_.erase({dropped.seq, dropped.layer});  // as if never called
      ++stats_.demotions_failed;
      throw;
    }
    stats_.bytes_written += bytes;
    stats_.tokens_demoted += n;
  }

  /// First and last position of an entry's tokens (one chunk of one write or demotion; a
  /// demoted entry may skip positions in between).
  using EntryRange = std::pair<std::int32_t, std::int32_t>;

  /// The entries held for (seq, layer, stream), in the order written.
  [[nodiscard]] std::span<const EntryRange> entries(SeqId seq, index_t layer, index_t stream) const {
    const auto found = layers_.find({seq, layer});
    if (found == layers_.end() || stream < 0 || static_cast<std::size_t>(stream) >= found->second.streams.size()) return {};
    return found->second.streams[static_cast<std::size_t>(stream)];
  }

  /// Appends the tokens of entry `entry` of (seq, layer, stream) to `out` (its dims set).
  /// \throws kvpack::Error kInvalidArgument for an entry not written; kUnavailable when the tier
  ///         no longer holds it (a bounded tier dropped it) or cannot be read; kInvalidArgument
  ///         when damaged.
  void read_entry(SeqId seq, index_t layer, index_t stream, std::size_t entry, StoredTokens& out) {
    KVPACK_CHECK(entry < entries(seq, layer, stream).size(), kInvalidArgument,
                 detail::message("RecallStore::read_entry: sequence ", seq, " layer ", layer, " stream ", stream,
                                 " has no entry ", entry));
    const index_t dim = layers_.find({seq, layer})->second.dim;
    out.key_dim = out.value_dim = dim;
    const std::string key = key_of(seq, layer, stream, entry);
    const std::optional<std::vector<std::byte>> bytes = tier_.get(key);
    KVPACK_CHECK(bytes.has_value(), kUnavailable,
                 detail::message("RecallStore: ", tier_.describe(), " no longer holds '", key, "'"));
    stats_.bytes_fetched += bytes->size();
    decode(*bytes, dim, key, out);
  }

  /// Every token held for (seq, layer, stream), in the order written (position order for a
  /// layer written through).
  /// \throws kvpack::Error as read_entry
  [[nodiscard]] StoredTokens read(SeqId seq, index_t layer, index_t stream) {
    StoredTokens out;
    for (std::size_t entry = 0; entry < entries(seq, layer, stream).size(); ++entry) {
      read_entry(seq, layer, stream, entry, out);
    }
    return out;
  }

  /// Removes `seq`'s entries from the tier.
  void forget(SeqId seq) {
    for (auto it = layers_.lower_bound({seq, 0}); it != layers_.end() && it->first.first == seq;) {
      for (std::size_t s = 0; s < it->second.streams.size(); ++s) {
        for (std::size_t entry = 0; entry < it->second.streams[s].size(); ++entry) {
          tier_.erase(key_of(seq, it->first.second, static_cast<index_t>(s), entry));
        }
      }
      it = layers_.erase(it);
    }
  }

  [[nodiscard]] const RecallStats& stats() const noexcept { return stats_; }
  [[nodiscard]] RecallStats& stats() noexcept { return stats_; }

 private:
  enum class Mode { kThrough, kDemoted };
  using Entries = std::vector<EntryRange>;
  struct Layer {
    Mode mode = Mode::kThrough;
    index_t dim = 0;
    std::int64_t last_position = -1;  ///< written through so far
    std::vector<Entries> streams;     ///< [streams]
  };

  [[nodiscard]] std::string key_of(SeqId seq, index_t layer, index_t stream, std::size_t entry) const {
    return detail::message(name_, "-s", seq, "-l", layer, "-h", stream, "-c", entry);
  }

  /// One entry: n tokens, position(i) and row(i, value) giving token i's position and key or
  /// value row of `dim` floats; in fp16 when the store says so and every value fits.
  template <class Position, class Row>
  [[nodiscard]] std::vector<std::byte> encode(std::size_t n, index_t dim, Position position, Row row) const {
    const std::size_t d = static_cast<std::size_t>(dim);
    bool narrow = precision_ == EntryPrecision::kF16;
    for (std::size_t i = 0; narrow && i < n; ++i) {
      for (const bool value : {false, true}) {
        const float* x = row(i, value);
        for (std::size_t c = 0; c < d; ++c) narrow &= std::isfinite(static_cast<float>(half(x[c]))) == std::isfinite(x[c]);
      }
    }
    const std::size_t element = narrow ? sizeof(half) : sizeof(float);
    std::vector<std::byte> entry(8 + n * 4 + 2 * n * d * element);
    const std::uint32_t tokens = static_cast<std::uint32_t>(n);
    const std::uint16_t shape[2] = {static_cast<std::uint16_t>(dim), static_cast<std::uint16_t>(element)};
    std::memcpy(entry.data(), &tokens, 4);
    std::memcpy(entry.data() + 4, shape, 4);
    std::byte* p = entry.data() + 8;
    for (std::size_t i = 0; i < n; ++i, p += 4) {
      const std::int32_t at = position(i);
      std::memcpy(p, &at, 4);
    }
    for (const bool value : {false, true}) {
      for (std::size_t i = 0; i < n; ++i, p += d * element) {
        if (!narrow) {
          std::memcpy(p, row(i, value), d * sizeof(float));
          continue;
        }
        for (std::size_t c = 0; c < d; ++c) {
          const half h(row(i, value)[c]);
          std::memcpy(p + c * sizeof(half), &h, sizeof(half));
        }
      }
    }
    return entry;
  }

  static void decode(std::span<const std::byte> entry, index_t dim, const std::string& key, StoredTokens& out) {
    KVPACK_CHECK(entry.size() >= 8, kInvalidArgument, detail::message("RecallStore: entry '", key, "' is truncated"));
    std::uint32_t tokens = 0;
    std::uint16_t shape[2] = {0, 0};
    std::memcpy(&tokens, entry.data(), 4);
    std::memcpy(shape, entry.data() + 4, 4);
    const std::size_t n = tokens, d = shape[0], element = shape[1];
    KVPACK_CHECK(d == static_cast<std::size_t>(dim) && (element == sizeof(float) || element == sizeof(half)) &&
                     entry.size() == 8 + n * 4 + 2 * n * d * element,
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
      if (element == sizeof(float)) {
        std::memcpy(plane->data() + old, p, n * d * sizeof(float));
      } else {
        for (std::size_t j = 0; j < n * d; ++j) {
          half h;
          std::memcpy(&h, p + j * sizeof(half), sizeof(half));
          (*plane)[old + j] = static_cast<float>(h);
        }
      }
      p += n * d * element;
    }
  }

  Tier& tier_;
  std::string name_;
  index_t chunk_tokens_;
  EntryPrecision precision_;
  std::map<std::pair<SeqId, index_t>, Layer> layers_;  ///< by (seq, layer)
  RecallStats stats_;
};

namespace recall_detail {

/// A head's softmax over some tokens: its largest scaled score and Σ e^{s − max}.
struct Softmax {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0.0;
};

/// Scores of query head `h` over `tokens`, in double from the query scaled in float as attend
/// scales it (the span bounds are of that query).
inline void head_scores(const StoredTokens& tokens, std::span<const float> query, index_t h, index_t dim, float scale,
                        std::vector<double>& scores) {
  const std::size_t n = tokens.positions.size(), d = static_cast<std::size_t>(dim);
  thread_local std::vector<float> q;
  q.resize(d);
  for (std::size_t c = 0; c < d; ++c) q[c] = query[static_cast<std::size_t>(h) * d + c] * scale;
  scores.resize(n);
  for (std::size_t t = 0; t < n; ++t) {
    double dot = 0.0;
    for (std::size_t c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * tokens.keys[t * d + c];
    scores[t] = dot;
  }
}

inline Softmax softmax_of(const std::vector<double>& scores) {
  Softmax state;
  for (double x : scores) state.max = std::max(state.max, x);
  for (double x : scores) state.sum += std::exp(x - state.max);
  return state;
}

/// out[heads][d] = exact softmax attention of each query head over `tokens` (double); returns
/// each head's softmax.
inline std::vector<Softmax> exact_heads(const StoredTokens& tokens, std::span<const float> query, index_t first_head,
                                        index_t heads, index_t dim, float scale, std::span<float> out) {
  const std::size_t n = tokens.positions.size(), d = static_cast<std::size_t>(dim);
  std::vector<double> p, acc(d);
  std::vector<Softmax> states;
  for (index_t h = first_head; h < first_head + heads; ++h) {
    head_scores(tokens, query, h, dim, scale, p);
    const Softmax state = softmax_of(p);
    states.push_back(state);
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::size_t t = 0; t < n; ++t) {
      const double weight = std::exp(p[t] - state.max) / state.sum;
      for (std::size_t c = 0; c < d; ++c) acc[c] += weight * tokens.values[t * d + c];
    }
    for (std::size_t c = 0; c < d; ++c) out[static_cast<std::size_t>(h) * d + c] = static_cast<float>(acc[c]);
  }
  return states;
}

/// The certified unread mass of head `h` (of `group`) when spans `rest` (indices) stay unread
/// and the attended tokens' softmax is `attended`: select::unread_mass_bound, with the sum
/// rounded down to float so that it stays a lower bound.
inline double mass_left(std::span<const UnreadSpan> spans, std::span<const float> bounds, std::span<const std::size_t> rest,
                        index_t h, const Softmax& attended) {
  thread_local std::vector<float> u;
  thread_local std::vector<index_t> n;
  u.clear();
  n.clear();
  for (std::size_t e : rest) {
    u.push_back(bounds[static_cast<std::size_t>(h) * spans.size() + e]);
    n.push_back(spans[e].tokens);
  }
  // unread_mass_bound takes the max as a float: the sum is rescaled to the rounded max and
  // rounded down, so that it stays a lower bound of the attended sum.
  const float max = static_cast<float>(attended.max);
  const double rescaled = std::isfinite(max) ? attended.sum * std::exp(attended.max - max) * (1.0 - 0x1p-30) : 0.0;
  float sum = static_cast<float>(rescaled);
  if (static_cast<double>(sum) > rescaled) sum = std::nextafter(sum, 0.0f);
  return select::unread_mass_bound(u, n, max, sum);
}

/// A stream's unread spans in decreasing order of their share of the bound: a span's largest
/// term tokens·e^{U} relative to a head's attended sum, in logs (a NaN bound first).
inline std::vector<std::size_t> spans_by_share(std::span<const UnreadSpan> spans, std::span<const float> bounds,
                                               std::span<const Softmax> attended) {
  const std::size_t count = spans.size();
  std::vector<double> share(count, -std::numeric_limits<double>::infinity());
  for (std::size_t e = 0; e < count; ++e) {
    for (std::size_t h = 0; h < attended.size(); ++h) {
      const double u = bounds[h * count + e];
      const double term = u + std::log(static_cast<double>(spans[e].tokens)) - attended[h].max - std::log(attended[h].sum);
      share[e] = std::max(share[e], std::isnan(term) ? std::numeric_limits<double>::infinity() : term);
    }
  }
  std::vector<std::size_t> order(count);
  for (std::size_t e = 0; e < count; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return share[a] > share[b]; });
  return order;
}

/// The fewest k such that, with the spans order[0, k) attended (or not: counting them unread is
/// only looser), every head's mass_left over order[k, end) against `attended` is at most
/// `epsilon`. Fetching more spans only lowers the bound, so k is found by bisection.
inline std::size_t spans_needed(std::span<const UnreadSpan> spans, std::span<const float> bounds,
                                std::span<const std::size_t> order, std::span<const Softmax> attended, double epsilon) {
  const auto fits = [&](std::size_t k) {
    for (std::size_t h = 0; h < attended.size(); ++h) {
      if (mass_left(spans, bounds, order.subspan(k), static_cast<index_t>(h), attended[h]) > epsilon) return false;
    }
    return true;
  };
  std::size_t low = 0, high = order.size();  // fits(size): nothing left unread
  while (low < high) {
    const std::size_t mid = low + (high - low) / 2;
    if (fits(mid)) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  return low;
}

/// Spans whose position ranges overlap, directly or through others, in one group: a token
/// recalled inside a group's range may be any of its spans' (ghosts merge neighbours' ranges,
/// compaction leaves live tokens inside a ghost's), so whether the store gave back every dropped
/// token can only be counted per group, and a group is fetched whole. Returns each span's group;
/// `ranges` receives each group's first and last position.
inline std::vector<std::size_t> overlap_groups(std::span<const UnreadSpan> spans,
                                               std::vector<std::pair<std::int32_t, std::int32_t>>& ranges) {
  std::vector<std::size_t> by_start(spans.size());
  for (std::size_t e = 0; e < spans.size(); ++e) by_start[e] = e;
  std::sort(by_start.begin(), by_start.end(),
            [&](std::size_t a, std::size_t b) { return spans[a].first_position < spans[b].first_position; });
  std::vector<std::size_t> group(spans.size());
  ranges.clear();
  for (std::size_t e : by_start) {
    if (ranges.empty() || spans[e].first_position > ranges.back().second) {
      ranges.emplace_back(spans[e].first_position, spans[e].last_position);
    } else {
      ranges.back().second = std::max(ranges.back().second, spans[e].last_position);
    }
    group[e] = ranges.size() - 1;
  }
  return group;
}

/// Adds token scores to a head's softmax.
inline void add_scores(Softmax& state, std::span<const double> scores) {
  for (double x : scores) {
    if (x > state.max) {
      state.sum = state.sum * std::exp(state.max - x) + 1.0;
      state.max = x;
    } else {
      state.sum += std::exp(x - state.max);
    }
  }
}

}  // namespace recall_detail

/// attend with the cache's certified bound; for every KV stream with a query head whose bound
/// exceeds report.epsilon, the unread spans the bound implicates are fetched from `store` (see
/// the file comment) and the stream's heads recomputed exactly over the live tokens plus the
/// dropped ones fetched. `Cache` is a KVCache (attend with a report) or an eval::AnyCache
/// (attend_reported). Returns the streams recalled; `report` stays what attend reported, and
/// store.stats() says what recall fetched and left (max_mass_left ≤ epsilon).
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
  // Entries live under the layer that wrote the tokens (layout::CrossLayer's groups share one).
  index_t written_layer = layer;
  if constexpr (requires { cache.writing_layer(layer); }) written_layer = cache.writing_layer(layer);
  const ModelShape& shape = cache.shape();
  const index_t dim = shape.head_dim, group = shape.q_heads / shape.kv_heads;
  index_t recalled = 0;
  std::vector<double> scores;
  for (index_t s = 0; s < shape.kv_heads; ++s) {
    bool fired = false;
    for (index_t g = 0; g < group; ++g) fired |= report.heads[static_cast<std::size_t>(s * group + g)].fired(report.epsilon);
    if (!fired) continue;
    StoredTokens all = cache.read_back(seq, layer, s);
    const auto stream = static_cast<std::size_t>(s);
    const std::span<const UnreadSpan> spans(report.unread_spans[stream]);
    const std::span<const float> bounds(report.unread_score_bounds[stream]);
    KVPACK_CHECK(bounds.size() == spans.size() * static_cast<std::size_t>(group), kInvalidArgument,
                 detail::message("attend_with_recall: the report holds ", bounds.size(), " span bounds for ",
                                 spans.size(), " spans of ", group, " heads"));
    const auto heads = static_cast<std::size_t>(group);
    std::vector<recall_detail::Softmax> state(heads);
    for (std::size_t g = 0; g < heads; ++g) {
      recall_detail::head_scores(all, query, s * group + static_cast<index_t>(g), dim, scale, scores);
      state[g] = recall_detail::softmax_of(scores);
    }
    // Fetch in rounds of 1, 1, 2, 4, … spans in order of share, until the bound over the rest,
    // against what is attended by then (the fetched tokens raise its sum), is at most epsilon:
    // few round trips, and a needle whose span comes first ends recall after one.
    const std::vector<std::size_t> order = recall_detail::spans_by_share(spans, bounds, state);
    std::vector<std::pair<std::int32_t, std::int32_t>> group_ranges;
    const std::vector<std::size_t> group_of = recall_detail::overlap_groups(spans, group_ranges);
    std::vector<std::uint8_t> group_fetched(group_ranges.size(), 0), span_fetched(spans.size(), 0);
    const std::vector<std::int32_t> live_positions = all.positions;
    const std::span<const RecallStore::EntryRange> entries = store.entries(seq, written_layer, s);
    std::vector<std::uint8_t> fetched(entries.size(), 0);
    std::set<std::int32_t> recalled_positions;
    const std::size_t d = static_cast<std::size_t>(dim);
    std::size_t taken = 0;
    for (;;) {
      const std::size_t needed = recall_detail::spans_needed(spans, bounds, order, state, report.epsilon);
      if (needed <= taken) break;
      const std::size_t target = std::min(needed, std::max<std::size_t>(1, 2 * taken));
      StoredTokens written;
      std::vector<std::size_t> groups;  // fetched in this round
      for (std::size_t i = taken; i < target; ++i) {
        const std::size_t g = group_of[order[i]];
        if (group_fetched[g] != 0) continue;
        group_fetched[g] = 1;
        groups.push_back(g);
        const auto [first, last] = group_ranges[g];
        for (std::size_t entry = 0; entry < entries.size(); ++entry) {
          if (fetched[entry] != 0 || entries[entry].first > last || entries[entry].second < first) continue;
          store.read_entry(seq, written_layer, s, entry, written);
          fetched[entry] = 1;
        }
      }
      // The dropped ones (not live, and not fetched before: a token can be demoted twice when a
      // copy-on-write failure kept it after its demotion) join what is attended.
      StoredTokens dropped;
      for (std::size_t t = 0; t < written.positions.size(); ++t) {
        if (std::binary_search(live_positions.begin(), live_positions.end(), written.positions[t]) ||
            !recalled_positions.insert(written.positions[t]).second) {
          continue;
        }
        for (StoredTokens* to : {&all, &dropped}) {
          to->positions.push_back(written.positions[t]);
          to->keys.insert(to->keys.end(), written.keys.begin() + t * d, written.keys.begin() + (t + 1) * d);
          to->values.insert(to->values.end(), written.values.begin() + t * d, written.values.begin() + (t + 1) * d);
        }
        ++stats.tokens_recalled;
      }
      // A group counts as fetched only when each of its spans' dropped tokens (unread and not
      // live: the live ones of a page Quest skipped are attended from the cache) came back.
      // Positions may skip numbers, so tokens are counted, not positions walked; live tokens in
      // the range do not count, since a page read or compacted holds them beside its dropped
      // ones. Fewer recalled tokens in the group's range than it dropped means the store never
      // held some (not written through, forgotten, a fork's prefix under its parent's id), and
      // the rest cannot be certified.
      for (std::size_t g : groups) {
        const auto [first, last] = group_ranges[g];
        std::int64_t dropped_tokens = 0;
        for (std::size_t e = 0; e < spans.size(); ++e) {
          if (group_of[e] != g) continue;
          dropped_tokens += spans[e].tokens - spans[e].live;
          span_fetched[e] = 1;
        }
        const auto back = std::distance(recalled_positions.lower_bound(first), recalled_positions.upper_bound(last));
        KVPACK_CHECK(back >= dropped_tokens, kUnavailable,
                     detail::message("attend_with_recall: the store holds no entry for ", dropped_tokens - back,
                                     " of the tokens at positions ", first, "..", last, " of sequence ", seq,
                                     " layer ", written_layer, " stream ", s,
                                     ", which the cache dropped (not written through or demoted, or forgotten)"));
      }
      for (std::size_t g = 0; g < heads; ++g) {
        recall_detail::head_scores(dropped, query, s * group + static_cast<index_t>(g), dim, scale, scores);
        recall_detail::add_scores(state[g], scores);
      }
      taken = target;
      while (taken < order.size() && span_fetched[order[taken]] != 0) ++taken;  // fetched with a group
    }
    std::vector<std::size_t> rest;  // in order; a prefix of it may have been fetched with a group
    for (std::size_t e : std::span<const std::size_t>(order).subspan(taken)) {
      if (span_fetched[e] == 0) rest.push_back(e);
    }
    const std::vector<recall_detail::Softmax> attended =
        recall_detail::exact_heads(all, query, s * group, group, dim, scale, out);
    for (index_t g = 0; g < group; ++g) {
      stats.max_mass_left = std::max(stats.max_mass_left,
                                     recall_detail::mass_left(spans, bounds, rest, g, attended[static_cast<std::size_t>(g)]));
    }
    stats.spans_recalled += spans.size() - rest.size();
    stats.spans_left += rest.size();
    ++stats.streams_recalled;
    ++recalled;
  }
  if (recalled > 0) ++stats.recalls;
  return recalled;
}

}  // namespace kvpack::inline v0::tier
