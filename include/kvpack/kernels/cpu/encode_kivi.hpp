#pragma once
/// \file encode_kivi.hpp
/// \brief quant::KIVI page planes encoded from fp32 rows in AVX-512: keys per channel (16
///        channels per vector, tokens in sequence) and per-token planes (a group's channels in
///        vectors).
///
/// The bytes are exactly the codecs' `encode`, because the operations are the scalar ones:
/// - Key ranges: min and max over a group's tokens in token order; `vminps(x, lo)` is
///   `x < lo ? x : lo`, std::min's rule, so even the sign of a zero matches. Per-token ranges:
///   std::minmax_element's first smallest and last largest element, found as the value and then
///   its first (last) index, so a zero's sign matches too.
/// - s = fp16((max − min) / (2^b − 1)) and min' = fp16(min) (`vcvtps2ph`, half.hpp's rounding),
///   code = round((x − min') / s) clamped to [0, 2^b − 1], 0 when s is 0 or the quotient is NaN,
///   rounded by MXCSR as kivi_detail::round_to_nearest_even's cvtss2si is.
/// - Codes are packed little end first (packed_codes.hpp): keys accumulate 32 / b tokens per
///   32-bit lane and scatter each lane to its channel's row; per-token rows fold neighbouring
///   lanes together and narrow with `vpmovqb`.
/// Without AVX-512 the kernel declines the page (EncodeRowsArgs::declined) and the caller runs the
/// scalar encoder. So does a page with a NaN (which reaches here only with check_inputs off): the
/// scalar encoder's NaN handling, through std::minmax_element, is not worth reproducing lane by
/// lane.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/core/half.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/kivi.hpp"

namespace kvpack::inline v0::kernels::cpu {

namespace kivi_encode {

#if XSIMD_WITH_AVX512BW
constexpr int kRoundHalf = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// Whether any of the page's inputs is NaN.
template <class A>
KVPACK_ALWAYS_INLINE bool has_nan(const EncodeRowsArgs& args) noexcept {
  __mmask16 nan = 0;
  for (index_t t = 0; t < args.page_size; ++t) {
    const float* row = args.rows + static_cast<std::ptrdiff_t>(t) * args.row_stride;
    for (index_t c = 0; c < args.head_dim; c += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(simd::first_lanes<A>(args.head_dim - c), row + c);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
  }
  return nan != 0;
}

/// kivi_detail::to_code for 16 lanes, as 32-bit integers.
template <class A, int Bits>
KVPACK_ALWAYS_INLINE __m512i codes16(__m512 x, __m512 min, __m512 scale) noexcept {
  const __m512 q = _mm512_div_ps(_mm512_sub_ps(x, min), scale);
  const __mmask16 coded = _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_NEQ_UQ) &
                          _mm512_cmp_ps_mask(q, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_maskz_cvtps_epi32(coded, _mm512_min_ps(q, _mm512_set1_ps(static_cast<float>((1 << Bits) - 1))));
}

/// 16 codes of Bits each, packed little end first at `out` (2·Bits bytes).
template <class A, int Bits>
KVPACK_ALWAYS_INLINE void store_packed16(__m512i codes, std::byte* out) noexcept {
  // Lanes 2k and 2k+1 form one 64-bit lane; shifting it right by 32 − Bits puts code 2k+1 just
  // above code 2k.
  const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi64(codes, 32 - Bits));
  if constexpr (Bits == 4) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pairs));
  } else {
    const __m256i nibbles = _mm512_cvtepi64_epi32(pairs);  // codes 2k, 2k+1 in 4 bits per lane
    const __m256i quads = _mm256_or_si256(nibbles, _mm256_srli_epi64(nibbles, 28));
    const int bytes = _mm_cvtsi128_si32(_mm256_cvtepi64_epi8(quads));
    std::memcpy(out, &bytes, sizeof(bytes));
  }
}

/// KiviKeyCodec: each group of Group tokens, 16 channels at a time.
template <class A, int Bits, int Group>
void encode_keys(const EncodeRowsArgs& args) noexcept {
  using Codec = quant::KiviKeyCodec<Bits, Group>;
  const quant::PageGeometry g{args.page_size, args.head_dim};
  constexpr int kCodesPerWord = 32 / Bits;
  const std::size_t row_bytes = Codec::row_bytes(g);
  const __m512i row_starts = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const __m512 top = _mm512_set1_ps(static_cast<float>((1 << Bits) - 1));
  const auto row_of = [&](index_t t) { return args.rows + static_cast<std::ptrdiff_t>(t) * args.row_stride; };
  for (index_t group = 0; group < g.page_size / Group; ++group) {
    const index_t first = group * Group;
    for (index_t c = 0; c < g.head_dim; c += 16) {
      const __mmask16 lanes = simd::first_lanes<A>(g.head_dim - c);
      __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
      for (index_t t = first; t < first + Group; ++t) {
        const __m512 x = _mm512_maskz_loadu_ps(lanes, row_of(t) + c);
        lo = _mm512_min_ps(x, lo);
        hi = _mm512_max_ps(x, hi);
      }
      const __m256i min_bits = _mm512_cvtps_ph(lo, kRoundHalf);
      const __m256i scale_bits = _mm512_cvtps_ph(_mm512_div_ps(_mm512_sub_ps(hi, lo), top), kRoundHalf);
      const std::size_t meta = (static_cast<std::size_t>(group) * g.head_dim + c) * 2;
      _mm256_mask_storeu_epi16(args.plane + Codec::scales_offset(g) + meta, lanes, scale_bits);
      _mm256_mask_storeu_epi16(args.plane + Codec::mins_offset(g) + meta, lanes, min_bits);
      const __m512 min = _mm512_cvtph_ps(min_bits), scale = _mm512_cvtph_ps(scale_bits);
      std::byte* rows_at = args.plane + row_bytes * c + static_cast<std::size_t>(first) * Bits / 8;
      for (index_t word = 0; word < Group / kCodesPerWord; ++word) {
        __m512i packed = _mm512_setzero_si512();
        for (int k = 0; k < kCodesPerWord; ++k) {
          const __m512 x = _mm512_maskz_loadu_ps(lanes, row_of(first + word * kCodesPerWord + k) + c);
          const __m512i codes = codes16<A, Bits>(x, min, scale);  // not inside the call: a macro at -O0
          packed = _mm512_or_si512(packed, _mm512_slli_epi32(codes, Bits * k));
        }
        _mm512_mask_i32scatter_epi32(rows_at + word * 4, lanes, row_starts, packed, 1);
      }
    }
  }
}

/// KiviTokenCodec: each token's groups of Group channels.
template <class A, int Bits, int Group, Plane kPlane>
void encode_tokens(const EncodeRowsArgs& args) noexcept {
  using Codec = quant::KiviTokenCodec<Bits, Group, kPlane>;
  const quant::PageGeometry g{args.page_size, args.head_dim};
  constexpr int kVectors = Group / 16;
  constexpr float kTop = static_cast<float>((1 << Bits) - 1);
  for (index_t t = 0; t < g.page_size; ++t) {
    const float* x = args.rows + static_cast<std::ptrdiff_t>(t) * args.row_stride;
    std::byte* row = args.plane + Codec::row_bytes(g) * t;
    for (index_t group = 0; group < g.head_dim / Group; ++group) {
      const float* in = x + group * Group;
      __m512 values[kVectors];
      __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
      for (int v = 0; v < kVectors; ++v) {
        values[v] = _mm512_loadu_ps(in + 16 * v);
        lo = _mm512_min_ps(values[v], lo);
        hi = _mm512_max_ps(values[v], hi);
      }
      // std::minmax_element: the first smallest and the last largest element.
      const __m512 smallest = _mm512_set1_ps(_mm512_reduce_min_ps(lo));
      const __m512 largest = _mm512_set1_ps(_mm512_reduce_max_ps(hi));
      int first_min = -1, last_max = -1;
      for (int v = 0; v < kVectors && first_min < 0; ++v) {
        const unsigned hits = _mm512_cmp_ps_mask(values[v], smallest, _CMP_EQ_OQ);
        if (hits != 0) first_min = 16 * v + std::countr_zero(hits);
      }
      for (int v = kVectors - 1; v >= 0 && last_max < 0; --v) {
        const unsigned hits = _mm512_cmp_ps_mask(values[v], largest, _CMP_EQ_OQ);
        if (hits != 0) last_max = 16 * v + 31 - std::countl_zero(hits);
      }
      // kivi_detail::group_range with vcvtps2ph: lane 0 the minimum, lane 1 the scale.
      const float lowest = in[first_min];
      const __m128i bits = _mm_cvtps_ph(_mm_setr_ps(lowest, (in[last_max] - lowest) / kTop, 0.0f, 0.0f), kRoundHalf);
      const __m128 range = _mm_cvtph_ps(bits);
      const std::size_t meta = (static_cast<std::size_t>(t) * (g.head_dim / Group) + group) * 2;
      const auto min_bits = static_cast<std::uint16_t>(_mm_extract_epi16(bits, 0));
      const auto scale_bits = static_cast<std::uint16_t>(_mm_extract_epi16(bits, 1));
      std::memcpy(args.plane + Codec::scales_offset(g) + meta, &scale_bits, sizeof(scale_bits));
      std::memcpy(args.plane + Codec::mins_offset(g) + meta, &min_bits, sizeof(min_bits));
      const __m512 min = _mm512_broadcastss_ps(range);
      const __m512 scale = _mm512_broadcastss_ps(_mm_shuffle_ps(range, range, 1));
      for (int v = 0; v < kVectors; ++v) {
        store_packed16<A, Bits>(codes16<A, Bits>(values[v], min, scale),
                                row + static_cast<std::size_t>(group * Group + 16 * v) * Bits / 8);
      }
    }
  }
}
#endif

}  // namespace kivi_encode

/// One KIVI key plane (per channel) from fp32 rows: the bytes the codec's `encode` writes.
template <class A, int Bits, int Group>
void encode_plane(A, std::type_identity<quant::KiviKeyCodec<Bits, Group>>, const EncodeRowsArgs& args) noexcept {
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) {
    if (!kivi_encode::has_nan<A>(args)) return kivi_encode::encode_keys<A, Bits, Group>(args);
  }
#endif
  *args.declined = true;
}

/// One per-token KIVI plane (values, or the ablation's keys): the bytes the codec's `encode` writes.
template <class A, int Bits, int Group, Plane kPlane>
void encode_plane(A, std::type_identity<quant::KiviTokenCodec<Bits, Group, kPlane>>,
                  const EncodeRowsArgs& args) noexcept {
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) {
    if (!kivi_encode::has_nan<A>(args)) return kivi_encode::encode_tokens<A, Bits, Group, kPlane>(args);
  }
#endif
  *args.declined = true;
}

}  // namespace kvpack::inline v0::kernels::cpu
