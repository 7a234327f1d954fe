#pragma once
/// \file packed_codes.hpp
/// \brief Writing bit-packed code rows (KIVI's and KVQuant's planes): element j at bit Bits·j,
///        little end first.

#include <cstddef>
#include <cstdint>

#include "kvpack/config.hpp"
#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::quant {

/// Writes elements [first, first + count) of a packed row, `code_of(j)` giving element j's code
/// (below 2^Bits); first and count are multiples of 8 (rows are whole pages of 16 tokens or groups
/// of 8 channels). Eight codes fill Bits whole bytes, so each byte is stored once rather than
/// or-ed in code by code, a read-modify-write the next code waits on.
template <int Bits, class CodeOf>
KVPACK_HOST_DEVICE void put_codes(std::byte* row, index_t first, index_t count, CodeOf code_of) noexcept {
  static_assert(Bits >= 1 && Bits <= 4, "eight codes must fit a 32-bit word");
  for (index_t j = first; j < first + count; j += 8) {
    std::uint32_t word = 0;
    for (int k = 0; k < 8; ++k) word |= static_cast<std::uint32_t>(code_of(j + k)) << (Bits * k);
    std::byte* out = row + static_cast<std::size_t>(j) / 8 * Bits;
    for (int b = 0; b < Bits; ++b) out[b] = static_cast<std::byte>(word >> (8 * b));
  }
}

}  // namespace kvpack::inline v0::quant
