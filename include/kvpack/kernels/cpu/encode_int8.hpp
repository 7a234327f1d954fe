#pragma once
/// \file encode_int8.hpp
/// \brief quant::Int8 and quant::Q8_0 page planes encoded from fp32 rows in AVX-512.
///
/// The scalar encoders compute each code separately and store it as one byte into the pair tiles
/// (tile_layout.hpp). Here 16 codes come from one vector, and they are stored as the tiles hold
/// them: a value plane interleaves two tokens' codes with `punpck{l,h}bw`; a key plane holds a
/// token's channels 2j, 2j+1 as one 16-bit word, so eight tokens' words are transposed and each
/// word row takes 16 bytes at once.
///
/// The bytes are exactly the codecs' `encode`, because every lane does the scalar operations in
/// the same order: |x| maximum (NaN ignored, as std::max ignores it), d = amax / 127, 1/d (0 when
/// d is 0), x·(1/d), then ggml::round_to_int8_code (clamp to ±127, truncate, add or subtract one
/// on a fraction of at least one half, NaN to 0). Scales are narrowed with half.hpp's conversion,
/// once per scale. Without AVX-512 the kernel declines the page (EncodeRowsArgs::declined) and
/// the caller runs the scalar encoder.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/core/half.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

namespace int8_encode {

/// Channels sharing one scale: a whole token for Int8, ggml's 32-channel block for Q8_0.
template <class Codec>
[[nodiscard]] constexpr index_t scale_group(index_t head_dim) noexcept {
  return std::is_same_v<Codec, quant::Int8Codec<Codec::kPlane>> ? head_dim : quant::ggml::kBlockSize;
}

/// Byte offset of the fp16 scale of (token t, group b).
template <class Codec>
[[nodiscard]] constexpr std::size_t scale_byte(quant::PageGeometry g, index_t t, index_t b) noexcept {
  if constexpr (std::is_same_v<Codec, quant::Int8Codec<Codec::kPlane>>) {
    return Codec::codes_bytes(g) + static_cast<std::size_t>(t) * sizeof(std::uint16_t);
  } else {
    return Codec::scale_byte(g, t, b);
  }
}

#if XSIMD_WITH_AVX512BW
/// max |x_c| over n floats; NaN lanes lose (vmaxps returns its second operand when one is NaN).
template <class A>
KVPACK_ALWAYS_INLINE float abs_max(const float* x, index_t n) noexcept {
  __m512 m = _mm512_setzero_ps();
  for (index_t c = 0; c < n; c += 16) {
    m = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(simd::first_lanes<A>(n - c), x + c)), m);
  }
  return _mm512_reduce_max_ps(m);
}

/// ggml::round_to_int8_code(x_c · inverse) for n ≤ 16 floats, as 16 bytes (lanes past n are 0).
template <class A>
KVPACK_ALWAYS_INLINE __m128i codes16(const float* x, index_t n, float inverse) noexcept {
  const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(simd::first_lanes<A>(n), x), _mm512_set1_ps(inverse));
  const __mmask16 number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  // With v not NaN, max-then-min is std::clamp; NaN lanes are zeroed below.
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  const __m512i whole = _mm512_cvttps_epi32(clamped);
  const __m512 fraction = _mm512_sub_ps(clamped, _mm512_cvtepi32_ps(whole));  // exact, as in the scalar code
  const __m512i one = _mm512_set1_epi32(1);
  __m512i code = _mm512_mask_add_epi32(whole, _mm512_cmp_ps_mask(fraction, _mm512_set1_ps(0.5f), _CMP_GE_OQ),
                                       whole, one);
  code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(fraction, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), code, one);
  return _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(number, code));
}

/// words[k] holds the 16-bit words 0–7 of token k; afterwards words[j] holds word j of tokens 0–7.
template <class A>
KVPACK_ALWAYS_INLINE void transpose_words(__m128i (&words)[8]) noexcept {
  __m128i pairs[8], quads[8];
  for (int k = 0; k < 4; ++k) {
    pairs[2 * k] = _mm_unpacklo_epi16(words[2 * k], words[2 * k + 1]);      // words 0–3 of tokens 2k, 2k+1
    pairs[2 * k + 1] = _mm_unpackhi_epi16(words[2 * k], words[2 * k + 1]);  // words 4–7
  }
  for (int h = 0; h < 2; ++h) {  // tokens 4h–4h+3
    for (int half_words = 0; half_words < 2; ++half_words) {
      const __m128i lo = pairs[4 * h + half_words], hi = pairs[4 * h + 2 + half_words];
      quads[4 * h + 2 * half_words] = _mm_unpacklo_epi32(lo, hi);      // words 4·half_words + 0, 1
      quads[4 * h + 2 * half_words + 1] = _mm_unpackhi_epi32(lo, hi);  // words 4·half_words + 2, 3
    }
  }
  for (int j = 0; j < 4; ++j) {
    words[2 * j] = _mm_unpacklo_epi64(quads[j], quads[4 + j]);
    words[2 * j + 1] = _mm_unpackhi_epi64(quads[j], quads[4 + j]);
  }
}

/// Scales of token t's row: stores each group's fp16 d and returns 1/d per group in `inverses`.
template <class A, class Codec>
KVPACK_ALWAYS_INLINE void scale_row(const EncodeRowsArgs& args, index_t t, const float* row, float* inverses) noexcept {
  const quant::PageGeometry g{args.page_size, args.head_dim};
  const index_t group = scale_group<Codec>(args.head_dim);
  for (index_t b = 0; b < args.head_dim / group; ++b) {
    const float d = abs_max<A>(row + b * group, group) / 127.0f;
    inverses[b] = d != 0.0f ? 1.0f / d : 0.0f;
    const std::uint16_t bits = half(d).bits;
    std::memcpy(args.plane + scale_byte<Codec>(g, t, b), &bits, sizeof(bits));
  }
}
#endif

}  // namespace int8_encode

/// One quant::Int8 or quant::Q8_0 plane from fp32 rows: the bytes the codec's `encode` writes.
template <class A, class Codec>
void encode_int8_tiles(const EncodeRowsArgs& args) noexcept {
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) {
    using namespace int8_encode;
    const index_t page = args.page_size, dim = args.head_dim;
    const index_t group = scale_group<Codec>(dim);
    const auto row_of = [&](index_t t) { return args.rows + static_cast<std::ptrdiff_t>(t) * args.row_stride; };
    // Q8_0 limits head_dim to 2048, so 64 blocks; Int8 has one scale per token.
    float inverses[8][2048 / quant::ggml::kBlockSize];
    if constexpr (Codec::kPlane == Plane::kValue) {
      // Tokens 2i and 2i+1 of a channel are adjacent bytes (page_size is even).
      for (index_t t = 0; t < page; t += 2) {
        scale_row<A, Codec>(args, t, row_of(t), inverses[0]);
        scale_row<A, Codec>(args, t + 1, row_of(t + 1), inverses[1]);
        std::byte* out = args.plane + static_cast<std::size_t>(t / 2) * dim * 2;
        for (index_t c = 0; c < dim; c += 16) {  // head_dim % 8 == 0: a chunk has 8 or 16 channels
          const index_t n = dim - c < 16 ? dim - c : 16;
          const __m128i first = codes16<A>(row_of(t) + c, n, inverses[0][c / group]);
          const __m128i second = codes16<A>(row_of(t + 1) + c, n, inverses[1][c / group]);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c * 2), _mm_unpacklo_epi8(first, second));
          if (n > 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c * 2 + 16), _mm_unpackhi_epi8(first, second));
        }
      }
    } else {
      // Channels 2j and 2j+1 of a token are one 16-bit word, and word row j holds every token's
      // word j. Eight tokens' codes are transposed so that each row takes 16 bytes at once; the
      // page's last page_size % 8 tokens are stored a word at a time.
      index_t t = 0;
      for (; t + 8 <= page; t += 8) {
        for (int k = 0; k < 8; ++k) scale_row<A, Codec>(args, t + k, row_of(t + k), inverses[k]);
        for (index_t c = 0; c < dim; c += 16) {
          const index_t n = dim - c < 16 ? dim - c : 16;
          __m128i words[8];
          for (int k = 0; k < 8; ++k) words[k] = codes16<A>(row_of(t + k) + c, n, inverses[k][c / group]);
          transpose_words<A>(words);
          for (index_t j = 0; j < n / 2; ++j) {
            std::byte* row_start = args.plane + (static_cast<std::size_t>(c / 2 + j) * page + t) * 2;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row_start), words[j]);
          }
        }
      }
      for (; t < page; ++t) {
        scale_row<A, Codec>(args, t, row_of(t), inverses[0]);
        for (index_t c = 0; c < dim; c += 16) {
          const index_t n = dim - c < 16 ? dim - c : 16;
          alignas(16) std::uint16_t pairs[8];
          _mm_store_si128(reinterpret_cast<__m128i*>(pairs), codes16<A>(row_of(t) + c, n, inverses[0][c / group]));
          for (index_t j = 0; j < n / 2; ++j) {
            std::memcpy(args.plane + (static_cast<std::size_t>(c / 2 + j) * page + t) * 2, &pairs[j], 2);
          }
        }
      }
    }
    return;
  }
#endif
  *args.declined = true;
}

template <class A, Plane kPlane>
void encode_plane(A, std::type_identity<quant::Int8Codec<kPlane>>, const EncodeRowsArgs& args) noexcept {
  encode_int8_tiles<A, quant::Int8Codec<kPlane>>(args);
}

template <class A, Plane kPlane>
void encode_plane(A, std::type_identity<quant::Q8_0Codec<kPlane>>, const EncodeRowsArgs& args) noexcept {
  encode_int8_tiles<A, quant::Q8_0Codec<kPlane>>(args);
}

}  // namespace kvpack::inline v0::kernels::cpu
