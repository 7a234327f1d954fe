#pragma once
/// \file device_cache.cuh
/// \brief A KV cache created on the GPU: KVCache's calls (add_sequence, prefill, append, attend,
///        release) with every span in device memory. Pages live in one DevicePagePool and are
///        encoded there, fp32 rows (exact prefix, tail) stay on the device, and the pages equal
///        the bytes a host KVCache with the same shape, options and tokens holds. One DeviceLayer
///        per (sequence, layer) does the work (device_layer.cuh).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/device_layer.cuh"
#include "kvpack/kernels/cuda/position_runs.hpp"
#include "kvpack/layout/gqa.hpp"
#include "kvpack/paging/prefix_index.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace device_cache_detail {

__global__ void scale_kernel(const float* in, float* out, float scale, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i] * scale;
  }
}

/// A codec whose parameters the device reads as the host holds them (not KVQuant's).
template <class Codec>
concept ParamsCrossUnchanged = std::is_same_v<device_params_t<Codec>, typename Codec::params_type>;

/// A codec the cache can encode and read. Not yet TurboQuant, whose per-layer tables the cache
/// would have to build (`prepare`) and whose attention in the rotated space its twins' tests
/// would have to bound.
template <class Codec>
concept CacheableCodec = DeviceEncodable<Codec> && !rotated_space<ElementDecoder<Codec>>;

/// A quantizer the cache can hold: when either plane's parameters have a device form of their
/// own (KVQuant's), the cache keeps one host set per stream, fixed up front, so neither plane may
/// calibrate from the data (a Mixed pair of FP8 keys and KVQuant values would).
template <class Quantizer, class K = typename Quantizer::key_codec, class V = typename Quantizer::value_codec>
concept CacheableQuantizer = CacheableCodec<K> && CacheableCodec<V> &&
                             ((ParamsCrossUnchanged<K> && ParamsCrossUnchanged<V>) ||
                              (!quant::CalibratedCodec<K> && !quant::CalibratedCodec<V>));

}  // namespace device_cache_detail

/// Grouped-query attention only (layout::GQA: one stream per KV head). Not yet: evictors,
/// selectors, keys stored before RoPE, codecs the device cannot encode (Prod's, QJL's keys) and
/// TurboQuant-MSE: each is rejected at compile time or by the constructor. KVQuant's parameters point into host tables:
/// each layer holds device copies of what they point to, and the cache keeps the host's. A
/// codec that calibrates from the data (FP8's default) takes a layer's parameters as KVCache
/// does, from the rows of the first write that encodes a page of that layer. Prefix sharing
/// (CacheConfig::prefix_sharing) works as KVCache's, over this cache's own PrefixIndex of device
/// pages: add_sequence(tokens) starts on the cached pages of a prompt's longest whole-page
/// prefix, share_prefix and release cache them.
/// Calls that touch one sequence's layer run on one CUDA stream at a time, any stream (its
/// tables, rows, workspace and scaled query are ordered by it); add_sequence and adopt are
/// synchronous, fork, read_back and share_prefix wait for the whole device. Not thread-safe: one
/// host thread at a time.
template <class Quantizer>
  requires device_cache_detail::CacheableQuantizer<Quantizer>
class DeviceKVCache {
 public:
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  using Layer = DeviceLayer<KeyCodec, ValueCodec>;
  using KeyParams = typename KeyCodec::params_type;
  using ValueParams = typename ValueCodec::params_type;
  /// Whether the layers hold the host's parameters themselves (every codec but KVQuant); only
  /// such codecs calibrate from the data.
  static constexpr bool kSameParams =
      device_cache_detail::ParamsCrossUnchanged<KeyCodec> && device_cache_detail::ParamsCrossUnchanged<ValueCodec>;

  /// \param device_pages the device pool's capacity in pages (one cudaMalloc up front;
  ///        CacheConfig::max_pages is the host pool's and is not read)
  /// \throws kvpack::Error: kInvalidConfig for a bad shape or config, kUnsupported for options the
  ///         device does not implement, a CUDA failure, or no GPU
  DeviceKVCache(const ModelShape& shape, CacheConfig config, std::size_t device_pages, Quantizer quantizer = {})
      : shape_(shape), config_(std::move(config)), quantizer_(std::move(quantizer)) {
    shape_.validate();
    config_.validate();
    const quant::PageGeometry g{config_.page_size, shape_.head_dim};
    quantizer_.key.validate(g);
    quantizer_.value.validate(g);
    // As KVCache: tables made for one model (FP8's static per-head scales, KVQuant's calibration)
    // are indexed by its layers and KV heads; another model's would hand heads the wrong rows.
    if constexpr (requires { quantizer_.key.check_model(shape_.layers, shape_.kv_heads); }) {
      quantizer_.key.check_model(shape_.layers, shape_.kv_heads);
    }
    if constexpr (requires { quantizer_.value.check_model(shape_.layers, shape_.kv_heads); }) {
      quantizer_.value.check_model(shape_.layers, shape_.kv_heads);
    }
    KVPACK_CHECK(!config_.key_rope, kUnsupported,
                 "DeviceKVCache: keys stored before RoPE are not supported on the device yet");
    // The exact prefix is fp32 rows per sequence, not pages: a hit could not supply them.
    KVPACK_CHECK(!config_.prefix_sharing || config_.exact_prefix_tokens == 0, kUnsupported,
                 ::kvpack::detail::message("CacheConfig.prefix_sharing shares whole pages from the first token: it "
                                           "needs exact_prefix_tokens == 0, got ", config_.exact_prefix_tokens));
    KVPACK_CHECK(device_availability().count > 0, kUnsupported,
                 ::kvpack::detail::message("DeviceKVCache: ", device_availability().reason));
    value_offset_ = round_up_64(quantizer_.key.plane_bytes(g));
    paging::PageFormat format;
    format.payload_bytes = round_up_64(value_offset_ + quantizer_.value.plane_bytes(g));
    pool_ = std::make_unique<DevicePagePool>(format, device_pages);
    if (config_.prefix_sharing) {
      prefix_index_ = std::make_unique<paging::PrefixIndex>(
          *pool_, config_.page_size, static_cast<std::size_t>(shape_.layers) * shape_.kv_heads);
    }
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      for (index_t s = 0; s < shape_.kv_heads; ++s) {
        key_params_.push_back(quantizer_.key.initial_params(layer, s));
        value_params_.push_back(quantizer_.value.initial_params(layer, s));
      }
    }
    calibrated_.assign(static_cast<std::size_t>(shape_.layers),
                       !calibrates(quantizer_.key) && !calibrates(quantizer_.value));
  }
  DeviceKVCache(DeviceKVCache&&) noexcept = default;
  /// Deleted: assigning would free the pool before the sequences whose pages it holds.
  DeviceKVCache& operator=(DeviceKVCache&&) = delete;

  /// Starts an empty sequence: every layer gets one stream per KV head.
  [[nodiscard]] SeqId add_sequence() {
    Sequence sequence = sequence_on({});
    const SeqId id = next_id_;
    sequences_.emplace(id, std::move(sequence));
    ++next_id_;
    return id;
  }

  /// Starts a sequence whose first tokens are `prompt`, on the cached pages of its longest
  /// whole-page prefix when this cache holds them under the same salt and codec parameters, as
  /// KVCache::add_sequence(tokens) does (its documentation holds here): `cached_tokens` tokens at
  /// positions 0 … cached_tokens − 1 in every layer, at least max(1, tail_tokens) prompt tokens
  /// left to prefill, and the caller's promise that the K/V it writes at positions 0 … n − 1 are
  /// those of prompt[0 … n − 1]. Synchronous.
  /// \throws kvpack::Error(kUnsupported) without CacheConfig::prefix_sharing
  [[nodiscard]] PrefixHit add_sequence(std::span<const paging::TokenId> prompt, std::string_view salt = {}) {
    KVPACK_CHECK(prefix_index_ != nullptr, kUnsupported,
                 "add_sequence(tokens) shares prompt prefixes: set CacheConfig.prefix_sharing (or call "
                 "add_sequence())");
    const std::size_t left = std::max<std::size_t>(1, static_cast<std::size_t>(config_.tail_tokens));
    const std::size_t lookup = prompt.size() > left ? prompt.size() - left : 0;
    std::string salt_of_prompt(salt);
    paging::PrefixMatch hit = prefix_index_->match(prefix_key(salt_of_prompt), prompt.first(lookup));
    Sequence sequence = sequence_on(hit);
    sequence.prompt.assign(prompt.begin(), prompt.end());
    sequence.salt = std::move(salt_of_prompt);
    sequence.lease = std::move(hit.lease);
    const SeqId id = next_id_;
    sequences_.emplace(id, std::move(sequence));
    ++next_id_;
    return {id, static_cast<index_t>(hit.tokens)};
  }

  /// Caches the whole pages of a sequence's prompt (given to add_sequence(tokens)) that every
  /// layer holds at positions 0, 1, … (as KVCache::share_prefix), so that sequences added from
  /// now on reuse them; release does the same. Waits for the whole device first: other sequences
  /// may read the pages on any stream once they are cached. Returns the prompt tokens now cached.
  /// \throws kvpack::Error(kUnsupported) without prefix sharing, (kInvalidArgument) for a
  ///         sequence added without tokens
  index_t share_prefix(SeqId seq) {
    Sequence& sequence = find(seq, "share_prefix");
    KVPACK_CHECK(prefix_index_ != nullptr, kUnsupported,
                 "share_prefix: prefix sharing is off (CacheConfig.prefix_sharing)");
    KVPACK_CHECK(!sequence.prompt.empty(), kInvalidArgument,
                 ::kvpack::detail::message("share_prefix: sequence ", seq,
                                           " was added without tokens (add_sequence(tokens))"));
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return insert_prefix(sequence);
  }

  /// The prefix index's counters and sizes (all zero without prefix sharing). Its cached pages
  /// are also in memory().pages_in_use: they stay on the device after their sequences are
  /// released, until a write finds the pool full or evict_prefix_cache drops them.
  [[nodiscard]] paging::PrefixIndexStats prefix_stats() const {
    return prefix_index_ ? prefix_index_->stats() : paging::PrefixIndexStats{};
  }

  /// Drops cached prefix pages no sequence is using, least recently used first, until
  /// `pool_pages` pages went back to the device pool (all of them by default). Writes do this on
  /// their own when the pool runs out.
  paging::PrefixEviction evict_prefix_cache(std::size_t pool_pages = paging::PrefixIndex::kAllPages) {
    return prefix_index_ ? prefix_index_->evict_unreferenced(pool_pages) : paging::PrefixEviction{};
  }

  /// A host cache's sequence, copied here to continue on the device (prefill on the CPU, decode
  /// on the GPU): every layer's pages byte for byte (mirror_layer), fp32 rows and positions; with
  /// prefix sharing, cached prefixes no sequence uses make room first (it comes without its
  /// prompt, so its own pages are never cached here). A layer with pages keeps the host's codec
  /// parameters, and a calibrating codec's become this cache's for that layer if it has none
  /// yet; a layer without pages takes this cache's. The host cache keeps its sequence. All or
  /// nothing (for the sequences; cached prefixes evicted to make room stay evicted).
  /// \throws kvpack::Error(kInvalidArgument) when its shape, page size, exact prefix or tail
  ///         window differ from this cache's, a layer's pages were calibrated otherwise than
  ///         this cache calibrated that layer, or (KVQuant) its quantizer is not this cache's;
  ///         what mirror_layer throws; kvpack::OutOfPages
  template <class Evictor, class Selector>
  [[nodiscard]] SeqId adopt(const KVCache<layout::GQA, Quantizer, Evictor, Selector>& cache, SeqId seq) {
    const ModelShape& other = cache.shape();
    const CacheConfig& options = cache.config();
    KVPACK_CHECK(other.layers == shape_.layers && other.q_heads == shape_.q_heads &&
                     other.kv_heads == shape_.kv_heads && other.head_dim == shape_.head_dim &&
                     options.page_size == config_.page_size &&
                     options.exact_prefix_tokens == config_.exact_prefix_tokens &&
                     options.tail_tokens == config_.tail_tokens,
                 kInvalidArgument,
                 "adopt: the host cache's shape, page_size, exact_prefix_tokens or tail_tokens differ from this "
                 "cache's");
    if constexpr (!kSameParams) {
      KVPACK_CHECK(cache.quantizer() == quantizer_, kInvalidArgument,
                   "adopt: the host cache's quantizer (KVQuant's calibration tables, outlier fraction) is not this "
                   "cache's");
    }
    if (prefix_index_ != nullptr) {
      std::size_t pages = 0;  // at most what mirror_layer uploads
      for (index_t layer = 0; layer < shape_.layers; ++layer) {
        for (index_t s = 0; s < shape_.kv_heads; ++s) pages += cache.pages(seq, layer, s).size();
      }
      reclaim(pages);
    }
    Sequence sequence(shape_.layers);
    std::vector<index_t> calibrated_here;  // layers whose parameters this cache takes from the host's
    std::vector<std::int32_t> positions;
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      sequence.layers.push_back(mirror_layer(cache, seq, layer, *pool_, &positions));
      Layer& device = sequence.layers.back();
      for (std::int32_t position : positions) sequence.positions[layer].add(position, 1);
      if constexpr (!kSameParams) {
        continue;  // the host's parameters are this cache's (checked above) and never calibrate
      } else if (cache.pages(seq, layer, 0).empty()) {
        for (index_t s = 0; s < shape_.kv_heads; ++s) {
          device.set_params(s, key_params_[param_index(layer, s)], value_params_[param_index(layer, s)]);
        }
      } else if (!calibrated_[layer]) {
        calibrated_here.push_back(layer);
      } else {
        for (index_t s = 0; s < shape_.kv_heads; ++s) {
          KVPACK_CHECK(same_calibration(device.key_params(s), device.value_params(s), layer, s), kInvalidArgument,
                       ::kvpack::detail::message("adopt: layer ", layer, " of the host sequence was calibrated with "
                                                 "other parameters than this cache's"));
        }
      }
    }
    const SeqId id = next_id_;
    sequences_.emplace(id, std::move(sequence));
    ++next_id_;
    if constexpr (kSameParams) {  // calibrated_here stays empty otherwise
      for (index_t layer : calibrated_here) {  // no other sequence holds a page of these layers
        // The host's parameters for the calibrating planes; this cache's own for the others.
        const Layer& device = sequences_.at(id).layers[layer];
        std::vector<KeyParams> keys;
        std::vector<ValueParams> values;
        for (index_t s = 0; s < shape_.kv_heads; ++s) {
          keys.push_back(calibrates(quantizer_.key) ? device.key_params(s) : key_params_[param_index(layer, s)]);
          values.push_back(calibrates(quantizer_.value) ? device.value_params(s)
                                                        : value_params_[param_index(layer, s)]);
        }
        commit_calibration(layer, keys, values, id);
      }
    }
    return id;
  }

  /// A new sequence sharing every page of `seq` (as KVCache::fork: pages are immutable once
  /// encoded, the fp32 rows are copied). Appends to either do not reach the other. Waits for the
  /// whole device first (its layers may be written on different streams).
  [[nodiscard]] SeqId fork(SeqId seq) {
    const Sequence& source = find(seq, "fork");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    Sequence copy(shape_.layers);
    for (const Layer& layer : source.layers) copy.layers.push_back(layer.fork());
    copy.positions = source.positions;
    copy.prompt = source.prompt;
    copy.salt = source.salt;
    copy.lease = source.lease.share();
    const SeqId id = next_id_;
    sequences_.emplace(id, std::move(copy));
    ++next_id_;
    return id;
  }

  /// Drops a sequence; its pages go back to the device pool and may be handed out at once, so
  /// let the launches that read the sequence finish first. With prefix sharing its prompt's whole
  /// pages are cached first, once the whole device is done with what was queued (launches still
  /// writing them included); best effort: release cannot fail, so a prompt the index has no
  /// memory for, or a device that reports an error, leaves nothing cached.
  void release(SeqId seq) {
    Sequence& sequence = find(seq, "release");
    if (prefix_index_ != nullptr && !sequence.prompt.empty() && cudaDeviceSynchronize() == cudaSuccess) {
      try {
        insert_prefix(sequence);
      } catch (const std::exception&) {
      }
    }
    sequences_.erase(seq);
  }

  /// Appends the prompt's keys and values for one layer ([T][kv_heads][head_dim] each, device
  /// memory), at positions following the layer's last; call again to prefill in chunks.
  /// Asynchronous on `stream`. The rows must be finite and within the codecs' max_abs_input():
  /// the device does not check them, as KVCache does with check_inputs.
  void prefill(SeqId seq, index_t layer, std::span<const float> keys, std::span<const float> values,
               cudaStream_t stream = nullptr) {
    const std::size_t row = static_cast<std::size_t>(shape_.kv_heads) * shape_.head_dim;
    KVPACK_CHECK(!keys.empty() && keys.size() % row == 0 && values.size() == keys.size(), kInvalidArgument,
                 ::kvpack::detail::message("prefill: keys and values must hold the same T > 0 rows of kv_heads * "
                                           "head_dim = ", row, " elements, got ", keys.size(), " and ", values.size()));
    const auto tokens = static_cast<std::int64_t>(keys.size() / row);
    const std::int64_t last = find(seq, "prefill").positions.at(checked_layer(layer, "prefill")).last();
    write(seq, layer, keys, values, tokens, last + tokens, "prefill", stream);
  }

  /// Appends one decoded token's key and value ([kv_heads][head_dim] each, device memory) at
  /// `position`, greater than every position already in this layer. Asynchronous on `stream`.
  void append(SeqId seq, index_t layer, std::span<const float> key, std::span<const float> value,
              std::int64_t position, cudaStream_t stream = nullptr) {
    const std::size_t row = static_cast<std::size_t>(shape_.kv_heads) * shape_.head_dim;
    KVPACK_CHECK(key.size() == row && value.size() == row, kInvalidArgument,
                 ::kvpack::detail::message("append: key and value must hold kv_heads * head_dim = ", row,
                                           " elements, got ", key.size(), " and ", value.size()));
    const std::int64_t last = find(seq, "append").positions.at(checked_layer(layer, "append")).last();
    KVPACK_CHECK(position > last, kInvalidArgument,
                 ::kvpack::detail::message("append: position ", position, " must be greater than the layer's last (",
                                           last, ")"));
    write(seq, layer, key, value, 1, position, "append", stream);
  }

  /// out[h] = softmax(scale · q[h] · Kᵀ) V over every token of the layer ([q_heads][head_dim]
  /// each, device memory). Asynchronous on `stream`.
  void attend(SeqId seq, index_t layer, std::span<const float> query, std::span<float> out, float scale,
              cudaStream_t stream = nullptr) {
    Sequence& sequence = find(seq, "attend");
    layer = checked_layer(layer, "attend");
    const std::size_t rows = static_cast<std::size_t>(shape_.q_heads) * shape_.head_dim;
    KVPACK_CHECK(query.size() == rows && out.size() == rows, kInvalidArgument,
                 ::kvpack::detail::message("attend: query and out must hold q_heads * head_dim = ", rows,
                                           " elements, got ", query.size(), " and ", out.size()));
    KVPACK_CHECK(std::isfinite(scale), kInvalidArgument,
                 ::kvpack::detail::message("attend: scale ", scale, " is not finite"));
    check_device(query.data(), "attend", "query");
    check_device(out.data(), "attend", "out");
    KVPACK_CHECK(sequence.positions[layer].last() >= 0, kInvalidArgument,
                 ::kvpack::detail::message("attend: layer ", layer, " of sequence ", seq, " holds no tokens"));
    DeviceBuffer<float>& scaled = sequence.scaled_queries[layer];
    if (scaled.size() < rows) scaled = DeviceBuffer<float>(rows);
    device_cache_detail::scale_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, stream>>>(
        query.data(), scaled.data(), scale, rows);
    check(cudaGetLastError(), "query scale launch");
    sequence.layers[layer].attend(scaled.data(), out.data(), stream);
  }

  /// What KV stream `kv_head` of a layer stores, decoded on the host, as KVCache::read_back gives
  /// it: the exact prefix's rows, the pages' tokens, then the tail's rows, with their positions.
  /// Waits for the whole device, then copies the pages and rows back. For checks and for moving
  /// a sequence elsewhere, not for a decode step.
  [[nodiscard]] StoredTokens read_back(SeqId seq, index_t layer, index_t kv_head) const {
    const Sequence& sequence = find(seq, "read_back");
    const Layer& device = sequence.layers[checked_layer(layer, "read_back")];
    KVPACK_CHECK(kv_head >= 0 && kv_head < shape_.kv_heads, kInvalidArgument,
                 ::kvpack::detail::message("read_back: stream ", kv_head, " out of range [0, ", shape_.kv_heads, ")"));
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const index_t d = shape_.head_dim;
    std::vector<float> row_keys, row_values;
    device.download_rows(kv_head, row_keys, row_values);
    const std::size_t prefix_floats = static_cast<std::size_t>(device.stored_rows(kv_head).prefix) * d;
    StoredTokens stored;
    stored.key_dim = stored.value_dim = d;
    stored.positions = sequence.positions[layer].expand();
    stored.keys.assign(row_keys.begin(), row_keys.begin() + static_cast<std::ptrdiff_t>(prefix_floats));
    stored.values.assign(row_values.begin(), row_values.begin() + static_cast<std::ptrdiff_t>(prefix_floats));
    const quant::PageGeometry g{config_.page_size, d};
    std::vector<std::byte> payload(pool_->format().payload_bytes);
    std::vector<float> keys(static_cast<std::size_t>(g.page_size) * d), values(keys.size());
    for (index_t i = 0; i < device.pages(kv_head); ++i) {
      check(cudaMemcpy(payload.data(), device.page(kv_head, i), payload.size(), cudaMemcpyDeviceToHost),
            "page download");
      const auto [key_params, value_params] = host_params(device, layer, kv_head);
      quantizer_.key.decode(g, payload.data(), key_params, keys.data());
      quantizer_.value.decode(g, payload.data() + value_offset_, value_params, values.data());
      stored.keys.insert(stored.keys.end(), keys.begin(), keys.end());
      stored.values.insert(stored.values.end(), values.begin(), values.end());
    }
    stored.keys.insert(stored.keys.end(), row_keys.begin() + static_cast<std::ptrdiff_t>(prefix_floats),
                       row_keys.end());
    stored.values.insert(stored.values.end(), row_values.begin() + static_cast<std::ptrdiff_t>(prefix_floats),
                         row_values.end());
    return stored;
  }

  /// The position of the last token of one layer of a sequence, -1 when it holds none.
  [[nodiscard]] std::int64_t last_position(SeqId seq, index_t layer) const {
    return find(seq, "last_position").positions[checked_layer(layer, "last_position")].last();
  }
  /// Tokens stored in one layer of a sequence.
  [[nodiscard]] index_t length(SeqId seq, index_t layer) const {
    return static_cast<index_t>(find(seq, "length").positions[checked_layer(layer, "length")].size());
  }
  [[nodiscard]] std::size_t sequence_count() const noexcept { return sequences_.size(); }
  /// The codec parameters (layer, kv_head) gives a new sequence: calibrated ones once the layer
  /// is calibrated.
  [[nodiscard]] std::pair<KeyParams, ValueParams> codec_params(index_t layer, index_t kv_head) const {
    layer = checked_layer(layer, "codec_params");
    KVPACK_CHECK(kv_head >= 0 && kv_head < shape_.kv_heads, kInvalidArgument,
                 ::kvpack::detail::message("codec_params: stream ", kv_head, " out of range [0, ", shape_.kv_heads,
                                           ")"));
    return {key_params_[param_index(layer, kv_head)], value_params_[param_index(layer, kv_head)]};
  }

  /// Device bytes held, by kind, as KVCache::memory counts host bytes: pages in use, fp32 rows
  /// (`tails`), block tables, their companions and the attention scratch (`tables`), and the
  /// elements stored (a fork counts its shared tokens again). Page metadata stays on the host
  /// (positions as runs); `codec_params` are the cache's host copies.
  [[nodiscard]] MemoryUsage memory() const {
    MemoryUsage usage;
    usage.pages_in_use = pool_->pages_in_use();
    usage.page_payload = usage.pages_in_use * pool_->format().payload_bytes;
    usage.codec_params = key_params_.size() * sizeof(KeyParams) + value_params_.size() * sizeof(ValueParams);
    for (const auto& [id, sequence] : sequences_) {
      for (index_t layer = 0; layer < shape_.layers; ++layer) {
        const Layer& device = sequence.layers[layer];
        usage.tails += device.row_bytes();
        usage.tables += device.table_bytes() + sequence.scaled_queries[layer].size() * sizeof(float);
        usage.stored_elements += static_cast<std::size_t>(sequence.positions[layer].size()) * shape_.kv_heads *
                                 shape_.head_dim * 2;
      }
    }
    return usage;
  }

  /// The DeviceLayer behind (seq, layer): its pages, rows and counts.
  [[nodiscard]] const Layer& layer(SeqId seq, index_t layer) const {
    return find(seq, "layer").layers[checked_layer(layer, "layer")];
  }
  [[nodiscard]] const DevicePagePool& pool() const noexcept { return *pool_; }
  [[nodiscard]] const ModelShape& shape() const noexcept { return shape_; }
  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] const Quantizer& quantizer() const noexcept { return quantizer_; }
  [[nodiscard]] std::size_t value_plane_offset() const noexcept { return value_offset_; }

 private:
  struct Sequence {
    explicit Sequence(index_t layers)
        : positions(static_cast<std::size_t>(layers)), scaled_queries(static_cast<std::size_t>(layers)) {
      this->layers.reserve(static_cast<std::size_t>(layers));
    }
    std::vector<Layer> layers;
    std::vector<PositionRuns> positions;  // per layer
    std::vector<DeviceBuffer<float>> scaled_queries;  // per layer: attend's query times the scale
    std::vector<paging::TokenId> prompt;  // add_sequence(tokens)'s, for the prefix index
    std::string salt;
    paging::PrefixLease lease;  // pins the cached prefix it started on or cached
  };

  /// The host form of stream `s`'s parameters in a layer of a sequence: the layer's own, or,
  /// where the layer holds a device form, this cache's (the only ones its layers take).
  std::pair<KeyParams, ValueParams> host_params(const Layer& device, index_t layer, index_t s) const {
    if constexpr (kSameParams) {
      return {device.key_params(s), device.value_params(s)};
    } else {
      return {key_params_[param_index(layer, s)], value_params_[param_index(layer, s)]};
    }
  }

  template <class Codec>
  static bool calibrates(const Codec& codec) {
    if constexpr (quant::CalibratedCodec<Codec>) {
      return codec.calibrates();
    } else {
      return false;
    }
  }
  static std::size_t round_up_64(std::size_t bytes) noexcept { return (bytes + 63) / 64 * 64; }
  std::size_t param_index(index_t layer, index_t s) const noexcept {
    return static_cast<std::size_t>(layer) * shape_.kv_heads + s;
  }

  /// A new sequence whose every stream starts on `hit`'s pages (none when nothing matched), with
  /// this cache's codec parameters: the state a prefill of those whole pages leaves.
  Sequence sequence_on(const paging::PrefixMatch& hit) {
    Sequence sequence(shape_.layers);
    std::vector<PageId> ids(hit.pages);
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      sequence.layers.emplace_back(*pool_, shape_.group_size(), config_.page_size, shape_.head_dim, value_offset_,
                                   TailWindow{config_.exact_prefix_tokens, config_.tail_tokens});
      for (index_t s = 0; s < shape_.kv_heads; ++s) {
        for (std::size_t p = 0; p < hit.pages; ++p) ids[p] = hit.page(p)[param_index(layer, s)];
        sequence.layers.back().add_cached_stream(ids, key_params_[param_index(layer, s)],
                                                 value_params_[param_index(layer, s)]);
      }
      sequence.positions[layer].add(0, static_cast<std::int64_t>(hit.tokens));
    }
    return sequence;
  }

  /// The PrefixKey of this cache now: its codec parameters are read at every call, since FP8
  /// calibrated from the data fixes a layer's scales with its first page.
  [[nodiscard]] paging::PrefixKey prefix_key(const std::string& salt) const {
    paging::PrefixKey key;
    key.model_id = config_.prefix_sharing->model_id;
    key.layout = std::string(layout::GQA::kName);
    key.shape = shape_;
    key.page_size = config_.page_size;
    key.codec = Quantizer::name();
    key.codec_params = paging::codec_params_fingerprint<KeyParams, ValueParams>(key_params_, value_params_);
    key.salt = salt;  // cache_options stays 0: no option that changes page bytes is supported here
    return key;
  }

  /// Caches the whole pages of a sequence's prompt that every layer holds at positions 0, 1, …
  /// (the exact prefix is 0, so token i of the first pages · page_size is slot i of the pages).
  /// Returns the tokens cached.
  index_t insert_prefix(Sequence& sequence) {
    const std::size_t page = static_cast<std::size_t>(config_.page_size);
    std::size_t pages = sequence.prompt.size() / page;
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      pages = std::min({pages, static_cast<std::size_t>(sequence.positions[layer].counted_from_zero()) / page,
                        static_cast<std::size_t>(sequence.layers[layer].pages(0))});
    }
    if (pages == 0) return 0;
    const std::size_t streams = static_cast<std::size_t>(shape_.layers) * shape_.kv_heads;
    std::vector<PageId> ids(pages * streams);
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      for (index_t s = 0; s < shape_.kv_heads; ++s) {
        for (std::size_t p = 0; p < pages; ++p) {
          ids[p * streams + param_index(layer, s)] = sequence.layers[layer].page_id(s, static_cast<index_t>(p));
        }
      }
    }
    const std::size_t tokens = pages * page;
    paging::PrefixLease lease = prefix_index_->insert(
        prefix_key(sequence.salt), std::span<const paging::TokenId>(sequence.prompt).first(tokens), ids);
    if (lease.pages() >= sequence.lease.pages()) sequence.lease = std::move(lease);
    return static_cast<index_t>(tokens);
  }

  /// With prefix sharing, cached pages no sequence uses go back to the pool first when a write of
  /// `tokens` tokens needs more pages than it has free (as KVCache does).
  void make_room(const Layer& device, index_t tokens, const RowRule& rule) {
    if (prefix_index_ == nullptr) return;
    // Every page a write encodes takes page_size of the stored and new rows: a bound that spares
    // a decode step the plan while the pool has room.
    const auto streams = static_cast<std::size_t>(shape_.kv_heads);
    const auto most = static_cast<std::size_t>((device.stored_rows(0).total() + tokens) / config_.page_size);
    if (most * streams <= pool_->pages_available()) return;
    reclaim(static_cast<std::size_t>(plan_row_append(device.stored_rows(0), tokens, rule).new_pages) * streams);
  }

  /// Cached pages no sequence uses go back to the pool, least recently used first, until it has
  /// `pages` free or no such page is left.
  void reclaim(std::size_t pages) {
    const std::size_t available = pool_->pages_available();
    if (pages > available) prefix_index_->evict_unreferenced(pages - available);
  }

  /// Whether a stream's parameters equal this cache's for (layer, s) on each calibrating plane.
  bool same_calibration(const KeyParams& key, const ValueParams& value, index_t layer, index_t s) const {
    bool same = true;
    if constexpr (quant::CalibratedCodec<KeyCodec>) {
      same = same && (!quantizer_.key.calibrates() || key == key_params_[param_index(layer, s)]);
    }
    if constexpr (quant::CalibratedCodec<ValueCodec>) {
      same = same && (!quantizer_.value.calibrates() || value == value_params_[param_index(layer, s)]);
    }
    return same;
  }

  /// One plane's parameters per stream from max |x| over the rows KVCache calibrates a layer's
  /// first page from (calibrate_plane): the tail rows and this write's rows after the exact prefix.
  /// Empty when the plane's codec does not calibrate.
  template <class Codec>
  std::vector<typename Codec::params_type> calibrate_plane(const Codec& codec, const Layer& device, Plane plane,
                                                           const float* input, index_t tokens,
                                                           cudaStream_t stream) const {
    std::vector<typename Codec::params_type> params;
    if constexpr (quant::CalibratedCodec<Codec>) {
      if (!codec.calibrates()) return params;
      const index_t pinned = std::min(config_.exact_prefix_tokens - device.stored_rows(0).prefix, tokens);
      const std::size_t d = static_cast<std::size_t>(shape_.head_dim);
      const std::size_t row = static_cast<std::size_t>(shape_.kv_heads) * d;
      std::vector<float> absmax = stream_absmax(device.tail_rows(plane),
                                                StridedRows{input + static_cast<std::size_t>(pinned) * row, d, row,
                                                            tokens - pinned},
                                                shape_.kv_heads, shape_.head_dim, stream);
      if (codec.granularity() == quant::ScaleGranularity::kPerTensor) {
        std::fill(absmax.begin(), absmax.end(), *std::max_element(absmax.begin(), absmax.end()));
      }
      for (float m : absmax) params.push_back(codec.params_from_absmax(m));
    }
    return params;
  }

  /// Appends `tokens` tokens ending at position `last` to a layer (room for one more run in
  /// `positions` reserved). A CUDA failure during append_tokens's launches leaves its rows
  /// recorded: their positions are then recorded too, so that the two stay in step.
  static void append(Layer& device, PositionRuns& positions, const float* keys, const float* values,
                     std::int64_t tokens, std::int64_t last, cudaStream_t stream) {
    const std::int64_t held = positions.size();
    try {
      device.append_tokens(keys, values, static_cast<index_t>(tokens), stream);
    } catch (...) {
      if (stored_tokens(device) != held) positions.add(last - tokens + 1, tokens);
      throw;
    }
    positions.add(last - tokens + 1, tokens);
  }
  /// Tokens stream 0 of a layer holds: its rows and its pages' slots.
  static std::int64_t stored_tokens(const Layer& device) {
    return device.stored_rows(0).total() + static_cast<std::int64_t>(device.pages(0)) * device.page_size();
  }

  /// Makes a layer's calibrated parameters this cache's, for every sequence: none holds a page
  /// of that layer yet (its first page is what calibrates it). `except` already has them.
  void commit_calibration(index_t layer, const std::vector<KeyParams>& keys, const std::vector<ValueParams>& values,
                          SeqId except) {
    for (index_t s = 0; s < shape_.kv_heads; ++s) {
      key_params_[param_index(layer, s)] = keys[s];
      value_params_[param_index(layer, s)] = values[s];
    }
    for (auto& [id, sequence] : sequences_) {
      if (id == except) continue;
      for (index_t s = 0; s < shape_.kv_heads; ++s) sequence.layers[layer].set_params(s, keys[s], values[s]);
    }
    calibrated_[layer] = true;
  }

  Sequence& find(SeqId seq, const char* call) {
    const auto it = sequences_.find(seq);
    KVPACK_CHECK(it != sequences_.end(), kUnknownSequence, ::kvpack::detail::message(call, ": no sequence ", seq));
    return it->second;
  }
  const Sequence& find(SeqId seq, const char* call) const { return const_cast<DeviceKVCache*>(this)->find(seq, call); }

  index_t checked_layer(index_t layer, const char* call) const {
    KVPACK_CHECK(layer >= 0 && layer < shape_.layers, kInvalidArgument,
                 ::kvpack::detail::message(call, ": layer ", layer, " out of range [0, ", shape_.layers, ")"));
    return layer;
  }

  static void check_device(const void* address, const char* call, const char* what) {
    KVPACK_CHECK(is_device_memory(address), kInvalidArgument,
                 ::kvpack::detail::message(call, ": ", what, " is not device memory (DeviceKVCache reads and writes "
                                           "the GPU's memory only)"));
  }

  /// `tokens` tokens whose last position is `last` (positions only order the calls: keys are
  /// stored after RoPE, so the device reads none).
  void write(SeqId seq, index_t layer, std::span<const float> keys, std::span<const float> values,
             std::int64_t tokens, std::int64_t last, const char* call, cudaStream_t stream) {
    Sequence& sequence = find(seq, call);
    layer = checked_layer(layer, call);
    check_device(keys.data(), call, "keys");
    check_device(values.data(), call, "values");
    constexpr std::int64_t kMaxPosition = std::numeric_limits<std::int32_t>::max();
    KVPACK_CHECK(last <= kMaxPosition && tokens <= kMaxPosition, kOutOfRange,
                 ::kvpack::detail::message(call, ": positions would exceed ", kMaxPosition));
    Layer& device = sequence.layers[layer];
    PositionRuns& positions = sequence.positions[layer];
    positions.reserve();  // so that adding this write's positions below cannot throw
    const RowRule rule{config_.page_size, {config_.exact_prefix_tokens, config_.tail_tokens}};
    make_room(device, static_cast<index_t>(tokens), rule);
    // Only a layer still to be calibrated plans ahead whether this write encodes its first page.
    const auto first_page = [&] {
      return plan_row_append(device.stored_rows(0), static_cast<index_t>(tokens), rule).new_pages > 0;
    };
    if constexpr (!kSameParams) {
      append(device, positions, keys.data(), values.data(), tokens, last, stream);  // nothing calibrates
    } else if (calibrated_[layer] || !first_page()) {
      append(device, positions, keys.data(), values.data(), tokens, last, stream);
    } else {
      // The layer's first page: its parameters come from the rows that fill it, as on the host.
      std::vector<KeyParams> key_params = calibrate_plane(quantizer_.key, device, Plane::kKey, keys.data(),
                                                          static_cast<index_t>(tokens), stream);
      std::vector<ValueParams> value_params = calibrate_plane(quantizer_.value, device, Plane::kValue,
                                                              values.data(), static_cast<index_t>(tokens), stream);
      for (index_t s = 0; s < shape_.kv_heads; ++s) {
        if (key_params.size() < static_cast<std::size_t>(shape_.kv_heads)) key_params.push_back(device.key_params(s));
        if (value_params.size() < static_cast<std::size_t>(shape_.kv_heads)) {
          value_params.push_back(device.value_params(s));
        }
      }
      for (index_t s = 0; s < shape_.kv_heads; ++s) device.set_params(s, key_params[s], value_params[s]);
      try {
        append(device, positions, keys.data(), values.data(), tokens, last, stream);
      } catch (...) {
        // append_tokens is all or nothing for the pool: the old parameters go back, unless a CUDA
        // failure during its launches left pages, which were encoded with the new ones.
        if (device.pages(0) > 0) {
          commit_calibration(layer, key_params, value_params, seq);
        } else {
          for (index_t s = 0; s < shape_.kv_heads; ++s) {
            device.set_params(s, key_params_[param_index(layer, s)], value_params_[param_index(layer, s)]);
          }
        }
        throw;
      }
      commit_calibration(layer, key_params, value_params, seq);
    }
  }

  ModelShape shape_;
  CacheConfig config_;
  Quantizer quantizer_;
  std::size_t value_offset_ = 0;
  std::unique_ptr<DevicePagePool> pool_;  // before the sequences: their layers release into it
  /// Null unless config_.prefix_sharing. After pool_ (it releases its pages into it when
  /// destroyed) and before sequences_ (their leases must go first).
  std::unique_ptr<paging::PrefixIndex> prefix_index_;
  std::unordered_map<SeqId, Sequence> sequences_;
  std::vector<KeyParams> key_params_;  // [layers][kv_heads]: what a new sequence's streams take
  std::vector<ValueParams> value_params_;
  std::vector<char> calibrated_;  // per layer: parameters final (a codec that calibrates took them)
  SeqId next_id_ = 0;
};

}  // namespace kvpack::inline v0::kernels::cuda
