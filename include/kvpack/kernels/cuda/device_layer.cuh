#pragma once
/// \file device_layer.cuh
/// \brief One layer's KV streams on the device: pages copied byte for byte from host payloads
///        into a DevicePagePool (or encoded on the device from rows already there), their block
///        tables, codec parameters and full-precision rows, ready for attend_paged.
///        `mirror_layer` builds one from a host KVCache.

#include <cuda_runtime.h>

#include <algorithm>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvpack/cache.hpp"
#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/device_params.cuh"
#include "kvpack/kernels/cuda/encode_pages.cuh"
#include "kvpack/kernels/cuda/paged_attention.cuh"

namespace kvpack::inline v0::kernels::cuda {

template <quant::Codec KeyCodec, quant::Codec ValueCodec>
  requires DeviceDecodable<KeyCodec> && DeviceDecodable<ValueCodec>
class DeviceLayer {
 public:
  using HostKeyParams = typename KeyCodec::params_type;
  using HostValueParams = typename ValueCodec::params_type;
  /// What the kernels read (device_params.cuh): the host's, or copies of the tables they point to.
  using KeyParams = device_params_t<KeyCodec>;
  using ValueParams = device_params_t<ValueCodec>;

  /// \param group query heads per stream; \param value_offset bytes from a payload's start to
  ///        its V plane (the pool's payload size is the page stride)
  DeviceLayer(DevicePagePool& pool, index_t group, index_t page_size, index_t head_dim, std::size_t value_offset)
      : pool_(&pool), group_(group), page_size_(page_size), head_dim_(head_dim), value_offset_(value_offset) {
    KVPACK_CHECK(group > 0 && page_size > 0 && head_dim > 0, kInvalidArgument,
                 "DeviceLayer: group, page_size and head_dim must be positive");
    KVPACK_CHECK(value_offset < pool.format().payload_bytes, kInvalidArgument,
                 "DeviceLayer: value_offset lies outside the page payload");
  }
  DeviceLayer(const DeviceLayer&) = delete;
  DeviceLayer& operator=(const DeviceLayer&) = delete;
  DeviceLayer(DeviceLayer&&) noexcept = default;
  ~DeviceLayer() {
    for (PageId id : owned_) pool_->release(id);
  }

  /// Adds a stream: its pages (host payloads, token order; the same host page given twice is
  /// stored once), codec parameters and full-precision rows ([rows][head_dim] keys and values).
  void add_stream(std::span<const std::byte* const> host_pages, const HostKeyParams& key_params,
                  const HostValueParams& value_params, std::span<const float> row_keys,
                  std::span<const float> row_values) {
    KVPACK_CHECK(row_keys.size() == row_values.size() && row_keys.size() % head_dim_ == 0, kInvalidArgument,
                 ::kvpack::detail::message("DeviceLayer::add_stream: ", row_keys.size(), " key and ", row_values.size(),
                                           " value floats are not whole rows of head_dim ", head_dim_));
    Rows rows(row_keys.data(), row_keys.data() + row_keys.size(), row_values.data(),
              row_values.data() + row_values.size());
    // All or nothing: on failure (device pool full, copy error) the pages taken here go back.
    const std::size_t owned_before = owned_.size();
    const std::size_t tables_before = param_tables_.table_count();
    std::vector<const std::byte*> new_hosts;
    std::vector<PageId> ids;
    try {
      ids.reserve(host_pages.size());
      for (const std::byte* host : host_pages) {
        auto it = uploaded_.find(host);
        if (it == uploaded_.end()) {
          const PageId id = pool_->allocate();
          owned_.push_back(id);
          new_hosts.push_back(host);
          it = uploaded_.emplace(host, id).first;
          pool_->upload(id, host);
        }
        ids.push_back(it->second);
      }
      const quant::PageGeometry g{page_size_, head_dim_};
      key_params_.reserve(key_params_.size() + 1);
      value_params_.reserve(value_params_.size() + 1);
      key_params_.push_back(param_tables_.upload<KeyCodec>(key_params, g));
      value_params_.push_back(param_tables_.upload<ValueCodec>(value_params, g));
      rows_.reserve(rows_.size() + 1);
      stream_pages_.reserve(stream_pages_.size() + 1);
    } catch (...) {
      for (std::size_t i = owned_before; i < owned_.size(); ++i) pool_->release(owned_[i]);
      for (const std::byte* host : new_hosts) uploaded_.erase(host);
      owned_.resize(owned_before);
      key_params_.resize(stream_pages_.size());
      value_params_.resize(stream_pages_.size());
      param_tables_.discard_from(tables_before);
      throw;
    }
    stream_pages_.push_back(std::move(ids));
    rows_.push_back(std::move(rows));
    dirty_ = true;
  }

  /// Appends `pages` full pages to stream `s`, encoded on the device from `pages · page_size`
  /// rows of `keys` and `values` (device memory, [rows][head_dim]), with the stream's codec
  /// parameters. All or nothing for the pool; asynchronous on `stream` like attend. The rows must
  /// be finite and within the codecs' max_abs_input(): the device does not check them (the host
  /// cache does).
  void append_pages(index_t s, const float* keys, const float* values, index_t pages, cudaStream_t stream = nullptr)
    requires DeviceEncodable<KeyCodec> && DeviceEncodable<ValueCodec>
  {
    KVPACK_CHECK(s >= 0 && s < streams(), kInvalidArgument,
                 ::kvpack::detail::message("DeviceLayer::append_pages: stream ", s, " out of range [0, ", streams(), ")"));
    KVPACK_CHECK(pages >= 0, kInvalidArgument, "DeviceLayer::append_pages: negative page count");
    if (pages == 0) return;
    std::vector<PageId> ids;
    std::vector<std::byte*> addresses;
    try {
      for (index_t i = 0; i < pages; ++i) {
        ids.push_back(pool_->allocate());
        addresses.push_back(pool_->payload(ids.back()));
      }
      stream_pages_[s].reserve(stream_pages_[s].size() + ids.size());
      owned_.reserve(owned_.size() + ids.size());
      encode_targets_ = DeviceBuffer<std::byte*>(std::span<std::byte* const>(addresses));
      encode_pages<KeyCodec, ValueCodec>(keys, values, head_dim_, pages, key_params_[s], value_params_[s],
                                         encode_targets_.data(), {page_size_, head_dim_}, value_offset_, stream);
    } catch (...) {
      for (PageId id : ids) pool_->release(id);
      throw;
    }
    stream_pages_[s].insert(stream_pages_[s].end(), ids.begin(), ids.end());
    owned_.insert(owned_.end(), ids.begin(), ids.end());
    dirty_ = true;
  }

  /// Device address of page `i` of stream `s` (its payload: K plane, then V at value_offset).
  [[nodiscard]] const std::byte* page(index_t s, index_t i) const {
    KVPACK_CHECK(s >= 0 && s < streams() && i >= 0 && i < static_cast<index_t>(stream_pages_[s].size()),
                 kInvalidArgument, ::kvpack::detail::message("DeviceLayer::page: no page ", i, " in stream ", s));
    return pool_->payload(stream_pages_[s][i]);
  }

  [[nodiscard]] index_t streams() const noexcept { return static_cast<index_t>(key_params_.size()); }
  [[nodiscard]] index_t group() const noexcept { return group_; }
  [[nodiscard]] index_t head_dim() const noexcept { return head_dim_; }
  /// Distinct pages this layer holds in the device pool.
  [[nodiscard]] std::size_t device_pages() const noexcept { return owned_.size(); }
  /// Bytes one attend reads from HBM: every stream's pages, plus its full-precision rows.
  [[nodiscard]] std::size_t bytes_read_per_attend() const noexcept {
    std::size_t rows = 0, pages = 0;
    for (const Rows& r : rows_) rows += r.keys.size() + r.values.size();
    for (const auto& ids : stream_pages_) pages += ids.size();
    return pages * pool_->format().payload_bytes + rows * sizeof(float);
  }

  /// out[stream][h] = softmax(queries[stream][h] · Kᵀ) V, queries already scaled; both
  /// [streams][group][head_dim] device arrays. Asynchronous on `stream`.
  void attend(const float* device_queries, float* device_out, cudaStream_t stream = nullptr) {
    KVPACK_CHECK(streams() > 0, kInvalidArgument, "DeviceLayer::attend: no stream was added");
    if (dirty_) upload_tables();
    attend_paged<KeyCodec, ValueCodec>(launch_args(device_queries, device_out), max_pages_, workspace_, stream);
  }

  /// Whether `attend` runs on the tensor-core kernel (mma_attention.cuh) rather than the generic one.
  [[nodiscard]] bool attends_on_tensor_cores() {
    if (dirty_) upload_tables();
    return kernels::cuda::attends_on_tensor_cores<KeyCodec, ValueCodec>(launch_args(nullptr, nullptr));
  }

 private:
  PagedAttentionArgs<KeyParams, ValueParams> launch_args(const float* device_queries, float* device_out) const {
    PagedAttentionArgs<KeyParams, ValueParams> args;
    args.pages = pages_.data();
    args.first_page = first_page_device_.data();
    args.key_params = key_params_device_.data();
    args.value_params = value_params_device_.data();
    args.tail_keys = tail_keys_.data();
    args.tail_values = tail_values_.data();
    args.tail_count = tail_count_.data();
    args.tail_stride = tail_stride_;
    args.queries = device_queries;
    args.out = device_out;
    args.streams = streams();
    args.group = group_;
    args.page_size = page_size_;
    args.head_dim = head_dim_;
    args.value_offset = value_offset_;
    args.payload_bytes = pool_->format().payload_bytes;
    return args;
  }

  struct Rows {
    Rows(const float* k0, const float* k1, const float* v0, const float* v1) : keys(k0, k1), values(v0, v1) {}
    std::vector<float> keys, values;
  };

  void upload_tables() {
    std::vector<const std::byte*> addresses;
    std::vector<index_t> first_page{0};
    max_pages_ = 0;
    for (const auto& ids : stream_pages_) {
      for (PageId id : ids) addresses.push_back(pool_->payload(id));
      first_page.push_back(static_cast<index_t>(addresses.size()));
      max_pages_ = std::max<index_t>(max_pages_, static_cast<index_t>(ids.size()));
    }
    pages_ = DeviceBuffer<const std::byte*>(std::span<const std::byte* const>(addresses));
    first_page_device_ = DeviceBuffer<index_t>(std::span<const index_t>(first_page));
    key_params_device_ = DeviceBuffer<KeyParams>(std::span<const KeyParams>(key_params_));
    value_params_device_ = DeviceBuffer<ValueParams>(std::span<const ValueParams>(value_params_));
    tail_stride_ = 1;
    std::vector<index_t> counts;
    for (const Rows& r : rows_) {
      counts.push_back(static_cast<index_t>(r.keys.size() / head_dim_));
      tail_stride_ = std::max(tail_stride_, counts.back());
    }
    std::vector<float> keys(static_cast<std::size_t>(streams()) * tail_stride_ * head_dim_, 0.0f);
    std::vector<float> values(keys.size(), 0.0f);
    for (std::size_t s = 0; s < rows_.size(); ++s) {
      std::copy(rows_[s].keys.begin(), rows_[s].keys.end(), keys.begin() + s * tail_stride_ * head_dim_);
      std::copy(rows_[s].values.begin(), rows_[s].values.end(), values.begin() + s * tail_stride_ * head_dim_);
    }
    tail_keys_ = DeviceBuffer<float>(std::span<const float>(keys));
    tail_values_ = DeviceBuffer<float>(std::span<const float>(values));
    tail_count_ = DeviceBuffer<index_t>(std::span<const index_t>(counts));
    dirty_ = false;
  }

  DevicePagePool* pool_;
  index_t group_, page_size_, head_dim_;
  std::size_t value_offset_;
  std::unordered_map<const std::byte*, PageId> uploaded_;  // host payload -> its device copy
  std::vector<PageId> owned_;                               // every device page this layer holds
  std::vector<std::vector<PageId>> stream_pages_;           // per stream, in token order
  index_t max_pages_ = 0;
  DeviceParamTables param_tables_;  // device copies of host tables the parameters point to
  std::vector<KeyParams> key_params_;
  std::vector<ValueParams> value_params_;
  std::vector<Rows> rows_;
  bool dirty_ = true;
  index_t tail_stride_ = 1;
  DeviceBuffer<const std::byte*> pages_;
  DeviceBuffer<index_t> first_page_device_;
  DeviceBuffer<KeyParams> key_params_device_;
  DeviceBuffer<ValueParams> value_params_device_;
  DeviceBuffer<float> tail_keys_, tail_values_;
  DeviceBuffer<index_t> tail_count_;
  DeviceBuffer<std::byte*> encode_targets_;
  AttentionWorkspace workspace_;
};

/// The layer `layer` of sequence `seq` of a host cache, copied to the device: every stream's
/// pages (byte for byte; pages the sequence shares with a fork are uploaded once per layer) and
/// its full-precision rows (exact prefix and tail). Keys stored before RoPE are not supported on
/// the device yet.
template <class Layout, class Quantizer, class Evictor, class Selector>
DeviceLayer<typename Quantizer::key_codec, typename Quantizer::value_codec> mirror_layer(
    const KVCache<Layout, Quantizer, Evictor, Selector>& cache, SeqId seq, index_t layer, DevicePagePool& pool) {
  static_assert(!Evictor::kDropsTokens,
                "mirror_layer: the CUDA kernels do not read live-slot masks yet, so a cache whose evictor "
                "drops tokens cannot be mirrored");
  KVPACK_CHECK(!cache.config().key_rope, kUnsupported,
               "mirror_layer: keys stored before RoPE (CacheConfig::key_rope) are not supported by the CUDA backend yet");
  KVPACK_CHECK(pool.format().payload_bytes == cache.page_format_info().payload_bytes, kInvalidArgument,
               ::kvpack::detail::message("mirror_layer: the device pool's pages hold ", pool.format().payload_bytes,
                                         " bytes, the cache's ", cache.page_format_info().payload_bytes));
  const index_t page_size = cache.config().page_size;
  const index_t d = cache.shape().head_dim;
  DeviceLayer<typename Quantizer::key_codec, typename Quantizer::value_codec> device(
      pool, cache.shape().group_size(), page_size, d, cache.value_plane_offset());
  std::vector<const std::byte*> host_pages;
  for (index_t s = 0; s < cache.streams_per_layer(); ++s) {
    const std::span<const PageId> ids = cache.pages(seq, layer, s);
    host_pages.clear();
    for (PageId id : ids) host_pages.push_back(cache.pool().payload(id));
    // read_back's order: exact prefix rows, the pages' slots, then the tail rows.
    const StoredTokens stored = cache.read_back(seq, layer, s);
    const index_t paged = static_cast<index_t>(ids.size()) * page_size;
    const index_t prefix = std::min<index_t>(cache.config().exact_prefix_tokens, stored.size() - paged);
    std::vector<float> keys, values;
    auto take = [&](index_t first, index_t last) {
      keys.insert(keys.end(), stored.keys.begin() + static_cast<std::ptrdiff_t>(first) * d,
                  stored.keys.begin() + static_cast<std::ptrdiff_t>(last) * d);
      values.insert(values.end(), stored.values.begin() + static_cast<std::ptrdiff_t>(first) * d,
                    stored.values.begin() + static_cast<std::ptrdiff_t>(last) * d);
    };
    take(0, prefix);
    take(prefix + paged, stored.size());
    const auto [key_params, value_params] = cache.codec_params(layer, s);
    device.add_stream(host_pages, key_params, value_params, keys, values);
  }
  return device;
}

}  // namespace kvpack::inline v0::kernels::cuda
