#pragma once
/// \file encoded_page.hpp
/// \brief EncodedPage and PageCheck: pages encoded elsewhere (a page file, a tier) handed to
///        KVCache::append_encoded_pages, and how much of them the cache verifies.

#include <cstddef>
#include <span>

namespace kvpack::inline v0 {

/// One page as a cache stores it: the payload (key plane, then the value plane at the cache's
/// value_plane_offset()) and the slot record (page_size int32 positions, then the live mask in
/// 64-bit words). A page file carries exactly these bytes.
struct EncodedPage {
  std::span<const std::byte> payload;
  std::span<const std::byte> slots;
};

/// What KVCache::append_encoded_pages verifies about a page's bytes beyond their structure
/// (sizes, positions, live mask), which it always checks. Each level includes the ones below it.
enum class PageCheck {
  /// Decoded and re-encoded, the page gives back its own bytes: it is exactly what this cache's
  /// encoder would store for those values, so the kernels read only what they were tested on.
  /// For bytes from anywhere. Codecs whose encoding is not a fixed point of decode-then-encode
  /// (KVQuant, TurboQuant, QJL: `kReencodeStable = false`) get kFinite's check and their own
  /// structural one (KVQuant's outlier sections) instead.
  kReencode,
  /// Every element decodes to a finite value. For bytes a kvpack cache wrote, guarded by a
  /// checksum on the way (a sealed tier entry, a page file), when re-encoding costs too much.
  kFinite,
  /// Nothing beyond the structure: the bytes are trusted as they are (the fastest restore).
  kStructure,
};

}  // namespace kvpack::inline v0
