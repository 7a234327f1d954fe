#pragma once
/// \file layout_concepts.hpp
/// \brief The Layout concept: what one token leaves in one layer, and who reads it.

#include <concepts>
#include <string_view>
#include <type_traits>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::layout {

/// A layout maps a ModelShape to KV streams. Per layer there are `streams(shape)` streams, each
/// storing `key_dim(shape)` key channels and `value_dim(shape)` value channels per token; query
/// head h reads stream `stream_of_query_head(shape, h)`. Layouts are trivially copyable so a
/// kernel can take one by value.
template <class L>
concept Layout = std::regular<L> && std::is_trivially_copyable_v<L> &&
                 requires(const L l, const ModelShape& shape, index_t query_head) {
                   { L::kName } -> std::convertible_to<std::string_view>;
                   l.validate(shape);
                   { l.streams(shape) } noexcept -> std::same_as<index_t>;
                   { l.stream_of_query_head(shape, query_head) } noexcept -> std::same_as<index_t>;
                   { l.key_dim(shape) } noexcept -> std::same_as<index_t>;
                   { l.value_dim(shape) } noexcept -> std::same_as<index_t>;
                 };

/// Layers that keep a cache: every layer, unless the layout shares one cache across several
/// (layout::CrossLayer declares `cache_layers`, `cache_layer_of` and `writer_of`).
template <Layout L>
[[nodiscard]] constexpr index_t cache_layers(const L& l, const ModelShape& shape) noexcept {
  if constexpr (requires { l.cache_layers(shape); }) {
    return l.cache_layers(shape);
  } else {
    return shape.layers;
  }
}

/// The cache layer model layer `layer` reads.
template <Layout L>
[[nodiscard]] constexpr index_t cache_layer_of(const L& l, const ModelShape& shape, index_t layer) noexcept {
  if constexpr (requires { l.cache_layer_of(shape, layer); }) {
    return l.cache_layer_of(shape, layer);
  } else {
    return layer;
  }
}

/// The model layer that writes cache layer `cache_layer` (the others only read it).
template <Layout L>
[[nodiscard]] constexpr index_t writer_of(const L& l, const ModelShape& shape, index_t cache_layer) noexcept {
  if constexpr (requires { l.writer_of(shape, cache_layer); }) {
    return l.writer_of(shape, cache_layer);
  } else {
    return cache_layer;
  }
}

/// Floats per query head that KVCache::attend takes: head_dim, or the layout's own query_dim.
template <Layout L>
[[nodiscard]] constexpr index_t query_dim(const L& l, const ModelShape& shape) noexcept {
  if constexpr (requires { l.query_dim(shape); }) {
    return l.query_dim(shape);
  } else {
    return l.key_dim(shape);
  }
}

/// Whether attend also scores the value plane (layout::MLA's latent).
template <Layout L>
inline constexpr bool scores_latent = requires { requires L::kScoresLatent; };

}  // namespace kvpack::inline v0::layout
