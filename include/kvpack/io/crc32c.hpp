#pragma once
/// \file crc32c.hpp
/// \brief CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every section of
///        a page file: a software slicing-by-8 implementation and, on x86-64 CPUs with SSE4.2, the
///        crc32 instruction, chosen at run time.
///
/// CRC32C rather than CRC32 (zlib) because x86 and Arm both have an instruction for it, so the
/// check of a multi-gigabyte file at open costs about as much as reading it; and it detects every
/// burst error up to 32 bits, which a corrupted or truncated sector is.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KVPACK_CRC32C_HAS_SSE42 1
#else
#define KVPACK_CRC32C_HAS_SSE42 0
#endif

namespace kvpack::inline v0::io {

namespace crc32c_detail {

inline constexpr std::uint32_t kPolynomial = 0x82F63B78u;  // 0x1EDC6F41 bit-reversed

/// tables[k][b]: the CRC of byte b followed by k zero bytes, so eight bytes fold in one step.
inline constexpr std::array<std::array<std::uint32_t, 256>, 8> kTables = [] {
  std::array<std::array<std::uint32_t, 256>, 8> tables{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    tables[0][b] = crc;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) {
      tables[k][b] = (tables[k - 1][b] >> 8) ^ tables[0][tables[k - 1][b] & 0xFFu];
    }
  }
  return tables;
}();

/// Runs on the raw register value (already inverted).
inline std::uint32_t update_software(std::uint32_t crc, const std::byte* data, std::size_t size) noexcept {
  const auto& t = kTables;
  while (size >= 8) {
    std::uint64_t word;
    std::memcpy(&word, data, 8);  // little-endian: byte 0 in the low bits, as the tables expect
    word ^= crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^ t[4][(word >> 24) & 0xFF] ^
          t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^ t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    data += 8;
    size -= 8;
  }
  for (std::size_t i = 0; i < size; ++i) {
    crc = (crc >> 8) ^ t[0][(crc ^ static_cast<std::uint8_t>(data[i])) & 0xFFu];
  }
  return crc;
}

#if KVPACK_CRC32C_HAS_SSE42
__attribute__((target("sse4.2"))) inline std::uint32_t update_sse42(std::uint32_t crc, const std::byte* data,
                                                                     std::size_t size) noexcept {
  std::uint64_t c = crc;
  while (size >= 8) {
    std::uint64_t word;
    std::memcpy(&word, data, 8);
    c = _mm_crc32_u64(c, word);
    data += 8;
    size -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (std::size_t i = 0; i < size; ++i) c32 = _mm_crc32_u8(c32, static_cast<std::uint8_t>(data[i]));
  return c32;
}

inline bool cpu_has_sse42() noexcept {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace crc32c_detail

/// Which implementation computes the checksum; kAuto takes the instruction where the CPU has it.
enum class Crc32cImpl { kAuto, kSoftware };

/// Continues a CRC32C: `crc32c_extend(crc32c(a), b) == crc32c(a ++ b)`; the CRC of nothing is 0.
[[nodiscard]] inline std::uint32_t crc32c_extend(std::uint32_t crc, std::span<const std::byte> data,
                                                 Crc32cImpl impl = Crc32cImpl::kAuto) noexcept {
  std::uint32_t state = ~crc;
#if KVPACK_CRC32C_HAS_SSE42
  if (impl == Crc32cImpl::kAuto && crc32c_detail::cpu_has_sse42()) {
    return ~crc32c_detail::update_sse42(state, data.data(), data.size());
  }
#endif
  (void)impl;
  state = crc32c_detail::update_software(state, data.data(), data.size());
  return ~state;
}

/// CRC32C of `data` (the iSCSI / ext4 / RFC 3720 checksum: "123456789" gives 0xE3069283).
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> data, Crc32cImpl impl = Crc32cImpl::kAuto) noexcept {
  return crc32c_extend(0, data, impl);
}

}  // namespace kvpack::inline v0::io
