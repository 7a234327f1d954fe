#pragma once
/// \file fp8.hpp
/// \brief OCP 8-bit float storage types, with the variant in the name: `fp8_e4m3fn`, `fp8_e5m2`.
///
/// E4M3FN (8 bits: sign 1 | exponent 4, bias 7 | mantissa 3): no infinities; the only NaN codes
/// are S.1111.111 (0x7F, 0xFF); max finite 448 (0x7E); min normal 2^-6; min subnormal 2^-9.
/// This is the OCP/NVIDIA "FN" variant, not AMD's FNUZ (bias 8, max 240).
///
/// E5M2 (8 bits: sign 1 | exponent 5, bias 15 | mantissa 2): IEEE-style, exponent 31 holds
/// +-inf (0x7C, 0xFC) and NaN (mantissa != 0); max finite 57344 (0x7B); min normal 2^-14; min
/// subnormal 2^-16.
///
/// Encoding (float -> fp8) is round to nearest, ties to even, with *satfinite* saturation, the
/// behaviour of the vLLM KV-cache store (CUDA `__NV_SATFINITE`):
/// - a finite value whose rounded magnitude would exceed max, and +-inf, become +-max;
/// - NaN becomes NaN (E4M3FN: 0x7F | sign; E5M2: the quiet NaN 0x7E | sign);
/// - subnormal results are rounded to nearest even as well, so magnitudes up to half the
///   smallest subnormal (the tie included) become a zero that keeps the input's sign.
/// Decoding (fp8 -> float) is exact for every code; NaN codes decode to a quiet float NaN with
/// the code's sign, E5M2 inf codes to +-inf.
///
/// All conversions are constexpr integer code on `std::bit_cast` bits: portable and bit-exact.

#include <bit>
#include <cstdint>
#include <type_traits>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"  // detail::shift_right_rne

namespace kvpack::inline v0::detail {

/// Satfinite RNE float -> fp8 for a format with `MantBits` mantissa bits and exponent bias
/// `Bias`. `max_code` is the largest finite positive code; `nan_code` the positive NaN code.
template <int MantBits, int Bias>
KVPACK_HOST_DEVICE constexpr std::uint8_t float_to_fp8_satfinite(float x, std::uint8_t max_code,
                                                                 std::uint8_t nan_code) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint8_t>(sign | nan_code);
  if (a == 0x7F800000u) return static_cast<std::uint8_t>(sign | max_code);  // satfinite: inf
  constexpr std::uint32_t kMinNormalBits = std::uint32_t{127 + 1 - Bias} << 23;
  if (a >= kMinNormalBits) {
    // Rebias the exponent and round off the low 23 - MantBits mantissa bits; a carry bumps the
    // exponent. Anything that rounds past max_code (including E4M3FN's NaN slot 0x7F and E5M2's
    // inf/NaN codes) is clamped, which is exactly satfinite.
    const std::uint32_t rebiased = a - (std::uint32_t{127 - Bias} << 23);
    const std::uint32_t r = shift_right_rne(rebiased, 23 - MantBits);
    return static_cast<std::uint8_t>(sign | (r > max_code ? max_code : r));
  }
  // Half the smallest subnormal, 2^(-Bias - MantBits); the tie itself rounds to even zero.
  constexpr std::uint32_t kHalfMinSubnormalBits = std::uint32_t{127 - Bias - MantBits} << 23;
  if (a <= kHalfMinSubnormalBits) return sign;
  // Subnormal result: count units of 2^(1 - Bias - MantBits). |x| = m * 2^(e - 150), and the
  // bounds above keep the shift within [21, 24] for both formats. A result of 1 << MantBits is
  // the smallest normal, encoded correctly.
  const std::uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const int shift = 151 - Bias - MantBits - static_cast<int>(a >> 23);
  return static_cast<std::uint8_t>(sign | shift_right_rne(m, shift));
}

/// Exact fp8 -> float for finite codes (normal, subnormal, zero) of a format with `MantBits`
/// mantissa bits and bias `Bias`. Callers handle the format's special codes first.
template <int MantBits, int Bias>
KVPACK_HOST_DEVICE constexpr float fp8_finite_bits_to_float(std::uint8_t b) noexcept {
  constexpr std::uint32_t kMantMask = (std::uint32_t{1} << MantBits) - 1u;
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t exp = static_cast<std::uint32_t>(b & 0x7Fu) >> MantBits;
  std::uint32_t mant = b & kMantMask;
  if (exp != 0u) {
    return std::bit_cast<float>(sign | ((exp + 127u - Bias) << 23) | (mant << (23 - MantBits)));
  }
  if (mant == 0u) return std::bit_cast<float>(sign);  // +-0
  // Subnormal: normalise so the leading one becomes float's implicit bit.
  std::uint32_t e = 127u + 1u - Bias;
  while ((mant & (kMantMask + 1u)) == 0u) {
    mant <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mant & kMantMask) << (23 - MantBits)));
}

/// float -> E4M3FN bits: RNE, satfinite (+-inf and overflow -> +-448), NaN -> 0x7F | sign.
KVPACK_HOST_DEVICE constexpr std::uint8_t float_to_e4m3fn_bits(float x) noexcept {
  return float_to_fp8_satfinite<3, 7>(x, 0x7E, 0x7F);
}

/// E4M3FN bits -> float, exact. 0x7F / 0xFF decode to a quiet NaN; there is no infinity.
KVPACK_HOST_DEVICE constexpr float e4m3fn_bits_to_float(std::uint8_t b) noexcept {
  if ((b & 0x7Fu) == 0x7Fu) {
    return std::bit_cast<float>(((std::uint32_t{b} & 0x80u) << 24) | 0x7FC00000u);
  }
  return fp8_finite_bits_to_float<3, 7>(b);
}

/// float -> E5M2 bits: RNE, satfinite (+-inf and overflow -> +-57344), NaN -> 0x7E | sign.
KVPACK_HOST_DEVICE constexpr std::uint8_t float_to_e5m2_bits(float x) noexcept {
  return float_to_fp8_satfinite<2, 15>(x, 0x7B, 0x7E);
}

/// E5M2 bits -> float, exact. Exponent 31 decodes to +-inf (mantissa 0) or a quiet NaN that
/// keeps the code's sign and mantissa as payload.
KVPACK_HOST_DEVICE constexpr float e5m2_bits_to_float(std::uint8_t b) noexcept {
  if ((b & 0x7Cu) == 0x7Cu) {
    const std::uint32_t sign = (std::uint32_t{b} & 0x80u) << 24;
    const std::uint32_t mant = b & 0x03u;
    return std::bit_cast<float>(sign | 0x7F800000u |
                                (mant != 0u ? 0x00400000u | (mant << 21) : 0u));
  }
  return fp8_finite_bits_to_float<2, 15>(b);
}

}  // namespace kvpack::inline v0::detail

namespace kvpack::inline v0 {

/// OCP FP8 E4M3FN storage type (8 bits: sign 1, exponent 4 with bias 7, mantissa 3; no inf,
/// NaN = S.1111.111). See the file comment for the satfinite rounding rules.
struct fp8_e4m3fn {
  std::uint8_t bits;  ///< the raw E4M3FN encoding

  static constexpr float kMax = 448.0f;           ///< largest finite magnitude
  static constexpr std::uint8_t kMaxBits = 0x7E;  ///< code of +kMax
  static constexpr std::uint8_t kNanBits = 0x7F;  ///< code of the positive NaN

  fp8_e4m3fn() = default;
  /// RNE with satfinite saturation: overflow and +-inf give +-448, NaN gives NaN.
  KVPACK_HOST_DEVICE constexpr explicit fp8_e4m3fn(float x) noexcept
      : bits(detail::float_to_e4m3fn_bits(x)) {}
  /// Widening to float is exact, so it is implicit.
  KVPACK_HOST_DEVICE constexpr operator float() const noexcept {
    return detail::e4m3fn_bits_to_float(bits);
  }
  /// Wraps a raw encoding without conversion.
  KVPACK_HOST_DEVICE static constexpr fp8_e4m3fn from_bits(std::uint8_t b) noexcept {
    fp8_e4m3fn v{};
    v.bits = b;
    return v;
  }
  /// True for the two NaN codes 0x7F and 0xFF.
  [[nodiscard]] KVPACK_HOST_DEVICE constexpr bool is_nan() const noexcept {
    return (bits & 0x7Fu) == kNanBits;
  }
};

/// OCP FP8 E5M2 storage type (8 bits: sign 1, exponent 5 with bias 15, mantissa 2; IEEE-style
/// inf and NaN in exponent 31). See the file comment for the satfinite rounding rules.
struct fp8_e5m2 {
  std::uint8_t bits;  ///< the raw E5M2 encoding

  static constexpr float kMax = 57344.0f;         ///< largest finite magnitude
  static constexpr std::uint8_t kMaxBits = 0x7B;  ///< code of +kMax
  static constexpr std::uint8_t kInfBits = 0x7C;  ///< code of +inf (never produced by encoding)
  static constexpr std::uint8_t kNanBits = 0x7E;  ///< quiet NaN code produced for NaN input

  fp8_e5m2() = default;
  /// RNE with satfinite saturation: overflow and +-inf give +-57344, NaN gives NaN.
  KVPACK_HOST_DEVICE constexpr explicit fp8_e5m2(float x) noexcept
      : bits(detail::float_to_e5m2_bits(x)) {}
  /// Widening to float is exact, so it is implicit.
  KVPACK_HOST_DEVICE constexpr operator float() const noexcept {
    return detail::e5m2_bits_to_float(bits);
  }
  /// Wraps a raw encoding without conversion.
  KVPACK_HOST_DEVICE static constexpr fp8_e5m2 from_bits(std::uint8_t b) noexcept {
    fp8_e5m2 v{};
    v.bits = b;
    return v;
  }
  /// True for the NaN codes: exponent 31 with a nonzero mantissa.
  [[nodiscard]] KVPACK_HOST_DEVICE constexpr bool is_nan() const noexcept {
    return (bits & 0x7Cu) == 0x7Cu && (bits & 0x03u) != 0u;
  }
  /// True for +-inf (0x7C, 0xFC).
  [[nodiscard]] KVPACK_HOST_DEVICE constexpr bool is_inf() const noexcept {
    return (bits & 0x7Fu) == kInfBits;
  }
};

static_assert(sizeof(fp8_e4m3fn) == 1 && sizeof(fp8_e5m2) == 1);
static_assert(std::is_trivially_copyable_v<fp8_e4m3fn> &&
              std::is_trivially_default_constructible_v<fp8_e4m3fn>);
static_assert(std::is_trivially_copyable_v<fp8_e5m2> &&
              std::is_trivially_default_constructible_v<fp8_e5m2>);
static_assert(std::is_standard_layout_v<fp8_e4m3fn> && std::is_standard_layout_v<fp8_e5m2>);

}  // namespace kvpack::inline v0
