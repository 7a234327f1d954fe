#pragma once
/// \file page_file_reader.hpp
/// \brief PageFileView: a verified page file held in memory the caller owns (a buffer, or a
///        mapping: see PageFile), with views into its page payloads, never copies of them.
///
/// parse() checks everything before it returns: the container (magic, version, lengths,
/// checksums: page_file_container.hpp), META (page_file_header_io.hpp), then that PARM, TOKN,
/// SLOT and PAGE hold exactly the bytes META implies, that codec parameters are the codec's kind
/// and usable, and that every live slot's position is one the kernels can use. Afterwards every
/// accessor is a bounds-checked view: no view can leave the buffer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/byte_cursor.hpp"
#include "kvpack/io/codec_registry.hpp"
#include "kvpack/io/page_file_container.hpp"
#include "kvpack/io/page_file_header_io.hpp"

namespace kvpack::inline v0::io {

class PageFileView {
 public:
  /// \throws kvpack::Error: kInvalidArgument for anything malformed (wrong magic, truncated,
  ///         oversized lengths, checksum mismatch, inconsistent sizes); kUnsupported for a version
  ///         or codec this build does not read.
  /// The view borrows the bytes, so a temporary buffer would dangle as soon as parse returns.
  static PageFileView parse(std::vector<std::byte>&& file, std::string_view what = "page file") = delete;
  [[nodiscard]] static PageFileView parse(std::span<const std::byte> file, std::string_view what = "page file") {
    PageFileView view;
    const SectionBodies s = split_sections(file, what);
    view.header_ = read_meta(s.meta, what);
    const PageFileHeader& h = view.header_;
    view.first_page_.reserve(h.page_counts.size() + 1);
    view.first_page_.push_back(0);
    for (const std::uint32_t n : h.page_counts) view.first_page_.push_back(view.first_page_.back() + n);
    const std::uint64_t pages = view.first_page_.back();

    view.read_params(s.params, what);
    view.read_tokens(s.tokens, what);
    // Sizes are compared by division: pages * bytes could overflow 64 bits for a hostile header.
    KVPACK_CHECK(s.slots.size() % h.slot_bytes == 0 && s.slots.size() / h.slot_bytes == pages, kInvalidArgument,
                 detail::message(what, ": SLOT holds ", s.slots.size(), " bytes; ", pages, " pages of ", h.slot_bytes,
                                 " bytes are declared"));
    KVPACK_CHECK(s.pages.size() % h.payload_bytes == 0 && s.pages.size() / h.payload_bytes == pages, kInvalidArgument,
                 detail::message(what, ": PAGE holds ", s.pages.size(), " bytes; ", pages, " pages of ",
                                 h.payload_bytes, " bytes are declared"));
    view.slots_ = s.slots;
    view.pages_ = s.pages;
    view.check_slots(what);
    return view;
  }

  [[nodiscard]] const PageFileHeader& header() const noexcept { return header_; }
  /// The sequence's token ids, if the writer was given them (copied: they are small).
  [[nodiscard]] std::span<const std::int32_t> tokens() const noexcept { return tokens_; }
  [[nodiscard]] std::uint64_t total_pages() const noexcept { return first_page_.back(); }
  [[nodiscard]] std::uint32_t page_count(index_t layer, index_t stream) const {
    return header_.page_counts[table(layer, stream)];
  }
  /// One page's payload, `payload_bytes` long: K plane at 0, V plane at value_plane_offset.
  [[nodiscard]] std::span<const std::byte> payload(index_t layer, index_t stream, std::uint32_t page) const {
    return pages_.subspan(index(layer, stream, page) * header_.payload_bytes, header_.payload_bytes);
  }
  [[nodiscard]] std::span<const std::byte> key_plane(index_t layer, index_t stream, std::uint32_t page) const {
    return payload(layer, stream, page).first(header_.key_plane_bytes);
  }
  [[nodiscard]] std::span<const std::byte> value_plane(index_t layer, index_t stream, std::uint32_t page) const {
    return payload(layer, stream, page).subspan(header_.value_plane_offset, header_.value_plane_bytes);
  }
  /// The original position of each slot of a page (int32, read unaligned-safe).
  [[nodiscard]] std::int32_t position(index_t layer, index_t stream, std::uint32_t page, index_t slot) const {
    std::int32_t p;
    std::memcpy(&p, slot_record(layer, stream, page, slot).data(), sizeof(p));
    return p;
  }
  [[nodiscard]] bool live(index_t layer, index_t stream, std::uint32_t page, index_t slot) const {
    return live_bit(slots(layer, stream, page), checked_slot(slot));
  }
  /// One page's whole SLOT record, `slot_bytes` long: positions, then the live mask (the head of
  /// the pool's page metadata).
  [[nodiscard]] std::span<const std::byte> slots(index_t layer, index_t stream, std::uint32_t page) const {
    return slots_.subspan(index(layer, stream, page) * header_.slot_bytes, header_.slot_bytes);
  }
  /// PARM's bytes for one (layer, stream): ParamsFormat<params_type>::read turns them back.
  [[nodiscard]] std::span<const std::byte> key_params(index_t layer, index_t stream) const {
    return params_.subspan(table(layer, stream) * (key_params_bytes_ + value_params_bytes_), key_params_bytes_);
  }
  [[nodiscard]] std::span<const std::byte> value_params(index_t layer, index_t stream) const {
    return params_.subspan(table(layer, stream) * (key_params_bytes_ + value_params_bytes_) + key_params_bytes_,
                           value_params_bytes_);
  }

 private:
  PageFileHeader header_;
  std::vector<std::uint64_t> first_page_;  ///< [tables + 1] prefix sums of page_counts
  std::vector<std::int32_t> tokens_;
  std::span<const std::byte> params_, slots_, pages_;
  std::size_t key_params_bytes_ = 0, value_params_bytes_ = 0;

  [[nodiscard]] std::size_t table(index_t layer, index_t stream) const {
    KVPACK_CHECK(layer >= 0 && layer < header_.cache_layers && stream >= 0 && stream < header_.streams,
                 kInvalidArgument,
                 detail::message("page file: (cache layer ", layer, ", stream ", stream, ") out of range [0, ",
                                 header_.cache_layers, ") x [0, ", header_.streams, ")"));
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(header_.streams) + static_cast<std::size_t>(stream);
  }
  [[nodiscard]] std::size_t index(index_t layer, index_t stream, std::uint32_t page) const {
    const std::size_t t = table(layer, stream);
    KVPACK_CHECK(page < header_.page_counts[t], kInvalidArgument,
                 detail::message("page file: page ", page, " out of range [0, ", header_.page_counts[t], ")"));
    return static_cast<std::size_t>(first_page_[t] + page);
  }
  [[nodiscard]] index_t checked_slot(index_t slot) const {
    KVPACK_CHECK(slot >= 0 && slot < header_.page_size, kInvalidArgument,
                 detail::message("page file: slot ", slot, " out of range [0, ", header_.page_size, ")"));
    return slot;
  }
  [[nodiscard]] std::span<const std::byte> slot_record(index_t layer, index_t stream, std::uint32_t page,
                                                       index_t slot) const {
    return slots_.subspan(index(layer, stream, page) * header_.slot_bytes + static_cast<std::size_t>(checked_slot(slot)) * 4,
                          4);
  }
  [[nodiscard]] bool live_bit(std::span<const std::byte> record, index_t slot) const noexcept {
    std::uint64_t word;
    std::memcpy(&word, record.data() + static_cast<std::size_t>(header_.page_size) * 4 + (slot / 64) * 8, 8);
    return (word >> (slot % 64)) & 1u;
  }

  /// PARM: kinds and record sizes that are the codecs', every record's values checked, the codec
  /// prefix equal in every record, then META's plane sizes from the first records.
  void read_params(std::span<const std::byte> body, std::string_view what) {
    const CodecEntry& key = *find_codec(header_.key_codec, Plane::kKey, header_.key_group);
    const CodecEntry& value = *find_codec(header_.value_codec, Plane::kValue, header_.value_group);
    const quant::PageGeometry key_geometry{header_.page_size, header_.key_dim};
    const quant::PageGeometry value_geometry{header_.page_size, header_.value_dim};
    ByteSource in(body, what);
    const auto key_kind = in.get<std::uint32_t>("PARM key kind");
    const auto key_bytes = in.get<std::uint32_t>("PARM key bytes");
    const auto value_kind = in.get<std::uint32_t>("PARM value kind");
    const auto value_bytes = in.get<std::uint32_t>("PARM value bytes");
    KVPACK_CHECK(key_kind == static_cast<std::uint32_t>(key.params) && key_bytes == key.params_bytes(key_geometry) &&
                     value_kind == static_cast<std::uint32_t>(value.params) &&
                     value_bytes == value.params_bytes(value_geometry),
                 kInvalidArgument,
                 detail::message(what, ": PARM declares parameters of kind ", key_kind, "/", value_kind, " (", key_bytes,
                                 "/", value_bytes, " bytes); the codecs ", header_.key_codec, "/", header_.value_codec,
                                 " have kind ", static_cast<std::uint32_t>(key.params), "/",
                                 static_cast<std::uint32_t>(value.params), " (",
                                 key.params_bytes(key_geometry), "/", value.params_bytes(value_geometry), " bytes)"));
    key_params_bytes_ = key_bytes;
    value_params_bytes_ = value_bytes;
    const std::size_t need = header_.page_counts.size() * (key_params_bytes_ + value_params_bytes_);
    KVPACK_CHECK(in.remaining() == need, kInvalidArgument,
                 detail::message(what, ": PARM holds ", in.remaining(), " bytes of parameters, ", need, " expected"));
    params_ = body.subspan(16);
    for (std::size_t t = 0; t < header_.page_counts.size(); ++t) {
      const auto c = static_cast<index_t>(t / static_cast<std::size_t>(header_.streams));
      const auto s = static_cast<index_t>(t % static_cast<std::size_t>(header_.streams));
      check_record(key, key_params(c, s), key_params(0, 0), key_geometry, what);
      check_record(value, value_params(c, s), value_params(0, 0), value_geometry, what);
    }
    check_plane_sizes(header_, key_params(0, 0), value_params(0, 0), what);
  }
  static void check_record(const CodecEntry& codec, std::span<const std::byte> record, std::span<const std::byte> first,
                           quant::PageGeometry g, std::string_view what) {
    codec.check_params(record, g, what);
    KVPACK_CHECK(std::equal(record.begin(), record.begin() + static_cast<std::ptrdiff_t>(codec.codec_prefix),
                            first.begin()),
                 kInvalidArgument,
                 detail::message(what, ": PARM's ", codec.name, " records disagree on the codec's options"));
  }

  void read_tokens(std::span<const std::byte> body, std::string_view what) {
    ByteSource in(body, what);
    const auto count = in.get<std::uint64_t>("TOKN count");
    KVPACK_CHECK(count <= PageFileLimits::kMaxTokens && in.remaining() == count * sizeof(std::int32_t), kInvalidArgument,
                 detail::message(what, ": TOKN declares ", count, " tokens in ", in.remaining(), " bytes"));
    tokens_.resize(static_cast<std::size_t>(count));
    if (count > 0) std::memcpy(tokens_.data(), body.data() + 8, tokens_.size() * sizeof(std::int32_t));
  }

  /// Live slots hold positions the kernels can use: non-negative and, for keys stored before
  /// RoPE, within the RoPE tables (a kernel indexes them by position); mask bits past page_size
  /// are clear.
  void check_slots(std::string_view what) const {
    const std::int64_t limit =
        header_.keys_before_rope ? header_.rope_max_position : std::numeric_limits<std::int32_t>::max();
    const std::size_t words = header_.live_mask_words();
    for (std::uint64_t page = 0; page < total_pages(); ++page) {
      const std::span<const std::byte> record = slots_.subspan(page * header_.slot_bytes, header_.slot_bytes);
      std::uint64_t last_word;
      std::memcpy(&last_word, record.data() + header_.page_size * 4 + (words - 1) * 8, 8);
      const unsigned used = static_cast<unsigned>(header_.page_size - 64 * static_cast<index_t>(words - 1));
      KVPACK_CHECK(used == 64 || (last_word >> used) == 0, kInvalidArgument,
                   detail::message(what, ": page ", page, "'s live mask marks slots beyond page_size"));
      for (index_t slot = 0; slot < header_.page_size; ++slot) {
        if (!live_bit(record, slot)) continue;
        std::int32_t p;
        std::memcpy(&p, record.data() + static_cast<std::size_t>(slot) * 4, 4);
        KVPACK_CHECK(p >= 0 && p <= limit, kInvalidArgument,
                     detail::message(what, ": page ", page, " slot ", slot, " has position ", p, ", outside [0, ",
                                     limit, "]"));
      }
    }
  }
};

}  // namespace kvpack::inline v0::io
