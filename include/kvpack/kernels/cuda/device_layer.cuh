#pragma once
/// \file device_layer.cuh
/// \brief One layer's KV streams on the device: pages copied byte for byte from host payloads
///        into a DevicePagePool (or encoded on the device from rows already there), their block
///        tables, codec parameters and full-precision rows (exact prefix and tail, in device
///        memory), ready for attend_paged. New tokens enter on the device by KVCache's rule
///        (`append_tokens`, row_append_plan.hpp). `mirror_layer` builds one from a host KVCache.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvpack/cache.hpp"
#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/device_params.cuh"
#include "kvpack/kernels/cuda/encode_pages.cuh"
#include "kvpack/kernels/cuda/paged_attention.cuh"
#include "kvpack/kernels/cuda/row_append_plan.hpp"
#include "kvpack/kernels/cuda/stream_absmax.cuh"

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
  ///        its V plane (the pool's payload size is the page stride); \param window the rows
  ///        kept in fp32 as new tokens arrive (CacheConfig's exact_prefix_tokens and tail_tokens)
  DeviceLayer(DevicePagePool& pool, index_t group, index_t page_size, index_t head_dim, std::size_t value_offset,
              TailWindow window = {})
      : pool_(&pool),
        group_(group),
        page_size_(page_size),
        head_dim_(head_dim),
        value_offset_(value_offset),
        rule_{page_size, window} {
    KVPACK_CHECK(group > 0 && page_size > 0 && head_dim > 0, kInvalidArgument,
                 "DeviceLayer: group, page_size and head_dim must be positive");
    KVPACK_CHECK(window.exact_prefix_tokens >= 0 && window.exact_prefix_tokens <= 4096 && window.tail_tokens >= 0 &&
                     window.tail_tokens <= CacheConfig::kMaxTailTokens,
                 kInvalidArgument,
                 "DeviceLayer: exact_prefix_tokens must be in [0, 4096] and tail_tokens in [0, kMaxTailTokens]");
    // 16-byte aligned: the kernels load the V plane in vectors (attend_paged checks it too).
    KVPACK_CHECK(value_offset < pool.format().payload_bytes && value_offset % 16 == 0, kInvalidArgument,
                 "DeviceLayer: value_offset lies outside the page payload or is not a multiple of 16");
    // The most rows a stream holds between appends (row_append_plan.hpp).
    row_capacity_ = std::max<index_t>(1, window.exact_prefix_tokens + window.tail_tokens + page_size - 1);
  }
  DeviceLayer(const DeviceLayer&) = delete;
  DeviceLayer& operator=(const DeviceLayer&) = delete;
  DeviceLayer(DeviceLayer&&) noexcept = default;
  ~DeviceLayer() {
    for (PageId id : owned_) pool_->release(id);
  }

  /// Adds a stream: its pages (host payloads, token order; the same host page given twice is
  /// stored once), codec parameters and full-precision rows ([rows][head_dim] keys and values:
  /// the first exact_prefix_tokens of them the exact prefix, the rest the tail). Synchronous on
  /// the default stream: call it before the layer's launches or after they finished.
  void add_stream(std::span<const std::byte* const> host_pages, const HostKeyParams& key_params,
                  const HostValueParams& value_params, std::span<const float> row_keys,
                  std::span<const float> row_values) {
    KVPACK_CHECK(row_keys.size() == row_values.size() && row_keys.size() % head_dim_ == 0, kInvalidArgument,
                 ::kvpack::detail::message("DeviceLayer::add_stream: ", row_keys.size(), " key and ", row_values.size(),
                                           " value floats are not whole rows of head_dim ", head_dim_));
    std::vector<const std::byte*> new_hosts;
    try {
      add_stream_with(
          host_pages.size(),
          [&](std::vector<PageId>& ids) {
            for (const std::byte* host : host_pages) {
              auto it = uploaded_.find(host);
              if (it == uploaded_.end()) {
                const PageId id = pool_->allocate();
                owned_.push_back(id);  // reserved by add_stream_with
                new_hosts.push_back(host);
                it = uploaded_.emplace(host, id).first;
                pool_->upload(id, host);
              }
              ids.push_back(it->second);
            }
          },
          key_params, value_params, row_keys, row_values);
    } catch (...) {
      for (const std::byte* host : new_hosts) uploaded_.erase(host);
      throw;
    }
  }

  /// Adds a stream whose pages are already in this layer's pool (a cached prompt prefix's,
  /// PrefixIndex): one more holder of each, in token order, and no full-precision rows, as a
  /// prefill of whole pages leaves a stream without a tail. Synchronous like add_stream.
  void add_cached_stream(std::span<const PageId> pages, const HostKeyParams& key_params,
                         const HostValueParams& value_params) {
    add_stream_with(
        pages.size(),
        [&](std::vector<PageId>& ids) {
          for (PageId id : pages) {
            pool_->retain(id);
            owned_.push_back(id);  // reserved by add_stream_with
            ids.push_back(id);
          }
        },
        key_params, value_params, {}, {});
  }

  /// Appends `count` tokens to every stream, from `keys` and `values` (device memory,
  /// [count][streams][head_dim], as KVCache::prefill takes them): the first rows of a layer fill
  /// the exact prefix, the rest the tail, and every page the tail overflows into is encoded on
  /// the device with the stream's codec parameters (a codec that calibrates from data, FP8, must
  /// have been given calibrated ones). Pages and bytes equal what KVCache writes for the same
  /// rows. All or nothing for the pool; asynchronous on `stream` like attend (keep one stream for a
  /// layer's appends and attends: their tables and rows are ordered by it).
  /// Rows must be finite and within the codecs' max_abs_input(): the device does not check them.
  void append_tokens(const float* keys, const float* values, index_t count, cudaStream_t stream = nullptr)
    requires DeviceEncodable<KeyCodec> && DeviceEncodable<ValueCodec>
  {
    KVPACK_CHECK(streams() > 0, kInvalidArgument, "DeviceLayer::append_tokens: no stream was added");
    KVPACK_CHECK(count >= 0, kInvalidArgument, "DeviceLayer::append_tokens: negative token count");
    if (count == 0) return;
    std::vector<RowAppendPlan> plans;
    index_t new_pages = 0, rows_needed = row_capacity_;
    for (const StoredRows& rows : rows_) {
      plans.push_back(plan_row_append(rows, count, rule_));
      new_pages += plans.back().new_pages;
      rows_needed = std::max(rows_needed, plans.back().stored_rows_needed);
    }
    // Everything that can fail before the layer changes: pages, row room, scratch, targets.
    std::vector<PageId> ids;
    try {
      std::vector<std::byte*> addresses;
      for (index_t i = 0; i < new_pages; ++i) {
        ids.push_back(pool_->allocate());
        addresses.push_back(pool_->payload(ids.back()));
      }
      if (rows_needed > row_capacity_) {
        rows_device_ = grow_rows(streams(), streams(), rows_needed, stream);
        row_capacity_ = rows_needed;
        dirty_ = true;
      }
      if (new_pages > 0 && scratch_.keys.size() == 0) {
        scratch_ = RowBuffers(static_cast<std::size_t>(page_size_) * head_dim_);
      }
      if (new_pages > 0) encode_targets_.assign(addresses, stream);
      owned_.reserve(owned_.size() + ids.size());
      for (index_t s = 0; s < streams(); ++s) stream_pages_[s].reserve(stream_pages_[s].size() + plans[s].new_pages);
    } catch (...) {
      for (PageId id : ids) pool_->release(id);
      throw;
    }
    // The bookkeeping first (it cannot throw), so that a CUDA failure in a launch below leaves
    // every page owned and the tables to be sent again; the rows' contents are then undefined.
    owned_.insert(owned_.end(), ids.begin(), ids.end());
    for (index_t s = 0, next = 0; s < streams(); next += plans[s].new_pages, ++s) {
      stream_pages_[s].insert(stream_pages_[s].end(), ids.begin() + next, ids.begin() + next + plans[s].new_pages);
      rows_[s] = plans[s].after;
    }
    if (new_pages > 0) dirty_ = true;
    counts_dirty_ = true;
    const std::ptrdiff_t input_stride = static_cast<std::ptrdiff_t>(streams()) * head_dim_;
    for (index_t s = 0, next = 0; s < streams(); next += plans[s].new_pages, ++s) {
      const RowSource input{keys + static_cast<std::size_t>(s) * head_dim_,
                            values + static_cast<std::size_t>(s) * head_dim_, input_stride};
      run_plan(s, plans[s], input, next, stream);
    }
  }

  /// Appends `pages` full pages to stream `s`, encoded on the device from `pages · page_size`
  /// rows of `keys` and `values` (device memory, [rows][head_dim]), with the stream's codec
  /// parameters. All or nothing for the pool; asynchronous on `stream` like attend. The rows must
  /// be finite and within the codecs' max_abs_input(): the device does not check them (the host
  /// cache does). The pages follow the stream's pages and bypass its tail rows: attention does not
  /// depend on token order, but a host cache would have encoded those rows first.
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
      encode_targets_.assign(addresses, stream);
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

  /// A layer that shares this one's pages (one more holder each: pages are immutable once
  /// encoded) and the device tables its parameters point to (KVQuant's key ranges, TurboQuant's
  /// rotations), and has its own fp32 rows and block tables, so what either appends later the
  /// other does not see. The rows are copied on `stream` after what is queued there; returns
  /// once they are.
  [[nodiscard]] DeviceLayer fork(cudaStream_t stream = nullptr) const {
    DeviceLayer copy(*pool_, group_, page_size_, head_dim_, value_offset_, rule_.window);
    copy.owned_.reserve(owned_.size());
    for (PageId id : owned_) {
      pool_->retain(id);
      copy.owned_.push_back(id);  // reserved: cannot throw, so the copy releases every page retained
    }
    copy.uploaded_ = uploaded_;
    copy.param_tables_ = param_tables_;
    copy.stream_pages_ = stream_pages_;
    copy.key_params_ = key_params_;
    copy.value_params_ = value_params_;
    copy.rows_ = rows_;
    copy.row_capacity_ = row_capacity_;
    copy.rows_device_ = RowBuffers(rows_device_.keys.size());
    const std::size_t bytes = rows_device_.keys.size() * sizeof(float);
    if (bytes > 0) {
      check(cudaMemcpyAsync(copy.rows_device_.keys.data(), rows_device_.keys.data(), bytes, cudaMemcpyDeviceToDevice,
                            stream),
            "row copy");
      check(cudaMemcpyAsync(copy.rows_device_.values.data(), rows_device_.values.data(), bytes,
                            cudaMemcpyDeviceToDevice, stream),
            "row copy");
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    }
    return copy;
  }

  /// Device address of page `i` of stream `s` (its payload: K plane, then V at value_offset).
  [[nodiscard]] const std::byte* page(index_t s, index_t i) const { return pool_->payload(page_id(s, i)); }

  /// The pool's id of page `i` of stream `s` (for a PrefixIndex that caches it).
  [[nodiscard]] PageId page_id(index_t s, index_t i) const {
    KVPACK_CHECK(s >= 0 && s < streams() && i >= 0 && i < static_cast<index_t>(stream_pages_[s].size()),
                 kInvalidArgument, ::kvpack::detail::message("DeviceLayer: no page ", i, " in stream ", s));
    return stream_pages_[s][i];
  }

  [[nodiscard]] index_t streams() const noexcept { return static_cast<index_t>(key_params_.size()); }
  [[nodiscard]] index_t group() const noexcept { return group_; }
  [[nodiscard]] index_t page_size() const noexcept { return page_size_; }
  [[nodiscard]] index_t head_dim() const noexcept { return head_dim_; }
  /// Distinct pages this layer holds in the device pool.
  [[nodiscard]] std::size_t device_pages() const noexcept { return owned_.size(); }
  /// Stream `s`'s full-precision rows: its exact prefix's and its tail's.
  [[nodiscard]] StoredRows stored_rows(index_t s) const { return rows_[checked_stream(s, "stored_rows")]; }
  /// Stream `s`'s pages, in token order.
  [[nodiscard]] index_t pages(index_t s) const {
    return static_cast<index_t>(stream_pages_[checked_stream(s, "pages")].size());
  }
  /// Stream `s`'s codec parameters, as the kernels read them.
  [[nodiscard]] const KeyParams& key_params(index_t s) const { return key_params_[checked_stream(s, "key_params")]; }
  [[nodiscard]] const ValueParams& value_params(index_t s) const {
    return value_params_[checked_stream(s, "value_params")];
  }
  /// Gives stream `s` new codec parameters before its first page: a layer whose codec calibrates
  /// from the data (FP8) takes them from its first rows. Refused once the stream has a page.
  void set_params(index_t s, const HostKeyParams& key, const HostValueParams& value)
    requires std::is_same_v<KeyParams, HostKeyParams> && std::is_same_v<ValueParams, HostValueParams>
  {
    KVPACK_CHECK(s >= 0 && s < streams() && stream_pages_[s].empty(), kInvalidArgument,
                 ::kvpack::detail::message("DeviceLayer::set_params: stream ", s,
                                           " is out of range or has pages encoded with its parameters"));
    key_params_[s] = key;
    value_params_[s] = value;
    dirty_ = true;
  }
  /// One plane's tail rows (those after the exact prefix) of every stream, in device memory, for
  /// stream_absmax. Every stream must hold as many rows, as a layer that takes all its tokens
  /// through append_tokens does.
  [[nodiscard]] StridedRows tail_rows(Plane plane) const {
    const bool same = std::all_of(rows_.begin(), rows_.end(), [&](const StoredRows& r) { return r == rows_[0]; });
    KVPACK_CHECK(streams() > 0 && same, kInvalidArgument, "DeviceLayer::tail_rows: the streams hold different rows");
    const float* base = plane == Plane::kKey ? rows_device_.keys.data() : rows_device_.values.data();
    const std::size_t d = static_cast<std::size_t>(head_dim_);
    return {base + static_cast<std::size_t>(rows_[0].prefix) * d, static_cast<std::size_t>(row_capacity_) * d, d,
            rows_[0].tail};
  }
  /// Stream `s`'s fp32 rows copied to `keys` and `values` on the host ([rows][head_dim] each: the
  /// exact prefix's, then the tail's). Synchronous: call it once the launches writing them are done.
  void download_rows(index_t s, std::vector<float>& keys, std::vector<float>& values) const {
    const std::size_t floats = static_cast<std::size_t>(stored_rows(s).total()) * head_dim_;
    const std::size_t first = static_cast<std::size_t>(s) * row_capacity_ * head_dim_;
    keys.resize(floats);
    values.resize(floats);
    if (floats == 0) return;
    check(cudaMemcpy(keys.data(), rows_device_.keys.data() + first, floats * sizeof(float), cudaMemcpyDeviceToHost),
          "row download");
    check(cudaMemcpy(values.data(), rows_device_.values.data() + first, floats * sizeof(float),
                     cudaMemcpyDeviceToHost),
          "row download");
  }
  /// Device bytes of its fp32 rows (and the scratch page), as allocated.
  [[nodiscard]] std::size_t row_bytes() const noexcept {
    return (rows_device_.keys.size() + rows_device_.values.size() + scratch_.keys.size() + scratch_.values.size()) *
           sizeof(float);
  }
  /// Device bytes of its block tables, parameters and the tables they point to (KVQuant's key
  /// ranges, TurboQuant's rotation: counted again by a fork that shares them), row counts,
  /// encode targets and attention scratch, as allocated.
  [[nodiscard]] std::size_t table_bytes() const noexcept {
    return pages_.allocated_bytes() + first_page_device_.allocated_bytes() + key_params_device_.allocated_bytes() +
           value_params_device_.allocated_bytes() + param_tables_.bytes() + tail_count_.allocated_bytes() +
           encode_targets_.allocated_bytes() + workspace_.bytes();
  }

  /// Bytes one attend reads from HBM: every stream's pages, plus its full-precision rows.
  [[nodiscard]] std::size_t bytes_read_per_attend() const noexcept {
    std::size_t rows = 0, pages = 0;
    for (const StoredRows& r : rows_) rows += static_cast<std::size_t>(r.total()) * head_dim_ * 2;
    for (const auto& ids : stream_pages_) pages += ids.size();
    return pages * pool_->format().payload_bytes + rows * sizeof(float);
  }

  /// out[stream][h] = softmax(queries[stream][h] · Kᵀ) V, queries already scaled; both
  /// [streams][group][head_dim] device arrays. Asynchronous on `stream`.
  void attend(const float* device_queries, float* device_out, cudaStream_t stream = nullptr) {
    KVPACK_CHECK(streams() > 0, kInvalidArgument, "DeviceLayer::attend: no stream was added");
    upload_tables(stream);
    attend_paged<KeyCodec, ValueCodec>(launch_args(device_queries, device_out), max_pages_, workspace_, stream);
  }

  /// Whether `attend` runs on the tensor-core kernel (mma_attention.cuh) rather than the generic
  /// one: decided by the layer's shape alone, so no table goes up.
  [[nodiscard]] bool attends_on_tensor_cores() const {
    return kernels::cuda::attends_on_tensor_cores<KeyCodec, ValueCodec>(launch_args(nullptr, nullptr));
  }

 private:
  index_t checked_stream(index_t s, const char* call) const {
    KVPACK_CHECK(s >= 0 && s < streams(), kInvalidArgument,
                 ::kvpack::detail::message("DeviceLayer::", call, ": stream ", s, " out of range [0, ", streams(),
                                           ")"));
    return s;
  }

  /// add_stream's and add_cached_stream's common part: `take_pages(ids)` puts the stream's
  /// `page_count` pages into ids, and each page it takes a holder of into owned_ (room for them is
  /// reserved). All or nothing: on failure those pages are let go and the layer is as before.
  template <class TakePages>
  void add_stream_with(std::size_t page_count, TakePages take_pages, const HostKeyParams& key_params,
                       const HostValueParams& value_params, std::span<const float> row_keys,
                       std::span<const float> row_values) {
    const auto row_count = static_cast<index_t>(row_keys.size() / head_dim_);
    const index_t prefix = std::min(rule_.window.exact_prefix_tokens, row_count);
    const StoredRows rows{prefix, row_count - prefix};
    const index_t capacity = std::max(row_capacity_, row_count);
    const index_t streams_before = streams();
    const std::size_t owned_before = owned_.size();
    const std::size_t tables_before = param_tables_.table_count();
    std::vector<PageId> ids;
    try {
      owned_.reserve(owned_.size() + page_count);
      ids.reserve(page_count);
      take_pages(ids);
      const quant::PageGeometry g{page_size_, head_dim_};
      key_params_.reserve(key_params_.size() + 1);
      value_params_.reserve(value_params_.size() + 1);
      key_params_.push_back(param_tables_.upload<KeyCodec>(key_params, g));
      value_params_.push_back(param_tables_.upload<ValueCodec>(value_params, g));
      RowBuffers grown = grow_rows(streams_before, streams_before + 1, capacity, nullptr);
      grown.upload_at(static_cast<std::size_t>(streams_before) * capacity * head_dim_, row_keys, row_values);
      // A copy from pageable memory may still be in flight when cudaMemcpy returns; a launch on
      // a non-blocking stream would not wait for it.
      check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
      rows_.reserve(rows_.size() + 1);
      stream_pages_.reserve(stream_pages_.size() + 1);
      rows_device_ = std::move(grown);
      row_capacity_ = capacity;
    } catch (...) {
      for (std::size_t i = owned_before; i < owned_.size(); ++i) pool_->release(owned_[i]);
      owned_.resize(owned_before);
      key_params_.resize(stream_pages_.size());
      value_params_.resize(stream_pages_.size());
      param_tables_.discard_from(tables_before);
      throw;
    }
    stream_pages_.push_back(std::move(ids));
    rows_.push_back(rows);
    dirty_ = true;
  }

  PagedAttentionArgs<KeyParams, ValueParams> launch_args(const float* device_queries, float* device_out) const {
    PagedAttentionArgs<KeyParams, ValueParams> args;
    args.pages = pages_.data();
    args.first_page = first_page_device_.data();
    args.key_params = key_params_device_.data();
    args.value_params = value_params_device_.data();
    args.tail_keys = rows_device_.keys.data();
    args.tail_values = rows_device_.values.data();
    args.tail_count = tail_count_.data();
    args.tail_stride = row_capacity_;
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

  /// Keys and values of the same shape: every stream's stored rows ([streams][capacity][head_dim]),
  /// or one page of scratch.
  struct RowBuffers {
    RowBuffers() = default;
    explicit RowBuffers(std::size_t floats) : keys(floats), values(floats) {}
    /// Copies host rows into the buffers from float `first` on.
    void upload_at(std::size_t first, std::span<const float> host_keys, std::span<const float> host_values) {
      for (auto [to, from] : {std::pair{keys.data(), host_keys}, std::pair{values.data(), host_values}}) {
        if (from.empty()) continue;
        check(cudaMemcpy(to + first, from.data(), from.size_bytes(), cudaMemcpyHostToDevice), "row upload");
      }
    }
    DeviceBuffer<float> keys, values;
  };

  /// Rows in device memory, `stride` floats apart.
  struct RowSource {
    const float* keys;
    const float* values;
    std::ptrdiff_t stride;
  };

  /// New stored-row buffers for `streams` streams of `capacity` rows, holding the first
  /// `kept` streams' rows so far, copied on `stream` after what is queued there. Returns once
  /// the copies are done, so the old buffers may be freed.
  RowBuffers grow_rows(index_t kept, index_t streams, index_t capacity, cudaStream_t stream) const {
    RowBuffers grown(static_cast<std::size_t>(streams) * capacity * head_dim_);
    const std::size_t row_bytes = static_cast<std::size_t>(head_dim_) * sizeof(float);
    if (kept > 0) {
      for (auto [to, from] : {std::pair{grown.keys.data(), rows_device_.keys.data()},
                              std::pair{grown.values.data(), rows_device_.values.data()}}) {
        check(cudaMemcpy2DAsync(to, capacity * row_bytes, from, row_capacity_ * row_bytes, row_capacity_ * row_bytes,
                                static_cast<std::size_t>(kept), cudaMemcpyDeviceToDevice, stream),
              "row buffer growth");
      }
    }
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return grown;
  }

  /// Runs stream `s`'s plan on `stream`: its copies as 2-D copies of rows, its encodes into the
  /// page addresses at encode_targets_[next_target...].
  void run_plan(index_t s, const RowAppendPlan& plan, const RowSource& input, index_t next_target,
                cudaStream_t stream) {
    const std::size_t stored_first = static_cast<std::size_t>(s) * row_capacity_ * head_dim_;
    // Where a copy writes: the stream's stored rows or the scratch page, rows head_dim apart.
    auto target = [&](RowBuffer b) -> std::pair<float*, float*> {
      if (b == RowBuffer::kScratch) return {scratch_.keys.data(), scratch_.values.data()};
      return {rows_device_.keys.data() + stored_first, rows_device_.values.data() + stored_first};
    };
    auto source = [&](RowBuffer b) -> RowSource {
      if (b == RowBuffer::kInput) return input;
      const auto [keys, values] = target(b);
      return {keys, values, head_dim_};
    };
    const std::size_t row_bytes = static_cast<std::size_t>(head_dim_) * sizeof(float);
    for (const RowStep& step : plan.steps) {
      const RowSource from = source(step.from);
      const std::size_t from_offset = static_cast<std::size_t>(step.from_row) * from.stride;
      if (step.kind == RowStep::Kind::kEncode) {
        encode_pages<KeyCodec, ValueCodec>(from.keys + from_offset, from.values + from_offset, from.stride, step.count,
                                           key_params_[s], value_params_[s], encode_targets_.data() + next_target,
                                           {page_size_, head_dim_}, value_offset_, stream);
        next_target += step.count;
        continue;
      }
      const auto [to_keys, to_values] = target(step.to);
      const std::size_t to_offset = static_cast<std::size_t>(step.to_row) * head_dim_;
      for (auto [to, from_rows] : {std::pair{to_keys + to_offset, from.keys + from_offset},
                                   std::pair{to_values + to_offset, from.values + from_offset}}) {
        check(cudaMemcpy2DAsync(to, row_bytes, from_rows, from.stride * sizeof(float), row_bytes,
                                static_cast<std::size_t>(step.count), cudaMemcpyDeviceToDevice, stream),
              "row copy");
      }
    }
  }

  /// Sends what changed since the last launch: block tables and parameters, or only row counts.
  /// On `stream`, after the launches queued there before (which read the old tables), into
  /// arrays that keep their allocation (DeviceTable).
  void upload_tables(cudaStream_t stream) {
    if (dirty_) {
      std::vector<const std::byte*> addresses;
      std::vector<index_t> first_page{0};
      max_pages_ = 0;
      for (const auto& ids : stream_pages_) {
        for (PageId id : ids) addresses.push_back(pool_->payload(id));
        first_page.push_back(static_cast<index_t>(addresses.size()));
        max_pages_ = std::max<index_t>(max_pages_, static_cast<index_t>(ids.size()));
      }
      pages_.assign(addresses, stream);
      first_page_device_.assign(first_page, stream);
      key_params_device_.assign(key_params_, stream);
      value_params_device_.assign(value_params_, stream);
    }
    if (dirty_ || counts_dirty_) {
      std::vector<index_t> counts;
      for (const StoredRows& r : rows_) counts.push_back(r.total());
      tail_count_.assign(counts, stream);
    }
    dirty_ = counts_dirty_ = false;
  }

  DevicePagePool* pool_;
  index_t group_, page_size_, head_dim_;
  std::size_t value_offset_;
  RowRule rule_;
  index_t row_capacity_ = 0;  // rows per stream in rows_device_: the kernels' tail_stride
  std::unordered_map<const std::byte*, PageId> uploaded_;  // host payload -> its device copy
  std::vector<PageId> owned_;                               // every device page this layer holds
  std::vector<std::vector<PageId>> stream_pages_;           // per stream, in token order
  index_t max_pages_ = 0;
  DeviceParamTables param_tables_;  // device copies of host tables the parameters point to
  std::vector<KeyParams> key_params_;
  std::vector<ValueParams> value_params_;
  std::vector<StoredRows> rows_;
  bool dirty_ = true;          // block tables or parameters changed: upload them all
  bool counts_dirty_ = false;  // only row counts changed
  RowBuffers rows_device_;     // every stream's exact prefix and tail rows
  RowBuffers scratch_;         // the page that straddles a stream's tail and new rows
  DeviceTable<const std::byte*> pages_;
  DeviceTable<index_t> first_page_device_;
  DeviceTable<KeyParams> key_params_device_;
  DeviceTable<ValueParams> value_params_device_;
  DeviceTable<index_t> tail_count_;
  DeviceTable<std::byte*> encode_targets_;
  AttentionWorkspace workspace_;
};

/// The layer `layer` of sequence `seq` of a host cache, copied to the device: every stream's
/// pages (byte for byte; pages the sequence shares with a fork are uploaded once per layer) and
/// its full-precision rows (exact prefix and tail). Keys stored before RoPE are not supported on
/// the device yet. `positions`, when given, receives the layer's positions (stream 0's).
template <class Layout, class Quantizer, class Evictor, class Selector>
DeviceLayer<typename Quantizer::key_codec, typename Quantizer::value_codec> mirror_layer(
    const KVCache<Layout, Quantizer, Evictor, Selector>& cache, SeqId seq, index_t layer, DevicePagePool& pool,
    std::vector<std::int32_t>* positions = nullptr) {
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
      pool, cache.shape().group_size(), page_size, d, cache.value_plane_offset(),
      TailWindow{cache.config().exact_prefix_tokens, cache.config().tail_tokens});
  std::vector<const std::byte*> host_pages;
  for (index_t s = 0; s < cache.streams_per_layer(); ++s) {
    const std::span<const PageId> ids = cache.pages(seq, layer, s);
    host_pages.clear();
    for (PageId id : ids) host_pages.push_back(cache.pool().payload(id));
    // read_back's order: exact prefix rows, the pages' slots, then the tail rows.
    const StoredTokens stored = cache.read_back(seq, layer, s);
    if (s == 0 && positions != nullptr) *positions = stored.positions;
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
