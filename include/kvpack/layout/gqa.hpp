#pragma once
/// \file gqa.hpp
/// \brief layout::GQA: grouped-query attention (MHA: groups of 1; MQA: one KV head).

#include <string_view>

#include "kvpack/layout/layout_concepts.hpp"

namespace kvpack::inline v0::layout {

/// One stream per KV head per layer, holding head_dim key and head_dim value channels per token.
/// Query head h reads KV head h / (q_heads / kv_heads), so a group of consecutive query heads
/// shares one stream and the kernel reads its bytes once for the whole group.
struct GQA {
  static constexpr std::string_view kName = "gqa";

  void validate(const ModelShape& shape) const { shape.validate(); }
  [[nodiscard]] index_t streams(const ModelShape& shape) const noexcept { return shape.kv_heads; }
  [[nodiscard]] index_t stream_of_query_head(const ModelShape& shape, index_t h) const noexcept {
    return h / shape.group_size();
  }
  [[nodiscard]] index_t key_dim(const ModelShape& shape) const noexcept { return shape.head_dim; }
  [[nodiscard]] index_t value_dim(const ModelShape& shape) const noexcept { return shape.head_dim; }

  friend constexpr bool operator==(GQA, GQA) noexcept { return true; }
};
static_assert(Layout<GQA>);

}  // namespace kvpack::inline v0::layout
