#pragma once
/// \file page_file_container.hpp
/// \brief The container of a page file, independent of what the sections hold: the preamble
///        (magic, version, file length, its CRC32C) and sections (tag, length, CRCs), framed by
///        preamble_bytes and section_header_bytes (in memory: ContainerWriter) and split and
///        verified by split_sections.
///
/// Preamble, 64 bytes: magic "KVPKPAGE" (8) | u32 version | u32 section count | u64 file bytes |
/// u32 CRC32C of bytes [0, 24) | 36 zero bytes.
/// Section header, 64 bytes: u32 tag | u32 0 | u64 body bytes | u32 CRC32C of the body |
/// u32 CRC32C of the header's bytes [0, 20) | 40 zero bytes. The body follows, then zeros to the
/// next multiple of 64.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/byte_cursor.hpp"
#include "kvpack/io/crc32c.hpp"
#include "kvpack/io/page_file_format.hpp"

namespace kvpack::inline v0::io {

/// The preamble of a file of `file_bytes` bytes holding `sections` sections.
inline std::array<std::byte, kPreambleBytes> preamble_bytes(std::uint64_t file_bytes, std::uint32_t sections) noexcept {
  std::array<std::byte, kPreambleBytes> p{};
  std::memcpy(p.data(), kPageFileMagic.data(), kPageFileMagic.size());
  std::memcpy(p.data() + 8, &kPageFileVersion, sizeof(kPageFileVersion));
  std::memcpy(p.data() + 12, &sections, sizeof(sections));
  std::memcpy(p.data() + 16, &file_bytes, sizeof(file_bytes));
  const std::uint32_t crc = crc32c(std::span<const std::byte>(p.data(), 24));
  std::memcpy(p.data() + 24, &crc, sizeof(crc));
  return p;
}

/// The header of a section whose body is `body_bytes` long with CRC32C `body_crc`.
inline std::array<std::byte, kSectionHeaderBytes> section_header_bytes(SectionTag tag, std::uint64_t body_bytes,
                                                                       std::uint32_t body_crc) noexcept {
  std::array<std::byte, kSectionHeaderBytes> h{};
  const auto raw = static_cast<std::uint32_t>(tag);
  std::memcpy(h.data(), &raw, sizeof(raw));
  std::memcpy(h.data() + 8, &body_bytes, sizeof(body_bytes));
  std::memcpy(h.data() + 16, &body_crc, sizeof(body_crc));
  const std::uint32_t header_crc = crc32c(std::span<const std::byte>(h.data(), 20));
  std::memcpy(h.data() + 20, &header_crc, sizeof(header_crc));
  return h;
}

/// Bytes a section of a `body_bytes` body takes in a file: its header, the body and its padding.
[[nodiscard]] inline std::uint64_t framed_section_bytes(std::uint64_t body_bytes) noexcept {
  return kSectionHeaderBytes + (body_bytes + kPageFileAlignment - 1) / kPageFileAlignment * kPageFileAlignment;
}

/// Builds a file in memory: the preamble, then sections appended one at a time.
class ContainerWriter {
 public:
  ContainerWriter() { file_.resize(kPreambleBytes); }

  /// Starts a section: its body is what is appended to body() until end_section().
  void begin_section(SectionTag tag) {
    section_start_ = file_.size();
    section_tag_ = tag;
    file_.resize(section_start_ + kSectionHeaderBytes);
  }
  [[nodiscard]] std::vector<std::byte>& body() noexcept { return file_; }
  void end_section() {
    const std::size_t body_start = section_start_ + kSectionHeaderBytes;
    const auto body = std::span<const std::byte>(file_).subspan(body_start);
    const auto header = section_header_bytes(section_tag_, body.size(), crc32c(body));
    std::memcpy(file_.data() + section_start_, header.data(), header.size());
    ByteSink(file_).pad_to(kPageFileAlignment);
    ++sections_;
  }
  /// Fills in the preamble and hands over the file.
  [[nodiscard]] std::vector<std::byte> finish() && {
    const auto preamble = preamble_bytes(file_.size(), sections_);
    std::memcpy(file_.data(), preamble.data(), preamble.size());
    return std::move(file_);
  }

 private:
  std::vector<std::byte> file_;
  std::size_t section_start_ = 0;
  SectionTag section_tag_{};
  std::uint32_t sections_ = 0;
};

/// The bodies of a verified file's sections, in kSectionOrder, as views into its bytes.
struct SectionBodies {
  std::span<const std::byte> meta, params, tokens, slots, pages;
};

namespace container_detail {

inline std::uint32_t load_u32(const std::byte* p) noexcept {
  std::uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline std::uint64_t load_u64(const std::byte* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
/// Reserved bytes and padding are zero, so that every byte of a file is either covered by a
/// checksum or checked: a single flipped bit anywhere is an error.
inline bool all_zero(std::span<const std::byte> bytes) noexcept {
  for (const std::byte b : bytes) {
    if (b != std::byte{0}) return false;
  }
  return true;
}
inline std::string tag_text(std::uint32_t tag) {
  std::string text(4, '?');
  for (int i = 0; i < 4; ++i) {
    const auto c = static_cast<char>((tag >> (8 * i)) & 0xFFu);
    if (c >= 0x20 && c < 0x7F) text[static_cast<std::size_t>(i)] = c;
  }
  return text;
}

}  // namespace container_detail

/// Checks the preamble and every section's framing and checksums, in an order that makes each
/// error name its real cause: the magic first (not a page file at all), then the version (a file
/// from a newer writer: kUnsupported, even if this reader could not parse the rest), then lengths
/// (truncated or oversized: every length is compared with the bytes actually there before it is
/// used), then checksums; reserved bytes and padding must be zero. Anything else malformed is
/// kInvalidArgument.
inline SectionBodies split_sections(std::span<const std::byte> file, std::string_view what) {
  using namespace container_detail;
  KVPACK_CHECK(file.size() >= 12 && std::memcmp(file.data(), kPageFileMagic.data(), kPageFileMagic.size()) == 0,
               kInvalidArgument,
               detail::message(what, " is not a kvpack page file (no \"KVPKPAGE\" magic in its first 8 bytes; ",
                               file.size(), " bytes)"));
  const std::uint32_t version = load_u32(file.data() + 8);
  KVPACK_CHECK(version == kPageFileVersion, kUnsupported,
               detail::message(what, " has page file version ", version, "; this build reads version ",
                               kPageFileVersion));
  KVPACK_CHECK(file.size() >= kPreambleBytes, kInvalidArgument,
               detail::message(what, " is truncated: ", file.size(), " bytes, shorter than the ", kPreambleBytes,
                               "-byte preamble"));
  KVPACK_CHECK(load_u32(file.data() + 24) == crc32c(file.first(24)), kInvalidArgument,
               detail::message(what, ": the preamble's checksum does not match (corrupted)"));
  KVPACK_CHECK(all_zero(file.subspan(28, kPreambleBytes - 28)), kInvalidArgument,
               detail::message(what, ": the preamble's reserved bytes [28, 64) are not zero"));
  const std::uint32_t sections = load_u32(file.data() + 12);
  const std::uint64_t declared = load_u64(file.data() + 16);
  KVPACK_CHECK(declared == file.size(), kInvalidArgument,
               detail::message(what, declared > file.size() ? " is truncated" : " has trailing bytes", ": it holds ",
                               file.size(), " bytes, its preamble says ", declared));
  KVPACK_CHECK(sections == kSectionOrder.size(), kInvalidArgument,
               detail::message(what, " declares ", sections, " sections; version 1 has exactly ", kSectionOrder.size()));

  std::span<const std::byte> bodies[kSectionOrder.size()];
  std::size_t at = kPreambleBytes;
  for (std::size_t i = 0; i < kSectionOrder.size(); ++i) {
    const auto expected = static_cast<std::uint32_t>(kSectionOrder[i]);
    KVPACK_CHECK(file.size() - at >= kSectionHeaderBytes, kInvalidArgument,
                 detail::message(what, " is truncated: section ", tag_text(expected), "'s header at offset ", at,
                                 " needs ", kSectionHeaderBytes, " bytes, ", file.size() - at, " left"));
    const std::byte* header = file.data() + at;
    KVPACK_CHECK(load_u32(header + 20) == crc32c(std::span<const std::byte>(header, 20)), kInvalidArgument,
                 detail::message(what, ": the header of section ", i, " (offset ", at,
                                 ") fails its checksum (corrupted)"));
    KVPACK_CHECK(all_zero(std::span(header + 4, 4)) && all_zero(std::span(header + 24, kSectionHeaderBytes - 24)),
                 kInvalidArgument, detail::message(what, ": section ", i, "'s reserved header bytes are not zero"));
    const std::uint32_t tag = load_u32(header);
    KVPACK_CHECK(tag == expected, kInvalidArgument,
                 detail::message(what, ": section ", i, " is \"", tag_text(tag), "\", expected \"",
                                 tag_text(expected), "\""));
    const std::uint64_t length = load_u64(header + 8);
    const std::size_t body_start = at + kSectionHeaderBytes;
    // Compared with what is left before any arithmetic on it, so 2^62 or 2^64 - 1 cannot wrap.
    KVPACK_CHECK(length <= file.size() - body_start, kInvalidArgument,
                 detail::message(what, ": section ", tag_text(tag), " declares ", length, " bytes, ",
                                 file.size() - body_start, " left in the file"));
    bodies[i] = file.subspan(body_start, static_cast<std::size_t>(length));
    KVPACK_CHECK(load_u32(header + 16) == crc32c(bodies[i]), kInvalidArgument,
                 detail::message(what, ": section ", tag_text(tag), " fails its checksum (corrupted)"));
    const std::size_t padded = (static_cast<std::size_t>(length) + kPageFileAlignment - 1) / kPageFileAlignment *
                               kPageFileAlignment;
    KVPACK_CHECK(padded <= file.size() - body_start, kInvalidArgument,
                 detail::message(what, " is truncated: section ", tag_text(tag), "'s padding runs past the end"));
    KVPACK_CHECK(all_zero(file.subspan(body_start + bodies[i].size(), padded - bodies[i].size())), kInvalidArgument,
                 detail::message(what, ": section ", tag_text(tag), "'s padding is not zero"));
    at = body_start + padded;
  }
  KVPACK_CHECK(at == file.size(), kInvalidArgument,
               detail::message(what, " has ", file.size() - at, " bytes after its last section"));
  return {bodies[0], bodies[1], bodies[2], bodies[3], bodies[4]};
}

}  // namespace kvpack::inline v0::io
