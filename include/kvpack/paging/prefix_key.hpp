#pragma once
/// \file prefix_key.hpp
/// \brief PrefixKey: the namespace a cached prefix lives in. Two prefixes share pages only when
///        their keys are equal field by field, so the key names everything that changes a page's
///        bytes, not only the tokens (peers that key on tokens alone mix dtypes silently).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/paging/fingerprint.hpp"

namespace kvpack::inline v0::paging {

struct PrefixKey {
  /// The model's identity as the engine knows it: weights and tokenizer (the same token ids mean
  /// other K/V under other weights). Required.
  std::string model_id;
  /// The layout's name and parameters (`layout::GQA::kName`; CrossLayer's K). Required.
  std::string layout;
  /// The attention shape; layers and heads decide which streams a page belongs to.
  ModelShape shape{};
  /// Tokens per page; must equal the index's.
  index_t page_size = 0;
  /// The quantizer's name (`Quantizer::name()`). Required.
  std::string codec;
  /// A Fingerprint of the codec's parameters: static scales, calibrated codebooks, rotation
  /// seeds. Two caches whose codecs differ in any parameter must pass different values here.
  std::uint64_t codec_params = 0;
  /// A Fingerprint of the cache options that change page bytes: pre-RoPE keys and their RoPE
  /// spec, exact-prefix tokens, the selector's summary.
  std::uint64_t cache_options = 0;
  /// The caller's salt: requests with different salts never share (tenants, privacy). Optional.
  std::string salt;

  /// Throws kvpack::Error(kInvalidArgument) naming the first missing or bad field.
  void validate() const {
    KVPACK_CHECK(!model_id.empty(), kInvalidArgument, "PrefixKey.model_id must not be empty");
    KVPACK_CHECK(!layout.empty(), kInvalidArgument, "PrefixKey.layout must not be empty");
    KVPACK_CHECK(!codec.empty(), kInvalidArgument, "PrefixKey.codec must not be empty");
    KVPACK_CHECK(shape.layers > 0 && shape.q_heads > 0 && shape.kv_heads > 0 && shape.head_dim > 0,
                 kInvalidArgument,
                 detail::message("PrefixKey.shape must be positive, got layers ", shape.layers,
                                 ", q_heads ", shape.q_heads, ", kv_heads ", shape.kv_heads,
                                 ", head_dim ", shape.head_dim));
    KVPACK_CHECK(page_size > 0, kInvalidArgument,
                 detail::message("PrefixKey.page_size must be > 0, got ", page_size));
  }

  /// A hash of every field, for lookups; equality is still decided field by field.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    Fingerprint f;
    f.add(std::string_view(model_id)).add(std::string_view(layout));
    f.add(shape.layers).add(shape.q_heads).add(shape.kv_heads).add(shape.head_dim).add(page_size);
    f.add(std::string_view(codec)).add(codec_params).add(cache_options).add(std::string_view(salt));
    return f.value();
  }

  friend bool operator==(const PrefixKey&, const PrefixKey&) = default;
};

/// PrefixKey::codec_params for a cache whose codecs take these parameters, [layers][streams]
/// each (as many values as keys): their object bytes (FP8's scales; KVQuant's table pointers,
/// which name tables inside one cache's quantizer, as a key of that cache's own index needs).
/// Padding bytes could make equal parameters differ, which would only lose a hit, never share a
/// wrong page.
template <class KeyParams, class ValueParams>
[[nodiscard]] std::uint64_t codec_params_fingerprint(std::span<const KeyParams> keys,
                                                     std::span<const ValueParams> values) noexcept {
  static_assert(
      std::is_trivially_copyable_v<KeyParams> && std::is_trivially_copyable_v<ValueParams>,
      "prefix sharing fingerprints codec parameters by their bytes");
  Fingerprint f;
  for (std::size_t p = 0; p < keys.size() && p < values.size(); ++p) {
    if constexpr (!std::is_empty_v<KeyParams>) f.add_bytes(std::as_bytes(keys.subspan(p, 1)));
    if constexpr (!std::is_empty_v<ValueParams>) f.add_bytes(std::as_bytes(values.subspan(p, 1)));
  }
  return f.value();
}

struct PrefixKeyHash {
  std::size_t operator()(const PrefixKey& key) const noexcept {
    return static_cast<std::size_t>(key.fingerprint());
  }
};

}  // namespace kvpack::inline v0::paging
