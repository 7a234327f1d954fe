#pragma once
/// \file types.hpp
/// \brief Index types, the model shape, and the small enums every module shares.

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvpack/error.hpp"

namespace kvpack::inline v0 {

/// Signed index for tokens, heads, channels and pages (signed so differences are safe).
using index_t = std::int32_t;

/// A sequence handle issued by KVCache::add_sequence; never reused within one cache.
using SeqId = std::uint64_t;

/// Physical page number inside a page pool.
using PageId = std::uint32_t;

/// Which half of attention state a codec encodes: keys are scored against queries, values are
/// accumulated with attention weights; each wants its own byte layout.
enum class Plane : std::uint8_t { kKey = 0, kValue = 1 };

/// The attention shape of a model, as the KV cache sees it.
struct ModelShape {
  index_t layers = 0;
  index_t q_heads = 0;   ///< query heads per layer
  index_t kv_heads = 0;  ///< KV heads per layer (GQA: q_heads is a multiple of it)
  index_t head_dim = 0;

  /// Query heads that share one KV head.
  [[nodiscard]] constexpr index_t group_size() const noexcept {
    return kv_heads > 0 ? q_heads / kv_heads : 0;
  }

  /// Throws kvpack::Error naming the first inconsistent field.
  void validate() const {
    KVPACK_CHECK(layers > 0, kInvalidConfig,
                 detail::message("ModelShape.layers must be > 0, got ", layers));
    KVPACK_CHECK(kv_heads > 0, kInvalidConfig,
                 detail::message("ModelShape.kv_heads must be > 0, got ", kv_heads));
    KVPACK_CHECK(q_heads > 0 && q_heads % kv_heads == 0, kInvalidConfig,
                 detail::message("ModelShape.q_heads (", q_heads,
                                 ") must be a positive multiple of kv_heads (", kv_heads, ")"));
    KVPACK_CHECK(head_dim > 0, kInvalidConfig,
                 detail::message("ModelShape.head_dim must be > 0, got ", head_dim));
  }

  friend constexpr bool operator==(const ModelShape&, const ModelShape&) = default;
};

}  // namespace kvpack::inline v0
