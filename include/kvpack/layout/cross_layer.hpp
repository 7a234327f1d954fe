#pragma once
/// \file cross_layer.hpp
/// \brief layout::CrossLayer<Inner, K>: K adjacent layers share one cache (cross-layer attention,
///        CLA; with K at least the layer count, one cache for the whole model as in YOCO).
///
/// Only the first layer of each group of K computes keys and values and writes them; every
/// layer of the group attends over that cache. The cache holds ⌈layers / K⌉ layers, so memory
/// divides by K. Within a layer, `Inner` (GQA) maps query heads to KV streams as usual. Writing
/// to another layer of a group is an error that names the layer to write instead.

#include <string_view>

#include "kvpack/layout/gqa.hpp"
#include "kvpack/layout/layout_concepts.hpp"

namespace kvpack::inline v0::layout {

template <Layout Inner, index_t K>
struct CrossLayer {
  static_assert(K >= 1, "CrossLayer shares one cache across K >= 1 layers");
  // What this wrapper does not pass on would be dropped silently: MLA's latent scoring and
  // query width (the cache would attend it as GQA over the rope part), or an inner sharing.
  static_assert(!scores_latent<Inner>, "CrossLayer over layout::MLA is not supported");
  static_assert(!requires(const Inner& inner, const ModelShape& shape) { inner.cache_layers(shape); },
                "CrossLayer over a layout that shares layers itself: use one CrossLayer with the product of the Ks");
  static constexpr std::string_view kName = "cross_layer";
  static constexpr index_t kLayersPerCache = K;

  Inner inner{};

  void validate(const ModelShape& shape) const { inner.validate(shape); }
  [[nodiscard]] index_t streams(const ModelShape& shape) const noexcept { return inner.streams(shape); }
  [[nodiscard]] index_t stream_of_query_head(const ModelShape& shape, index_t h) const noexcept {
    return inner.stream_of_query_head(shape, h);
  }
  [[nodiscard]] index_t key_dim(const ModelShape& shape) const noexcept { return inner.key_dim(shape); }
  [[nodiscard]] index_t value_dim(const ModelShape& shape) const noexcept { return inner.value_dim(shape); }

  [[nodiscard]] constexpr index_t cache_layers(const ModelShape& shape) const noexcept {
    return (shape.layers - 1) / K + 1;  // ⌈layers / K⌉ without overflow for a K near the index's largest
  }
  [[nodiscard]] constexpr index_t cache_layer_of(const ModelShape&, index_t layer) const noexcept { return layer / K; }
  [[nodiscard]] constexpr index_t writer_of(const ModelShape&, index_t cache_layer) const noexcept {
    return cache_layer * K;
  }

  friend constexpr bool operator==(const CrossLayer&, const CrossLayer&) = default;
};

static_assert(Layout<CrossLayer<GQA, 2>>);

}  // namespace kvpack::inline v0::layout
