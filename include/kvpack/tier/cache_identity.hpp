#pragma once
/// \file cache_identity.hpp
/// \brief What a tier key must name besides the tokens: everything about the cache and model
///        that decides a page's bytes, fingerprinted (sequence_key, chunk_keys).

#include <string_view>

#include "kvpack/core/types.hpp"
#include "kvpack/layout/layout_concepts.hpp"
#include "kvpack/paging/fingerprint.hpp"

namespace kvpack::inline v0::tier {

/// Adds the model id, salt, layout (its name and what its parameters decide: the layers that
/// keep a cache, streams and row widths, e.g. CrossLayer's K or MLA's latent and rope dims),
/// shape, page size, quantizer and RoPE storage of `cache` to `f`. Codec parameters are not
/// added: page files carry them and the loader compares them, so caches that differ only there
/// refuse each other's entries rather than read them.
template <class Cache>
void add_cache_identity(paging::Fingerprint& f, const Cache& cache, std::string_view model_id, std::string_view salt) {
  const ModelShape& shape = cache.shape();
  const auto& layout = cache.layout();
  f.add(model_id).add(salt).add(std::string_view(Cache::layout_type::kName));
  f.add(layout::cache_layers(layout, shape)).add(layout.streams(shape));
  f.add(layout.key_dim(shape)).add(layout.value_dim(shape));
  f.add(shape.layers).add(shape.q_heads).add(shape.kv_heads).add(shape.head_dim).add(cache.config().page_size);
  f.add(std::string_view(Cache::quantizer_type::name()));
  const auto& rope = cache.config().key_rope;
  f.add(rope.has_value());
  if (rope) f.add(rope->theta).add(rope->pairing).add(rope->max_position);
}

}  // namespace kvpack::inline v0::tier
