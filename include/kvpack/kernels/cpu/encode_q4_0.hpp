#pragma once
/// \file encode_q4_0.hpp
/// \brief quant::Q4_0 page planes encoded from fp32 rows in AVX-512.
///
/// One ggml block (32 channels of a token) is two vectors: its 16 bytes qs[j] (element j in the
/// low nibble, j + 16 in the high one) come out of one `vpmovdb`. Both tiles take whole qs
/// bytes (tile_layout.hpp), so four tokens' blocks are transposed in registers: a key plane
/// holds a token's qs as four 32-bit words, one per row of tokens; a value plane holds the four
/// tokens' qs[j] as one 32-bit word.
///
/// The bytes are exactly ggml::quantize_q4_0's: the scale comes from the first element of
/// largest magnitude (NaN skipped; +0 when there is none, as the scalar loop's strict `<` gives),
/// d = max / -8, 1/d (0 when d is 0), then trunc(x·(1/d) + 8.5) clamped to [0, 15], NaN to 8.
/// The product and the sum are `vmulps`/`vaddps` with explicit rounding, which the compiler may
/// not fuse into one FMA (that would round once instead of twice and move codes at the
/// boundaries). Without AVX-512 the kernel declines the page (EncodeRowsArgs::declined)
/// and the caller runs the scalar encoder.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/core/half.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/q4_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

namespace q4_0_encode {

#if XSIMD_WITH_AVX512BW
/// ggml::quantize_q4_0 of the 32 floats at x: returns qs[0..15] and stores the fp16 scale.
template <class A>
KVPACK_ALWAYS_INLINE __m128i quantize_block(const float* x, std::byte* scale) noexcept {
  const __m512 low = _mm512_loadu_ps(x), high = _mm512_loadu_ps(x + 16);
  const __m512 low_abs = _mm512_abs_ps(low), high_abs = _mm512_abs_ps(high);
  // vmaxps returns its second operand when one is NaN, so NaN lanes never win.
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(low_abs, _mm512_max_ps(high_abs, _mm512_setzero_ps())));
  float max = 0.0f;
  if (amax != 0.0f) {
    const __m512 target = _mm512_set1_ps(amax);
    const std::uint32_t hits = _mm512_cmp_ps_mask(low_abs, target, _CMP_EQ_OQ) |
                               static_cast<std::uint32_t>(_mm512_cmp_ps_mask(high_abs, target, _CMP_EQ_OQ)) << 16;
    max = x[std::countr_zero(hits)];
  }
  const float d = max / -8.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  const std::uint16_t bits = half(d).bits;
  std::memcpy(scale, &bits, sizeof(bits));

  // The current rounding mode, as the scalar encoder rounds (the _round forms keep the compiler
  // from fusing the product and the sum into an FMA, which would round once).
  constexpr int kRound = _MM_FROUND_CUR_DIRECTION;
  const auto codes = [&](__m512 v) KVPACK_ALWAYS_INLINE_LAMBDA {
    v = _mm512_add_round_ps(_mm512_mul_round_ps(v, _mm512_set1_ps(inverse), kRound), _mm512_set1_ps(8.5f), kRound);
    const __mmask16 number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(15.0f));
    return _mm512_mask_mov_epi32(_mm512_set1_epi32(8), number, _mm512_cvttps_epi32(clamped));
  };
  return _mm512_cvtepi32_epi8(_mm512_or_si512(codes(low), _mm512_slli_epi32(codes(high), 4)));
}
#endif

}  // namespace q4_0_encode

/// One quant::Q4_0 plane from fp32 rows: the bytes Q4_0Codec::encode writes.
template <class A, Plane kPlane>
void encode_plane(A, std::type_identity<quant::Q4_0Codec<kPlane>>, const EncodeRowsArgs& args) noexcept {
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) {
    using Codec = quant::Q4_0Codec<kPlane>;
    const quant::PageGeometry g{args.page_size, args.head_dim};
    const index_t blocks = g.head_dim / quant::ggml::kBlockSize;
    for (index_t t = 0; t < g.page_size; t += 4) {  // page_size % 4 == 0
      for (index_t b = 0; b < blocks; ++b) {
        __m128i qs[4];
        for (int k = 0; k < 4; ++k) {
          const float* row = args.rows + static_cast<std::ptrdiff_t>(t + k) * args.row_stride;
          qs[k] = q4_0_encode::quantize_block<A>(row + b * quant::ggml::kBlockSize,
                                                 args.plane + Codec::scale_byte(g, t + k, b));
        }
        if constexpr (kPlane == Plane::kKey) {
          // Word m of a token's qs goes to row 4b + m, tokens consecutive: a 4×4 word transpose.
          const __m128i words01 = _mm_unpacklo_epi32(qs[0], qs[1]), words23 = _mm_unpacklo_epi32(qs[2], qs[3]);
          const __m128i words01_high = _mm_unpackhi_epi32(qs[0], qs[1]);
          const __m128i words23_high = _mm_unpackhi_epi32(qs[2], qs[3]);
          const __m128i rows[4] = {_mm_unpacklo_epi64(words01, words23), _mm_unpackhi_epi64(words01, words23),
                                   _mm_unpacklo_epi64(words01_high, words23_high),
                                   _mm_unpackhi_epi64(words01_high, words23_high)};
          for (index_t m = 0; m < 4; ++m) {
            std::byte* out = args.plane + (static_cast<std::size_t>(b * 4 + m) * g.page_size + t) * 4;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out), rows[m]);
          }
        } else {
          // The four tokens' qs[j] are one word, j = 0..15: a 4×16 byte transpose.
          const __m128i low01 = _mm_unpacklo_epi8(qs[0], qs[1]), low23 = _mm_unpacklo_epi8(qs[2], qs[3]);
          const __m128i high01 = _mm_unpackhi_epi8(qs[0], qs[1]), high23 = _mm_unpackhi_epi8(qs[2], qs[3]);
          std::byte* out = args.plane + (static_cast<std::size_t>(t / 4) * blocks + b) * 64;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi16(low01, low23));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi16(low01, low23));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32), _mm_unpacklo_epi16(high01, high23));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 48), _mm_unpackhi_epi16(high01, high23));
        }
      }
    }
    return;
  }
#endif
  *args.declined = true;
}

}  // namespace kvpack::inline v0::kernels::cpu
