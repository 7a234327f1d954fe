#pragma once
// Edits of valid page files for the bad-input tests: locate sections, re-seal checksums after a
// byte was changed on purpose (so that a test reaches the check behind the checksum), and rebuild
// a file with one section's body replaced.

#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <vector>

#include "kvpack/io/page_file_container.hpp"
#include "kvpack/io/page_file_header_io.hpp"

namespace kvpack::test {

/// Where one section of a file lies.
struct SectionAt {
  std::size_t header = 0;  ///< offset of its 64-byte header
  std::size_t body = 0;    ///< offset of its body
  std::size_t length = 0;  ///< body bytes
};

/// The five sections of a well-formed file, found by walking the declared lengths.
inline std::vector<SectionAt> sections_of(std::span<const std::byte> file) {
  std::vector<SectionAt> out;
  std::size_t at = io::kPreambleBytes;
  for (std::size_t i = 0; i < io::kSectionOrder.size(); ++i) {
    std::uint64_t length;
    std::memcpy(&length, file.data() + at + 8, 8);
    out.push_back({at, at + io::kSectionHeaderBytes, static_cast<std::size_t>(length)});
    at += io::kSectionHeaderBytes + (length + 63) / 64 * 64;
  }
  return out;
}

inline void store_u32(std::vector<std::byte>& file, std::size_t at, std::uint32_t v) { std::memcpy(file.data() + at, &v, 4); }
inline void store_u64(std::vector<std::byte>& file, std::size_t at, std::uint64_t v) { std::memcpy(file.data() + at, &v, 8); }

/// Recomputes the preamble's checksum, and the checksums of every section whose declared
/// length still fits the file (the others are left for the reader to reject).
inline void reseal(std::vector<std::byte>& file) {
  const std::span<const std::byte> all(file);
  store_u32(file, 24, io::crc32c(all.first(24)));
  std::size_t at = io::kPreambleBytes;
  for (std::size_t i = 0; i < io::kSectionOrder.size() && at + io::kSectionHeaderBytes <= file.size(); ++i) {
    std::uint64_t length;
    std::memcpy(&length, file.data() + at + 8, 8);
    const std::size_t body = at + io::kSectionHeaderBytes;
    if (length <= file.size() - body) store_u32(file, at + 16, io::crc32c(all.subspan(body, length)));
    store_u32(file, at + 20, io::crc32c(all.subspan(at, 20)));
    if (length > file.size() - body) break;
    at = body + (length + 63) / 64 * 64;
  }
}

/// The same file with section `index`'s body replaced by `edit(old body)`, well framed and sealed.
inline std::vector<std::byte> with_section(std::span<const std::byte> file, std::size_t index,
                                           const std::function<std::vector<std::byte>(std::vector<std::byte>)>& edit) {
  const std::vector<SectionAt> at = sections_of(file);
  io::ContainerWriter out;
  for (std::size_t i = 0; i < at.size(); ++i) {
    out.begin_section(io::kSectionOrder[i]);
    std::vector<std::byte> body(file.begin() + at[i].body, file.begin() + at[i].body + at[i].length);
    if (i == index) body = edit(std::move(body));
    out.body().insert(out.body().end(), body.begin(), body.end());
    out.end_section();
  }
  return std::move(out).finish();
}

/// The same file with META re-encoded after `edit` changed its header.
inline std::vector<std::byte> with_header(std::span<const std::byte> file,
                                          const std::function<void(io::PageFileHeader&)>& edit) {
  return with_section(file, 0, [&](std::vector<std::byte> body) {
    io::PageFileHeader h = io::read_meta(body, "test");
    edit(h);
    std::vector<std::byte> out;
    io::ByteSink sink(out);
    io::write_meta(sink, h);
    return out;
  });
}

}  // namespace kvpack::test
