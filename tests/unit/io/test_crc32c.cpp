// CRC32C against published check values (RFC 3720 appendix B.4, and the catalogue's "123456789"),
// for the software tables and the SSE4.2 instruction alike.

#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "kvpack/io/crc32c.hpp"

namespace {

using kvpack::io::Crc32cImpl;

std::vector<std::byte> bytes_of(std::initializer_list<int> list) {
  std::vector<std::byte> out;
  for (const int b : list) out.push_back(static_cast<std::byte>(b));
  return out;
}
std::vector<std::byte> filled(std::size_t n, int (*at)(std::size_t)) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>(at(i));
  return out;
}

}  // namespace

TEST_CASE("CRC32C matches the published check values", "[io][crc32c]") {
  const auto impl = GENERATE(Crc32cImpl::kAuto, Crc32cImpl::kSoftware);
  const std::string_view digits = "123456789";
  CHECK(kvpack::io::crc32c(std::as_bytes(std::span(digits.data(), digits.size())), impl) == 0xE3069283u);
  CHECK(kvpack::io::crc32c({}, impl) == 0u);
  // RFC 3720, B.4: 32 bytes of zeros, of ones, incrementing and decrementing.
  CHECK(kvpack::io::crc32c(filled(32, [](std::size_t) { return 0; }), impl) == 0x8A9136AAu);
  CHECK(kvpack::io::crc32c(filled(32, [](std::size_t) { return 0xFF; }), impl) == 0x62A8AB43u);
  CHECK(kvpack::io::crc32c(filled(32, [](std::size_t i) { return static_cast<int>(i); }), impl) == 0x46DD794Eu);
  CHECK(kvpack::io::crc32c(filled(32, [](std::size_t i) { return static_cast<int>(31 - i); }), impl) == 0x113FDB5Cu);
  // RFC 3720, B.4: an iSCSI read command PDU.
  const std::vector<std::byte> pdu = bytes_of({0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                               0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
                                               0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
                                               0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
  CHECK(kvpack::io::crc32c(pdu, impl) == 0xD9963A56u);
}

TEST_CASE("CRC32C extends across splits at any offset and alignment", "[io][crc32c]") {
  std::mt19937 rng(3);
  std::vector<std::byte> data(1000);
  for (auto& b : data) b = static_cast<std::byte>(rng() & 0xFF);
  const std::uint32_t whole = kvpack::io::crc32c(data, Crc32cImpl::kSoftware);
  for (std::size_t start = 0; start < 9; ++start) {
    for (std::size_t split = start; split < data.size(); split += 97) {
      const std::span<const std::byte> all(data);
      const std::uint32_t first = kvpack::io::crc32c(all.subspan(start, split - start));
      CHECK(kvpack::io::crc32c_extend(first, all.subspan(split)) ==
            kvpack::io::crc32c(all.subspan(start), Crc32cImpl::kSoftware));
    }
  }
  CHECK(kvpack::io::crc32c(data) == whole);  // the instruction, where there is one, agrees
}
