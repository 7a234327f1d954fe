#pragma once
/// \file page_file_header_io.hpp
/// \brief The META section: PageFileHeader to bytes, and bytes back to a header that has been
///        checked for internal consistency (bounded sizes, known codecs, slot sizes that match
///        the shape) before anything is sized from it; its plane sizes once PARM is read.

#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include "kvpack/error.hpp"
#include "kvpack/io/byte_cursor.hpp"
#include "kvpack/io/codec_registry.hpp"
#include "kvpack/io/page_file_format.hpp"

namespace kvpack::inline v0::io {

/// Appends META's body. Field order is the README's table.
inline void write_meta(ByteSink& out, const PageFileHeader& h) {
  out.put(static_cast<std::int32_t>(h.shape.layers));
  out.put(static_cast<std::int32_t>(h.shape.q_heads));
  out.put(static_cast<std::int32_t>(h.shape.kv_heads));
  out.put(static_cast<std::int32_t>(h.shape.head_dim));
  out.put(static_cast<std::int32_t>(h.layers_per_cache));
  out.put(static_cast<std::int32_t>(h.cache_layers));
  out.put(static_cast<std::int32_t>(h.streams));
  out.put(static_cast<std::int32_t>(h.key_dim));
  out.put(static_cast<std::int32_t>(h.value_dim));
  out.put(static_cast<std::int32_t>(h.page_size));
  out.put(static_cast<std::uint32_t>(h.keys_before_rope ? 1 : 0));
  out.put(h.rope_pairing);
  out.put(h.rope_theta);
  out.put(h.rope_max_position);
  out.put(h.key_group);
  out.put(h.value_group);
  out.put(h.key_plane_bytes);
  out.put(h.value_plane_offset);
  out.put(h.value_plane_bytes);
  out.put(h.payload_bytes);
  out.put(h.slot_bytes);
  out.put(h.sequence_tokens);
  out.put_string(h.model_id);
  out.put_string(h.layout);
  out.put_string(h.quantizer);
  out.put_string(h.key_codec);
  out.put_string(h.value_codec);
  for (const std::uint32_t n : h.page_counts) out.put(n);
}

namespace header_detail {

inline void check_range(std::string_view what, const char* field, std::int64_t value, std::int64_t lo, std::int64_t hi) {
  KVPACK_CHECK(value >= lo && value <= hi, kInvalidArgument,
               detail::message(what, ": META.", field, " = ", value, " is outside [", lo, ", ", hi, "]"));
}
inline void check_equal(std::string_view what, const char* field, std::uint64_t value, std::uint64_t expected) {
  KVPACK_CHECK(value == expected, kInvalidArgument,
               detail::message(what, ": META.", field, " = ", value, " but the shape and codec give ", expected));
}

/// The codec of one plane, or kUnsupported naming it.
inline const CodecEntry& codec_of(std::string_view what, const std::string& name, Plane plane,
                                  std::uint32_t group) {
  const CodecEntry* entry = find_codec(name, plane, group);
  KVPACK_CHECK(entry != nullptr, kUnsupported,
               detail::message(what, ": ", plane == Plane::kKey ? "key" : "value", " codec \"", name,
                               "\" (group ", group, ") is not one this build reads from page files"));
  return *entry;
}

}  // namespace header_detail

/// Parses and checks META. Every count is bounded (PageFileLimits) before a vector is sized from
/// it, so a hostile header cannot make the reader allocate more than a few kilobytes here.
inline PageFileHeader read_meta(std::span<const std::byte> body, std::string_view what) {
  using namespace header_detail;
  using L = PageFileLimits;
  ByteSource in(body, what);
  PageFileHeader h;
  const auto i32 = [&](const char* field) { return static_cast<std::int64_t>(in.get<std::int32_t>(field)); };
  const std::int64_t layers = i32("layers"), q_heads = i32("q_heads"), kv_heads = i32("kv_heads"),
                     head_dim = i32("head_dim"), layers_per_cache = i32("layers_per_cache"),
                     cache_layers = i32("cache_layers"), streams = i32("streams"), key_dim = i32("key_dim"),
                     value_dim = i32("value_dim"), page_size = i32("page_size");
  check_range(what, "layers", layers, 1, L::kMaxLayers);
  check_range(what, "kv_heads", kv_heads, 1, L::kMaxHeads);
  check_range(what, "q_heads", q_heads, kv_heads, L::kMaxHeads);
  KVPACK_CHECK(q_heads % kv_heads == 0, kInvalidArgument,
               detail::message(what, ": META.q_heads (", q_heads, ") is not a multiple of kv_heads (", kv_heads, ")"));
  check_range(what, "head_dim", head_dim, 1, L::kMaxHeadDim);
  check_range(what, "layers_per_cache", layers_per_cache, 1, L::kMaxLayers);
  check_equal(what, "cache_layers", static_cast<std::uint64_t>(cache_layers),
              static_cast<std::uint64_t>((layers + layers_per_cache - 1) / layers_per_cache));
  check_range(what, "streams", streams, 1, L::kMaxHeads);
  check_range(what, "key_dim", key_dim, 1, L::kMaxHeadDim);
  check_range(what, "value_dim", value_dim, 1, L::kMaxHeadDim);
  check_range(what, "page_size", page_size, 16, 256);
  KVPACK_CHECK(page_size % 16 == 0, kInvalidArgument,
               detail::message(what, ": META.page_size = ", page_size, " is not a multiple of 16"));
  h.shape = {static_cast<index_t>(layers), static_cast<index_t>(q_heads), static_cast<index_t>(kv_heads),
             static_cast<index_t>(head_dim)};
  h.layers_per_cache = static_cast<index_t>(layers_per_cache);
  h.cache_layers = static_cast<index_t>(cache_layers);
  h.streams = static_cast<index_t>(streams);
  h.key_dim = static_cast<index_t>(key_dim);
  h.value_dim = static_cast<index_t>(value_dim);
  h.page_size = static_cast<index_t>(page_size);

  const auto rope = in.get<std::uint32_t>("keys_before_rope");
  KVPACK_CHECK(rope <= 1, kInvalidArgument, detail::message(what, ": META.keys_before_rope = ", rope, " is not 0 or 1"));
  h.keys_before_rope = rope == 1;
  h.rope_pairing = in.get<std::uint32_t>("rope_pairing");
  h.rope_theta = in.get<double>("rope_theta");
  h.rope_max_position = in.get<std::int64_t>("rope_max_position");
  if (h.keys_before_rope) {
    KVPACK_CHECK(h.rope_pairing <= 1 && h.rope_theta > 1.0 && h.rope_theta < std::numeric_limits<double>::infinity() &&
                     h.rope_max_position >= 0 && h.rope_max_position <= std::numeric_limits<std::int32_t>::max(),
                 kInvalidArgument,
                 detail::message(what, ": META's RoPE fields (pairing ", h.rope_pairing, ", theta ", h.rope_theta,
                                 ", max_position ", h.rope_max_position, ") are not a valid RopeSpec"));
  }
  h.key_group = in.get<std::uint32_t>("key_group");
  h.value_group = in.get<std::uint32_t>("value_group");
  h.key_plane_bytes = in.get<std::uint64_t>("key_plane_bytes");
  h.value_plane_offset = in.get<std::uint64_t>("value_plane_offset");
  h.value_plane_bytes = in.get<std::uint64_t>("value_plane_bytes");
  h.payload_bytes = in.get<std::uint64_t>("payload_bytes");
  h.slot_bytes = in.get<std::uint64_t>("slot_bytes");
  h.sequence_tokens = in.get<std::uint64_t>("sequence_tokens");
  KVPACK_CHECK(h.sequence_tokens <= L::kMaxTokens, kInvalidArgument,
               detail::message(what, ": META.sequence_tokens = ", h.sequence_tokens, " exceeds ", L::kMaxTokens));
  h.model_id = in.get_string("model_id", L::kMaxString);
  h.layout = in.get_string("layout", L::kMaxString);
  h.quantizer = in.get_string("quantizer", L::kMaxString);
  h.key_codec = in.get_string("key_codec", L::kMaxString);
  h.value_codec = in.get_string("value_codec", L::kMaxString);
  KVPACK_CHECK(h.layout == "gqa" || h.layout == "cross_layer" || h.layout == "mla", kUnsupported,
               detail::message(what, ": layout \"", h.layout, "\" is not one this build reads (gqa, cross_layer, mla)"));
  KVPACK_CHECK(h.layout == "cross_layer" || h.layers_per_cache == 1, kInvalidArgument,
               detail::message(what, ": layout ", h.layout, " with layers_per_cache ", h.layers_per_cache));
  if (h.layout == "mla") {
    // RoPE keys (key_dim) and latents (value_dim) of any width.
    KVPACK_CHECK(kv_heads == 1 && streams == 1, kInvalidArgument,
                 detail::message(what, ": layout mla keeps one latent stream per layer, but META.kv_heads = ", kv_heads,
                                 " and streams = ", streams));
  } else {
    check_equal(what, "streams", static_cast<std::uint64_t>(streams), static_cast<std::uint64_t>(kv_heads));
    check_equal(what, "key_dim", static_cast<std::uint64_t>(key_dim), static_cast<std::uint64_t>(head_dim));
    check_equal(what, "value_dim", static_cast<std::uint64_t>(value_dim), static_cast<std::uint64_t>(head_dim));
  }

  // The codecs: unknown ones are kUnsupported here; their sizes are checked with PARM's records.
  (void)codec_of(what, h.key_codec, Plane::kKey, h.key_group);
  (void)codec_of(what, h.value_codec, Plane::kValue, h.value_group);
  check_equal(what, "slot_bytes", h.slot_bytes,
              static_cast<std::uint64_t>(h.page_size) * 4 + h.live_mask_words() * 8);

  // cache_layers * streams <= 4096 * 4096: the page table is at most 64 MiB of u32, and only
  // allocated once the section holds that many bytes.
  const std::size_t tables = static_cast<std::size_t>(cache_layers) * static_cast<std::size_t>(streams);
  KVPACK_CHECK(in.remaining() == tables * sizeof(std::uint32_t), kInvalidArgument,
               detail::message(what, ": META holds ", in.remaining(), " bytes of page counts, ", tables,
                               " (layer, stream) counts need ", tables * sizeof(std::uint32_t)));
  h.page_counts.resize(tables);
  for (std::uint32_t& n : h.page_counts) n = in.get<std::uint32_t>("page_counts");
  return h;
}

/// Checks META's plane, payload and slot sizes against the shape and the codecs, whose options
/// (KVQuant's outlier fraction, TurboQuant's rate) come from a PARM record of each plane.
inline void check_plane_sizes(const PageFileHeader& h, std::span<const std::byte> key_record,
                              std::span<const std::byte> value_record, std::string_view what) {
  using namespace header_detail;
  const CodecEntry& key = codec_of(what, h.key_codec, Plane::kKey, h.key_group);
  const CodecEntry& value = codec_of(what, h.value_codec, Plane::kValue, h.value_group);
  const quant::PageGeometry key_geometry{h.page_size, h.key_dim};
  const quant::PageGeometry value_geometry{h.page_size, h.value_dim};
  key.validate(key_geometry, key_record);
  value.validate(value_geometry, value_record);
  check_equal(what, "key_plane_bytes", h.key_plane_bytes, key.plane_bytes(key_geometry, key_record));
  check_equal(what, "value_plane_offset", h.value_plane_offset, (h.key_plane_bytes + 63) / 64 * 64);
  check_equal(what, "value_plane_bytes", h.value_plane_bytes, value.plane_bytes(value_geometry, value_record));
  check_equal(what, "payload_bytes", h.payload_bytes, (h.value_plane_offset + h.value_plane_bytes + 63) / 64 * 64);
  KVPACK_CHECK(h.payload_bytes <= PageFileLimits::kMaxPageBytes, kInvalidArgument,
               detail::message(what, ": pages of ", h.payload_bytes, " bytes exceed ", PageFileLimits::kMaxPageBytes));
}

}  // namespace kvpack::inline v0::io
