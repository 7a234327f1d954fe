#pragma once
/// \file device_cache.cuh
/// \brief A KV cache created on the GPU: KVCache's calls (add_sequence, prefill, append, attend,
///        release) with every span in device memory. Pages live in one DevicePagePool and are
///        encoded there, fp32 rows (exact prefix, tail) stay on the device, and the pages equal
///        the bytes a host KVCache with the same shape, options and tokens holds. One DeviceLayer
///        per (sequence, layer) does the work (device_layer.cuh).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/kernels/cuda/check.cuh"
#include "kvpack/kernels/cuda/device_layer.cuh"
#include "kvpack/layout/gqa.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace device_cache_detail {

__global__ void scale_kernel(const float* in, float* out, float scale, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i] * scale;
  }
}

}  // namespace device_cache_detail

/// Grouped-query attention only (layout::GQA: one stream per KV head). Not yet: evictors,
/// selectors, prefix sharing, forks, keys stored before RoPE, codecs the device cannot encode
/// (KVQuant, TurboQuant) and codecs that calibrate their parameters from the data (FP8 with
/// calibration on): each is rejected at compile time or by the constructor. Calls that touch one
/// sequence's layer run on one CUDA stream at a time (its workspace and scaled query are one),
/// a blocking stream or the default one (tables go up on the legacy stream).
template <class Quantizer>
  requires DeviceEncodable<typename Quantizer::key_codec> && DeviceEncodable<typename Quantizer::value_codec>
class DeviceKVCache {
 public:
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  using Layer = DeviceLayer<KeyCodec, ValueCodec>;

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
    KVPACK_CHECK(!config_.key_rope && !config_.prefix_sharing, kUnsupported,
                 "DeviceKVCache: keys stored before RoPE and prefix sharing are not supported on the device yet");
    KVPACK_CHECK(!calibrates(quantizer_.key) && !calibrates(quantizer_.value), kUnsupported,
                 "DeviceKVCache: a codec that calibrates its parameters from the data (FP8 with calibration) "
                 "needs them before the first page: encode on the host, or turn calibration off");
    KVPACK_CHECK(device_availability().count > 0, kUnsupported,
                 ::kvpack::detail::message("DeviceKVCache: ", device_availability().reason));
    value_offset_ = round_up_64(quantizer_.key.plane_bytes(g));
    paging::PageFormat format;
    format.payload_bytes = round_up_64(value_offset_ + quantizer_.value.plane_bytes(g));
    pool_ = std::make_unique<DevicePagePool>(format, device_pages);
  }
  DeviceKVCache(DeviceKVCache&&) noexcept = default;
  /// Deleted: assigning would free the pool before the sequences whose pages it holds.
  DeviceKVCache& operator=(DeviceKVCache&&) = delete;

  /// Starts an empty sequence: every layer gets one stream per KV head.
  [[nodiscard]] SeqId add_sequence() {
    Sequence sequence(shape_.layers);
    sequence.last_position.assign(static_cast<std::size_t>(shape_.layers), -1);
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      sequence.layers.emplace_back(*pool_, shape_.group_size(), config_.page_size, shape_.head_dim, value_offset_,
                                   TailWindow{config_.exact_prefix_tokens, config_.tail_tokens});
      for (index_t s = 0; s < shape_.kv_heads; ++s) {
        sequence.layers.back().add_stream({}, quantizer_.key.initial_params(layer, s),
                                          quantizer_.value.initial_params(layer, s), {}, {});
      }
    }
    const SeqId id = next_id_++;
    sequences_.emplace(id, std::move(sequence));
    return id;
  }

  /// A host cache's sequence, copied here to continue on the device (prefill on the CPU, decode
  /// on the GPU): every layer's pages byte for byte (mirror_layer), codec parameters, fp32 rows
  /// and last position. The host cache keeps its sequence. All or nothing for the pool.
  /// \throws kvpack::Error(kInvalidArgument) when its shape, page size, exact prefix or tail
  ///         window differ from this cache's; what mirror_layer throws; kvpack::OutOfPages
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
    Sequence sequence(shape_.layers);
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      sequence.layers.push_back(mirror_layer(cache, seq, layer, *pool_));
      sequence.last_position.push_back(cache.last_position(seq, layer));
    }
    const SeqId id = next_id_++;
    sequences_.emplace(id, std::move(sequence));
    return id;
  }

  /// Drops a sequence; its pages go back to the device pool.
  void release(SeqId seq) {
    KVPACK_CHECK(sequences_.erase(seq) == 1, kUnknownSequence,
                 ::kvpack::detail::message("release: no sequence ", seq));
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
    const std::int64_t last = find(seq, "prefill").last_position.at(checked_layer(layer, "prefill"));
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
    const std::int64_t last = find(seq, "append").last_position.at(checked_layer(layer, "append"));
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
    KVPACK_CHECK(sequence.last_position[layer] >= 0, kInvalidArgument,
                 ::kvpack::detail::message("attend: layer ", layer, " of sequence ", seq, " holds no tokens"));
    DeviceBuffer<float>& scaled = sequence.scaled_queries[layer];
    if (scaled.size() < rows) scaled = DeviceBuffer<float>(rows);
    device_cache_detail::scale_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, stream>>>(
        query.data(), scaled.data(), scale, rows);
    check(cudaGetLastError(), "query scale launch");
    sequence.layers[layer].attend(scaled.data(), out.data(), stream);
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
    explicit Sequence(index_t layers) : scaled_queries(static_cast<std::size_t>(layers)) {
      this->layers.reserve(static_cast<std::size_t>(layers));
      last_position.reserve(static_cast<std::size_t>(layers));
    }
    std::vector<Layer> layers;
    std::vector<std::int64_t> last_position;          // per layer; -1 while empty
    std::vector<DeviceBuffer<float>> scaled_queries;  // per layer: attend's query times the scale
  };

  template <class Codec>
  static bool calibrates(const Codec& codec) {
    if constexpr (quant::CalibratedCodec<Codec>) {
      return codec.calibrates();
    } else {
      return false;
    }
  }
  static std::size_t round_up_64(std::size_t bytes) noexcept { return (bytes + 63) / 64 * 64; }

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
    sequence.layers[layer].append_tokens(keys.data(), values.data(), static_cast<index_t>(tokens), stream);
    sequence.last_position[layer] = last;
  }

  ModelShape shape_;
  CacheConfig config_;
  Quantizer quantizer_;
  std::size_t value_offset_ = 0;
  std::unique_ptr<DevicePagePool> pool_;  // before the sequences: their layers release into it
  std::unordered_map<SeqId, Sequence> sequences_;
  SeqId next_id_ = 0;
};

}  // namespace kvpack::inline v0::kernels::cuda
