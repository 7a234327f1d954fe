#pragma once
/// \file simd_compat.hpp
/// \brief Per-target loads that widen stored formats to fp32 lanes, and reductions xsimd 8.1
///        lacks.
///
/// xsimd 8.1 converts mixed-type loads through a stack buffer and std::copy, so every widening
/// load the kernels need is written here once per target with the instruction that does it
/// (vcvtph2ps, vpmovsxbd, ...). Overloads are picked the way xsimd picks its own kernels: the
/// last parameter is `requires_arch<X>`, and the most derived X the target inherits from wins.
/// Every function loads exactly `batch<float, A>::size` elements.

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::kernels::cpu::simd {

using xsimd::kernel::requires_arch;

template <class A>
using f32 = xsimd::batch<float, A>;
template <class A>
using i32 = xsimd::batch<std::int32_t, A>;

// --- fp16 -----------------------------------------------------------------------------------

/// fp16 bits to fp32 with integer operations only (no denormal fp32 arithmetic, so the result
/// is exact whatever the MXCSR flush settings are): the exponent is rebased, subnormals are
/// normalised by a float subtraction whose operands are normal, inf/NaN keep an all-ones exponent.
template <class A>
KVPACK_ALWAYS_INLINE f32<A> half_bits_to_f32(i32<A> h) noexcept {
  const i32<A> magnitude = (h & i32<A>(0x7FFF)) << 13;
  const i32<A> exponent = magnitude & i32<A>(0x7C00 << 13);
  i32<A> bits = magnitude + i32<A>((127 - 15) << 23);
  bits = xsimd::select(exponent == i32<A>(0x7C00 << 13), bits + i32<A>((128 - 16) << 23), bits);
  const f32<A> subnormal =
      xsimd::bitwise_cast<f32<A>>(bits + i32<A>(1 << 23)) - xsimd::bitwise_cast<f32<A>>(i32<A>(113 << 23));
  f32<A> value = xsimd::select(xsimd::bitwise_cast<f32<A>>(exponent) == f32<A>(0.0f), subnormal,
                               xsimd::bitwise_cast<f32<A>>(bits));
  return xsimd::bitwise_cast<f32<A>>(xsimd::bitwise_cast<i32<A>>(value) |
                                     ((h & i32<A>(0x8000)) << 16));
}

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_f16(const std::uint16_t* p, requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#if XSIMD_WITH_AVX2 && defined(__F16C__)
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_f16(const std::uint16_t* p, requires_arch<xsimd::avx2>) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#if XSIMD_WITH_SSE2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_f16(const std::uint16_t* p, requires_arch<xsimd::sse2>) noexcept {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return half_bits_to_f32<A>(i32<A>(_mm_unpacklo_epi16(raw, _mm_setzero_si128())));
}
#endif
/// `batch::size` fp16 values from `p` as fp32.
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_f16(const std::uint16_t* p) noexcept {
  return load_f16<A>(p, A{});
}

/// One fp16 value as fp32: F16C's conversion on the AVX2 and AVX-512 targets (built with F16C,
/// like load_f16); the portable one is a dozen integer operations.
template <class A>
KVPACK_ALWAYS_INLINE float f16_to_f32(std::uint16_t bits) noexcept {
#if defined(__F16C__)
  if constexpr (std::is_base_of_v<xsimd::avx2, A> || std::is_base_of_v<xsimd::avx512f, A>) return _cvtsh_ss(bits);
#endif
  return static_cast<float>(half::from_bits(bits));
}

// --- bfloat16: the upper half of an fp32 ----------------------------------------------------

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_bf16(const std::uint16_t* p, requires_arch<xsimd::avx512bw>) noexcept {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif
#if XSIMD_WITH_AVX2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_bf16(const std::uint16_t* p, requires_arch<xsimd::avx2>) noexcept {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif
#if XSIMD_WITH_SSE2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_bf16(const std::uint16_t* p, requires_arch<xsimd::sse2>) noexcept {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), raw));
}
#endif
/// `batch::size` bfloat16 values from `p` as fp32 (exact).
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_bf16(const std::uint16_t* p) noexcept {
  return load_bf16<A>(p, A{});
}

// --- packed b-bit codes to 32-bit lanes ---------------------------------------------------------
// `batch::size` consecutive b-bit codes (code j at bit b·j of the little-endian row) starting at
// code `first` (a multiple of 8), one per lane, built in registers: a vector assembled through a
// stack buffer stalls on store forwarding, which cost more than the rest of the unpacking.

/// `Bytes` (≤ 8) little-endian bytes as an integer, assembled from whole-width loads in registers.
template <int Bytes>
KVPACK_ALWAYS_INLINE std::uint64_t load_le(const std::byte* p) noexcept {
  if constexpr (Bytes == 8 || Bytes == 4 || Bytes == 2 || Bytes == 1) {
    using Word = std::conditional_t<Bytes == 8, std::uint64_t,
                                    std::conditional_t<Bytes == 4, std::uint32_t,
                                                       std::conditional_t<Bytes == 2, std::uint16_t, std::uint8_t>>>;
    Word word;
    std::memcpy(&word, p, sizeof(word));
    return word;
  } else {
    constexpr int kLow = Bytes > 4 ? 4 : (Bytes > 2 ? 2 : 1);
    return load_le<kLow>(p) | (load_le<Bytes - kLow>(p + kLow) << (8 * kLow));
  }
}

#if XSIMD_WITH_AVX512BW
/// For lane l of 16: the byte shuffle that brings bytes ⌊b·l/8⌋ and ⌊b·l/8⌋ + 1 of an 8-byte word
/// to the lane's bottom (-128: zero), and the shift that then aligns code l.
template <int Bits>
inline constexpr std::array<std::int8_t, 64> kCodeBytes = [] {
  std::array<std::int8_t, 64> index{};
  for (int l = 0; l < 16; ++l) {
    const int byte = Bits * l / 8;
    index[4 * l] = static_cast<std::int8_t>(byte);
    index[4 * l + 1] = static_cast<std::int8_t>(byte + 1 < 8 ? byte + 1 : -128);
    index[4 * l + 2] = index[4 * l + 3] = -128;
  }
  return index;
}();
template <int Bits>
KVPACK_ALWAYS_INLINE __m512i code_bytes() noexcept {
  return _mm512_loadu_si512(kCodeBytes<Bits>.data());
}
template <int Bits>
KVPACK_ALWAYS_INLINE __m512i code_shifts() noexcept {
  return _mm512_setr_epi32(0, Bits % 8, 2 * Bits % 8, 3 * Bits % 8, 4 * Bits % 8, 5 * Bits % 8, 6 * Bits % 8,
                           7 * Bits % 8, 8 * Bits % 8, 9 * Bits % 8, 10 * Bits % 8, 11 * Bits % 8, 12 * Bits % 8,
                           13 * Bits % 8, 14 * Bits % 8, 15 * Bits % 8);
}

template <int Bits, class A>
KVPACK_ALWAYS_INLINE i32<A> load_codes(const std::byte* row, std::int32_t first, requires_arch<xsimd::avx512bw>) noexcept {
  // 16 codes: 2·b ≤ 8 bytes, copied into every 8-byte half of the vector. One byte shuffle puts
  // the (at most two) bytes holding code l at the bottom of lane l, one shift per lane aligns it:
  // four operations instead of two 64-bit shifts and two narrowing moves.
  const std::uint64_t word = load_le<2 * Bits>(row + static_cast<std::size_t>(first / 8) * Bits);
  const __m512i bytes = _mm512_shuffle_epi8(_mm512_set1_epi64(static_cast<long long>(word)), code_bytes<Bits>());
  return _mm512_and_si512(_mm512_srlv_epi32(bytes, code_shifts<Bits>()), _mm512_set1_epi32((1 << Bits) - 1));
}
#endif
#if XSIMD_WITH_AVX2
template <int Bits, class A>
KVPACK_ALWAYS_INLINE i32<A> load_codes(const std::byte* row, std::int32_t first, requires_arch<xsimd::avx2>) noexcept {
  // 8 codes: b bytes.
  const auto word = static_cast<std::uint32_t>(load_le<Bits>(row + static_cast<std::size_t>(first / 8) * Bits));
  const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                                            _mm256_setr_epi32(0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits,
                                                              6 * Bits, 7 * Bits));
  return _mm256_and_si256(shifted, _mm256_set1_epi32((1 << Bits) - 1));
}
#endif
#if XSIMD_WITH_SSE2
template <int Bits, class A>
KVPACK_ALWAYS_INLINE i32<A> load_codes(const std::byte* row, std::int32_t first, requires_arch<xsimd::sse2>) noexcept {
  // The 8 codes around `first`; 4 lanes take half of them.
  const auto word = static_cast<std::uint32_t>(load_le<Bits>(row + static_cast<std::size_t>(first / 8) * Bits));
  const int base = first % 8;
  constexpr std::uint32_t kMask = (1u << Bits) - 1;
  return _mm_setr_epi32(static_cast<int>((word >> (Bits * base)) & kMask), static_cast<int>((word >> (Bits * (base + 1))) & kMask),
                        static_cast<int>((word >> (Bits * (base + 2))) & kMask), static_cast<int>((word >> (Bits * (base + 3))) & kMask));
}
#endif
template <int Bits, class A>
KVPACK_ALWAYS_INLINE i32<A> load_codes(const std::byte* row, std::int32_t first) noexcept {
  return load_codes<Bits, A>(row, first, A{});
}

// --- a 16-entry float table indexed per lane -------------------------------------------------

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE f32<A> lookup16(i32<A> index, const float* table, requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_permutexvar_ps(index, _mm512_loadu_ps(table));
}
#endif
#if XSIMD_WITH_AVX2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> lookup16(i32<A> index, const float* table, requires_arch<xsimd::avx2>) noexcept {
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), index);
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), index);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_cmpgt_epi32(index, _mm256_set1_epi32(7))));
}
#endif
#if XSIMD_WITH_SSE2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> lookup16(i32<A> index, const float* table, requires_arch<xsimd::sse2>) noexcept {
  alignas(16) std::int32_t lanes[4];
  index.store_aligned(lanes);
  return _mm_setr_ps(table[lanes[0]], table[lanes[1]], table[lanes[2]], table[lanes[3]]);
}
#endif
/// table[index] per lane; `table` holds 16 floats, every index is in [0, 16).
template <class A>
KVPACK_ALWAYS_INLINE f32<A> lookup16(i32<A> index, const float* table) noexcept {
  return lookup16<A>(index, table, A{});
}

// --- bytes to 32-bit lanes ------------------------------------------------------------------

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_i8(const std::int8_t* p, requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_u8(const std::uint8_t* p, requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#if XSIMD_WITH_AVX2
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_i8(const std::int8_t* p, requires_arch<xsimd::avx2>) noexcept {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_u8(const std::uint8_t* p, requires_arch<xsimd::avx2>) noexcept {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#endif
#if XSIMD_WITH_SSE2
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_i8(const std::int8_t* p, requires_arch<xsimd::sse2>) noexcept {
  std::int32_t four;
  std::memcpy(&four, p, sizeof(four));
  const __m128i bytes = _mm_cvtsi32_si128(four);
  // Place each byte at the top of a 32-bit lane, then shift it down arithmetically.
  const __m128i words = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes);
  return _mm_srai_epi32(_mm_unpacklo_epi16(_mm_setzero_si128(), words), 24);
}
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_u8(const std::uint8_t* p, requires_arch<xsimd::sse2>) noexcept {
  std::int32_t four;
  std::memcpy(&four, p, sizeof(four));
  const __m128i words = _mm_unpacklo_epi8(_mm_cvtsi32_si128(four), _mm_setzero_si128());
  return _mm_unpacklo_epi16(words, _mm_setzero_si128());
}
#endif
/// `batch::size` signed bytes from `p`, sign-extended to 32-bit lanes.
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_i8(const std::int8_t* p) noexcept {
  return load_i8<A>(p, A{});
}
/// `batch::size` unsigned bytes from `p`, zero-extended to 32-bit lanes.
template <class A>
KVPACK_ALWAYS_INLINE i32<A> load_u8(const std::uint8_t* p) noexcept {
  return load_u8<A>(p, A{});
}

// --- FP8 --------------------------------------------------------------------------------------
// E5M2 is the upper byte of an fp16. The 7 magnitude bits of E4M3FN, shifted into an fp16, are
// the value times 2^-8 (exponent bias 7 vs 15; subnormals map onto fp16 normals and subnormals);
// its only NaN is S.1111.111. So both decode exactly through the fp16 converter.

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e5m2(const std::uint8_t* p, requires_arch<xsimd::avx512bw>) noexcept {
  const __m256i code = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(code, 8));
}
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e4m3fn_over_256(const std::uint8_t* p, requires_arch<xsimd::avx512bw>) noexcept {
  const __m256i code = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(code, _mm256_set1_epi16(0x7F));
  __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                                 _mm256_slli_epi16(_mm256_and_si256(code, _mm256_set1_epi16(0x80)), 8));
  const __m256i is_nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F));
  half = _mm256_or_si256(half, _mm256_and_si256(is_nan, _mm256_set1_epi16(0x7E00)));
  return _mm512_cvtph_ps(half);
}
#endif
#if XSIMD_WITH_AVX2 && defined(__F16C__)
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e5m2(const std::uint8_t* p, requires_arch<xsimd::avx2>) noexcept {
  const __m128i code = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(code, 8));
}
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e4m3fn_over_256(const std::uint8_t* p, requires_arch<xsimd::avx2>) noexcept {
  const __m128i code = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_and_si128(code, _mm_set1_epi16(0x7F));
  __m128i half = _mm_or_si128(_mm_slli_epi16(magnitude, 7),
                              _mm_slli_epi16(_mm_and_si128(code, _mm_set1_epi16(0x80)), 8));
  const __m128i is_nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F));
  half = _mm_or_si128(half, _mm_and_si128(is_nan, _mm_set1_epi16(0x7E00)));
  return _mm256_cvtph_ps(half);
}
#endif
#if XSIMD_WITH_SSE2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e5m2(const std::uint8_t* p, requires_arch<xsimd::sse2>) noexcept {
  return half_bits_to_f32<A>(load_u8<A>(p) << 8);
}
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e4m3fn_over_256(const std::uint8_t* p, requires_arch<xsimd::sse2>) noexcept {
  const i32<A> code = load_u8<A>(p);
  const i32<A> magnitude = code & i32<A>(0x7F);
  i32<A> half = (magnitude << 7) | ((code & i32<A>(0x80)) << 8);
  half = xsimd::select(magnitude == i32<A>(0x7F), half | i32<A>(0x7E00), half);
  return half_bits_to_f32<A>(half);
}
#endif
/// `batch::size` E5M2 codes from `p` as fp32 (exact, inf and NaN included).
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e5m2(const std::uint8_t* p) noexcept {
  return load_e5m2<A>(p, A{});
}
/// `batch::size` E4M3FN codes from `p` as fp32 values times 2^-8 (exact, NaN included): callers
/// fold the 2^8 into the scale they apply anyway.
template <class A>
KVPACK_ALWAYS_INLINE f32<A> load_e4m3fn_over_256(const std::uint8_t* p) noexcept {
  return load_e4m3fn_over_256<A>(p, A{});
}

// --- broadcasts ---------------------------------------------------------------------------

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE f32<A> broadcast_quad(const float* p, requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
}
#endif
#if XSIMD_WITH_AVX2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> broadcast_quad(const float* p, requires_arch<xsimd::avx2>) noexcept {
  return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
}
#endif
#if XSIMD_WITH_SSE2
template <class A>
KVPACK_ALWAYS_INLINE f32<A> broadcast_quad(const float* p, requires_arch<xsimd::sse2>) noexcept {
  return _mm_loadu_ps(p);
}
#endif
/// The four floats p[0..3] repeated across the vector.
template <class A>
KVPACK_ALWAYS_INLINE f32<A> broadcast_quad(const float* p) noexcept {
  return broadcast_quad<A>(p, A{});
}

// --- reductions ---------------------------------------------------------------------------

/// Horizontal sum (xsimd 8.1 calls it hadd; 9.0 renamed it reduce_add).
template <class A>
KVPACK_ALWAYS_INLINE float reduce_sum(f32<A> x) noexcept {
  return xsimd::hadd(x);
}

/// Horizontal maximum; xsimd 8.1 has no reduce_max.
template <class A>
KVPACK_ALWAYS_INLINE float reduce_max(f32<A> x) noexcept {
  alignas(64) float lanes[f32<A>::size];
  x.store_aligned(lanes);
  float best = lanes[0];
  for (std::size_t i = 1; i < f32<A>::size; ++i) best = lanes[i] > best ? lanes[i] : best;
  return best;
}

// --- masks --------------------------------------------------------------------------------

#if XSIMD_WITH_AVX512BW
/// Lanes [0, n) of a 16-lane vector (all of them for n ≥ 16): a row's last, partial vector.
template <class A>
KVPACK_ALWAYS_INLINE __mmask16 first_lanes(index_t n) noexcept {
  return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}
#endif

}  // namespace kvpack::inline v0::kernels::cpu::simd
