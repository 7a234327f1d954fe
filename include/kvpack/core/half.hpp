#pragma once
/// \file half.hpp
/// \brief 16-bit float storage types: IEEE binary16 (`half`) and bfloat16 (`bfloat16`).
///
/// Both are storage-only: arithmetic happens in float after the lossless implicit widening.
/// The conversions are written with integer operations on `std::bit_cast` bits so they are
/// constexpr, bit-exact on every host, and do not depend on F16C, `_Float16` or <cmath>.
///
/// binary16: 16 bits = sign(1) | exponent(5, bias 15) | mantissa(10). Max 65504, min normal
/// 2^-14, min subnormal 2^-24, IEEE inf/NaN.
/// bfloat16: 16 bits = sign(1) | exponent(8, bias 127) | mantissa(7): the top half of a float.

#include <bit>
#include <cstdint>
#include <type_traits>

#include "kvpack/config.hpp"

namespace kvpack::inline v0::detail {

/// Shifts `m` right by `shift` (1..31) bits, rounding to nearest with ties to even.
KVPACK_HOST_DEVICE constexpr std::uint32_t shift_right_rne(std::uint32_t m, int shift) noexcept {
  const std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((std::uint32_t{1} << shift) - 1u);
  const std::uint32_t half_ulp = std::uint32_t{1} << (shift - 1);
  return (rem > half_ulp || (rem == half_ulp && (q & 1u) != 0u)) ? q + 1u : q;
}

/// float -> binary16 bits, round to nearest even. Magnitudes >= 65520 (the midpoint between
/// 65504 and 2^16) become +-inf as IEEE rounding dictates; NaN stays a quiet NaN with its sign and
/// the top 9 payload bits.
KVPACK_HOST_DEVICE constexpr std::uint16_t float_to_half_bits(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {
    // Setting the quiet bit guarantees a NaN even when the kept payload bits are all zero.
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  }
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520, or inf
  if (a >= 0x38800000u) {
    // Normal result: rebias the exponent (127 -> 15) and round away the 13 low mantissa bits. A
    // mantissa carry correctly bumps the exponent, and 65520 was excluded above so it cannot
    // reach the inf code.
    const std::uint32_t rebiased = a - (std::uint32_t{127 - 15} << 23);
    return static_cast<std::uint16_t>(sign | shift_right_rne(rebiased, 13));
  }
  // |x| <= 2^-25 is at most half the smallest subnormal; the tie at exactly 2^-25 goes to even 0.
  if (a <= 0x33000000u) return sign;
  // Subnormal result: count units of 2^-24. |x| = m * 2^(e - 150) with e in [102, 112], so the
  // shift 126 - e lies in [14, 24]. A result of 0x400 is the smallest normal, encoded correctly.
  const std::uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const int shift = 126 - static_cast<int>(a >> 23);
  return static_cast<std::uint16_t>(sign | shift_right_rne(m, shift));
}

/// binary16 bits -> float. Exact for every pattern (float has a superset of the range).
KVPACK_HOST_DEVICE constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x03FFu;
  if (exp == 0x1Fu) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // inf, NaN
  if (exp != 0u) return std::bit_cast<float>(sign | ((exp + 127u - 15u) << 23) | (mant << 13));
  if (mant == 0u) return std::bit_cast<float>(sign);  // +-0
  // Subnormal mant * 2^-24: normalise so the leading one becomes the implicit bit.
  std::uint32_t e = 127u - 14u;
  while ((mant & 0x0400u) == 0u) {
    mant <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mant & 0x03FFu) << 13));
}

/// float -> bfloat16 bits: round to nearest even on the upper 16 bits. Floats above the midpoint
/// of the largest bfloat16 and 2^128 (including FLT_MAX) become inf; NaN stays a quiet NaN.
KVPACK_HOST_DEVICE constexpr std::uint16_t float_to_bfloat16_bits(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    // Truncation alone could drop every payload bit and produce inf; the quiet bit prevents that.
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  // Adding 0x7FFF plus the kept LSB rounds half to even; no overflow since u <= 0xFF800000.
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// bfloat16 bits -> float. Exact: bfloat16 is the top half of a float.
KVPACK_HOST_DEVICE constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace kvpack::inline v0::detail

namespace kvpack::inline v0 {

/// IEEE 754 binary16 storage type (16 bits: sign 1, exponent 5 with bias 15, mantissa 10).
/// Trivial so arrays of it can live in raw page memory and be memcpy'd.
struct half {
  std::uint16_t bits;  ///< the raw binary16 encoding

  half() = default;
  /// Rounds to nearest even; overflow gives +-inf, NaN stays NaN.
  KVPACK_HOST_DEVICE constexpr explicit half(float x) noexcept
      : bits(detail::float_to_half_bits(x)) {}
  /// Widening to float is exact, so it is implicit.
  KVPACK_HOST_DEVICE constexpr operator float() const noexcept {
    return detail::half_bits_to_float(bits);
  }
  /// Wraps a raw encoding without conversion.
  KVPACK_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    half h{};
    h.bits = b;
    return h;
  }
};

/// bfloat16 storage type (16 bits: sign 1, exponent 8 with bias 127, mantissa 7).
struct bfloat16 {
  std::uint16_t bits;  ///< the raw bfloat16 encoding (upper half of a float)

  bfloat16() = default;
  /// Rounds to nearest even; values past the largest bfloat16 midpoint give +-inf.
  KVPACK_HOST_DEVICE constexpr explicit bfloat16(float x) noexcept
      : bits(detail::float_to_bfloat16_bits(x)) {}
  /// Widening to float is exact, so it is implicit.
  KVPACK_HOST_DEVICE constexpr operator float() const noexcept {
    return detail::bfloat16_bits_to_float(bits);
  }
  /// Wraps a raw encoding without conversion.
  KVPACK_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 v{};
    v.bits = b;
    return v;
  }
};

static_assert(sizeof(half) == 2 && alignof(half) == 2);
static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
static_assert(std::is_trivially_copyable_v<half> &&
              std::is_trivially_default_constructible_v<half>);
static_assert(std::is_trivially_copyable_v<bfloat16> &&
              std::is_trivially_default_constructible_v<bfloat16>);
static_assert(std::is_standard_layout_v<half> && std::is_standard_layout_v<bfloat16>);

}  // namespace kvpack::inline v0
