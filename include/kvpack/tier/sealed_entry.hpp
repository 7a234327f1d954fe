#pragma once
/// \file sealed_entry.hpp
/// \brief The frame tiers outside the process (disk, Redis) put around each entry, so that a
///        half-written file, a flipped bit or an entry stored under another key is detected on
///        read instead of being handed to a cache.
///
/// Layout, little-endian, 24 bytes then the payload:
///   u64 magic "KVPTIER1" · u64 payload length · u32 CRC32C of the payload · u32 CRC32C of the key

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/io/crc32c.hpp"

namespace kvpack::inline v0::tier {

static_assert(std::endian::native == std::endian::little, "sealed entries are written in host order");

inline constexpr std::size_t kSealBytes = 24;
inline constexpr std::uint64_t kSealMagic = 0x315245495450564Bull;  // "KVPTIER1" read little-endian

namespace seal_detail {
[[nodiscard]] inline std::uint32_t key_crc(std::string_view key) noexcept {
  return io::crc32c(std::as_bytes(std::span<const char>(key.data(), key.size())));
}
}  // namespace seal_detail

/// `payload` framed for storage under `key`.
[[nodiscard]] inline std::vector<std::byte> seal(std::string_view key, std::span<const std::byte> payload) {
  std::vector<std::byte> out(kSealBytes + payload.size());
  const std::uint64_t length = payload.size();
  const std::uint32_t payload_crc = io::crc32c(payload);
  const std::uint32_t key_crc = seal_detail::key_crc(key);
  std::memcpy(out.data(), &kSealMagic, 8);
  std::memcpy(out.data() + 8, &length, 8);
  std::memcpy(out.data() + 16, &payload_crc, 4);
  std::memcpy(out.data() + 20, &key_crc, 4);
  if (!payload.empty()) std::memcpy(out.data() + kSealBytes, payload.data(), payload.size());
  return out;
}

/// The payload of a sealed entry read back under `key` (a view into `sealed`).
/// \throws kvpack::Error kInvalidArgument, naming `what`, for a frame that is not one, a length
///         that disagrees with the bytes present (a half-written entry), a payload checksum
///         mismatch or an entry sealed under another key.
[[nodiscard]] inline std::span<const std::byte> unseal(std::string_view key, std::span<const std::byte> sealed,
                                                       std::string_view what) {
  KVPACK_CHECK(sealed.size() >= kSealBytes, kInvalidArgument,
               detail::message(what, ": ", sealed.size(), " bytes, shorter than the ", kSealBytes,
                               "-byte frame (a write that did not finish?)"));
  std::uint64_t magic = 0;
  std::uint64_t length = 0;
  std::uint32_t payload_crc = 0;
  std::uint32_t key_crc = 0;
  std::memcpy(&magic, sealed.data(), 8);
  std::memcpy(&length, sealed.data() + 8, 8);
  std::memcpy(&payload_crc, sealed.data() + 16, 4);
  std::memcpy(&key_crc, sealed.data() + 20, 4);
  KVPACK_CHECK(magic == kSealMagic, kInvalidArgument, detail::message(what, ": not a kvpack tier entry (bad magic)"));
  const std::size_t present = sealed.size() - kSealBytes;
  KVPACK_CHECK(length == present, kInvalidArgument,
               detail::message(what, ": the frame declares ", length, " payload bytes, ", present,
                               " are present (a write that did not finish?)"));
  KVPACK_CHECK(key_crc == seal_detail::key_crc(key), kInvalidArgument,
               detail::message(what, ": the entry was stored under another key"));
  const std::span<const std::byte> payload = sealed.subspan(kSealBytes);
  KVPACK_CHECK(io::crc32c(payload) == payload_crc, kInvalidArgument,
               detail::message(what, ": payload checksum mismatch (the stored bytes changed)"));
  return payload;
}

}  // namespace kvpack::inline v0::tier
