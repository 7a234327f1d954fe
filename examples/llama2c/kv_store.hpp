#pragma once
/// \file kv_store.hpp
/// \brief Where a forward pass keeps each token's keys and values, and how attention reads them:
///        through a kvpack cache (the engine) or exactly, in double (the oracle).
///
/// The transformer is the same code over either store, so any difference in logits is the cache's.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/kv_dump.hpp"
#include "kvpack/eval/policies.hpp"

namespace llama2c {

/// The keys and values of one text, layer by layer, and attention over them.
class KvStore {
 public:
  virtual ~KvStore() = default;
  /// Stores one token of `layer`: key and value [kv_heads][head_dim], RoPE already applied to
  /// the key. Positions grow by at least one per call.
  virtual void append(int layer, std::span<const float> key, std::span<const float> value, int position) = 0;
  /// Stores a whole prompt of `layer` at positions 0 .. T - 1 in one call: keys and values
  /// [T][kv_heads][head_dim], and the last W prompt queries [W][q_heads][head_dim] (after RoPE)
  /// for stores whose evictors decide at prefill (SnapKV).
  virtual void prefill(int layer, std::span<const float> keys, std::span<const float> values,
                       std::span<const float> observation_queries) = 0;
  /// Softmax attention of query [q_heads][head_dim] over every token stored for `layer`;
  /// query head h reads KV head h / (q_heads / kv_heads). Writes out [q_heads][head_dim].
  virtual void attend(int layer, std::span<const float> query, std::span<float> out, float scale) const = 0;
};

/// One sequence in a kvpack cache, which it owns.
class CacheKvStore final : public KvStore {
 public:
  explicit CacheKvStore(std::unique_ptr<kvpack::eval::AnyCache> cache)
      : cache_(std::move(cache)), sequence_(cache_->add_sequence()) {}

  /// A fresh cache of `policy`. Throws kvpack::Error when the policy cannot hold this shape
  /// (e.g. q4_0's 32-element blocks with head_dim 8).
  CacheKvStore(const kvpack::eval::Policy& policy, const kvpack::ModelShape& shape, const kvpack::CacheConfig& config,
               const kvpack::eval::PolicyInputs& inputs = {})
      : CacheKvStore(policy.make(shape, config, inputs)) {}

  void append(int layer, std::span<const float> key, std::span<const float> value, int position) override {
    cache_->append(sequence_, layer, key, value, position);
  }
  void prefill(int layer, std::span<const float> keys, std::span<const float> values,
               std::span<const float> observation_queries) override {
    cache_->prefill(sequence_, layer, keys, values, observation_queries);
  }
  void attend(int layer, std::span<const float> query, std::span<float> out, float scale) const override {
    cache_->attend(sequence_, layer, query, out, scale);
  }

  [[nodiscard]] const kvpack::eval::AnyCache& cache() const noexcept { return *cache_; }
  [[nodiscard]] kvpack::SeqId sequence() const noexcept { return sequence_; }

 private:
  std::unique_ptr<kvpack::eval::AnyCache> cache_;
  kvpack::SeqId sequence_;
};

/// Keys and values as given, in std::vector; attention computed naively in double. The oracle
/// the cached engine is tested against.
class ExactKvStore final : public KvStore {
 public:
  explicit ExactKvStore(const kvpack::ModelShape& shape)
      : shape_(shape), keys_(static_cast<std::size_t>(shape.layers)), values_(static_cast<std::size_t>(shape.layers)) {}

  // Positions are not needed: RoPE is already in the keys and every stored token is visible.
  void append(int layer, std::span<const float> key, std::span<const float> value, int /*position*/) override {
    auto& keys = keys_.at(static_cast<std::size_t>(layer));
    auto& values = values_.at(static_cast<std::size_t>(layer));
    keys.insert(keys.end(), key.begin(), key.end());
    values.insert(values.end(), value.begin(), value.end());
  }

  void prefill(int layer, std::span<const float> keys, std::span<const float> values,
               std::span<const float> /*observation_queries*/) override {
    append(layer, keys, values, 0);
  }

  void attend(int layer, std::span<const float> query, std::span<float> out, float scale) const override {
    const std::vector<double> exact =
        kvpack::eval::exact_attention(keys_.at(static_cast<std::size_t>(layer)), values_.at(static_cast<std::size_t>(layer)),
                                      shape_.kv_heads, shape_.head_dim, query, scale);
    std::copy(exact.begin(), exact.end(), out.begin());
  }

  /// Every token's keys (post-RoPE) or values of `layer`, [tokens][kv_heads][head_dim].
  [[nodiscard]] std::span<const float> keys(int layer) const { return keys_.at(static_cast<std::size_t>(layer)); }
  [[nodiscard]] std::span<const float> values(int layer) const { return values_.at(static_cast<std::size_t>(layer)); }

  /// Writes every layer's keys (post-RoPE) and values as a kvpack K/V dump (eval/kv_dump.hpp),
  /// real model K/V that compare_policies --kv-dump and other evaluations can read.
  void write_dump(const std::string& path) const {
    const auto tokens = static_cast<std::uint32_t>(keys_.front().size() / (static_cast<std::size_t>(shape_.kv_heads) * shape_.head_dim));
    kvpack::eval::KVDumpWriter writer(path, {static_cast<std::uint32_t>(shape_.layers), tokens,
                                             static_cast<std::uint32_t>(shape_.kv_heads),
                                             static_cast<std::uint32_t>(shape_.head_dim)});
    for (std::size_t layer = 0; layer < keys_.size(); ++layer) writer.write_layer(keys_[layer], values_[layer]);
  }

 private:
  kvpack::ModelShape shape_;
  std::vector<std::vector<float>> keys_;    ///< [layers][tokens][kv_heads][head_dim]
  std::vector<std::vector<float>> values_;  ///< [layers][tokens][kv_heads][head_dim]
};

/// A prompt being prefilled: the forward pass attends exactly over the prompt's own fresh keys
/// and values, as a prefill kernel does before any cache holds them, and every layer's queries
/// are kept; `hand_over` then stores the prompt in the real store, one prefill call per layer
/// with the last queries as the observation window.
class PrefillStaging final : public KvStore {
 public:
  explicit PrefillStaging(const kvpack::ModelShape& shape)
      : shape_(shape), exact_(shape), queries_(static_cast<std::size_t>(shape.layers)) {}

  void append(int layer, std::span<const float> key, std::span<const float> value, int position) override {
    exact_.append(layer, key, value, position);
  }
  void prefill(int layer, std::span<const float> keys, std::span<const float> values,
               std::span<const float> observation_queries) override {
    exact_.prefill(layer, keys, values, observation_queries);
  }
  void attend(int layer, std::span<const float> query, std::span<float> out, float scale) const override {
    auto& queries = queries_.at(static_cast<std::size_t>(layer));
    queries.insert(queries.end(), query.begin(), query.end());
    exact_.attend(layer, query, out, scale);
  }

  /// Prefills `target` with every staged layer; the observation window is the last `window`
  /// queries (fewer when the prompt is shorter).
  void hand_over(KvStore& target, int window) const {
    const std::size_t query_row = static_cast<std::size_t>(shape_.q_heads) * shape_.head_dim;
    for (int layer = 0; layer < shape_.layers; ++layer) {
      const std::vector<float>& queries = queries_[static_cast<std::size_t>(layer)];
      const std::size_t kept = std::min(queries.size(), static_cast<std::size_t>(window) * query_row);
      target.prefill(layer, exact_.keys(layer), exact_.values(layer),
                     std::span<const float>(queries).last(kept));
    }
  }

 private:
  kvpack::ModelShape shape_;
  ExactKvStore exact_;
  // attend is const for the forward pass; recording its queries is bookkeeping, not state it reads.
  mutable std::vector<std::vector<float>> queries_;  ///< [layers][tokens][q_heads][head_dim]
};

}  // namespace llama2c
