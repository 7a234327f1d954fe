#pragma once
/// \file cache.hpp
/// \brief kvpack::KVCache<Layout, Quantizer, Evictor, Selector>: a paged, compressed KV cache
///        with decode attention that reads the compressed pages directly.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/encoded_page.hpp"
#include "kvpack/evict/attention_scores.hpp"
#include "kvpack/evict/evict_concepts.hpp"
#include "kvpack/evict/keep_all.hpp"
#include "kvpack/kernels/attend_latent.hpp"
#include "kvpack/kernels/attend_stream.hpp"
#include "kvpack/layout/layout_concepts.hpp"
#include "kvpack/paging/page_pool.hpp"
#include "kvpack/paging/prefix_index.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "kvpack/select/dense.hpp"
#include "kvpack/select/quest.hpp"
#include "kvpack/select/select_concepts.hpp"
#include "kvpack/select/unread_bound.hpp"

namespace kvpack::inline v0 {

/// An element type `prefill`, `append` and `attend` accept: float, kvpack::half,
/// kvpack::bfloat16, or a caller's own type convertible to float.
template <class T>
concept InputElement = std::is_convertible_v<T, float>;

/// What `KVCache::add_sequence(tokens)` returns: the new sequence and how many of its first
/// tokens it already holds (whole pages of a cached prefix, in every layer); prefill the rest.
struct PrefixHit {
  SeqId seq = 0;
  index_t cached_tokens = 0;
};

/// The KV cache of one model: many sequences, each a stream per (layer, KV stream) of pages
/// plus a full-precision tail. See DESIGN.md §2–§3.
///
/// Threads: one sequence is mutated by one thread at a time; different sequences may be written
/// and read from different threads concurrently, and a sequence no thread is changing may be
/// attended and forked from several at once; `memory()` may be called from any thread.
/// Every call that throws leaves the cache as it was (the strong guarantee).
///
/// Eviction: with an Evictor that drops tokens, each prefill (and each append, for evictors that
/// evict during decode) ends by letting every (layer, KV stream) over its budget drop tokens. A
/// tail row dies before it is encoded (a page all of whose rows died is never allocated), a page
/// slot dies in its page's live mask, a page whose last slot dies goes back to the pool, and once
/// half of a stream's page slots are dead its pages are compacted: decoded and re-encoded densely
/// (group codecs re-quantize; see the README for the bound). Pages shared with a fork are copied
/// before they change. Eviction never fails the write that triggered it: when it cannot get
/// memory it keeps those tokens and tries again after the next write. Tokens in a pinned span
/// (`pin`) and the exact prefix are never dropped. With an evictor that needs scores (H2O),
/// `attend` adds every token's attention probability to its score, so attending a sequence
/// changes it: one thread at a time per sequence.
///
/// Prefix sharing (CacheConfig::prefix_sharing, off by default): add_sequence(tokens) starts a
/// sequence on the cached pages of the longest whole-page prefix of its prompt, and share_prefix
/// and release cache a prompt's whole pages; see the README's "Prefix sharing". With an evictor,
/// shared prompt tokens are pinned in every sequence that holds them.
///
/// \tparam Layout    layout::GQA, layout::CrossLayer<GQA, K>, layout::MLA — how tokens map to KV
///                   streams, and which layers keep a cache
/// \tparam Quantizer quant::Float<T>, quant::FP8<F>, quant::Int8, quant::Q8_0, quant::Q4_0, ...
/// \tparam Evictor   evict::KeepAll, evict::StreamingLLM<Budget>, evict::H2O<Budget>, evict::SnapKV<Budget>
///                   — which tokens each (layer, KV stream) drops after a write; see "Eviction" below
/// \tparam Selector  select::DenseRead, or select::Quest: attend reads the pages whose keys may
///                   score highest, and can certify how much attention it left unread
template <layout::Layout Layout, quant::Quantizer Quantizer, evict::Evictor Evictor = evict::KeepAll,
          select::PageSelector Selector = select::DenseRead>
class KVCache {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  using KeyParams = typename KeyCodec::params_type;
  using ValueParams = typename ValueCodec::params_type;
  static constexpr bool kEvicts = Evictor::kDropsTokens;
  /// Whether pages carry select::Quest's summary: the keys' channel min and max as read.
  static constexpr bool kSummarizes = !Selector::kReadsAllPages;
  /// Whether per-slot attention scores are kept for the evictor.
  static constexpr bool kKeepsScores = [] {
    if constexpr (Evictor::kDropsTokens) return Evictor::kNeedsScores || Evictor::kUsesObservation;
    return false;
  }();

  static_assert(KeyCodec::kPlane == Plane::kKey,
                "Quantizer::key_codec encodes the value plane: keys need a key-plane codec "
                "(their byte layouts differ)");
  static_assert(ValueCodec::kPlane == Plane::kValue,
                "Quantizer::value_codec encodes the key plane: values need a value-plane codec");
  // select::Quest passes: it may read every page (dense_layers), which the constructor checks.
  static_assert(!(Evictor::kNeedsScores && !Selector::kReadsAllPages) || std::is_same_v<Selector, select::Quest>,
                "an Evictor that ranks tokens by attention scores cannot be combined with a "
                "Selector that skips pages: tokens on unread pages would never be scored");
  static_assert(Selector::kReadsAllPages || std::is_same_v<Selector, select::Quest>,
                "KVCache applies select::Quest; another selector that skips pages needs its own path");
  /// layout::MLA: one latent stream per layer, scored on [value plane ; key plane].
  static constexpr bool kLatent = layout::scores_latent<Layout>;
  static_assert(!kLatent || (!Evictor::kDropsTokens && Selector::kReadsAllPages),
                "layout::MLA supports neither eviction nor Quest yet: its one stream is read by every "
                "query head, so token scores and page bounds must be aggregated over all of them (and "
                "Quest's summaries span the latent and RoPE planes); use evict::KeepAll and select::DenseRead");

 public:
  using layout_type = Layout;
  using quantizer_type = Quantizer;
  /// One stream's codec parameters: the key codec's, then the value codec's (codec_params()).
  using CodecParams = std::pair<KeyParams, ValueParams>;
  using evictor_type = Evictor;
  using selector_type = Selector;

  /// \throws kvpack::Error when the shape, the config or the codecs' options do not fit together
  ///         (e.g. q4_0 with a head_dim that is not a multiple of 32).
  explicit KVCache(const ModelShape& shape, CacheConfig config = {}, Quantizer quantizer = {},
                   Layout layout = {}, Evictor evictor = {}, Selector selector = {})
      : shape_(shape),
        config_(std::move(config)),
        quantizer_(std::move(quantizer)),
        layout_(layout),
        evictor_(std::move(evictor)),
        selector_(std::move(selector)),
        streams_(validated_streams(layout_, shape_)),
        key_dim_(layout_.key_dim(shape_)),
        value_dim_(layout_.value_dim(shape_)),
        cache_layers_(layout::cache_layers(layout_, shape_)),
        pool_(page_format(), config_.max_pages),
        rope_tables_(config_.key_rope ? RopeTables::shared(*config_.key_rope, key_dim_) : nullptr) {
    for (index_t h = 0; h < shape_.q_heads; ++h) {
      KVPACK_CHECK(layout_.stream_of_query_head(shape_, h) == h / shape_.group_size(), kInvalidConfig,
                   detail::message("layout ", Layout::kName, " maps query head ", h,
                                   " outside its contiguous group; KVCache needs contiguous groups"));
    }
    quantizer_.key.validate(key_geometry());
    quantizer_.value.validate(value_geometry());
    // A bad KVPACK_ISA is reported here: the write path picks its encoder where it may no
    // longer throw, and the choice is made once per process.
    (void)dispatch::active_cpu_isa();
    // Codecs whose parameters were made for one model (FP8's static per-head scales, KVQuant's
    // calibration) check its shape; their tables are indexed by model layer and KV stream.
    if constexpr (requires { quantizer_.key.check_model(shape_.layers, streams_); }) {
      quantizer_.key.check_model(shape_.layers, streams_);
    }
    if constexpr (requires { quantizer_.value.check_model(shape_.layers, streams_); }) {
      quantizer_.value.check_model(shape_.layers, streams_);
    }
    if constexpr (kEvicts) {
      evictor_.validate();
      // The exact prefix is kept and counts towards each budget: it must leave room for the
      // token just written. The smallest budget of a layer is the one for the longest context.
      for (index_t layer = 0; layer < cache_layers_; ++layer) {
        const index_t least = evictor_.capacity(layer, cache_layers_, std::numeric_limits<index_t>::max());
        KVPACK_CHECK(config_.exact_prefix_tokens < least, kInvalidConfig,
                     detail::message(Evictor::kName, " keeps ", least, " tokens per KV stream of layer ", layer,
                                     " at long contexts; CacheConfig.exact_prefix_tokens (",
                                     config_.exact_prefix_tokens, ") must leave room for the newest token"));
      }
    }
    if (evict::uses_in_cache_positions(evictor_)) {
      KVPACK_CHECK(config_.key_rope.has_value(), kInvalidConfig,
                   "in_cache_positions rotates keys when they are read: it needs keys stored before RoPE "
                   "(CacheConfig.key_rope)");
      KVPACK_CHECK(!kSummarizes, kUnsupported,
                   "in_cache_positions changes every key's rotation as tokens leave, which would make "
                   "select::Quest's page summaries stale");
    }
    if constexpr (kSummarizes) {
      selector_.validate();
      if constexpr (Evictor::kNeedsScores) {
        // Here Quest only keeps summaries (for the bound): a skipped page's tokens would go unscored.
        KVPACK_CHECK(selector_.reads_densely(shape_.layers - 1), kUnsupported,
                     detail::message(Evictor::kName, " ranks tokens by attention scores, so it needs every page "
                                     "read: select::Quest's dense_layers must cover all ", shape_.layers,
                                     " layers, got ", selector_.dense_layers));
      }
      KVPACK_CHECK(shape_.group_size() <= 64 && key_dim_ <= 1024, kUnsupported,
                   detail::message("select::Quest scores pages for at most 64 query heads per KV head and "
                                   "head_dim 1024, got ", shape_.group_size(), " and ", key_dim_));
    }
    KVPACK_CHECK(kLatent || key_dim_ == value_dim_, kUnsupported,
                 "KVCache's attention kernels need key and value rows of the same width");
    if constexpr (kLatent) {
      // DeepSeek-V2 caches k^R after RoPE; rotating at read time would need the latent kernel to
      // rotate its tile.
      KVPACK_CHECK(!config_.key_rope.has_value(), kUnsupported,
                   "layout::MLA stores the decoupled RoPE key after rotation: CacheConfig.key_rope must be unset");
    }
    key_params_.reserve(static_cast<std::size_t>(cache_layers_) * streams_);
    value_params_.reserve(key_params_.capacity());
    for (index_t layer = 0; layer < cache_layers_; ++layer) {
      // Per-layer codec parameters (FP8 static scales, KVQuant's calibration) are those of the
      // model layer that writes the cache layer.
      const index_t writer = layout::writer_of(layout_, shape_, layer);
      for (index_t s = 0; s < streams_; ++s) {
        key_params_.push_back(quantizer_.key.initial_params(writer, s));
        value_params_.push_back(quantizer_.value.initial_params(writer, s));
        // Codecs with tables built on first use (TurboQuant's rotations) build them here: encoding
        // happens after write_tokens' last possible throw and must not allocate.
        if constexpr (requires { quantizer_.key.prepare(key_geometry(), key_params_.back()); }) {
          quantizer_.key.prepare(key_geometry(), key_params_.back());
        }
        if constexpr (requires { quantizer_.value.prepare(value_geometry(), value_params_.back()); }) {
          quantizer_.value.prepare(value_geometry(), value_params_.back());
        }
      }
    }
    // shape_ was validated: layers > 0 (max() tells the compiler so).
    calibrated_ = std::make_unique<std::atomic<bool>[]>(static_cast<std::size_t>(std::max<index_t>(cache_layers_, 1)));
    if (config_.prefix_sharing) {
      // The exact prefix is fp32 rows per sequence, not pages: a hit could not supply them.
      KVPACK_CHECK(config_.exact_prefix_tokens == 0, kUnsupported,
                   detail::message("CacheConfig.prefix_sharing shares whole pages from the first token: it needs "
                                   "exact_prefix_tokens == 0, got ", config_.exact_prefix_tokens));
      prefix_options_ = prefix_options_fingerprint();
      prefix_index_ = std::make_unique<paging::PrefixIndex>(
          pool_, config_.page_size, static_cast<std::size_t>(cache_layers_) * streams_);
    }
  }

  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;
  ~KVCache() {
    for (auto& [id, sequence] : sequences_) release_pages(*sequence);
  }

  [[nodiscard]] const ModelShape& shape() const noexcept { return shape_; }
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] const Quantizer& quantizer() const noexcept { return quantizer_; }
  [[nodiscard]] index_t streams_per_layer() const noexcept { return streams_; }

  /// Starts an empty sequence.
  [[nodiscard]] SeqId add_sequence() {
    auto sequence = std::make_unique<Sequence>(cache_layers_);
    std::unique_lock lock(sequences_mutex_);
    const SeqId id = next_id_;
    sequences_.emplace(id, std::move(sequence));  // may throw bad_alloc: no id used up
    ++next_id_;
    return id;
  }

  /// Starts a sequence whose first tokens are `prompt` (CacheConfig::prefix_sharing must be set).
  /// When the cache holds the K/V of a prefix of it under the same model, salt, codec parameters
  /// and cache options, the sequence starts with those pages (shared, not copied) in every layer:
  /// `cached_tokens` tokens at positions 0 … cached_tokens − 1, a multiple of page_size; prefill
  /// then continues from position cached_tokens with the rest of the prompt. At least
  /// max(1, tail_tokens) tokens are left to prefill: the engine needs the last token's logits,
  /// and the full-precision tail then fills exactly as a prefill of the whole prompt would
  /// (attention is bit-identical to one). The caller promises that the K/V it writes at
  /// positions 0 … n − 1 are those of prompt[0 … n − 1]: the cache cannot check it.
  /// The prompt is kept with the sequence; its whole pages are cached at release (and by
  /// share_prefix). A lookup counts in prefix_stats() even when a later allocation throws.
  /// \param salt sequences added with different salts never share pages (tenants, privacy)
  /// \throws kvpack::Error(kUnsupported) without CacheConfig::prefix_sharing
  [[nodiscard]] PrefixHit add_sequence(std::span<const paging::TokenId> prompt, std::string_view salt = {}) {
    KVPACK_CHECK(prefix_index_ != nullptr, kUnsupported,
                 "add_sequence(tokens) shares prompt prefixes: set CacheConfig.prefix_sharing (or call "
                 "add_sequence())");
    const std::size_t page = static_cast<std::size_t>(config_.page_size);
    const std::size_t left = std::max<std::size_t>(1, static_cast<std::size_t>(config_.tail_tokens));
    const std::size_t lookup = prompt.size() > left ? prompt.size() - left : 0;
    auto sequence = std::make_unique<Sequence>(cache_layers_);
    sequence->prompt.assign(prompt.begin(), prompt.end());
    sequence->salt = salt;
    paging::PrefixMatch hit = prefix_index_->match(prefix_key(sequence->salt), prompt.first(lookup));
    const auto cached = static_cast<index_t>(hit.pages * page);
    if (hit.pages > 0) {
      for (index_t layer = 0; layer < cache_layers_; ++layer) {
        // The state a prefill of `cached` tokens leaves when tail_tokens is 0: whole pages and
        // an empty tail, whose buffers are allocated as write_tokens' first write would (the
        // next prefill then takes the path of a layer written before).
        LayerState& state = sequence->layers[layer];
        size_rows(state);
        state.tables.resize(static_cast<std::size_t>(streams_));
        for (index_t s = 0; s < streams_; ++s) {
          state.tables[s].reserve(hit.pages);
          for (std::size_t p = 0; p < hit.pages; ++p) {
            state.tables[s].push_back(hit.page(p)[static_cast<std::size_t>(layer) * streams_ + s]);
          }
        }
        state.tokens = cached;
        state.last_position = cached - 1;
        if constexpr (kEvicts) adopt_eviction_state(state, hit.pages);
      }
      // Shared pages are pinned: evicting from one frees nothing while others hold it.
      if constexpr (kEvicts) sequence->pins.emplace_back(0, cached - 1);
    }
    sequence->lease = std::move(hit.lease);
    const Sequence& added = *sequence;
    SeqId id = 0;
    {
      std::unique_lock lock(sequences_mutex_);
      id = next_id_;
      sequences_.emplace(id, std::move(sequence));  // may throw bad_alloc: no id used up
      ++next_id_;
    }
    // The lease keeps the index's reference until here; now the sequence holds its own.
    for (const LayerState& state : added.layers) {
      for (const auto& table : state.tables) {
        for (PageId id_of_page : table) pool_.retain(id_of_page);
      }
    }
    account(added, +1);
    return {id, cached};
  }

  /// Caches the whole pages of a sequence's prompt (given to add_sequence(tokens)) that every
  /// layer holds, so that sequences added from now on can reuse them; release does the same.
  /// Call it after prefilling a prompt that concurrent requests share (a system prompt). Pages
  /// cover tokens from position 0 without gaps; a partial page, tokens beyond the prompt and
  /// pages written at other positions (append with gaps) are not cached; with an evictor, nor
  /// pages it dropped slots from or compacted, and the cached tokens are pinned in `seq` (as in
  /// every sequence that adopts them). Returns the prompt tokens now cached (a multiple of
  /// page_size).
  /// \throws kvpack::Error(kUnsupported) without prefix sharing, (kInvalidArgument) for a
  ///         sequence added without tokens
  index_t share_prefix(SeqId seq) {
    Sequence& sequence = find(seq, "share_prefix");
    KVPACK_CHECK(prefix_index_ != nullptr, kUnsupported,
                 "share_prefix: prefix sharing is off (CacheConfig.prefix_sharing)");
    KVPACK_CHECK(!sequence.prompt.empty(), kInvalidArgument,
                 detail::message("share_prefix: sequence ", seq, " was added without tokens (add_sequence(tokens))"));
    return insert_prefix(sequence);
  }

  /// The prefix index's counters and sizes (all zero without prefix sharing). Its cached pages
  /// are also in memory().pages_in_use: they stay allocated after their sequences are released,
  /// until a write finds the pool full or evict_prefix_cache drops them.
  [[nodiscard]] paging::PrefixIndexStats prefix_stats() const {
    return prefix_index_ ? prefix_index_->stats() : paging::PrefixIndexStats{};
  }

  /// Drops cached prefix pages no live sequence is using, least recently used first, until
  /// `pool_pages` pages went back to the pool (all of them by default). Writes do this on their
  /// own when the pool runs out.
  paging::PrefixEviction evict_prefix_cache(std::size_t pool_pages = paging::PrefixIndex::kAllPages) {
    return prefix_index_ ? prefix_index_->evict_unreferenced(pool_pages) : paging::PrefixEviction{};
  }

  /// Appends the prompt's keys and values for one layer, at positions following the layer's last
  /// one (0 for an empty layer); call again to prefill in chunks.
  /// \param keys   [T][kv_heads][head_dim], T > 0
  /// \param values [T][kv_heads][head_dim]
  /// \param observation_queries [W][q_heads][head_dim], the last W prompt queries (after RoPE),
  ///        for evictors that rank tokens by attention (SnapKV, H2O): query w is taken to sit at
  ///        position last − (W − 1 − w) and scores the tokens up to it with scale 1/√head_dim;
  ///        checked, unused by evictors that do not score
  template <InputElement T>
  void prefill(SeqId seq, index_t layer, std::span<const T> keys, std::span<const T> values,
               std::span<const T> observation_queries = {}) {
    Sequence& sequence = find(seq, "prefill");
    layer = written_layer(layer, "prefill");
    const std::size_t key_row = static_cast<std::size_t>(streams_) * key_dim_;
    const std::size_t value_row = static_cast<std::size_t>(streams_) * value_dim_;
    KVPACK_CHECK(!keys.empty() && keys.size() % key_row == 0, kInvalidArgument,
                 detail::message("prefill: keys must hold T > 0 rows of ",
                                 kLatent ? "rope_dim (layout::MLA) = " : "kv_heads * head_dim = ", key_row,
                                 " elements, got ", keys.size()));
    const std::size_t tokens = keys.size() / key_row;
    KVPACK_CHECK(values.size() == tokens * value_row, kInvalidArgument,
                 detail::message("prefill: values must hold ", tokens * value_row, " elements (", tokens, " tokens",
                                 kLatent ? " of latent_dim" : "", "), got ", values.size()));
    // MLA's cache never evicts, and its queries are not q_heads × head_dim wide.
    KVPACK_CHECK(!kLatent || observation_queries.empty(), kInvalidArgument,
                 "prefill: layout::MLA keeps every token; observation_queries must be empty");
    const std::size_t query_row = static_cast<std::size_t>(shape_.q_heads) * shape_.head_dim;
    KVPACK_CHECK(observation_queries.size() % query_row == 0, kInvalidArgument,
                 detail::message("prefill: observation_queries must hold rows of q_heads * head_dim = ",
                                 query_row, " elements, got ", observation_queries.size()));
    LayerState& state = sequence.layers[layer];
    const std::int64_t first = state.last_position + 1;
    KVPACK_CHECK(first + static_cast<std::int64_t>(tokens) - 1 <= max_position(), kOutOfRange,
                 detail::message("prefill: positions would exceed ", max_position(), max_position_reason()));
    if (config_.check_inputs && !observation_queries.empty()) {
      check_values(as_floats(observation_queries, 2), std::numeric_limits<float>::max(), "prefill",
                   "observation_queries");
    }
    write_tokens(state, layer, as_floats(keys, 0), as_floats(values, 1),
                 static_cast<index_t>(tokens), static_cast<std::int32_t>(first), "prefill");
    if constexpr (kEvicts) {
      if constexpr (Evictor::kUsesObservation) {
        if (!observation_queries.empty()) {
          // After the write: scoring must not fail the call. Without memory for it, the tokens
          // keep the scores they had (0 for new ones).
          try {
            add_observation_scores(state, layer, as_floats(observation_queries, 2));
          } catch (const std::bad_alloc&) {
          }
        }
      }
      // SnapKV decides only when the window scored the tokens; H2O and StreamingLLM always.
      evict_layer(seq, sequence, state, layer, !uses_observation_only() || !observation_queries.empty());
    }
  }

  /// Appends one decoded token's key and value for one layer.
  /// \param key   [kv_heads][head_dim]
  /// \param value [kv_heads][head_dim]
  /// \param position its position, greater than every position already in this layer
  template <InputElement T>
  void append(SeqId seq, index_t layer, std::span<const T> key, std::span<const T> value,
              std::int64_t position) {
    Sequence& sequence = find(seq, "append");
    layer = written_layer(layer, "append");
    const std::size_t key_row = static_cast<std::size_t>(streams_) * key_dim_;
    const std::size_t value_row = static_cast<std::size_t>(streams_) * value_dim_;
    KVPACK_CHECK(key.size() == key_row && value.size() == value_row, kInvalidArgument,
                 kLatent ? detail::message("append: key and value must hold rope_dim = ", key_row, " and latent_dim = ",
                                           value_row, " elements (layout::MLA), got ", key.size(), " and ", value.size())
                         : detail::message("append: key and value must hold kv_heads * head_dim = ", key_row,
                                           " elements, got ", key.size(), " and ", value.size()));
    LayerState& state = sequence.layers[layer];
    KVPACK_CHECK(position > state.last_position, kInvalidArgument,
                 detail::message("append: position ", position, " must be greater than the layer's last (",
                                 state.last_position, ")"));
    KVPACK_CHECK(position <= max_position(), kOutOfRange,
                 detail::message("append: position ", position, " exceeds ", max_position(), max_position_reason()));
    write_tokens(state, layer, as_floats(key, 0), as_floats(value, 1), 1,
                 static_cast<std::int32_t>(position), "append");
    if constexpr (kEvicts) evict_layer(seq, sequence, state, layer, Evictor::kEvictsOnAppend);
  }

  /// Appends `pages` whole pages per KV stream, encoded elsewhere (a page file, a tier), to one
  /// layer by copying their bytes: nothing is decoded into rows and re-encoded through prefill.
  /// `page_of(s, p)` returns page p of stream s as an EncodedPage in this cache's format (its
  /// codecs, page size, RoPE storage: the caller matches them). `params`, one per stream, are
  /// the codec parameters the pages were encoded with: a layer whose codec calibrates them from
  /// data (FP8) and is not calibrated yet takes them, as its first prefill would have set them;
  /// otherwise they must equal the layer's (and may be omitted). Checked before anything
  /// changes: the parameters; the byte sizes; every slot live; positions growing strictly from
  /// past the layer's last, equal in every stream and within max_position; then `check` on each
  /// page. The layer must hold no full-precision rows but a complete exact prefix, so its tokens
  /// so far end on a page boundary.
  /// \throws kvpack::Error, leaving the cache as it was: kUnsupported for an evicting cache, a
  ///         layer with rows in its tail, or a layer to calibrate without `params`;
  ///         kInvalidArgument for parameters other than the layer's and bytes that fail a check,
  ///         naming the stream, page and slot; kOutOfRange for positions beyond max_position;
  ///         kvpack::OutOfPages.
  template <class PageOf>
  void append_encoded_pages(SeqId seq, index_t layer, std::size_t pages, PageOf page_of,
                            PageCheck check = PageCheck::kReencode, std::span<const CodecParams> params = {}) {
    static constexpr const char* kCall = "append_encoded_pages";
    KVPACK_CHECK(!kEvicts, kUnsupported,
                 "append_encoded_pages: an evicting cache keeps per-slot state a page's bytes do not carry");
    Sequence& sequence = find(seq, kCall);
    const index_t model_layer = layer;
    layer = written_layer(layer, kCall);
    LayerState& state = sequence.layers[layer];
    KVPACK_CHECK(state.tail_count == 0 && state.prefix_count == config_.exact_prefix_tokens, kUnsupported,
                 detail::message("append_encoded_pages: layer ", model_layer, " of sequence ", seq, " holds ",
                                 state.rows_count(), " full-precision rows; pages go after whole pages only"));
    const ParamsAdoption adoption = adopt_params(layer, model_layer, params);
    const std::int64_t last = verify_encoded_pages(state, layer, pages, page_of, check, adoption.used);
    if (pages == 0) return;

    // Everything that can fail, then the changes (as write_tokens).
    std::vector<PageId> fresh(pages * static_cast<std::size_t>(streams_));
    allocate_pages(fresh);
    const bool first_write = state.tail_keys.empty();
    LayerState grown;
    std::size_t table_growth = 0;
    try {
      if constexpr (kSummarizes) prepare_summary_scratch();
      if (first_write) size_rows(grown);
      grown.tables.resize(static_cast<std::size_t>(streams_));
      for (index_t s = 0; s < streams_; ++s) {
        const std::vector<PageId>* table = first_write ? nullptr : &state.tables[s];
        const std::size_t before = table != nullptr ? table->capacity() : 0;
        grown.tables[s].reserve(std::max((table != nullptr ? table->size() : 0) + pages, before));
        if (table != nullptr) grown.tables[s].assign(table->begin(), table->end());
        table_growth += (grown.tables[s].capacity() - before) * sizeof(PageId);
      }
    } catch (...) {
      for (PageId id : fresh) pool_.release(id);
      throw;
    }
    if (adoption.sets_keys || adoption.sets_values) {
      // The layer takes the pages' parameters unless another sequence's first prefill has just
      // calibrated it: then they must be equal, as for a layer calibrated before.
      std::lock_guard lock(calibration_mutex_);
      bool taken = true;
      if (calibrated_[layer].load(std::memory_order_relaxed)) {
        for (index_t s = 0; s < streams_; ++s) {
          const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
          taken = taken && key_params_[p] == adoption.used[s].first && value_params_[p] == adoption.used[s].second;
        }
        if (!taken) {
          for (PageId id : fresh) pool_.release(id);
          detail::throw_error(ErrorCode::kInvalidArgument,
                              detail::message("append_encoded_pages: layer ", model_layer,
                                              " was calibrated meanwhile with other parameters than the pages'"));
        }
      } else {
        for (index_t s = 0; s < streams_; ++s) {
          const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
          key_params_[p] = adoption.used[s].first;
          value_params_[p] = adoption.used[s].second;
        }
        calibrated_[layer].store(true, std::memory_order_release);
      }
    }
    // No more throws from here on.
    if (first_write) take_rows(state, grown);
    state.tables.swap(grown.tables);  // the old tables go with `grown`
    table_bytes_.fetch_add(table_growth, std::memory_order_relaxed);
    const std::size_t slot_bytes = slot_record_bytes();
    for (index_t s = 0; s < streams_; ++s) {
      const std::size_t params = static_cast<std::size_t>(layer) * streams_ + s;
      for (std::size_t p = 0; p < pages; ++p) {
        const EncodedPage page = page_of(s, p);
        const PageId id = fresh[static_cast<std::size_t>(s) * pages + p];
        std::memcpy(pool_.payload(id), page.payload.data(), page.payload.size());
        std::memcpy(pool_.metadata(id), page.slots.data(), slot_bytes);
        if constexpr (kSummarizes) write_summary(id, params, config_.page_size);
        state.tables[s].push_back(id);
      }
    }
    const auto count = static_cast<index_t>(pages) * config_.page_size;
    state.tokens += count;
    state.last_position = last;
    stored_elements_.fetch_add(static_cast<std::size_t>(count) * streams_ * (key_dim_ + value_dim_),
                               std::memory_order_relaxed);
  }

  /// Pins positions [first, last] of a sequence in every layer, including tokens not written
  /// yet: no evictor drops them (a system prompt, tool definitions). Pins cannot be removed.
  void pin(SeqId seq, std::int64_t first, std::int64_t last) {
    Sequence& sequence = find(seq, "pin");
    KVPACK_CHECK(first >= 0 && first <= last, kInvalidArgument,
                 detail::message("pin: need 0 <= first <= last, got [", first, ", ", last, "]"));
    sequence.pins.emplace_back(first, last);
  }

  /// Demotes what the evictor drops (write-back): before any token leaves, `sink` receives the
  /// tokens of one (sequence, layer, stream) that are about to go, decoded (DroppedTokens). A
  /// sink that throws keeps them alive (counted in demotions_refused()): the stream stays over
  /// its budget until the evictor decides again and the sink takes them (at the next append for
  /// StreamingLLM and H2O; SnapKV decides only at a prefill with observation queries), so
  /// nothing is dropped that was not demoted. An empty sink turns demotion off. Set it between
  /// writes, not concurrently with them. The sink runs inside the write (prefill, append) that
  /// evicts, on its thread: writes to different sequences from several threads call it
  /// concurrently, and it must not write to this cache. tier::RecallStore's demote is one (not
  /// thread-safe: one store per writing thread, or a lock).
  void set_demotion_sink(DemotionSink sink)
    requires kEvicts
  {
    demotion_sink_ = std::move(sink);
  }
  /// Evictions called off because the demotion sink threw (their tokens stayed in the cache).
  [[nodiscard]] std::uint64_t demotions_refused() const noexcept {
    return demotions_refused_.load(std::memory_order_relaxed);
  }

  /// The layer whose writes `layer` reads: itself, or for layout::CrossLayer the first layer of
  /// its group (what DroppedTokens and tier::attend_with_recall name).
  [[nodiscard]] index_t writing_layer(index_t layer) const {
    return layout::writer_of(layout_, shape_, stored_layer(layer, "writing_layer"));
  }

  /// Tokens of one KV stream that an evictor has not dropped (length() counts every token ever
  /// written to the layer).
  [[nodiscard]] index_t live_tokens(SeqId seq, index_t layer, index_t stream) const {
    const Sequence& sequence = find(seq, "live_tokens");
    layer = stored_layer(layer, "live_tokens");
    KVPACK_CHECK(stream >= 0 && stream < streams_, kInvalidArgument,
                 detail::message("live_tokens: stream ", stream, " out of range"));
    const LayerState& state = sequence.layers[layer];
    if constexpr (kEvicts) {
      if (!state.eviction.empty()) return state.eviction[stream].live_tokens;
    }
    return state.tokens;
  }

  /// Decode attention for one layer: out[h] = softmax(scale · q[h] · Kᵀ) V over every live token
  /// of the layer — or, with select::Quest beyond its dense layers, over the pages whose keys may
  /// score highest plus the tail — read from the encoded pages directly.
  /// \param query  [q_heads][head_dim]
  /// \param out    [q_heads][head_dim]
  /// \param report when given (its epsilon set), receives per query head a certified upper bound
  ///        on the attention mass of the tokens this call did not read; needs select::Quest's
  ///        page summaries when any token can be unread (an evicting cache)
  template <InputElement T>
  void attend(SeqId seq, index_t layer, std::span<const T> query, std::span<float> out, float scale,
              AttendReport* report = nullptr) const {
    const Sequence& sequence = find(seq, "attend");
    const index_t model_layer = layer;
    layer = stored_layer(layer, "attend");
    const std::size_t query_row = static_cast<std::size_t>(shape_.q_heads) * layout::query_dim(layout_, shape_);
    const std::size_t out_row = static_cast<std::size_t>(shape_.q_heads) * value_dim_;
    KVPACK_CHECK(query.size() == query_row && out.size() == out_row, kInvalidArgument,
                 kLatent ? detail::message("attend: query and out must hold q_heads * (latent_dim + rope_dim) = ",
                                           query_row, " and q_heads * latent_dim = ", out_row,
                                           " elements (layout::MLA), got ", query.size(), " and ", out.size())
                         : detail::message("attend: query and out must hold q_heads * head_dim = ", query_row,
                                           " elements, got ", query.size(), " and ", out.size()));
    KVPACK_CHECK(std::isfinite(scale), kInvalidArgument, detail::message("attend: scale ", scale, " is not finite"));
    const LayerState& state = sequence.layers[layer];
    KVPACK_CHECK(state.tokens > 0, kInvalidArgument,
                 detail::message("attend: layer ", model_layer, " of sequence ", seq, " holds no tokens"));
    KVPACK_CHECK(report == nullptr || kSummarizes || !kEvicts, kUnsupported,
                 "attend: a bound on what an evicting cache did not read needs its pages' summaries: "
                 "use select::Quest (a token_budget above the context reads every page)");
    KVPACK_CHECK(report == nullptr || report->epsilon >= 0.0, kInvalidArgument,
                 detail::message("attend: AttendReport.epsilon ", report != nullptr ? report->epsilon : 0.0,
                                 " must be >= 0"));
    const std::span<const float> q = as_floats(query, 0);
    if (config_.check_inputs) check_values(q, std::numeric_limits<float>::max(), "attend", "query");

    const index_t group = shape_.group_size();
    const bool select_pages = [&] {
      if constexpr (kSummarizes) return !selector_.reads_densely(model_layer);
      return false;
    }();
    if (report != nullptr) {
      report->heads.assign(static_cast<std::size_t>(shape_.q_heads), select::UnreadBound{});
      report->read_pages.resize(static_cast<std::size_t>(streams_));
      report->unread_spans.resize(static_cast<std::size_t>(streams_));
      report->unread_score_bounds.resize(static_cast<std::size_t>(streams_));
      for (auto& spans : report->unread_spans) spans.clear();
      for (auto& bounds : report->unread_score_bounds) bounds.clear();
      report->fired = false;
    }
    if constexpr (kLatent) {
      attend_latent(state, layer, q, out, scale, report);
      return;
    }
    std::vector<std::size_t> pages_read(report != nullptr ? static_cast<std::size_t>(streams_) : 0);
    const auto kernel_set = kernels::KernelSet<KeyCodec, ValueCodec>::selected();
    auto attend_stream = [&](index_t s) {
      thread_local kernels::Workspace workspace;
      thread_local std::vector<float> scaled_queries;
      thread_local std::vector<index_t> reading;  // indices into the table of the pages read
      thread_local std::vector<const std::byte*> page_pointers;
      thread_local std::vector<const std::int32_t*> page_positions;
      thread_local std::vector<std::int32_t> indices;  // in_cache_positions: [pages][page_size], then rows
      thread_local std::vector<const std::uint64_t*> page_live;
      thread_local std::vector<float> recorded;
      thread_local std::vector<float> head_bounds;  // [group][pages]
      const std::vector<PageId>& table = state.tables[s];
      scaled_queries.resize(static_cast<std::size_t>(group) * key_dim_);
      for (std::size_t i = 0; i < scaled_queries.size(); ++i) {
        scaled_queries[i] = q[static_cast<std::size_t>(s) * group * key_dim_ + i] * scale;
      }
      reading.resize(table.size());
      std::iota(reading.begin(), reading.end(), 0);
      if constexpr (kSummarizes) {
        if (select_pages || report != nullptr) page_bounds(table, scaled_queries, group, report != nullptr, head_bounds);
        if (select_pages) {
          const index_t keep = selector_.pages_to_read(static_cast<index_t>(table.size()), config_.page_size);
          reading.resize(static_cast<std::size_t>(
              select::select_top_pages(std::span<const float>(head_bounds).last(table.size()), keep, reading)));
        }
      }
      page_pointers.resize(reading.size());
      for (std::size_t i = 0; i < reading.size(); ++i) page_pointers[i] = pool_.payload(table[reading[i]]);
      const std::uint64_t* const* live = nullptr;
      const std::uint8_t* row_live = nullptr;
      if constexpr (kEvicts) {
        // Pages with dead slots hand their live masks to the kernels; full pages keep the fast path.
        page_live.resize(reading.size());
        for (std::size_t i = 0; i < reading.size(); ++i) {
          const std::uint64_t* mask = live_mask(table[reading[i]]);
          page_live[i] = live_count(mask) == config_.page_size ? nullptr : mask;
        }
        live = page_live.data();
        row_live = state.eviction[s].row_live.data();
      }
      kernels::KeyRope key_rope;
      if (config_.key_rope) {
        page_positions.resize(reading.size());
        if (evict::uses_in_cache_positions(evictor_)) {
          in_cache_positions(state, s, indices);
          for (std::size_t i = 0; i < reading.size(); ++i) {
            page_positions[i] = indices.data() + static_cast<std::size_t>(reading[i]) * config_.page_size;
          }
          key_rope = {rope_tables_->view(), page_positions.data(), indices.data() + table.size() * config_.page_size};
        } else {
          // Slot positions lead each page's metadata.
          for (std::size_t i = 0; i < reading.size(); ++i) {
            page_positions[i] = reinterpret_cast<const std::int32_t*>(pool_.metadata(table[reading[i]]));
          }
          key_rope = {rope_tables_->view(), page_positions.data(), state.tail_positions.data()};
        }
      }
      workspace.prepare(group, key_dim_, config_.page_size, state.rows_count());
      const kernels::PageRun run{page_pointers.data(), live, static_cast<index_t>(reading.size()), 0,
                                 config_.page_size, key_dim_, value_plane_offset(),
                                 pool_.format().payload_bytes};
      const std::size_t tail_offset = static_cast<std::size_t>(s) * tail_capacity() * key_dim_;
      const kernels::TailView tail{state.tail_keys.data() + tail_offset,
                                   state.tail_values.data() + tail_offset, state.rows_count(), row_live};
      const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
      kernels::ScoreRecord record;
      if constexpr (kEvicts && Evictor::kNeedsScores) {
        record.stride = static_cast<index_t>(table.size()) * config_.page_size + state.rows_count();
        recorded.resize(static_cast<std::size_t>(group) * record.stride);
        record.scores = recorded.data();
      }
      kernels::attend_stream<KeyCodec, ValueCodec>(run, key_params_[p], value_params_[p], tail,
                                                   scaled_queries.data(), group,
                                                   out.data() + static_cast<std::size_t>(s) * group * value_dim_,
                                                   workspace, kernel_set, config_.key_rope ? &key_rope : nullptr,
                                                   record.scores != nullptr ? &record : nullptr);
      if constexpr (kEvicts && Evictor::kNeedsScores) {
        add_attention_scores(state.eviction[s], record, workspace, group);
      }
      if (report != nullptr) {
        pages_read[s] = reading.size();
        report->read_pages[s].assign(reading.begin(), reading.end());
        if constexpr (kSummarizes) {
          bound_unread(state, s, reading, head_bounds, scaled_queries, workspace,
                       std::span<select::UnreadBound>(report->heads).subspan(static_cast<std::size_t>(s) * group, group),
                       report->unread_spans[s], report->unread_score_bounds[s]);
        }
      }
    };
    if (config_.executor && streams_ > 1) {
      config_.executor(streams_, attend_stream);
    } else {
      for (index_t s = 0; s < streams_; ++s) attend_stream(s);
    }
    if (report != nullptr) {
      report->pages_read = std::accumulate(pages_read.begin(), pages_read.end(), std::size_t{0});
      report->pages_total = 0;
      for (const auto& table : state.tables) report->pages_total += table.size();
      report->fired = std::any_of(report->heads.begin(), report->heads.end(),
                                  [&](const select::UnreadBound& head) { return head.fired(report->epsilon); });
    }
  }

  /// A new sequence sharing every page of `seq` (copy-on-write: pages are immutable once encoded,
  /// the tails are copied).
  [[nodiscard]] SeqId fork(SeqId seq) {
    const Sequence& source = find(seq, "fork");
    auto copy = std::make_unique<Sequence>(source);  // may throw bad_alloc: nothing changed yet
    const Sequence& added = *copy;
    SeqId id = 0;
    {
      std::unique_lock lock(sequences_mutex_);
      id = next_id_;
      sequences_.emplace(id, std::move(copy));  // may throw bad_alloc: nothing changed yet
      ++next_id_;
    }
    // Only now the pages gain a reference: no caller knows the new id before it is returned.
    for (const LayerState& state : added.layers) {
      for (const auto& table : state.tables) {
        for (PageId page : table) pool_.retain(page);
      }
    }
    account(added, +1);
    return id;
  }

  /// Drops a sequence; its pages go back to the pool when no fork shares them.
  void release(SeqId seq) {
    std::unique_ptr<Sequence> sequence;
    {
      std::unique_lock lock(sequences_mutex_);
      const auto it = sequences_.find(seq);
      KVPACK_CHECK(it != sequences_.end(), kUnknownSequence,
                   detail::message("release: sequence ", seq, " is unknown or already released"));
      sequence = std::move(it->second);
      sequences_.erase(it);
    }
    account(*sequence, -1);
    if (prefix_index_ != nullptr && !sequence->prompt.empty()) {
      // Best effort: release cannot fail, so a prompt the index has no memory for is not cached.
      try {
        insert_prefix(*sequence);
      } catch (const std::exception&) {
      }
    }
    release_pages(*sequence);
  }

  /// The position of the last token of one layer of a sequence, -1 when it holds none.
  [[nodiscard]] std::int64_t last_position(SeqId seq, index_t layer) const {
    const Sequence& sequence = find(seq, "last_position");
    layer = stored_layer(layer, "last_position");
    return sequence.layers[layer].last_position;
  }

  /// The position an engine rotates this layer's query with when keys are stored before RoPE:
  /// the last position written, or, with StreamingLLM's in_cache_positions, the newest token's
  /// index among the live tokens (every KV stream of a layer keeps the same number under
  /// StreamingLLM). -1 when the layer holds no tokens.
  [[nodiscard]] std::int64_t query_position(SeqId seq, index_t layer) const {
    const Sequence& sequence = find(seq, "query_position");
    layer = stored_layer(layer, "query_position");
    const LayerState& state = sequence.layers[layer];
    if (evict::uses_in_cache_positions(evictor_) && state.tokens > 0) {
      if constexpr (kEvicts) return state.eviction[0].live_tokens - 1;
    }
    return state.last_position;
  }

  /// Tokens stored in one layer of a sequence.
  [[nodiscard]] index_t length(SeqId seq, index_t layer) const {
    const Sequence& sequence = find(seq, "length");
    layer = stored_layer(layer, "length");
    return sequence.layers[layer].tokens;
  }

  /// Sequences alive.
  [[nodiscard]] std::size_t sequence_count() const {
    std::shared_lock lock(sequences_mutex_);
    return sequences_.size();
  }

  /// Exact bytes held, by kind (see MemoryUsage).
  [[nodiscard]] MemoryUsage memory() const noexcept {
    MemoryUsage usage;
    usage.pages_in_use = pool_.pages_in_use();
    usage.page_payload = usage.pages_in_use * pool_.format().payload_bytes;
    usage.page_metadata = usage.pages_in_use * pool_.format().metadata_bytes;
    usage.tails = tail_bytes_.load(std::memory_order_relaxed);
    usage.tables = table_bytes_.load(std::memory_order_relaxed);
    usage.codec_params = codec_param_bytes();
    usage.shared_tables = (rope_tables_ ? rope_tables_->bytes() : 0) + quantizer_table_bytes();
    usage.stored_elements = stored_elements_.load(std::memory_order_relaxed);
    return usage;
  }

  /// The pool's page format: payload bytes (K plane at 0, V plane at value_plane_offset()) and
  /// metadata bytes per page.
  [[nodiscard]] const paging::PageFormat& page_format_info() const noexcept { return pool_.format(); }
  [[nodiscard]] std::size_t value_plane_offset() const noexcept {
    return round_up(quantizer_.key.plane_bytes(key_geometry()), 64);
  }
  /// The codec parameters of (layer, stream), e.g. calibrated FP8 scales.
  [[nodiscard]] CodecParams codec_params(index_t layer, index_t stream) const {
    layer = stored_layer(layer, "codec_params");
    KVPACK_CHECK(stream >= 0 && stream < streams_, kInvalidArgument,
                 detail::message("codec_params: stream ", stream, " out of range"));
    const std::size_t p = static_cast<std::size_t>(layer) * streams_ + stream;
    return {key_params_[p], value_params_[p]};
  }

  /// Read access for tests, tools and serialisers: the page ids of (sequence, layer, stream), in
  /// token order, and the pool holding them.
  [[nodiscard]] std::span<const PageId> pages(SeqId seq, index_t layer, index_t stream) const {
    const Sequence& sequence = find(seq, "pages");
    layer = stored_layer(layer, "pages");
    KVPACK_CHECK(stream >= 0 && stream < streams_, kInvalidArgument,
                 detail::message("pages: stream ", stream, " out of range"));
    const LayerState& state = sequence.layers[layer];
    if (state.tables.empty()) return {};  // nothing written to this layer yet
    return state.tables[stream];
  }
  [[nodiscard]] const paging::PagePool& pool() const noexcept { return pool_; }

  /// The full-precision rows of (sequence, layer) that attend reads after the pages, for every
  /// stream: the exact prefix, then the tail. Keys at keys[(s·stride + r)·key_dim], values at
  /// values[(s·stride + r)·value_dim] for stream s and row r < count. Read access like pages():
  /// valid until the sequence is next written, forked or released. Null pointers while the layer
  /// holds nothing.
  struct FullPrecisionRows {
    const float* keys = nullptr;
    const float* values = nullptr;
    index_t count = 0;
    index_t stride = 0;
  };
  [[nodiscard]] FullPrecisionRows full_precision_rows(SeqId seq, index_t layer) const {
    const Sequence& sequence = find(seq, "full_precision_rows");
    const LayerState& state = sequence.layers[stored_layer(layer, "full_precision_rows")];
    if (state.tail_keys.empty()) return {};
    return {state.tail_keys.data(), state.tail_values.data(), state.rows_count(), tail_capacity()};
  }

  /// What one stream of a layer holds, decoded: the tokens a policy kept (live slots of every
  /// page, then the tail), in token order, as the attention kernels see them (pre-RoPE keys
  /// rotated to their positions). For evaluation and
  /// debugging (eval/ computes attention distributions from it); it allocates and runs the
  /// codecs' scalar decoders, so it is not for the decode loop.
  [[nodiscard]] StoredTokens read_back(SeqId seq, index_t layer, index_t stream) const {
    const Sequence& sequence = find(seq, "read_back");
    layer = stored_layer(layer, "read_back");
    KVPACK_CHECK(stream >= 0 && stream < streams_, kInvalidArgument,
                 detail::message("read_back: stream ", stream, " out of range [0, ", streams_, ")"));
    return stored_tokens(sequence.layers[layer], layer, stream, nullptr);
  }

 private:
  /// One KV stream's state for a dropping evictor, slot-aligned with its pages and rows.
  struct StreamEviction {
    std::vector<float> page_scores;      ///< [pages][page_size] attention scores (kKeepsScores)
    std::vector<std::uint8_t> row_live;  ///< [tail_capacity] per full-precision row: 0 once dropped
    std::vector<float> row_scores;       ///< [tail_capacity] (kKeepsScores)
    index_t live_tokens = 0;             ///< tokens not dropped, exact prefix included
    index_t dead_page_slots = 0;         ///< dead slots in its pages: what compaction would free
    std::vector<float> ghosts;           ///< [kMaxGhosts][summary_floats()] with select::Quest
    std::vector<std::int32_t> ghost_positions;  ///< [kMaxGhosts][2]: first and last position of each
    index_t ghost_count = 0;
  };
  /// One layer of one sequence. Its full-precision rows, per stream: the exact prefix (rows
  /// [0, prefix_count), never encoded) and the tail (rows [exact_prefix_tokens, … + tail_count),
  /// encoded a page at a time). Only a full prefix is followed by tail rows, so the rows in use
  /// are always [0, rows_count()).
  struct LayerState {
    std::vector<std::vector<PageId>> tables;  ///< [streams] block tables, token order
    /// [streams] when Evictor::kDropsTokens, else empty. Mutable: attend adds scores (H2O).
    mutable std::vector<StreamEviction> eviction;
    std::vector<float> tail_keys;             ///< [streams][tail_capacity][key_dim]
    std::vector<float> tail_values;           ///< [streams][tail_capacity][value_dim]
    std::vector<std::int32_t> tail_positions;  ///< [tail_capacity]
    index_t prefix_count = 0;
    index_t tail_count = 0;
    [[nodiscard]] index_t rows_count() const noexcept { return prefix_count + tail_count; }
    index_t tokens = 0;
    std::int64_t last_position = -1;
  };
  struct Sequence {
    explicit Sequence(index_t layers) : layers(static_cast<std::size_t>(layers)) {}
    /// A fork: the same pages (the caller retains them), and another lease on the prefix path.
    Sequence(const Sequence& other)
        : layers(other.layers), pins(other.pins), prompt(other.prompt), salt(other.salt), lease(other.lease.share()) {}
    Sequence& operator=(const Sequence&) = delete;
    std::vector<LayerState> layers;
    std::vector<std::pair<std::int64_t, std::int64_t>> pins;  ///< pinned [first, last] positions
    std::vector<paging::TokenId> prompt;  ///< add_sequence(tokens)'s prompt; empty otherwise
    std::string salt;                     ///< and its salt
    paging::PrefixLease lease;            ///< pins the cached path this sequence matched or inserted
    [[nodiscard]] bool pinned(std::int64_t position) const noexcept {
      return std::any_of(pins.begin(), pins.end(), [&](const auto& pin) {
        return position >= pin.first && position <= pin.second;
      });
    }
  };

  /// attend for layout::MLA: one stream, every query head, nothing dropped or skipped (the
  /// static_asserts above), so every page is read and a report's bound is exactly 0. With an
  /// executor, the pages are split into runs of whole chunks whose softmax states are merged
  /// (split-K): the one stream is arithmetic-bound on a CPU, so it needs every core.
  void attend_latent(const LayerState& state, index_t layer, std::span<const float> q, std::span<float> out,
                     float scale, AttendReport* report) const {
    /// Most runs one call splits into: enough for the cores of a CPU socket, few enough that
    /// each run's pages amortise its workspace and the merge.
    constexpr index_t kMaxRuns = 8;
    thread_local std::vector<float> scaled_queries;
    thread_local std::vector<const std::byte*> page_pointers;
    thread_local std::vector<kernels::LatentPartial> partials;
    static const std::vector<PageId> kNoPages;
    const std::vector<PageId>& table = state.tables.empty() ? kNoPages : state.tables[0];
    const index_t group = shape_.q_heads;
    const index_t pages = static_cast<index_t>(table.size());
    scaled_queries.resize(q.size());
    for (std::size_t i = 0; i < q.size(); ++i) scaled_queries[i] = q[i] * scale;
    page_pointers.resize(table.size());
    for (std::size_t i = 0; i < table.size(); ++i) page_pointers[i] = pool_.payload(table[i]);
    const kernels::PageRun all{page_pointers.data(), nullptr, pages, 0, config_.page_size, value_dim_,
                               value_plane_offset(), pool_.format().payload_bytes};
    const kernels::TailView tail{state.tail_keys.data(), state.tail_values.data(), state.rows_count(), nullptr};
    const std::size_t p = static_cast<std::size_t>(layer);
    const kernels::LatentCodecs<KeyCodec, ValueCodec> codecs{&quantizer_.key, key_params_[p], &quantizer_.value,
                                                             value_params_[p]};
    const auto kernel_set = kernels::LatentKernelSet<KeyCodec, ValueCodec>::selected();
    // Run r reads pages [r·per_run, …) and the last one the tail too.
    const index_t chunk = std::max<index_t>(1, kernels::Workspace::kChunkTokens / config_.page_size);
    const index_t chunks = (pages + chunk - 1) / chunk;
    const index_t chunks_per_run = config_.executor ? std::max<index_t>(1, (chunks + kMaxRuns - 1) / kMaxRuns)
                                                    : std::max<index_t>(1, chunks);
    const index_t runs = std::max<index_t>(1, (chunks + chunks_per_run - 1) / chunks_per_run);
    const index_t per_run = chunks_per_run * chunk;
    // The caller's thread_local buffers, named here: inside a task a thread_local name would
    // mean the worker's own.
    const float* queries = scaled_queries.data();
    std::vector<kernels::LatentPartial>& parts = partials;
    auto pass = [&](index_t r, float* finished) {
      thread_local kernels::Workspace workspace;
      thread_local std::vector<float> tile;
      const bool last = r == runs - 1;
      const index_t tail_rows = last ? tail.count : 0;
      workspace.prepare(group, value_dim_ + key_dim_, config_.page_size, tail_rows);
      tile.resize(kernels::latent_tile_floats(config_.page_size, value_dim_, key_dim_, tail_rows));
      kernels::PageRun run = all;
      run.pages = all.pages + std::min(pages, r * per_run);
      run.count = std::clamp<index_t>(pages - r * per_run, 0, per_run);
      const kernels::TailView own_tail = last ? tail : kernels::TailView{};
      if (finished != nullptr) {
        kernels::attend_latent_stream(run, key_dim_, codecs, own_tail, queries, group, finished, workspace,
                                      tile.data(), kernel_set);
      } else {
        kernels::latent_pass(run, key_dim_, codecs, own_tail, queries, group, workspace, tile.data(), kernel_set);
        parts[r].take(workspace, group, value_dim_);
      }
    };
    if (runs == 1) {
      pass(0, out.data());
    } else {
      parts.resize(static_cast<std::size_t>(runs));
      config_.executor(runs, [&](index_t r) { pass(r, nullptr); });
      kernels::merge_latent_partials(std::span<const kernels::LatentPartial>(parts.data(), runs), group,
                                     value_dim_, out.data());
    }
    if (report != nullptr) {
      report->read_pages[0].resize(table.size());
      std::iota(report->read_pages[0].begin(), report->read_pages[0].end(), index_t{0});
      report->pages_read = report->pages_total = table.size();
    }
  }
  /// Where a token of a stream lives: slot `slot` of page `page` of its table, or, when page is
  /// -1, full-precision row `slot`.
  struct SlotRef {
    index_t page = -1;
    index_t slot = 0;
  };

  static constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
    return (n + multiple - 1) / multiple * multiple;
  }

  /// read_back's work: the live tokens of one stream, decoded; `refs`, when given, receives
  /// where each of them lives.
  [[nodiscard]] StoredTokens stored_tokens(const LayerState& state, index_t layer, index_t stream,
                                           std::vector<SlotRef>* refs) const {
    StoredTokens stored;
    stored.key_dim = key_dim_;
    stored.value_dim = value_dim_;
    if (state.tables.empty()) return stored;
    const index_t page = config_.page_size;
    std::vector<float> keys(static_cast<std::size_t>(page) * key_dim_);
    std::vector<float> values(static_cast<std::size_t>(page) * value_dim_);
    const std::size_t p = static_cast<std::size_t>(layer) * streams_ + stream;
    // Full-precision rows [first, last) of this stream: the exact prefix, then the tail.
    const float* rows_k = state.tail_keys.data() + static_cast<std::size_t>(stream) * tail_capacity() * key_dim_;
    const float* rows_v = state.tail_values.data() + static_cast<std::size_t>(stream) * tail_capacity() * value_dim_;
    const std::uint8_t* row_live = state.eviction.empty() ? nullptr : state.eviction[stream].row_live.data();
    auto add_rows = [&](index_t first, index_t last) {
      for (index_t r = first; r < last; ++r) {
        if (row_live != nullptr && row_live[r] == 0) continue;
        stored.positions.push_back(state.tail_positions[r]);
        stored.keys.insert(stored.keys.end(), rows_k + static_cast<std::size_t>(r) * key_dim_,
                           rows_k + static_cast<std::size_t>(r + 1) * key_dim_);
        stored.values.insert(stored.values.end(), rows_v + static_cast<std::size_t>(r) * value_dim_,
                             rows_v + static_cast<std::size_t>(r + 1) * value_dim_);
        if (refs != nullptr) refs->push_back({-1, r});
      }
    };
    add_rows(0, state.prefix_count);
    for (index_t i = 0; i < static_cast<index_t>(state.tables[stream].size()); ++i) {
      const PageId id = state.tables[stream][i];
      decode_page(id, p, keys.data(), values.data());
      const std::byte* metadata = pool_.metadata(id);
      const std::byte* mask = metadata + static_cast<std::size_t>(page) * sizeof(std::int32_t);
      for (index_t t = 0; t < page; ++t) {
        std::uint64_t word = 0;
        std::memcpy(&word, mask + static_cast<std::size_t>(t / 64) * sizeof(word), sizeof(word));
        if (((word >> (t % 64)) & 1u) == 0) continue;
        std::int32_t position = 0;
        std::memcpy(&position, metadata + static_cast<std::size_t>(t) * sizeof(position), sizeof(position));
        stored.positions.push_back(position);
        stored.keys.insert(stored.keys.end(), keys.begin() + static_cast<std::ptrdiff_t>(t) * key_dim_,
                           keys.begin() + static_cast<std::ptrdiff_t>(t + 1) * key_dim_);
        stored.values.insert(stored.values.end(), values.begin() + static_cast<std::ptrdiff_t>(t) * value_dim_,
                             values.begin() + static_cast<std::ptrdiff_t>(t + 1) * value_dim_);
        if (refs != nullptr) refs->push_back({i, t});
      }
    }
    add_rows(state.prefix_count, state.rows_count());
    if (config_.key_rope) {
      for (index_t i = 0; i < stored.size(); ++i) {
        // Stored in token order, live tokens only: with in-cache positions, i is the token's index.
        const std::int64_t position = evict::uses_in_cache_positions(evictor_) ? i : stored.positions[i];
        apply_rope_reference(*config_.key_rope, key_dim_, position,
                             stored.keys.data() + static_cast<std::size_t>(i) * key_dim_);
      }
    }
    return stored;
  }

  static index_t validated_streams(const Layout& layout, const ModelShape& shape) {
    layout.validate(shape);
    return layout.streams(shape);
  }

  /// The largest position a token may have: int32 (slot metadata), or the RoPE tables' reach.
  [[nodiscard]] std::int64_t max_position() const noexcept {
    return config_.key_rope ? rope_tables_->max_position() : std::numeric_limits<std::int32_t>::max();
  }
  [[nodiscard]] const char* max_position_reason() const noexcept {
    return config_.key_rope ? " (CacheConfig.key_rope.max_position; raise it for longer contexts)"
                            : " (the int32 range pages store)";
  }

  [[nodiscard]] quant::PageGeometry key_geometry() const noexcept { return {config_.page_size, key_dim_}; }
  /// Decodes page `id` into rows [page_size][key_dim] and [page_size][value_dim], with the codec
  /// parameters of (layer, stream) number `params` (layer · streams + stream).
  void decode_page(PageId id, std::size_t params, float* keys, float* values) const {
    const std::byte* payload = pool_.payload(id);
    quantizer_.key.decode(key_geometry(), payload, key_params_[params], keys);
    quantizer_.value.decode(value_geometry(), payload + value_plane_offset(), value_params_[params], values);
  }
  [[nodiscard]] quant::PageGeometry value_geometry() const noexcept { return {config_.page_size, value_dim_}; }
  /// Full-precision rows per stream: the exact prefix, the tail window and a page being filled.
  [[nodiscard]] index_t tail_capacity() const noexcept {
    return config_.exact_prefix_tokens + config_.tail_tokens + config_.page_size;
  }
  [[nodiscard]] std::size_t live_mask_words() const noexcept {
    return static_cast<std::size_t>(config_.page_size + 63) / 64;
  }

  [[nodiscard]] paging::PageFormat page_format() const {
    config_.validate();
    quantizer_.key.validate(key_geometry());
    quantizer_.value.validate(value_geometry());
    paging::PageFormat format;
    format.payload_bytes = round_up(value_plane_offset() + quantizer_.value.plane_bytes(value_geometry()), 64);
    format.metadata_bytes =
        round_up(static_cast<std::size_t>(config_.page_size) * sizeof(std::int32_t) +
                     live_mask_words() * sizeof(std::uint64_t) +
                     selector_.summary_bytes(config_.page_size, key_dim_),
                 8);
    return format;
  }

  [[nodiscard]] std::size_t codec_param_bytes() const noexcept {
    const std::size_t per_stream = (std::is_empty_v<KeyParams> ? 0 : sizeof(KeyParams)) +
                                   (std::is_empty_v<ValueParams> ? 0 : sizeof(ValueParams));
    return per_stream * key_params_.size();
  }
  /// Tables a quantizer's params point into (KVQuant's calibration), shared by its copies.
  [[nodiscard]] std::size_t quantizer_table_bytes() const noexcept {
    if constexpr (requires { quantizer_.table_bytes(); }) return quantizer_.table_bytes();
    return 0;
  }

  Sequence& find(SeqId seq, const char* call) const {
    std::shared_lock lock(sequences_mutex_);
    const auto it = sequences_.find(seq);
    KVPACK_CHECK(it != sequences_.end(), kUnknownSequence,
                 detail::message(call, ": sequence ", seq, " is unknown or was released"));
    return *it->second;
  }

  /// The cache layer that holds model layer `layer` (itself unless the layout shares caches
  /// across layers); throws for a layer outside the model.
  [[nodiscard]] index_t stored_layer(index_t layer, const char* call) const {
    KVPACK_CHECK(layer >= 0 && layer < shape_.layers, kInvalidArgument,
                 detail::message(call, ": layer ", layer, " out of range [0, ", shape_.layers, ")"));
    return layout::cache_layer_of(layout_, shape_, layer);
  }
  /// The same for a write, which only the first layer of a shared group may make.
  [[nodiscard]] index_t written_layer(index_t layer, const char* call) const {
    const index_t stored = stored_layer(layer, call);
    const index_t writer = layout::writer_of(layout_, shape_, stored);
    KVPACK_CHECK(writer == layer, kInvalidArgument,
                 detail::message(call, ": layer ", layer, " reads the cache layer ", writer, " writes (layout ",
                                 Layout::kName, " shares one cache across layers); write layer ", writer));
    return stored;
  }

  /// Inputs as fp32: a view of float input, or a per-thread converted copy in slot `slot`.
  template <InputElement T>
  static std::span<const float> as_floats(std::span<const T> input, int slot) {
    if constexpr (std::is_same_v<T, float>) {
      return input;
    } else {
      thread_local std::vector<float> converted[3];
      converted[slot].resize(input.size());
      if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
        dispatch::cpu_kernel<kernels::cpu::WidenToFloat<T>>()({input.data(), converted[slot].data(), input.size()});
      } else {
        for (std::size_t i = 0; i < input.size(); ++i) converted[slot][i] = static_cast<float>(input[i]);
      }
      return converted[slot];
    }
  }

  /// Whether every |x| ≤ max_abs, NaN and Inf failing: eight independent flags without a branch,
  /// which the compiler turns into vector compares even at -O2 (a query of 4096 floats: 0.7 µs,
  /// against 5–6 µs for check_values' loop, which stops at the first failure to name it).
  static bool all_within(std::span<const float> data, float max_abs) noexcept {
    const float limit = std::min(max_abs, std::numeric_limits<float>::max());
    int failed[8] = {};
    std::size_t i = 0;
    for (; i + 8 <= data.size(); i += 8) {
      for (int l = 0; l < 8; ++l) failed[l] |= !(std::fabs(data[i + l]) <= limit);
    }
    for (; i < data.size(); ++i) failed[0] |= !(std::fabs(data[i]) <= limit);
    int any = 0;
    for (const int f : failed) any |= f;
    return any == 0;
  }

  /// Throws kNonFinite for NaN/Inf and kOutOfRange beyond `max_abs`, naming the element.
  static void check_values(std::span<const float> data, float max_abs, const char* call, const char* what) {
    if (all_within(data, max_abs)) return;
    for (std::size_t i = 0; i < data.size(); ++i) {
      const float x = data[i];
      KVPACK_CHECK(std::isfinite(x), kNonFinite,
                   detail::message(call, ": ", what, "[", i, "] is ", std::isnan(x) ? "NaN" : "Inf",
                                   " (set CacheConfig.check_inputs = false to skip this check)"));
      KVPACK_CHECK(std::fabs(x) <= max_abs, kOutOfRange,
                   detail::message(call, ": ", what, "[", i, "] = ", x, " exceeds what this codec stores (|x| <= ",
                                   max_abs, ")"));
    }
  }

  /// Parameters for a layer that still needs calibration, computed from every token written so
  /// far (the tail and this call's input): the whole prompt when the first prefill fills a page.
  struct Calibration {
    bool needed = false;
    std::vector<KeyParams> keys;
    std::vector<ValueParams> values;
  };

  /// One parameter per stream from the absolute maxima of `row_of(s, i)`, i in [0, rows).
  template <class Codec, class RowOf>
  std::vector<typename Codec::params_type> calibrate_plane(const Codec& codec, index_t rows, index_t dim,
                                                           RowOf row_of) const {
    std::vector<typename Codec::params_type> params;
    if constexpr (quant::CalibratedCodec<Codec>) {
      if (!codec.calibrates()) return params;
      std::vector<float> absmax(static_cast<std::size_t>(streams_), 0.0f);
      for (index_t s = 0; s < streams_; ++s) {
        for (index_t i = 0; i < rows; ++i) {
          const float* row = row_of(s, i);
          for (index_t c = 0; c < dim; ++c) absmax[s] = std::max(absmax[s], std::fabs(row[c]));
        }
      }
      if (codec.granularity() == quant::ScaleGranularity::kPerTensor) {
        std::fill(absmax.begin(), absmax.end(), *std::max_element(absmax.begin(), absmax.end()));
      }
      for (float m : absmax) params.push_back(codec.params_from_absmax(m));
    }
    return params;
  }

  /// Stores calibrated parameters once per layer; a concurrent first prefill of the same layer
  /// from another sequence waits and then uses the winner's parameters.
  void commit_calibration(index_t layer, const Calibration& plan) noexcept {
    if (!plan.needed) return;
    std::lock_guard lock(calibration_mutex_);
    if (calibrated_[layer].load(std::memory_order_relaxed)) return;
    for (index_t s = 0; s < streams_; ++s) {
      const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
      if (!plan.keys.empty()) key_params_[p] = plan.keys[s];
      if (!plan.values.empty()) value_params_[p] = plan.values[s];
    }
    calibrated_[layer].store(true, std::memory_order_release);
  }

  /// Sizes the full-precision row buffers of a layer not written yet (every stream's exact
  /// prefix, tail window and page being filled), as its first write leaves them.
  void size_rows(LayerState& rows) const {
    rows.tail_keys.resize(static_cast<std::size_t>(streams_) * tail_capacity() * key_dim_);
    rows.tail_values.resize(static_cast<std::size_t>(streams_) * tail_capacity() * value_dim_);
    rows.tail_positions.resize(static_cast<std::size_t>(tail_capacity()));
  }
  /// Moves the buffers `rows` got from size_rows into `state` and counts their bytes.
  void take_rows(LayerState& state, LayerState& rows) noexcept {
    state.tail_keys = std::move(rows.tail_keys);
    state.tail_values = std::move(rows.tail_values);
    state.tail_positions = std::move(rows.tail_positions);
    tail_bytes_.fetch_add((state.tail_keys.capacity() + state.tail_values.capacity()) * sizeof(float) +
                              state.tail_positions.capacity() * sizeof(std::int32_t),
                          std::memory_order_relaxed);
  }

  /// Appends `count` tokens (rows of [streams][dim]) at consecutive positions from `first`,
  /// encoding every page the tail overflows into. All checks and allocations happen before the
  /// first change, so a throw leaves the layer untouched.
  void write_tokens(LayerState& state, index_t layer, std::span<const float> all_keys,
                    std::span<const float> all_values, index_t all_count, std::int32_t all_first, const char* call) {
    if (config_.check_inputs) {
      check_values(all_keys, quantizer_.key.max_abs_input(), call, "keys");
      check_values(all_values, quantizer_.value.max_abs_input(), call, "values");
    }
    // The first tokens of the layer fill the exact prefix; the rest go through the tail.
    const index_t pinned = std::min(config_.exact_prefix_tokens - state.prefix_count, all_count);
    const std::span<const float> keys = all_keys.subspan(static_cast<std::size_t>(pinned) * streams_ * key_dim_);
    const std::span<const float> values = all_values.subspan(static_cast<std::size_t>(pinned) * streams_ * value_dim_);
    const index_t count = all_count - pinned;
    const std::int32_t first = all_first + pinned;
    const index_t page = config_.page_size;
    const index_t total = state.tail_count + count;
    const index_t new_pages = total >= config_.tail_tokens + page ? (total - config_.tail_tokens) / page : 0;

    // Token i of the concatenation [tail rows..., new rows...] of stream s.
    const std::size_t key_row = static_cast<std::size_t>(streams_) * key_dim_;
    const std::size_t value_row = static_cast<std::size_t>(streams_) * value_dim_;
    const index_t tail_start = config_.exact_prefix_tokens;  // first tail row of each stream
    auto key_of = [&](index_t s, index_t i) -> const float* {
      return i < state.tail_count
                 ? state.tail_keys.data() + (static_cast<std::size_t>(s) * tail_capacity() + tail_start + i) * key_dim_
                 : keys.data() + static_cast<std::size_t>(i - state.tail_count) * key_row + s * key_dim_;
    };
    auto value_of = [&](index_t s, index_t i) -> const float* {
      return i < state.tail_count
                 ? state.tail_values.data() + (static_cast<std::size_t>(s) * tail_capacity() + tail_start + i) * value_dim_
                 : values.data() + static_cast<std::size_t>(i - state.tail_count) * value_row + s * value_dim_;
    };
    auto position_of = [&](index_t i) -> std::int32_t {
      return i < state.tail_count ? state.tail_positions[tail_start + i] : first + (i - state.tail_count);
    };

    Calibration calibration;
    if (new_pages > 0 && (quant::CalibratedCodec<KeyCodec> || quant::CalibratedCodec<ValueCodec>) &&
        !calibrated_[layer].load(std::memory_order_acquire)) {
      calibration.needed = true;
      calibration.keys = calibrate_plane(quantizer_.key, total, key_dim_, key_of);
      calibration.values = calibrate_plane(quantizer_.value, total, value_dim_, value_of);
    }

    // 1. Everything that can fail, before the layer changes: pages, then new buffers (a first
    //    write's tails and tables; a larger copy of each table that must grow), moved in below
    //    once all exist. A throw returns the pages and frees the new buffers.
    const bool first_write = state.tail_keys.empty();
    // fresh_index[s * new_pages + p]: page p of stream s in `fresh`, or -1 when an evictor has
    // dropped every row it would hold (such a page is never allocated). Stream-major: a stream's
    // new pages are consecutive ids, i.e. adjacent in the pool, so the hardware prefetcher
    // streams through them during attention.
    std::vector<index_t> fresh_index(static_cast<std::size_t>(new_pages) * streams_);
    index_t fresh_count = 0;
    for (index_t s = 0; s < streams_; ++s) {
      for (index_t p = 0; p < new_pages; ++p) {
        // With summaries the page is kept until eviction frees it, so its summary outlives it.
        const bool dead = !kSummarizes && !first_write && !state.eviction.empty() && (p + 1) * page <= state.tail_count &&
                          std::all_of(state.eviction[s].row_live.begin() + tail_start + p * page,
                                      state.eviction[s].row_live.begin() + tail_start + (p + 1) * page,
                                      [](std::uint8_t live) { return live == 0; });
        fresh_index[static_cast<std::size_t>(s) * new_pages + p] = dead ? -1 : fresh_count++;
      }
    }
    std::vector<PageId> fresh(static_cast<std::size_t>(fresh_count));
    allocate_pages(fresh);
    LayerState new_rows;  // a first write's row buffers (size_rows)
    std::vector<StreamEviction> new_eviction;
    std::vector<std::vector<PageId>> new_tables;  // [streams] when used; capacity 0: keep the old table
    std::vector<std::vector<float>> new_page_scores;  // the same for StreamEviction::page_scores
    std::size_t table_growth = 0;
    thread_local std::vector<float> staging;
    try {
      staging.resize(static_cast<std::size_t>(page) * std::max(key_dim_, value_dim_));
      if constexpr (kSummarizes) prepare_summary_scratch();
      if (first_write) {
        size_rows(new_rows);
        new_tables.resize(static_cast<std::size_t>(streams_));
        if constexpr (kEvicts) {
          new_eviction.resize(static_cast<std::size_t>(streams_));
          for (StreamEviction& stream : new_eviction) {
            stream.row_live.assign(static_cast<std::size_t>(tail_capacity()), 1);
            if constexpr (kKeepsScores) stream.row_scores.assign(static_cast<std::size_t>(tail_capacity()), 0.0f);
          }
        }
      }
      for (index_t s = 0; s < streams_ && new_pages > 0; ++s) {
        const std::vector<PageId>* table = first_write ? nullptr : &state.tables[s];
        const std::size_t size = table != nullptr ? table->size() : 0;
        const std::size_t before = table != nullptr ? table->capacity() : 0;
        if (size + new_pages <= before) continue;
        if (new_tables.empty()) new_tables.resize(static_cast<std::size_t>(streams_));
        new_tables[s].reserve(std::max(size + new_pages, 2 * before));
        if (table != nullptr) new_tables[s].assign(table->begin(), table->end());
        table_growth += (new_tables[s].capacity() - before) * sizeof(PageId);
      }
      for (index_t s = 0; s < streams_ && kKeepsScores && new_pages > 0; ++s) {
        const std::vector<float>* scores = first_write ? nullptr : &state.eviction[s].page_scores;
        const std::size_t size = scores != nullptr ? scores->size() : 0;
        const std::size_t need = size + static_cast<std::size_t>(new_pages) * page;
        const std::size_t before = scores != nullptr ? scores->capacity() : 0;
        if (need <= before) continue;
        if (new_page_scores.empty()) new_page_scores.resize(static_cast<std::size_t>(streams_));
        new_page_scores[s].reserve(std::max(need, 2 * before));
        if (scores != nullptr) new_page_scores[s].assign(scores->begin(), scores->end());
        table_growth += (new_page_scores[s].capacity() - before) * sizeof(float);
      }
    } catch (...) {
      for (PageId id : fresh) pool_.release(id);
      throw;
    }
    // 2. No more throws from here on.
    commit_calibration(layer, calibration);
    if (first_write) {
      take_rows(state, new_rows);
      state.tables = std::move(new_tables);
      state.eviction = std::move(new_eviction);
      std::size_t bytes = 0;
      for (const StreamEviction& stream : state.eviction) {
        bytes += stream.row_live.capacity() + stream.row_scores.capacity() * sizeof(float);
      }
      tail_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    } else if (!new_tables.empty()) {
      for (index_t s = 0; s < streams_; ++s) {
        if (new_tables[s].capacity() > 0) state.tables[s].swap(new_tables[s]);  // the old buffer goes with new_tables
      }
    }
    for (index_t s = 0; s < static_cast<index_t>(new_page_scores.size()); ++s) {
      if (new_page_scores[s].capacity() > 0) state.eviction[s].page_scores.swap(new_page_scores[s]);
    }
    table_bytes_.fetch_add(table_growth, std::memory_order_relaxed);
    for (index_t i = 0; i < pinned; ++i) {
      const index_t row = state.prefix_count + i;
      for (index_t s = 0; s < streams_; ++s) {
        std::memcpy(state.tail_keys.data() + (static_cast<std::size_t>(s) * tail_capacity() + row) * key_dim_,
                    all_keys.data() + static_cast<std::size_t>(i) * key_row + s * key_dim_, key_dim_ * sizeof(float));
        std::memcpy(state.tail_values.data() + (static_cast<std::size_t>(s) * tail_capacity() + row) * value_dim_,
                    all_values.data() + static_cast<std::size_t>(i) * value_row + s * value_dim_,
                    value_dim_ * sizeof(float));
      }
      state.tail_positions[row] = all_first + i;
    }
    state.prefix_count += pinned;

    // 3. Encode full pages from the oldest tokens. Rows an evictor dropped in the tail become
    //    dead slots; their scores move along.
    auto row_live = [&](index_t s, index_t i) -> bool {
      return state.eviction.empty() || i >= state.tail_count || state.eviction[s].row_live[tail_start + i] != 0;
    };
    for (index_t p = 0; p < new_pages; ++p) {
      const index_t begin = p * page;
      for (index_t s = 0; s < streams_; ++s) {
        const index_t index = fresh_index[static_cast<std::size_t>(s) * new_pages + p];
        if (index < 0) continue;
        const PageId id = fresh[static_cast<std::size_t>(index)];
        std::byte* payload = pool_.payload(id);
        const std::size_t params = static_cast<std::size_t>(layer) * streams_ + s;
        encode_plane(quantizer_.key, key_geometry(), key_dim_, key_row, state.tail_count, begin,
                     [&](index_t i) { return key_of(s, i); }, key_params_[params], payload, staging);
        encode_plane(quantizer_.value, value_geometry(), value_dim_, value_row, state.tail_count, begin,
                     [&](index_t i) { return value_of(s, i); }, value_params_[params],
                     payload + value_plane_offset(), staging);
        write_slot_metadata(pool_.metadata(id), [&](index_t t) { return position_of(begin + t); },
                            [&](index_t t) { return row_live(s, begin + t); });
        if constexpr (kSummarizes) write_summary(id, params, page);
        state.tables[s].push_back(id);
        if constexpr (kEvicts) {
          StreamEviction& stream = state.eviction[s];
          for (index_t t = 0; t < page; ++t) {
            stream.dead_page_slots += row_live(s, begin + t) ? 0 : 1;
            if constexpr (kKeepsScores) {
              const index_t i = begin + t;
              stream.page_scores.push_back(i < state.tail_count ? stream.row_scores[tail_start + i] : 0.0f);
            }
          }
        }
      }
    }

    // 4. The rest becomes the new tail: surviving old tail rows move down, new rows follow.
    const index_t consumed = new_pages * page;
    const index_t kept_old = std::max<index_t>(0, state.tail_count - consumed);
    for (index_t s = 0; s < streams_; ++s) {
      float* tail_k = state.tail_keys.data() + (static_cast<std::size_t>(s) * tail_capacity() + tail_start) * key_dim_;
      float* tail_v = state.tail_values.data() + (static_cast<std::size_t>(s) * tail_capacity() + tail_start) * value_dim_;
      if (kept_old > 0 && consumed > 0) {
        std::memmove(tail_k, tail_k + static_cast<std::size_t>(consumed) * key_dim_,
                     static_cast<std::size_t>(kept_old) * key_dim_ * sizeof(float));
        std::memmove(tail_v, tail_v + static_cast<std::size_t>(consumed) * value_dim_,
                     static_cast<std::size_t>(kept_old) * value_dim_ * sizeof(float));
      }
      for (index_t i = std::max(consumed, state.tail_count); i < total; ++i) {
        const index_t row = i - consumed;
        std::memcpy(tail_k + static_cast<std::size_t>(row) * key_dim_, key_of(s, i), key_dim_ * sizeof(float));
        std::memcpy(tail_v + static_cast<std::size_t>(row) * value_dim_, value_of(s, i), value_dim_ * sizeof(float));
      }
    }
    std::int32_t* tail_positions = state.tail_positions.data() + tail_start;
    if (kept_old > 0 && consumed > 0) {
      std::memmove(tail_positions, tail_positions + consumed, static_cast<std::size_t>(kept_old) * sizeof(std::int32_t));
    }
    for (index_t i = std::max(consumed, state.tail_count); i < total; ++i) tail_positions[i - consumed] = position_of(i);
    for (StreamEviction& stream : state.eviction) {
      shift_rows(stream.row_live, tail_start, consumed, kept_old, total - consumed, std::uint8_t{1});
      if constexpr (kKeepsScores) shift_rows(stream.row_scores, tail_start, consumed, kept_old, total - consumed, 0.0f);
      stream.live_tokens += all_count;
    }
    state.tail_count = total - consumed;
    state.tokens += all_count;
    state.last_position = static_cast<std::int64_t>(all_first) + all_count - 1;
    stored_elements_.fetch_add(static_cast<std::size_t>(all_count) * streams_ * (key_dim_ + value_dim_),
                               std::memory_order_relaxed);
  }

  /// Encodes tokens [begin, begin + page_size) of one stream into one plane. Rows that are all
  /// new input are read in place (strided); a page that starts in the tail is staged first
  /// (`staging` is already large enough: nothing here allocates).
  template <class Codec, class RowOf>
  static void encode_plane(const Codec& codec, quant::PageGeometry geometry, index_t dim, std::size_t input_row,
                           index_t tail_count, index_t begin, RowOf row_of,
                           const typename Codec::params_type& params, std::byte* plane,
                           std::vector<float>& staging) {
    const auto encode = [&](const float* rows, std::ptrdiff_t row_stride) {
      // Float, Int8, Q8_0, Q4_0 and KIVI pages go through SIMD write kernels (the codecs' own
      // bytes); a page a kernel declines, and every other codec's, through the codec's encode.
      bool declined = false;
      if constexpr (kernels::cpu::has_plane_encoder_v<Codec>) {
        dispatch::cpu_kernel<kernels::cpu::EncodePlane<Codec>>()(
            {rows, row_stride, geometry.page_size, geometry.head_dim, plane, &declined});
      } else {
        declined = true;
      }
      if (declined) codec.encode(geometry, rows, row_stride, params, plane);
    };
    if (begin >= tail_count) {
      encode(row_of(begin), static_cast<std::ptrdiff_t>(input_row));
      return;
    }
    for (index_t t = 0; t < geometry.page_size; ++t) {
      std::memcpy(staging.data() + static_cast<std::size_t>(t) * dim, row_of(begin + t), dim * sizeof(float));
    }
    encode(staging.data(), dim);
  }

  /// Bytes of a page's slot record: positions, then the live mask.
  [[nodiscard]] std::size_t slot_record_bytes() const noexcept {
    return static_cast<std::size_t>(config_.page_size) * sizeof(std::int32_t) + live_mask_words() * sizeof(std::uint64_t);
  }

  /// The parameters append_encoded_pages decodes a layer's pages with (`used`, one per stream),
  /// and which of them the layer takes: a plane whose codec calibrates from data, on a layer not
  /// yet calibrated, takes the given ones; any other given parameters must be the layer's.
  struct ParamsAdoption {
    std::vector<CodecParams> used;
    bool sets_keys = false;
    bool sets_values = false;
  };
  [[nodiscard]] ParamsAdoption adopt_params(index_t layer, index_t model_layer, std::span<const CodecParams> params) const {
    KVPACK_CHECK(params.empty() || params.size() == static_cast<std::size_t>(streams_), kInvalidArgument,
                 detail::message("append_encoded_pages: params must hold one entry per stream (", streams_, "), got ",
                                 params.size()));
    const auto calibrating = [](const auto& codec) {
      if constexpr (quant::CalibratedCodec<std::remove_cvref_t<decltype(codec)>>) return codec.calibrates();
      return false;
    };
    ParamsAdoption adoption;
    const bool open = !calibrated_[layer].load(std::memory_order_acquire);
    adoption.sets_keys = open && calibrating(quantizer_.key);
    adoption.sets_values = open && calibrating(quantizer_.value);
    KVPACK_CHECK(!(adoption.sets_keys || adoption.sets_values) || !params.empty(), kUnsupported,
                 detail::message("append_encoded_pages: ", Quantizer::name(), " calibrates its parameters from the ",
                                 "first page layer ", model_layer, " encodes: pass those the pages were encoded with"));
    for (index_t s = 0; s < streams_; ++s) {
      const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
      CodecParams used{key_params_[p], value_params_[p]};
      if (!params.empty()) {
        const CodecParams& given = params[static_cast<std::size_t>(s)];
        KVPACK_CHECK(adoption.sets_keys || given.first == used.first, kInvalidArgument,
                     detail::message("append_encoded_pages: layer ", model_layer, " stream ", s,
                                     " has other key codec parameters than the pages'"));
        KVPACK_CHECK(adoption.sets_values || given.second == used.second, kInvalidArgument,
                     detail::message("append_encoded_pages: layer ", model_layer, " stream ", s,
                                     " has other value codec parameters than the pages'"));
        if (adoption.sets_keys) used.first = given.first;
        if (adoption.sets_values) used.second = given.second;
      }
      adoption.used.push_back(used);
    }
    return adoption;
  }

  /// append_encoded_pages' checks of the bytes, before anything changes; returns the last
  /// position the pages hold (the layer's last when `pages` is 0).
  template <class PageOf>
  std::int64_t verify_encoded_pages(const LayerState& state, index_t layer, std::size_t pages, PageOf& page_of,
                                    PageCheck check, const std::vector<CodecParams>& params) const {
    const index_t page = config_.page_size;
    const std::size_t payload_bytes = pool_.format().payload_bytes;
    const std::size_t slot_bytes = slot_record_bytes();
    const index_t model_layer = layout::writer_of(layout_, shape_, layer);
    const auto where = [&](index_t s, std::size_t p) {
      return detail::message("layer ", model_layer, " stream ", s, " page ", p);
    };
    thread_local std::vector<std::int32_t> positions;  // stream 0's, every stream must match
    thread_local std::vector<float> decoded;
    thread_local std::vector<std::byte> reencoded;
    positions.resize(pages * static_cast<std::size_t>(page));
    if (check != PageCheck::kStructure) decoded.resize(static_cast<std::size_t>(page) * std::max(key_dim_, value_dim_));
    if (check == PageCheck::kReencode) reencoded.resize(payload_bytes);
    // Checks a plane's structure where the codec states one (KVQuant's outliers: decoding
    // indexes rows by them), decodes it, checks it finite and, for kReencode, that encoding gives
    // its bytes back, for codecs whose encoding is a fixed point of decode-then-encode.
    const auto check_plane = [&](const auto& codec, quant::PageGeometry geometry, const auto& params,
                                 const std::byte* plane, index_t s, std::size_t p, const char* what) {
      using Codec = std::remove_cvref_t<decltype(codec)>;
      if constexpr (requires { codec.valid_encoding(geometry, plane, params); }) {
        KVPACK_CHECK(codec.valid_encoding(geometry, plane, params), kInvalidArgument,
                     detail::message("append_encoded_pages: ", where(s, p), " (", what,
                                     ") has an outlier section its decoder cannot apply (entries beyond the "
                                     "capacity or outside the page)"));
      }
      codec.decode(geometry, plane, params, decoded.data());
      const std::size_t elements = static_cast<std::size_t>(geometry.page_size) * geometry.head_dim;
      KVPACK_CHECK(std::all_of(decoded.begin(), decoded.begin() + elements, [](float x) { return std::isfinite(x); }),
                   kInvalidArgument,
                   detail::message("append_encoded_pages: ", where(s, p), " (", what, ") decodes to NaN or Inf"));
      if constexpr (requires { Codec::kReencodeStable; }) {
        if (!Codec::kReencodeStable) return;
      }
      if (check != PageCheck::kReencode) return;
      codec.encode(geometry, decoded.data(), geometry.head_dim, params, reencoded.data());
      KVPACK_CHECK(std::memcmp(reencoded.data(), plane, codec.plane_bytes(geometry)) == 0, kInvalidArgument,
                   detail::message("append_encoded_pages: ", where(s, p), " (", what, ") is not what ",
                                   Quantizer::name(), " encodes for its own decoded values (a non-canonical encoding)"));
    };
    std::int64_t previous = state.last_position;
    for (index_t s = 0; s < streams_; ++s) {
      for (std::size_t p = 0; p < pages; ++p) {
        const EncodedPage encoded = page_of(s, p);
        KVPACK_CHECK(encoded.payload.size() == payload_bytes && encoded.slots.size() == slot_bytes, kInvalidArgument,
                     detail::message("append_encoded_pages: ", where(s, p), " has ", encoded.payload.size(),
                                     " payload and ", encoded.slots.size(), " slot bytes, this cache's pages ",
                                     payload_bytes, " and ", slot_bytes));
        for (index_t w = 0; w < static_cast<index_t>(live_mask_words()); ++w) {
          std::uint64_t word = 0;
          std::memcpy(&word, encoded.slots.data() + page * sizeof(std::int32_t) + w * sizeof(word), sizeof(word));
          const index_t bits = std::min<index_t>(64, page - 64 * w);
          const std::uint64_t full = bits == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1;
          KVPACK_CHECK(word == full, kInvalidArgument,
                       detail::message("append_encoded_pages: ", where(s, p),
                                       " has dead slots or bits beyond page_size in its live mask"));
        }
        for (index_t t = 0; t < page; ++t) {
          std::int32_t position = 0;
          std::memcpy(&position, encoded.slots.data() + t * sizeof(position), sizeof(position));
          std::int32_t& first_stream = positions[p * page + t];
          if (s == 0) {
            KVPACK_CHECK(position > previous, kInvalidArgument,
                         detail::message("append_encoded_pages: ", where(s, p), " slot ", t, " is at position ",
                                         position, ", not after ", previous));
            KVPACK_CHECK(position <= max_position(), kOutOfRange,
                         detail::message("append_encoded_pages: ", where(s, p), " slot ", t, " is at position ",
                                         position, ", beyond ", max_position(), max_position_reason()));
            first_stream = position;
            previous = position;
          }
          KVPACK_CHECK(position == first_stream, kInvalidArgument,
                       detail::message("append_encoded_pages: ", where(s, p), " slot ", t, " is at position ",
                                       position, ", stream 0's at ", first_stream));
        }
        if (check == PageCheck::kStructure) continue;
        const CodecParams& stream_params = params[static_cast<std::size_t>(s)];
        check_plane(quantizer_.key, key_geometry(), stream_params.first, encoded.payload.data(), s, p, "keys");
        check_plane(quantizer_.value, value_geometry(), stream_params.second,
                    encoded.payload.data() + value_plane_offset(), s, p, "values");
      }
    }
    return previous;
  }

  /// Slot positions, then the live mask.
  template <class PositionOf, class LiveOf>
  void write_slot_metadata(std::byte* metadata, PositionOf position_of, LiveOf live_of) const noexcept {
    for (index_t t = 0; t < config_.page_size; ++t) {
      const std::int32_t position = position_of(t);
      std::memcpy(metadata + static_cast<std::size_t>(t) * sizeof(std::int32_t), &position, sizeof(position));
    }
    std::uint64_t* mask = live_mask(metadata);
    std::fill_n(mask, live_mask_words(), std::uint64_t{0});
    for (index_t t = 0; t < config_.page_size; ++t) {
      if (live_of(t)) mask[t / 64] |= std::uint64_t{1} << (t % 64);
    }
  }

  /// The tail rows of one stream's per-row state move like the rows: `kept` rows from
  /// first + consumed down to first, then new rows (value `fresh`) up to `count`.
  template <class T>
  static void shift_rows(std::vector<T>& rows, index_t first, index_t consumed, index_t kept, index_t count,
                         T fresh) noexcept {
    T* tail = rows.data() + first;
    if (kept > 0 && consumed > 0) std::memmove(tail, tail + consumed, static_cast<std::size_t>(kept) * sizeof(T));
    std::fill(tail + kept, tail + count, fresh);
  }

  // ---- Eviction (Evictor::kDropsTokens) ----

  [[nodiscard]] std::uint64_t* live_mask(std::byte* metadata) const noexcept {
    return reinterpret_cast<std::uint64_t*>(metadata + static_cast<std::size_t>(config_.page_size) * sizeof(std::int32_t));
  }
  [[nodiscard]] const std::uint64_t* live_mask(PageId id) const noexcept {
    return reinterpret_cast<const std::uint64_t*>(pool_.metadata(id) +
                                                  static_cast<std::size_t>(config_.page_size) * sizeof(std::int32_t));
  }
  /// Tokens that ever lived in a summarized page (its slots minus a compaction's padding).
  [[nodiscard]] index_t lived_in(PageId id) const noexcept {
    return static_cast<index_t>(summary_of(id)[2 * key_dim_ + 1]);
  }
  [[nodiscard]] index_t live_count(const std::uint64_t* mask) const noexcept {
    index_t count = 0;
    for (std::size_t w = 0; w < live_mask_words(); ++w) count += static_cast<index_t>(std::popcount(mask[w]));
    return count;
  }

  /// StreamingLLM's in-cache positions (ALGORITHMS.md §8.2): every live token's index among the
  /// stream's live tokens in token order (exact prefix, pages, tail), laid out as attend's
  /// KeyRope reads positions: [pages][page_size], then the full-precision rows. Dead slots get
  /// the index of the next live token; the kernels skip them.
  void in_cache_positions(const LayerState& state, index_t s, std::vector<std::int32_t>& indices) const {
    const std::vector<PageId>& table = state.tables[s];
    const std::size_t page = static_cast<std::size_t>(config_.page_size);
    indices.resize(table.size() * page + static_cast<std::size_t>(state.rows_count()));
    std::int32_t* const rows = indices.data() + table.size() * page;
    const std::uint8_t* row_live = state.eviction.empty() ? nullptr : state.eviction[s].row_live.data();
    std::int32_t next = 0;
    auto number_rows = [&](index_t first, index_t last) {
      for (index_t r = first; r < last; ++r) {
        rows[r] = next;
        next += (row_live == nullptr || row_live[r] != 0) ? 1 : 0;
      }
    };
    number_rows(0, state.prefix_count);
    for (std::size_t i = 0; i < table.size(); ++i) {
      const std::uint64_t* mask = live_mask(table[i]);
      for (std::size_t t = 0; t < page; ++t) {
        indices[i * page + t] = next;
        next += static_cast<std::int32_t>((mask[t / 64] >> (t % 64)) & 1u);
      }
    }
    number_rows(state.prefix_count, state.rows_count());
  }

  /// Adds the observation window's attention to every live token's score, per stream; an
  /// evictor that ranks by the window alone (SnapKV) gets this window's scores only, not the sum
  /// with an earlier prefill's.
  void add_observation_scores(LayerState& state, index_t layer, std::span<const float> queries) {
    const index_t group = shape_.group_size();
    const float scale = 1.0f / std::sqrt(static_cast<float>(key_dim_));
    std::vector<SlotRef> refs;
    std::vector<float> scores;
    for (index_t s = 0; s < streams_; ++s) {
      refs.clear();
      const StoredTokens stored = stored_tokens(state, layer, s, &refs);
      scores.resize(refs.size());
      evict::observation_scores(stored.keys, stored.positions, key_dim_, queries, shape_.q_heads, s * group, group,
                                state.last_position, scale, evictor_.reduce(), scores);
      StreamEviction& stream = state.eviction[s];
      for (std::size_t j = 0; j < refs.size(); ++j) {
        float& score = slot_score(stream, refs[j]);
        score = uses_observation_only() ? scores[j] : score + scores[j];
      }
    }
  }

  [[nodiscard]] float& slot_score(StreamEviction& stream, SlotRef ref) const noexcept {
    return ref.page < 0 ? stream.row_scores[ref.slot]
                        : stream.page_scores[static_cast<std::size_t>(ref.page) * config_.page_size + ref.slot];
  }

  /// Adds the attention probabilities `attend` recorded for one stream (see kernels::ScoreRecord)
  /// to its tokens' scores, reduced over the group.
  void add_attention_scores(StreamEviction& stream, const kernels::ScoreRecord& record,
                            const kernels::Workspace& workspace, index_t group) const noexcept {
    const std::size_t page_slots = stream.page_scores.size();
    const evict::GroupReduce reduce = evictor_.reduce();
    for (index_t j = 0; j < record.stride; ++j) {
      float score = 0.0f;
      for (index_t h = 0; h < group; ++h) {
        const float logit = record.scores[static_cast<std::size_t>(h) * record.stride + j];
        const float sum = workspace.running_sum()[h];
        const float probability =
            logit == -std::numeric_limits<float>::infinity() || sum <= 0.0f
                ? 0.0f
                : std::exp(logit - workspace.running_max()[h]) / sum;
        evict::fold_head(reduce, probability, score);
      }
      score = evict::finish_group(reduce, score, group);
      if (static_cast<std::size_t>(j) < page_slots) {
        stream.page_scores[static_cast<std::size_t>(j)] += score;
      } else {
        stream.row_scores[static_cast<std::size_t>(j) - page_slots] += score;
      }
    }
  }

  /// Lets every stream of a layer over its budget drop tokens. Never throws: it runs after a
  /// write has committed, so when memory runs short (bad_alloc, or no page to copy a shared one
  /// into) it leaves tokens alive and the next write tries again.
  /// Whether the evictor ranks tokens by the observation window alone (SnapKV), so a prefill
  /// without one gives it nothing to decide on.
  static constexpr bool uses_observation_only() noexcept {
    if constexpr (Evictor::kDropsTokens) return Evictor::kUsesObservation && !Evictor::kNeedsScores;
    return false;
  }

  /// `choose`: whether the evictor decides now (else only pages left empty by earlier decisions
  /// are freed: tail rows dropped before they were encoded into a summarized page).
  void evict_layer(SeqId seq, const Sequence& sequence, LayerState& state, index_t layer, bool choose = true) noexcept {
    for (index_t s = 0; s < static_cast<index_t>(state.eviction.size()); ++s) {
      try {
        StreamEviction& stream = state.eviction[s];
        ensure_ghosts(stream);
        if (kSummarizes && stream.dead_page_slots >= config_.page_size) remove_empty_pages(stream, state.tables[s]);
        if (choose) evict_stream(seq, sequence, state, layer, s);
      } catch (const std::bad_alloc&) {
      } catch (const Error&) {  // OutOfPages from a copy-on-write
      }
    }
  }

  void evict_stream(SeqId seq, const Sequence& sequence, LayerState& state, index_t layer, index_t s) {
    StreamEviction& stream = state.eviction[s];
    // The context is every token written to the layer (what Pyramid's schedule is defined on),
    // not what is left of it.
    const index_t budget = evictor_.capacity(layer, cache_layers_, state.tokens);
    if (stream.live_tokens <= budget) return;
    // The exact prefix is kept and counts towards the budget; the evictor sees the rest.
    thread_local std::vector<SlotRef> refs;
    thread_local std::vector<std::int32_t> positions;
    thread_local std::vector<float> scores;
    thread_local std::vector<std::uint8_t> pinned;
    thread_local std::vector<std::uint8_t> keep;
    refs.clear();
    positions.clear();
    scores.clear();
    const std::vector<PageId>& table = state.tables[s];
    for (index_t i = 0; i < static_cast<index_t>(table.size()); ++i) {
      const std::byte* metadata = pool_.metadata(table[i]);
      const std::uint64_t* mask = live_mask(table[i]);
      for (index_t t = 0; t < config_.page_size; ++t) {
        if (((mask[t / 64] >> (t % 64)) & 1u) == 0) continue;
        std::int32_t position = 0;
        std::memcpy(&position, metadata + static_cast<std::size_t>(t) * sizeof(position), sizeof(position));
        refs.push_back({i, t});
        positions.push_back(position);
      }
    }
    for (index_t r = state.prefix_count; r < state.rows_count(); ++r) {
      if (stream.row_live[r] == 0) continue;
      refs.push_back({-1, r});
      positions.push_back(state.tail_positions[r]);
    }
    if constexpr (kKeepsScores) {
      for (const SlotRef& ref : refs) scores.push_back(slot_score(stream, ref));
    }
    pinned.resize(refs.size());
    for (std::size_t j = 0; j < refs.size(); ++j) pinned[j] = sequence.pinned(positions[j]) ? 1 : 0;
    keep.assign(refs.size(), 0);
    const evict::StreamTokens tokens{positions, scores, pinned, std::max<index_t>(0, budget - state.prefix_count),
                                     state.prefix_count};
    evictor_.choose(tokens, keep);
    if (demotion_sink_) {
      // Own copies: a sink that writes to another cache on this thread reuses the thread_locals.
      const std::vector<SlotRef> chosen(refs);
      const std::vector<std::uint8_t> kept(keep);
      if (!demote(seq, state, layer, s, chosen, kept)) {
        demotions_refused_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      drop_tokens(state, s, chosen, kept);
    } else {
      drop_tokens(state, s, refs, keep);
    }
    if (stream.dead_page_slots >= config_.page_size &&
        2 * static_cast<std::size_t>(stream.dead_page_slots) >= table.size() * config_.page_size) {
      compact_stream(state, layer, s);
    }
  }

  /// Hands the tokens of `refs` whose keep flag is 0 to the demotion sink, decoded as
  /// stored_tokens decodes them; false when the sink (or decoding) threw, so that they stay.
  bool demote(SeqId seq, const LayerState& state, index_t layer, index_t s, std::span<const SlotRef> refs,
              std::span<const std::uint8_t> keep) noexcept {
    try {
      StoredTokens dropped;
      dropped.key_dim = key_dim_;
      dropped.value_dim = value_dim_;
      const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
      const float* rows_k = state.tail_keys.data() + static_cast<std::size_t>(s) * tail_capacity() * key_dim_;
      const float* rows_v = state.tail_values.data() + static_cast<std::size_t>(s) * tail_capacity() * value_dim_;
      std::vector<float> keys, values;
      index_t decoded = -1;  // the page whose rows keys and values hold
      for (std::size_t j = 0; j < refs.size(); ++j) {
        if (keep[j] != 0) continue;
        const SlotRef ref = refs[j];
        const float* key = rows_k + static_cast<std::size_t>(ref.slot) * key_dim_;
        const float* value = rows_v + static_cast<std::size_t>(ref.slot) * value_dim_;
        std::int32_t position = 0;
        if (ref.page < 0) {
          position = state.tail_positions[ref.slot];
        } else {
          const PageId id = state.tables[s][ref.page];
          if (decoded != ref.page) {
            keys.resize(static_cast<std::size_t>(config_.page_size) * key_dim_);
            values.resize(static_cast<std::size_t>(config_.page_size) * value_dim_);
            decode_page(id, p, keys.data(), values.data());
            decoded = ref.page;
          }
          key = keys.data() + static_cast<std::size_t>(ref.slot) * key_dim_;
          value = values.data() + static_cast<std::size_t>(ref.slot) * value_dim_;
          std::memcpy(&position, pool_.metadata(id) + static_cast<std::size_t>(ref.slot) * sizeof(position),
                      sizeof(position));
        }
        dropped.positions.push_back(position);
        dropped.keys.insert(dropped.keys.end(), key, key + key_dim_);
        dropped.values.insert(dropped.values.end(), value, value + value_dim_);
      }
      if (dropped.positions.empty()) return true;
      if (config_.key_rope) {
        for (index_t i = 0; i < dropped.size(); ++i) {
          apply_rope_reference(*config_.key_rope, key_dim_, dropped.positions[i],
                               dropped.keys.data() + static_cast<std::size_t>(i) * key_dim_);
        }
      }
      demotion_sink_(DroppedTokens{seq, layout::writer_of(layout_, shape_, layer), s, dropped});
      return true;
    } catch (...) {  // the sink's failure, or no memory to decode: keep the tokens
      return false;
    }
  }

  /// Kills the tokens of `refs` (evict_stream's) whose keep flag is 0: tail rows in their live
  /// flags, page slots in their page's live mask (copying a page a fork shares first); frees pages
  /// left without a live slot.
  void drop_tokens(LayerState& state, index_t s, std::span<const SlotRef> refs, std::span<const std::uint8_t> keep) {
    StreamEviction& stream = state.eviction[s];
    std::vector<PageId>& table = state.tables[s];
    index_t dropped = 0;
    std::size_t j = 0;
    bool emptied = false;
    while (j < refs.size()) {
      const SlotRef ref = refs[j];
      if (ref.page < 0) {
        if (keep[j] == 0) {
          stream.row_live[ref.slot] = 0;
          ++dropped;
        }
        ++j;
        continue;
      }
      // All of this page's entries, then drop them together (one copy-on-write at most).
      std::size_t end = j;
      index_t drops = 0;
      while (end < refs.size() && refs[end].page == ref.page) drops += keep[end++] == 0 ? 1 : 0;
      if (drops > 0) {
        PageId id = table[ref.page];
        if (pool_.ref_count(id) > 1) {
          PageId copy = 0;
          try {
            // As every write allocates: cached prefix pages no sequence uses make room first.
            allocate_pages(std::span<PageId>(&copy, 1));
          } catch (const std::exception&) {  // OutOfPages or bad_alloc
            j = end;  // keep this page's tokens; retried after the next write
            continue;
          }
          std::memcpy(pool_.payload(copy), pool_.payload(id), pool_.format().payload_bytes);
          std::memcpy(pool_.metadata(copy), pool_.metadata(id), pool_.format().metadata_bytes);
          pool_.release(id);
          table[ref.page] = id = copy;
        }
        std::uint64_t* mask = live_mask(pool_.metadata(id));
        for (std::size_t k = j; k < end; ++k) {
          if (keep[k] == 0) mask[refs[k].slot / 64] &= ~(std::uint64_t{1} << (refs[k].slot % 64));
        }
        stream.dead_page_slots += drops;
        dropped += drops;
        emptied = emptied || live_count(mask) == 0;
      }
      j = end;
    }
    if (emptied) remove_empty_pages(stream, table);
    stream.live_tokens -= dropped;
    stored_elements_.fetch_sub(static_cast<std::size_t>(dropped) * (key_dim_ + value_dim_), std::memory_order_relaxed);
  }

  /// Returns the pages of `table` without a live slot to the pool, keeping the order of the rest.
  void remove_empty_pages(StreamEviction& stream, std::vector<PageId>& table) noexcept {
    const index_t page = config_.page_size;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < table.size(); ++i) {
      if (live_count(live_mask(table[i])) == 0) {
        if constexpr (kSummarizes) add_ghost(stream, table[i], lived_in(table[i]));
        pool_.release(table[i]);
        stream.dead_page_slots -= page;
        continue;
      }
      if (kept != i) {
        table[kept] = table[i];
        if constexpr (kKeepsScores) {
          std::copy_n(stream.page_scores.begin() + static_cast<std::ptrdiff_t>(i) * page, page,
                      stream.page_scores.begin() + static_cast<std::ptrdiff_t>(kept) * page);
        }
      }
      ++kept;
    }
    table.resize(kept);
    if constexpr (kKeepsScores) stream.page_scores.resize(kept * page);
  }

  /// Re-encodes the live slots of every run of consecutive pages only this sequence holds into as
  /// few pages as they fill, in token order, and frees the rest (pages shared with a fork stay as
  /// they are). Float codecs decode and re-encode exactly; the others re-quantize decoded values.
  void compact_stream(LayerState& state, index_t layer, index_t s) {
    std::vector<PageId>& table = state.tables[s];
    std::size_t first = 0;
    while (first < table.size()) {
      // A shared page is not rewritten; nor is a whole page at the start of a run (nothing to
      // gain, and prefix sharing must not cache a page whose bytes were encoded twice).
      if (pool_.ref_count(table[first]) > 1 || live_count(live_mask(table[first])) == config_.page_size) {
        ++first;
        continue;
      }
      std::size_t end = first;
      while (end < table.size() && pool_.ref_count(table[end]) == 1) ++end;
      first += compact_run(state, layer, s, first, end);
    }
  }

  /// compact_stream for pages [first, end) of the table; returns how many pages they became.
  std::size_t compact_run(LayerState& state, index_t layer, index_t s, std::size_t first, std::size_t end) {
    std::vector<PageId>& table = state.tables[s];
    StreamEviction& stream = state.eviction[s];
    const index_t page = config_.page_size;
    index_t live = 0;
    for (std::size_t i = first; i < end; ++i) live += live_count(live_mask(table[i]));
    const std::size_t pages = static_cast<std::size_t>((live + page - 1) / page);
    if (pages == end - first) return pages;  // nothing to gain

    // Everything that allocates, before the pages change.
    std::vector<float> keys(static_cast<std::size_t>(live + page) * key_dim_);
    std::vector<float> values(static_cast<std::size_t>(live + page) * value_dim_);
    std::vector<std::int32_t> positions(static_cast<std::size_t>(live));
    std::vector<float> scores(kKeepsScores ? static_cast<std::size_t>(live) : 0);
    std::vector<float> decoded_keys(static_cast<std::size_t>(page) * key_dim_);
    std::vector<float> decoded_values(static_cast<std::size_t>(page) * value_dim_);
    if constexpr (kSummarizes) {
      prepare_summary_scratch();
      ensure_ghosts(stream);
    }

    const std::size_t p = static_cast<std::size_t>(layer) * streams_ + s;
    std::size_t n = 0;
    for (std::size_t i = first; i < end; ++i) {
      decode_page(table[i], p, decoded_keys.data(), decoded_values.data());
      const std::byte* metadata = pool_.metadata(table[i]);
      const std::uint64_t* mask = live_mask(table[i]);
      for (index_t t = 0; t < page; ++t) {
        if (((mask[t / 64] >> (t % 64)) & 1u) == 0) continue;
        std::copy_n(decoded_keys.begin() + static_cast<std::ptrdiff_t>(t) * key_dim_, key_dim_,
                    keys.begin() + static_cast<std::ptrdiff_t>(n) * key_dim_);
        std::copy_n(decoded_values.begin() + static_cast<std::ptrdiff_t>(t) * value_dim_, value_dim_,
                    values.begin() + static_cast<std::ptrdiff_t>(n) * value_dim_);
        std::memcpy(&positions[n], metadata + static_cast<std::size_t>(t) * sizeof(std::int32_t), sizeof(std::int32_t));
        if constexpr (kKeepsScores) scores[n] = stream.page_scores[i * page + t];
        ++n;
      }
    }
    if constexpr (kSummarizes) {
      // Decoding changed nothing; from here on nothing throws. The dead tokens of these pages
      // keep their summaries; the new pages summarize the live ones.
      for (std::size_t i = first; i < end; ++i) {
        add_ghost(stream, table[i], lived_in(table[i]) - live_count(live_mask(table[i])));
      }
    }
    // The last page's unused slots repeat its last token (dead slots): they leave its scales and
    // ranges as they are, where zeros would widen them.
    for (std::size_t t = n; t < pages * page; ++t) {
      std::copy_n(keys.begin() + static_cast<std::ptrdiff_t>(n - 1) * key_dim_, key_dim_,
                  keys.begin() + static_cast<std::ptrdiff_t>(t) * key_dim_);
      std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(n - 1) * value_dim_, value_dim_,
                  values.begin() + static_cast<std::ptrdiff_t>(t) * value_dim_);
    }
    for (std::size_t j = 0; j < pages; ++j) {
      const PageId id = table[first + j];
      const std::size_t base = j * page;
      std::byte* payload = pool_.payload(id);
      quantizer_.key.encode(key_geometry(), keys.data() + base * key_dim_, key_dim_, key_params_[p], payload);
      quantizer_.value.encode(value_geometry(), values.data() + base * value_dim_, value_dim_, value_params_[p],
                              payload + value_plane_offset());
      write_slot_metadata(
          pool_.metadata(id), [&](index_t t) { return positions[std::min(base + t, n - 1)]; },
          [&](index_t t) { return base + t < n; });
      if constexpr (kSummarizes) write_summary(id, p, static_cast<index_t>(std::min<std::size_t>(page, n - base)));
      if constexpr (kKeepsScores) {
        for (index_t t = 0; t < page; ++t) stream.page_scores[(first + j) * page + t] = base + t < n ? scores[base + t] : 0.0f;
      }
    }
    for (std::size_t i = first + pages; i < end; ++i) pool_.release(table[i]);
    const auto gone = static_cast<std::ptrdiff_t>(end - first - pages);
    table.erase(table.begin() + static_cast<std::ptrdiff_t>(first + pages), table.begin() + static_cast<std::ptrdiff_t>(end));
    if constexpr (kKeepsScores) {
      stream.page_scores.erase(stream.page_scores.begin() + static_cast<std::ptrdiff_t>((first + pages) * page),
                               stream.page_scores.begin() + static_cast<std::ptrdiff_t>(end * page));
    }
    stream.dead_page_slots -= static_cast<index_t>(gone) * page;
    return pages;
  }

  // ---- Page summaries and the certified bound (select::Quest) ----

  /// Summary floats per page: [min][max] of the keys as read (head_dim each), the largest value
  /// norm, the tokens that lived in the page.
  [[nodiscard]] std::size_t summary_floats() const noexcept { return 2 * static_cast<std::size_t>(key_dim_) + 2; }
  [[nodiscard]] std::size_t summary_offset() const noexcept {
    return static_cast<std::size_t>(config_.page_size) * sizeof(std::int32_t) + live_mask_words() * sizeof(std::uint64_t);
  }
  [[nodiscard]] float* summary_of(PageId id) noexcept {
    return reinterpret_cast<float*>(pool_.metadata(id) + summary_offset());
  }
  [[nodiscard]] const float* summary_of(PageId id) const noexcept {
    return reinterpret_cast<const float*>(pool_.metadata(id) + summary_offset());
  }

  /// Per-thread buffers write_summary decodes a page into; sized here, where throwing is allowed.
  struct SummaryScratch {
    std::vector<float> keys;
    std::vector<float> values;
    std::vector<float> rotated;
  };
  static SummaryScratch& summary_scratch() noexcept {
    thread_local SummaryScratch scratch;
    return scratch;
  }
  void prepare_summary_scratch() const {
    SummaryScratch& scratch = summary_scratch();
    const std::size_t rows = static_cast<std::size_t>(config_.page_size);
    if (scratch.keys.size() < rows * key_dim_) scratch.keys.resize(rows * key_dim_);
    if (scratch.values.size() < rows * value_dim_) scratch.values.resize(rows * value_dim_);
    if (scratch.rotated.size() < rows * key_dim_) scratch.rotated.resize(rows * key_dim_);
  }

  /// Writes a page's summary from its encoded bytes (prepare_summary_scratch first): the
  /// channel box of every slot's key as the kernels read it (decoded, and rotated to its
  /// position for pre-RoPE keys, the box then widened by the rotation's rounding), the largest
  /// value norm, and `lived`.
  void write_summary(PageId id, std::size_t params, index_t lived) noexcept {
    SummaryScratch& scratch = summary_scratch();
    const index_t page = config_.page_size;
    decode_page(id, params, scratch.keys.data(), scratch.values.data());
    const float* keys = scratch.keys.data();
    if (config_.key_rope) {
      const std::byte* metadata = pool_.metadata(id);
      for (index_t t = 0; t < page; ++t) {
        std::int32_t position = 0;
        std::memcpy(&position, metadata + static_cast<std::size_t>(t) * sizeof(position), sizeof(position));
        rotate_with_tables(rope_tables_->view(), position, scratch.keys.data() + static_cast<std::size_t>(t) * key_dim_,
                           scratch.rotated.data() + static_cast<std::size_t>(t) * key_dim_);
      }
      keys = scratch.rotated.data();
    }
    float* summary = summary_of(id);
    select::summarize_page(keys, nullptr, page, key_dim_, summary, summary + key_dim_);
    if (config_.key_rope) {
      // The kernels rotate with their own instruction order: allow a few ulps of the row's size.
      for (index_t c = 0; c < key_dim_; ++c) {
        const float slack = 0x1p-18f * (std::fabs(summary[c]) + std::fabs(summary[key_dim_ + c])) + 1e-30f;
        summary[c] -= slack;
        summary[key_dim_ + c] += slack;
      }
    }
    float norm = 0.0f;
    for (index_t t = 0; t < page; ++t) norm = std::max(norm, row_norm(scratch.values.data() + static_cast<std::size_t>(t) * value_dim_));
    summary[2 * key_dim_] = norm;
    summary[2 * key_dim_ + 1] = static_cast<float>(lived);
  }

  /// ‖v‖₂ rounded up (a relative 2^-20 covers the float sum's rounding at any head_dim we take).
  [[nodiscard]] float row_norm(const float* v) const noexcept {
    double sum = 0.0;
    for (index_t c = 0; c < value_dim_; ++c) sum += static_cast<double>(v[c]) * v[c];
    return static_cast<float>(std::sqrt(sum) * (1.0 + 0x1p-20));
  }

  /// Bounds of every page of a stream: [group][pages] per head (only with `per_head`: the
  /// certified bound needs them, selection does not), then [pages] for the group.
  void page_bounds(const std::vector<PageId>& table, std::span<const float> queries, index_t group, bool per_head,
                   std::vector<float>& bounds) const {
    thread_local std::vector<const float*> summaries;
    summaries.resize(table.size());
    for (std::size_t i = 0; i < table.size(); ++i) summaries[i] = summary_of(table[i]);
    bounds.resize((static_cast<std::size_t>(group) + 1) * table.size());
    const std::span<float> all(bounds);
    const std::span<float> heads = per_head ? all.first(static_cast<std::size_t>(group) * table.size()) : std::span<float>{};
    select::group_page_bounds(queries, group, key_dim_, summaries, heads, all.last(table.size()), selector_.group_bound);
  }

  /// The certified bound for one stream's heads after attend read the pages `reading` and the
  /// live tail rows: unread tokens are the pages not read, the dead slots of pages read, the
  /// tokens of freed pages (ghosts) and dead tail rows. `spans` and `span_bounds` receive the
  /// entries with unread tokens, as AttendReport describes them.
  void bound_unread(const LayerState& state, index_t s, std::span<const index_t> reading,
                    std::span<const float> head_bounds, std::span<const float> queries,
                    const kernels::Workspace& workspace, std::span<select::UnreadBound> out,
                    std::vector<UnreadSpan>& spans, std::vector<float>& span_bounds) const {
    const index_t group = static_cast<index_t>(out.size());
    const std::vector<PageId>& table = state.tables[s];
    const std::size_t pages = table.size();
    thread_local std::vector<std::uint8_t> read;
    thread_local std::vector<index_t> unread;  // [entries]: pages, ghosts, dead tail rows
    thread_local std::vector<index_t> unread_live;  // [pages]: of unread, the live ones
    thread_local std::vector<float> bounds;    // [group][entries]
    thread_local std::vector<float> ghost_bounds;
    thread_local std::vector<float> rotated;
    read.assign(pages, 0);
    for (index_t i : reading) read[static_cast<std::size_t>(i)] = 1;
    const StreamEviction* stream = state.eviction.empty() ? nullptr : &state.eviction[s];
    const std::size_t ghosts = stream != nullptr ? static_cast<std::size_t>(stream->ghost_count) : 0;
    thread_local std::vector<index_t> dead_rows;
    dead_rows.clear();
    if (stream != nullptr) {
      for (index_t r = state.prefix_count; r < state.rows_count(); ++r) {
        if (stream->row_live[r] == 0) dead_rows.push_back(r);
      }
    }
    const std::size_t entries = pages + ghosts + dead_rows.size();
    unread.assign(entries, 0);
    unread_live.assign(pages, 0);
    bounds.assign(static_cast<std::size_t>(group) * entries, 0.0f);
    float max_norm = 0.0f;
    for (std::size_t i = 0; i < pages; ++i) {
      const float* summary = summary_of(table[i]);
      const auto lived = static_cast<index_t>(summary[2 * key_dim_ + 1]);
      const index_t live = live_count(live_mask(table[i]));
      unread[i] = read[i] != 0 ? lived - live : lived;
      unread_live[i] = read[i] != 0 ? 0 : live;
      max_norm = std::max(max_norm, summary[2 * key_dim_]);
      for (index_t h = 0; h < group; ++h) bounds[h * entries + i] = head_bounds[h * pages + i];
    }
    if (ghosts > 0) {
      thread_local std::vector<const float*> summaries;
      summaries.resize(ghosts);
      for (std::size_t g = 0; g < ghosts; ++g) {
        summaries[g] = stream->ghosts.data() + g * summary_floats();
        unread[pages + g] = static_cast<index_t>(std::min<float>(summaries[g][2 * key_dim_ + 1], 2e9f));
        max_norm = std::max(max_norm, summaries[g][2 * key_dim_]);
      }
      ghost_bounds.resize((static_cast<std::size_t>(group) + 1) * ghosts);
      const std::span<float> all(ghost_bounds);
      select::group_page_bounds(queries, group, key_dim_, summaries, all.first(static_cast<std::size_t>(group) * ghosts),
                                all.last(ghosts), select::GroupBound::kMax);
      for (index_t h = 0; h < group; ++h) {
        std::copy_n(ghost_bounds.begin() + static_cast<std::ptrdiff_t>(h) * ghosts, ghosts,
                    bounds.begin() + static_cast<std::ptrdiff_t>(h * entries + pages));
      }
    }
    const float* rows_k = state.tail_keys.data() + static_cast<std::size_t>(s) * tail_capacity() * key_dim_;
    const float* rows_v = state.tail_values.data() + static_cast<std::size_t>(s) * tail_capacity() * value_dim_;
    for (index_t r = 0; r < state.rows_count(); ++r) max_norm = std::max(max_norm, row_norm(rows_v + static_cast<std::size_t>(r) * value_dim_));
    rotated.resize(static_cast<std::size_t>(key_dim_));
    for (std::size_t j = 0; j < dead_rows.size(); ++j) {
      // A dead tail row's score is known exactly; a margin covers the kernels' float rounding.
      const float* key = rows_k + static_cast<std::size_t>(dead_rows[j]) * key_dim_;
      if (config_.key_rope) {
        rotate_with_tables(rope_tables_->view(), state.tail_positions[dead_rows[j]], key, rotated.data());
        key = rotated.data();
      }
      unread[pages + ghosts + j] = 1;
      for (index_t h = 0; h < group; ++h) {
        double dot = 0.0, size = 0.0;
        for (index_t c = 0; c < key_dim_; ++c) {
          dot += static_cast<double>(queries[h * key_dim_ + c]) * key[c];
          size += std::fabs(static_cast<double>(queries[h * key_dim_ + c]) * key[c]);
        }
        bounds[h * entries + pages + ghosts + j] = static_cast<float>(dot + 0x1p-16 * size + 1e-30);
      }
    }
    select::unread_bounds(bounds, unread, std::span<const float>(workspace.running_max(), static_cast<std::size_t>(group)),
                          std::span<const float>(workspace.running_sum(), static_cast<std::size_t>(group)), max_norm, out);
    // The entries with unread tokens, for recall: where they lie and their bounds.
    spans.clear();
    for (std::size_t e = 0; e < entries; ++e) {
      if (unread[e] == 0) continue;
      std::pair<std::int32_t, std::int32_t> range;
      if (e < pages) {
        range = position_range(table[e]);
      } else if (e < pages + ghosts) {
        range = {stream->ghost_positions[2 * (e - pages)], stream->ghost_positions[2 * (e - pages) + 1]};
      } else {
        const std::int32_t position = state.tail_positions[dead_rows[e - pages - ghosts]];
        range = {position, position};
      }
      spans.push_back({range.first, range.second, unread[e], e < pages ? unread_live[e] : 0});
    }
    span_bounds.clear();
    for (index_t h = 0; h < group; ++h) {
      for (std::size_t e = 0; e < entries; ++e) {
        if (unread[e] != 0) span_bounds.push_back(bounds[h * entries + e]);
      }
    }
  }

  /// The first and last position of a page's slots (unused slots repeat the last token's).
  [[nodiscard]] std::pair<std::int32_t, std::int32_t> position_range(PageId id) const noexcept {
    const std::byte* metadata = pool_.metadata(id);
    std::int32_t first = std::numeric_limits<std::int32_t>::max(), last = std::numeric_limits<std::int32_t>::min();
    for (index_t t = 0; t < config_.page_size; ++t) {
      std::int32_t position = 0;
      std::memcpy(&position, metadata + static_cast<std::size_t>(t) * sizeof(std::int32_t), sizeof(position));
      first = std::min(first, position);
      last = std::max(last, position);
    }
    return {first, last};
  }

  // Ghosts: the summaries of tokens that died with their page (or left it in a compaction), kept
  // so the bound still covers them. At most kMaxGhosts per stream: when full, neighbours merge
  // (their boxes' union holds both, so the bound stays valid, only looser).
  static constexpr index_t kMaxGhosts = 16;

  /// Allocates a stream's ghost storage on first need (may throw: call before changing anything).
  void ensure_ghosts(StreamEviction& stream) {
    if constexpr (kSummarizes) {
      if (!stream.ghosts.empty()) return;
      stream.ghosts.resize(kMaxGhosts * summary_floats());
      stream.ghost_positions.resize(2 * kMaxGhosts);
      table_bytes_.fetch_add(stream.ghosts.capacity() * sizeof(float) +
                                 stream.ghost_positions.capacity() * sizeof(std::int32_t),
                             std::memory_order_relaxed);
    }
  }

  /// Keeps the `count` dead tokens of page `id` under its summary's box and its position range
  /// (ensure_ghosts first).
  void add_ghost(StreamEviction& stream, PageId id, index_t count) noexcept {
    if (count <= 0) return;
    const std::size_t n = summary_floats();
    std::int32_t* positions = stream.ghost_positions.data();
    if (stream.ghost_count == kMaxGhosts) {
      for (index_t g = 0; g < kMaxGhosts / 2; ++g) {
        merge_ghost(stream.ghosts.data() + static_cast<std::size_t>(g) * n,
                    stream.ghosts.data() + static_cast<std::size_t>(2 * g) * n,
                    stream.ghosts.data() + static_cast<std::size_t>(2 * g + 1) * n);
        positions[2 * g] = std::min(positions[4 * g], positions[4 * g + 2]);
        positions[2 * g + 1] = std::max(positions[4 * g + 1], positions[4 * g + 3]);
      }
      stream.ghost_count = kMaxGhosts / 2;
    }
    float* ghost = stream.ghosts.data() + static_cast<std::size_t>(stream.ghost_count) * n;
    std::copy_n(summary_of(id), n - 1, ghost);
    ghost[n - 1] = static_cast<float>(count);
    const auto [first, last] = position_range(id);
    positions[2 * stream.ghost_count] = first;
    positions[2 * stream.ghost_count + 1] = last;
    ++stream.ghost_count;
  }

  /// out = the union of ghosts a and b (out may be a).
  void merge_ghost(float* out, const float* a, const float* b) const noexcept {
    for (index_t c = 0; c < key_dim_; ++c) {
      out[c] = std::min(a[c], b[c]);
      out[key_dim_ + c] = std::max(a[key_dim_ + c], b[key_dim_ + c]);
    }
    out[2 * key_dim_] = std::max(a[2 * key_dim_], b[2 * key_dim_]);
    // Counts add up; rounded up where a float cannot hold the sum, so none is lost.
    const double sum = static_cast<double>(a[2 * key_dim_ + 1]) + b[2 * key_dim_ + 1];
    float rounded = static_cast<float>(sum);
    if (static_cast<double>(rounded) < sum) rounded = std::nextafter(rounded, std::numeric_limits<float>::infinity());
    out[2 * key_dim_ + 1] = rounded;
  }

  /// Adds (sign +1) or removes (-1) a sequence's tails, tables and elements from the counters.
  void account(const Sequence& sequence, int sign) noexcept {
    std::size_t tails = 0;
    std::size_t tables = 0;
    std::size_t elements = 0;
    for (const LayerState& state : sequence.layers) {
      tails += (state.tail_keys.capacity() + state.tail_values.capacity()) * sizeof(float) +
               state.tail_positions.capacity() * sizeof(std::int32_t);
      for (const auto& table : state.tables) tables += table.capacity() * sizeof(PageId);
      if (state.eviction.empty()) {
        elements += static_cast<std::size_t>(state.tokens) * streams_ * (key_dim_ + value_dim_);
      }
      for (const StreamEviction& stream : state.eviction) {
        tails += stream.row_live.capacity() + stream.row_scores.capacity() * sizeof(float);
        tables += (stream.page_scores.capacity() + stream.ghosts.capacity()) * sizeof(float) +
                  stream.ghost_positions.capacity() * sizeof(std::int32_t);
        elements += static_cast<std::size_t>(stream.live_tokens) * (key_dim_ + value_dim_);
      }
    }
    if (sign > 0) {
      tail_bytes_.fetch_add(tails, std::memory_order_relaxed);
      table_bytes_.fetch_add(tables, std::memory_order_relaxed);
      stored_elements_.fetch_add(elements, std::memory_order_relaxed);
    } else {
      tail_bytes_.fetch_sub(tails, std::memory_order_relaxed);
      table_bytes_.fetch_sub(tables, std::memory_order_relaxed);
      stored_elements_.fetch_sub(elements, std::memory_order_relaxed);
    }
  }

  // ---- Prefix sharing (CacheConfig::prefix_sharing) ----

  /// Takes pages for a write; with prefix sharing, cached pages no sequence uses go back to the
  /// pool first when it has too few. When even that is not enough OutOfPages is thrown as
  /// before: the sequences are unchanged, but the evicted prefixes stay evicted.
  void allocate_pages(std::span<PageId> out) {
    if (prefix_index_ != nullptr && !out.empty()) {
      const std::size_t available = pool_.pages_available();
      if (out.size() > available) prefix_index_->evict_unreferenced(out.size() - available);
    }
    pool_.allocate(out);
  }

  /// The PrefixKey of this cache now. The codec parameters are fingerprinted at every call: FP8
  /// calibrated from the first prefill fixes a layer's scales with its first page, and a lookup
  /// must only meet pages encoded with the parameters in force.
  [[nodiscard]] paging::PrefixKey prefix_key(const std::string& salt) {
    paging::PrefixKey key;
    key.model_id = config_.prefix_sharing->model_id;
    key.layout = std::string(Layout::kName);
    key.shape = shape_;
    key.page_size = config_.page_size;
    key.codec = Quantizer::name();
    key.codec_params = codec_params_fingerprint();
    key.cache_options = prefix_options_;
    key.salt = salt;
    return key;
  }

  /// Every (layer, stream)'s key and value parameters, by their object bytes (paging's
  /// codec_params_fingerprint), read under the lock commit_calibration writes them under.
  [[nodiscard]] std::uint64_t codec_params_fingerprint() {
    std::lock_guard lock(calibration_mutex_);
    return paging::codec_params_fingerprint<KeyParams, ValueParams>(key_params_, value_params_);
  }

  /// The cache options that change page bytes or which stream a page belongs to: pre-RoPE keys
  /// and their RoPE, the exact prefix (0: checked), the selector's summaries in page metadata,
  /// the layout's cache layers (CrossLayer's K).
  [[nodiscard]] std::uint64_t prefix_options_fingerprint() const noexcept {
    paging::Fingerprint f;
    f.add(config_.key_rope.has_value());
    if (config_.key_rope) {
      f.add(config_.key_rope->theta).add(config_.key_rope->pairing).add(config_.key_rope->max_position);
    }
    f.add(config_.exact_prefix_tokens).add(kSummarizes).add(selector_.summary_bytes(config_.page_size, key_dim_));
    f.add(cache_layers_).add(streams_);
    return f.value();
  }

  /// Whole pages of `sequence`'s prompt that every layer holds at positions 0, 1, …: what may be
  /// cached. Positions grow strictly from 0, so a page's last slot at position (p + 1)·page − 1
  /// means every earlier slot is at its index; every stream of a layer has the same positions.
  [[nodiscard]] std::size_t shareable_pages(const Sequence& sequence) const noexcept {
    const std::size_t page = static_cast<std::size_t>(config_.page_size);
    std::size_t pages = sequence.prompt.size() / page;
    // Page p must hold positions [p·page, (p + 1)·page), every slot live: its last slot at the
    // last of them (positions increase within a page), and — once an evictor may have dropped
    // or compacted slots, in any stream — its first slot at the first and a full live mask.
    const auto intact = [&](PageId id, std::size_t p) {
      std::int32_t first = 0, last = 0;
      std::memcpy(&first, pool_.metadata(id), sizeof(first));
      std::memcpy(&last, pool_.metadata(id) + (page - 1) * sizeof(std::int32_t), sizeof(last));
      if (static_cast<std::size_t>(last) != (p + 1) * page - 1) return false;
      if constexpr (kEvicts) {
        return static_cast<std::size_t>(first) == p * page && live_count(live_mask(id)) == config_.page_size;
      }
      return true;
    };
    for (const LayerState& state : sequence.layers) {
      if (state.tables.empty()) return 0;
      const index_t streams = kEvicts ? streams_ : 1;
      for (index_t s = 0; s < streams; ++s) {
        pages = std::min(pages, state.tables[s].size());
        std::size_t ok = 0;
        while (ok < pages && intact(state.tables[s][ok], ok)) ++ok;
        pages = ok;
      }
    }
    return pages;
  }

  /// The eviction state a prefill of `pages` whole pages leaves before any token is dropped:
  /// every slot live, scores 0, an empty full-precision window.
  void adopt_eviction_state(LayerState& state, std::size_t pages) {
    state.eviction.resize(static_cast<std::size_t>(streams_));
    for (StreamEviction& stream : state.eviction) {
      stream.row_live.assign(static_cast<std::size_t>(tail_capacity()), 1);
      if constexpr (kKeepsScores) {
        stream.row_scores.assign(static_cast<std::size_t>(tail_capacity()), 0.0f);
        stream.page_scores.assign(pages * static_cast<std::size_t>(config_.page_size), 0.0f);
      }
      stream.live_tokens = static_cast<index_t>(pages) * config_.page_size;
    }
  }

  /// Caches `sequence`'s shareable pages; the sequence's lease moves to the longer path. With
  /// an evicting cache, the cached tokens are pinned in `sequence` as in every sequence that
  /// adopts them.
  index_t insert_prefix(Sequence& sequence) {
    const std::size_t pages = shareable_pages(sequence);
    if (pages == 0) return 0;
    if constexpr (kEvicts) sequence.pins.reserve(sequence.pins.size() + 1);  // no throw after the insert
    const std::size_t streams = static_cast<std::size_t>(cache_layers_) * streams_;
    std::vector<PageId> ids(pages * streams);
    for (index_t layer = 0; layer < cache_layers_; ++layer) {
      for (index_t s = 0; s < streams_; ++s) {
        const std::vector<PageId>& table = sequence.layers[layer].tables[s];
        for (std::size_t p = 0; p < pages; ++p) ids[p * streams + static_cast<std::size_t>(layer) * streams_ + s] = table[p];
      }
    }
    const std::size_t tokens = pages * static_cast<std::size_t>(config_.page_size);
    paging::PrefixLease lease =
        prefix_index_->insert(prefix_key(sequence.salt), std::span<const paging::TokenId>(sequence.prompt).first(tokens), ids);
    if (lease.pages() >= sequence.lease.pages()) sequence.lease = std::move(lease);
    if constexpr (kEvicts) sequence.pins.emplace_back(0, static_cast<std::int64_t>(tokens) - 1);
    return static_cast<index_t>(tokens);
  }

  void release_pages(const Sequence& sequence) noexcept {
    for (const LayerState& state : sequence.layers) {
      for (const auto& table : state.tables) {
        for (PageId page : table) pool_.release(page);
      }
    }
  }

  ModelShape shape_;
  CacheConfig config_;
  Quantizer quantizer_;
  Layout layout_;
  [[no_unique_address]] Evictor evictor_;
  [[no_unique_address]] Selector selector_;
  index_t streams_;
  index_t key_dim_;
  index_t value_dim_;
  index_t cache_layers_;  // layers that keep a cache (fewer than shape_.layers when shared)
  mutable paging::PagePool pool_;
  std::shared_ptr<const RopeTables> rope_tables_;  ///< null unless config_.key_rope
  /// Null unless config_.prefix_sharing. After pool_ (it releases its pages into it when
  /// destroyed) and before sequences_ (their leases must go first).
  std::unique_ptr<paging::PrefixIndex> prefix_index_;
  std::uint64_t prefix_options_ = 0;  ///< the PrefixKey's cache_options, fixed at construction

  std::vector<KeyParams> key_params_;      ///< [layers][streams]
  std::vector<ValueParams> value_params_;  ///< [layers][streams]
  std::unique_ptr<std::atomic<bool>[]> calibrated_;  ///< [layers]
  std::mutex calibration_mutex_;

  mutable std::shared_mutex sequences_mutex_;
  std::unordered_map<SeqId, std::unique_ptr<Sequence>> sequences_;
  SeqId next_id_ = 1;

  DemotionSink demotion_sink_;  ///< empty unless set_demotion_sink
  std::atomic<std::uint64_t> demotions_refused_{0};

  std::atomic<std::size_t> tail_bytes_{0};
  std::atomic<std::size_t> table_bytes_{0};
  std::atomic<std::size_t> stored_elements_{0};
};

}  // namespace kvpack::inline v0
