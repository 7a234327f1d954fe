#pragma once
/// \file cache_identity.hpp
/// \brief What a tier key must name besides the tokens: everything about the cache and model
///        that decides a page's bytes, fingerprinted (sequence_key, chunk_keys).

#include <string_view>

#include "kvpack/core/types.hpp"
#include "kvpack/paging/fingerprint.hpp"

namespace kvpack::inline v0::tier {

/// Adds the model id, salt, layout, shape, page size, quantizer and RoPE storage of `cache` to
/// `f`. Codec parameters are not added: page files carry them and the loader compares them, so
/// caches that differ only there refuse each other's entries rather than read them.
template <class Cache>
void add_cache_identity(paging::Fingerprint& f, const Cache& cache, std::string_view model_id, std::string_view salt) {
  const ModelShape& shape = cache.shape();
  f.add(model_id).add(salt).add(std::string_view(Cache::layout_type::kName));
  f.add(shape.layers).add(shape.q_heads).add(shape.kv_heads).add(shape.head_dim).add(cache.config().page_size);
  f.add(std::string_view(Cache::quantizer_type::name()));
  const auto& rope = cache.config().key_rope;
  f.add(rope.has_value());
  if (rope) f.add(rope->theta).add(rope->pairing).add(rope->max_position);
}

}  // namespace kvpack::inline v0::tier
