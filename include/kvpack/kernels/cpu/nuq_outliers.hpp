#pragma once
/// \file nuq_outliers.hpp
/// \brief The exact outliers of a quant::KVQuant page in the fused kernels (kvquant.hpp): each
///        one corrects a score or a value sum by its multiplier times x − x̂, where x̂ is what the
///        codes alone decode to.
///
/// One at a time (every ISA), or on AVX-512 sixteen and on AVX2 eight at a time: the outliers'
/// positions, codes, ranges and exact values are gathered into vectors, and each correction is
/// then added for all heads at once into a head-minor [position][group] copy of the target, so
/// that one vector multiply-add serves a block of heads. The one-at-a-time form spends a scalar
/// multiply-add per head besides decoding the outlier, about as many instructions per page as the
/// integer products themselves at the default 1 % of outliers (on AVX2, a quarter to a third of
/// KVQuant-4's kernel time). On the AVX2 host measured (Zen 3) the eight-lane form was no faster
/// than that scalar loop for 4- and 2-bit pages (its three gathers per eight outliers), and
/// faster for 3-bit ones; it was kept for one flow on both ISAs (README, "KVQuant-3 and the
/// outlier corrections on AVX2").

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/integer_avx2.hpp"
#include "kvpack/kernels/cpu/integer_common.hpp"
#include "kvpack/quant/kvquant.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Calls f(t, c, exact) for each outlier a page's section holds. The index t·head_dim + c is
/// split by a multiply instead of a division: with c = ⌈2³²/d⌉, ⌊n/d⌋ = ⌊c·n/2³²⌋ exactly for
/// 16-bit n and d (Lemire, Kaser & Kurz, "Faster remainder by direct computation", 2019).
template <class A, class F>
KVPACK_ALWAYS_INLINE void for_each_nuq_outlier(const std::byte* section, std::size_t capacity, index_t head_dim,
                                               F&& f) noexcept {
  using quant::kvquant_detail::get_u16;
  const std::size_t count = std::min<std::size_t>(get_u16(section), capacity);
  const std::uint64_t magic = UINT64_C(0xFFFFFFFF) / static_cast<std::uint64_t>(head_dim) + 1;
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t index = get_u16(section + 2 + 2 * i);
    const auto t = static_cast<index_t>((index * magic) >> 32);
    f(t, static_cast<index_t>(index) - t * head_dim, simd::f16_to_f32<A>(get_u16(section + 2 + 2 * capacity + 2 * i)));
  }
}

/// Writes the page's exact outliers over a decoded tile, element (t, c) at tile[t·t_stride + c·c_stride].
template <class A>
KVPACK_ALWAYS_INLINE void apply_nuq_outliers(const std::byte* section, std::size_t capacity, index_t head_dim,
                                             float* tile, std::size_t t_stride, std::size_t c_stride) noexcept {
  for_each_nuq_outlier<A>(section, capacity, head_dim, [&](index_t t, index_t c, float exact) {
    tile[static_cast<std::size_t>(t) * t_stride + static_cast<std::size_t>(c) * c_stride] = exact;
  });
}

/// Whether A adds the outliers' corrections vectors at a time, head-minor (below).
template <class A>
inline constexpr bool kNuqOutlierVectors =
#if KVPACK_KERNELS_HAVE_VNNI
    std::is_same_v<A, xsimd::avx512bw> ||
#endif
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
    std::is_same_v<A, avx2_arch> ||
#endif
    false;

#if KVPACK_KERNELS_HAVE_AVX2_INTEGER

/// How the outliers of one page meet a fused kernel. The plane's codes are stored in rows (keys:
/// one per channel, values: one per token); outlier (t, c) sits in row r and column k of them and
/// is decoded as ℓ(code)·range[r] + offset[r]. Its correction x − x̂ times multiplier[r][h] is
/// added to target[k][h] for every head h (keys: multiplier the query, target the token's score;
/// values: multiplier the token's weight, target the channel's sum).
struct NuqOutlierTarget {
  const std::byte* codes;          ///< the plane's packed rows
  std::size_t row_bytes;
  bool rows_are_channels;          ///< keys: r = c, k = t; values: r = t, k = c
  const float* levels;             ///< 16 lanes, NuqLevels
  const float* range;              ///< [rows]
  const float* offset;             ///< [rows]
  const float* multiplier;         ///< [rows][group]
  float* target;                   ///< [columns][group]
  index_t group;
};

/// target[k] += multiplier[r] · correction over a block of kG heads, one vector operation.
template <int kG>
KVPACK_ALWAYS_INLINE void add_to_heads(const float* multiplier, float correction, float* target) noexcept {
  if constexpr (kG == 8) {
    _mm256_storeu_ps(target, _mm256_fmadd_ps(_mm256_loadu_ps(multiplier), _mm256_set1_ps(correction),
                                             _mm256_loadu_ps(target)));
  } else if constexpr (kG == 4) {
    _mm_storeu_ps(target, _mm_fmadd_ps(_mm_loadu_ps(multiplier), _mm_set1_ps(correction), _mm_loadu_ps(target)));
  } else {
    for (int h = 0; h < kG; ++h) target[h] += multiplier[h] * correction;
  }
}

/// target[column_at[j] + h] += multiplier[row_at[j] + h] · correction[j] for j < n and the kG
/// heads from h0 (offsets already scaled by the group).
template <int kG>
KVPACK_ALWAYS_INLINE void add_outliers_to_heads(index_t n, const std::int32_t* row_at, const std::int32_t* column_at,
                                                const float* correction, const NuqOutlierTarget& to,
                                                index_t h0) noexcept {
  for (index_t j = 0; j < n; ++j) {
    add_to_heads<kG>(to.multiplier + row_at[j] + h0, correction[j], to.target + column_at[j] + h0);
  }
}

/// dst[t·group + h] = src[h·src_stride + t] for t < count: the page's weights or the call's
/// queries turned head-minor. Four heads (the common GQA ratio) in 4×4 blocks of registers, 16
/// tokens at a time on AVX-512 and 8 on AVX2; any other group one element at a time.
template <class A>
KVPACK_ALWAYS_INLINE void to_head_minor(A, const float* src, std::size_t src_stride, index_t group, index_t count,
                                        float* dst) noexcept {
  index_t t = 0;
  if constexpr (std::is_same_v<A, avx2_arch>) {
    for (; group == 4 && t + 8 <= count; t += 8) {
      const float* at = src + t;
      const __m256 r0 = _mm256_loadu_ps(at), r1 = _mm256_loadu_ps(at + src_stride);
      const __m256 r2 = _mm256_loadu_ps(at + 2 * src_stride), r3 = _mm256_loadu_ps(at + 3 * src_stride);
      // Within each 128-bit lane L, o_j holds token 4L + j of the four heads ...
      const __m256 a = _mm256_unpacklo_ps(r0, r1), b = _mm256_unpackhi_ps(r0, r1);
      const __m256 c = _mm256_unpacklo_ps(r2, r3), d = _mm256_unpackhi_ps(r2, r3);
      const __m256 o0 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(c)));
      const __m256 o1 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(c)));
      const __m256 o2 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b), _mm256_castps_pd(d)));
      const __m256 o3 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b), _mm256_castps_pd(d)));
      // ... and pairing the lanes puts tokens 2m, 2m + 1 in output vector m.
      float* out = dst + 4 * t;
      _mm256_storeu_ps(out, _mm256_permute2f128_ps(o0, o1, 0x20));
      _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(o2, o3, 0x20));
      _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(o0, o1, 0x31));
      _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(o2, o3, 0x31));
    }
  }
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    for (; group == 4 && t + 16 <= count; t += 16) {
      const float* at = src + t;
      const __m512 r0 = _mm512_loadu_ps(at), r1 = _mm512_loadu_ps(at + src_stride);
      const __m512 r2 = _mm512_loadu_ps(at + 2 * src_stride), r3 = _mm512_loadu_ps(at + 3 * src_stride);
      // Within each 128-bit lane L, o_j holds token 4L + j of the four heads ...
      const __m512 a = _mm512_unpacklo_ps(r0, r1), b = _mm512_unpackhi_ps(r0, r1);
      const __m512 c = _mm512_unpacklo_ps(r2, r3), d = _mm512_unpackhi_ps(r2, r3);
      const __m512 o0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(c)));
      const __m512 o1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(c)));
      const __m512 o2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b), _mm512_castps_pd(d)));
      const __m512 o3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b), _mm512_castps_pd(d)));
      // ... and a 4×4 transpose of the lanes puts tokens 4m .. 4m + 3 in output vector m.
      const __m512 p0 = _mm512_shuffle_f32x4(o0, o1, 0x44), p1 = _mm512_shuffle_f32x4(o2, o3, 0x44);
      const __m512 p2 = _mm512_shuffle_f32x4(o0, o1, 0xEE), p3 = _mm512_shuffle_f32x4(o2, o3, 0xEE);
      float* out = dst + 4 * t;
      _mm512_storeu_ps(out, _mm512_shuffle_f32x4(p0, p1, 0x88));
      _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(p0, p1, 0xDD));
      _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(p2, p3, 0x88));
      _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(p2, p3, 0xDD));
    }
  }
#endif
  for (; t < count; ++t) {
    for (index_t h = 0; h < group; ++h) dst[t * group + h] = src[h * src_stride + t];
  }
}

/// dst[h·dst_stride + t] += src[t·group + h] for t < count: head-minor corrections added back to
/// the kernel's head-major scores or sums. The inverse of to_head_minor's blocks for four heads.
template <class A>
KVPACK_ALWAYS_INLINE void add_head_minor(A, const float* src, index_t group, index_t count, float* dst,
                                         std::size_t dst_stride) noexcept {
  index_t t = 0;
  if constexpr (std::is_same_v<A, avx2_arch>) {
    for (; group == 4 && t + 8 <= count; t += 8) {
      const float* in = src + 4 * t;
      const __m256 i0 = _mm256_loadu_ps(in), i1 = _mm256_loadu_ps(in + 8);
      const __m256 i2 = _mm256_loadu_ps(in + 16), i3 = _mm256_loadu_ps(in + 24);
      // Lane L of o_j: token 4L + j of the four heads, as in to_head_minor ...
      const __m256 o0 = _mm256_permute2f128_ps(i0, i2, 0x20), o1 = _mm256_permute2f128_ps(i0, i2, 0x31);
      const __m256 o2 = _mm256_permute2f128_ps(i1, i3, 0x20), o3 = _mm256_permute2f128_ps(i1, i3, 0x31);
      // ... then the 4×4 transposes inside the lanes give each head's 8 tokens.
      const __m256 a = _mm256_unpacklo_ps(o0, o1), b = _mm256_unpackhi_ps(o0, o1);
      const __m256 c = _mm256_unpacklo_ps(o2, o3), d = _mm256_unpackhi_ps(o2, o3);
      const __m256 heads[4] = {
          _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(c))),
          _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(c))),
          _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b), _mm256_castps_pd(d))),
          _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b), _mm256_castps_pd(d)))};
      for (int h = 0; h < 4; ++h) {
        float* out = dst + h * dst_stride + t;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), heads[h]));
      }
    }
  }
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    for (; group == 4 && t + 16 <= count; t += 16) {
      const float* in = src + 4 * t;
      const __m512 i0 = _mm512_loadu_ps(in), i1 = _mm512_loadu_ps(in + 16);
      const __m512 i2 = _mm512_loadu_ps(in + 32), i3 = _mm512_loadu_ps(in + 48);
      // Lane L of o_j: token 4L + j of the four heads, as in to_head_minor ...
      const __m512 p0 = _mm512_shuffle_f32x4(i0, i1, 0x88), p1 = _mm512_shuffle_f32x4(i2, i3, 0x88);
      const __m512 p2 = _mm512_shuffle_f32x4(i0, i1, 0xDD), p3 = _mm512_shuffle_f32x4(i2, i3, 0xDD);
      const __m512 o0 = _mm512_shuffle_f32x4(p0, p1, 0x88), o1 = _mm512_shuffle_f32x4(p2, p3, 0x88);
      const __m512 o2 = _mm512_shuffle_f32x4(p0, p1, 0xDD), o3 = _mm512_shuffle_f32x4(p2, p3, 0xDD);
      // ... then the 4×4 transposes inside the lanes give each head's 16 tokens.
      const __m512 a = _mm512_unpacklo_ps(o0, o1), b = _mm512_unpackhi_ps(o0, o1);
      const __m512 c = _mm512_unpacklo_ps(o2, o3), d = _mm512_unpackhi_ps(o2, o3);
      const __m512 heads[4] = {
          _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(c))),
          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(c))),
          _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b), _mm512_castps_pd(d))),
          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b), _mm512_castps_pd(d)))};
      for (int h = 0; h < 4; ++h) {
        float* out = dst + h * dst_stride + t;
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), heads[h]));
      }
    }
  }
#endif
  for (; t < count; ++t) {
    for (index_t h = 0; h < group; ++h) dst[h * dst_stride + t] += src[t * group + h];
  }
}

#if KVPACK_KERNELS_HAVE_VNNI
/// x·k for a factor k fixed per call: a shift where k is a power of two. A `vpmulld` costs two
/// uops and ten cycles of latency, and the five of them took 3-6 % of KVQuant's in-cache time.
class TimesConstant {
 public:
  explicit TimesConstant(index_t k) noexcept
      : factor_(_mm512_set1_epi32(k)),
        shift_(_mm512_set1_epi32(std::countr_zero(static_cast<std::uint32_t>(k)))),
        is_shift_(std::has_single_bit(static_cast<std::uint32_t>(k))) {}
  [[nodiscard]] bool is_shift() const noexcept { return is_shift_; }
  KVPACK_ALWAYS_INLINE __m512i operator()(__m512i x) const noexcept {
    return is_shift_ ? _mm512_sllv_epi32(x, shift_) : _mm512_mullo_epi32(x, factor_);
  }
  /// x / k where is_shift().
  KVPACK_ALWAYS_INLINE __m512i divide(__m512i x) const noexcept { return _mm512_srlv_epi32(x, shift_); }

 private:
  __m512i factor_, shift_;
  bool is_shift_;
};

/// Adds the corrections of every outlier in a page's section (see NuqOutlierTarget), sixteen
/// decoded at a time. An index n splits into t = ⌊n/d⌋ by a shift where d is a power of two,
/// else as ⌊(n + ½)/d⌋ in fp32, exact for 16-bit n: (n + ½)/d is at least 1/(2d) from an
/// integer, and two roundings move it by at most 2⁻²³·2¹⁶/d. A code is read as the
/// 32-bit word at its first byte shifted right, which holds it whole for every width ≤ 8 bits;
/// the word may reach 3 bytes past the last row, into the page's metadata that follows the codes.
template <int Bits>
  requires(Bits >= 2 && Bits <= 4)
KVPACK_ALWAYS_INLINE void add_nuq_outlier_corrections(xsimd::avx512bw, const std::byte* section, std::size_t capacity,
                                                      index_t head_dim, const NuqOutlierTarget& to) noexcept {
  const auto count = static_cast<index_t>(std::min<std::size_t>(quant::kvquant_detail::get_u16(section), capacity));
  const auto* indices = reinterpret_cast<const std::uint16_t*>(section + 2);
  const auto* exacts = reinterpret_cast<const std::uint16_t*>(section + 2 + 2 * capacity);
  const __m512 levels = _mm512_loadu_ps(to.levels);
  const __m512 inverse_d = _mm512_set1_ps(1.0f / static_cast<float>(head_dim));
  const TimesConstant times_d(head_dim), times_group(to.group), times_row_bytes(static_cast<index_t>(to.row_bytes));
  alignas(64) std::int32_t row_at[16], column_at[16];
  alignas(64) float correction[16];
  for (index_t first = 0; first < count; first += 16) {
    const index_t n = std::min<index_t>(16, count - first);
    const auto lanes = static_cast<__mmask16>((1u << n) - 1);
    const __m512i index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, indices + first));
    __m512i t, c;
    if (times_d.is_shift()) {
      t = times_d.divide(index);
      c = _mm512_and_si512(index, _mm512_set1_epi32(head_dim - 1));
    } else {
      t = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(index), _mm512_set1_ps(0.5f)), inverse_d));
      c = _mm512_sub_epi32(index, times_d(t));
    }
    const __m512i row = to.rows_are_channels ? c : t, column = to.rows_are_channels ? t : c;
    const __m512i bit = Bits == 3 ? _mm512_add_epi32(column, _mm512_slli_epi32(column, 1))
                                  : _mm512_slli_epi32(column, Bits == 4 ? 2 : 1);
    const __m512i byte = _mm512_add_epi32(times_row_bytes(row), _mm512_srli_epi32(bit, 3));
    const __m512i word = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, byte, to.codes, 1);
    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(word, _mm512_and_si512(bit, _mm512_set1_epi32(7))),
                                          _mm512_set1_epi32((1 << Bits) - 1));
    const __m512 range = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, row, to.range, 4);
    const __m512 offset = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, row, to.offset, 4);
    const __m512 exact = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, exacts + first));
    const __m512 decoded = _mm512_fmadd_ps(_mm512_permutexvar_ps(code, levels), range, offset);
    _mm512_store_ps(correction, _mm512_sub_ps(exact, decoded));
    _mm512_store_si512(row_at, times_group(row));
    _mm512_store_si512(column_at, times_group(column));
    // Head blocks outside the loop over outliers: chosen per outlier, they took three times the
    // instructions of the multiply-add itself.
    for_each_head_block<8>(to.group, [&](auto block, index_t h0) {
      add_outliers_to_heads<decltype(block)::value>(n, row_at, column_at, correction, to, h0);
    });
  }
}
#endif

/// The same on AVX2, eight outliers at a time: the index split by a shift where head_dim is a
/// power of two, else in fp32 as above; a code read as the 32-bit word at its first byte (up to 3
/// bytes past the last row, into the page's metadata); the sixteen levels from two 8-lane
/// permutes, picked by the code's bit 3. A last partial block is copied out first, so that no
/// load reads past the section.
template <int Bits>
  requires(Bits >= 2 && Bits <= 4)
KVPACK_ALWAYS_INLINE void add_nuq_outlier_corrections(avx2_arch, const std::byte* section, std::size_t capacity,
                                                      index_t head_dim, const NuqOutlierTarget& to) noexcept {
  const auto count = static_cast<index_t>(std::min<std::size_t>(quant::kvquant_detail::get_u16(section), capacity));
  const auto* indices = reinterpret_cast<const std::uint16_t*>(section + 2);
  const auto* exacts = reinterpret_cast<const std::uint16_t*>(section + 2 + 2 * capacity);
  const __m256 low_levels = _mm256_loadu_ps(to.levels), high_levels = _mm256_loadu_ps(to.levels + 8);
  const __m256 inverse_d = _mm256_set1_ps(1.0f / static_cast<float>(head_dim));
  const bool d_is_power_of_two = std::has_single_bit(static_cast<std::uint32_t>(head_dim));
  const __m128i d_shift = _mm_cvtsi32_si128(std::countr_zero(static_cast<std::uint32_t>(head_dim)));
  const __m256i d = _mm256_set1_epi32(head_dim), group = _mm256_set1_epi32(to.group);
  const __m256i row_bytes = _mm256_set1_epi32(static_cast<int>(to.row_bytes));
  alignas(32) std::int32_t row_at[8], column_at[8];
  alignas(32) float correction[8];
  for (index_t first = 0; first < count; first += 8) {
    const index_t n = std::min<index_t>(8, count - first);
    __m128i index16 = _mm_setzero_si128(), exact16 = _mm_setzero_si128();
    if (n == 8) {
      index16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(indices + first));
      exact16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(exacts + first));
    } else {  // lanes past n: outlier 0 of row 0, computed and never added
      std::memcpy(&index16, indices + first, 2 * static_cast<std::size_t>(n));
      std::memcpy(&exact16, exacts + first, 2 * static_cast<std::size_t>(n));
    }
    const __m256i index = _mm256_cvtepu16_epi32(index16);
    __m256i t, c;
    if (d_is_power_of_two) {
      t = _mm256_srl_epi32(index, d_shift);
      c = _mm256_and_si256(index, _mm256_sub_epi32(d, _mm256_set1_epi32(1)));
    } else {
      t = _mm256_cvttps_epi32(
          _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(index), _mm256_set1_ps(0.5f)), inverse_d));
      c = _mm256_sub_epi32(index, _mm256_mullo_epi32(t, d));
    }
    const __m256i row = to.rows_are_channels ? c : t, column = to.rows_are_channels ? t : c;
    const __m256i bit = Bits == 3 ? _mm256_add_epi32(column, _mm256_slli_epi32(column, 1))
                                  : _mm256_slli_epi32(column, Bits == 4 ? 2 : 1);
    const __m256i byte = _mm256_add_epi32(_mm256_mullo_epi32(row, row_bytes), _mm256_srli_epi32(bit, 3));
    const __m256i word = _mm256_i32gather_epi32(reinterpret_cast<const int*>(to.codes), byte, 1);
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_and_si256(bit, _mm256_set1_epi32(7))),
                                          _mm256_set1_epi32((1 << Bits) - 1));
    const __m256 level = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_levels, code),
                                          _mm256_permutevar8x32_ps(high_levels, code),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
    const __m256 range = _mm256_i32gather_ps(to.range, row, 4);
    const __m256 offset = _mm256_i32gather_ps(to.offset, row, 4);
    const __m256 decoded = _mm256_fmadd_ps(level, range, offset);
    _mm256_store_ps(correction, _mm256_sub_ps(_mm256_cvtph_ps(exact16), decoded));
    _mm256_store_si256(reinterpret_cast<__m256i*>(row_at), _mm256_mullo_epi32(row, group));
    _mm256_store_si256(reinterpret_cast<__m256i*>(column_at), _mm256_mullo_epi32(column, group));
    for_each_head_block<8>(to.group, [&](auto block, index_t h0) {
      add_outliers_to_heads<decltype(block)::value>(n, row_at, column_at, correction, to, h0);
    });
  }
}
#endif  // KVPACK_KERNELS_HAVE_AVX2_INTEGER

}  // namespace kvpack::inline v0::kernels::cpu
