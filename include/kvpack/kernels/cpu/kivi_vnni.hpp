#pragma once
/// \file kivi_vnni.hpp
/// \brief The AVX-512 VNNI path of the fused 4-bit KIVI kernels (kivi.hpp): integer dot products
///        on the packed codes instead of fp32 FMAs.
///
/// The operand that multiplies the codes is quantized:
/// - keys: q·s (the query times the channel scales of a token group) to int16 per head, step
///   max_c |q_c·s_c| / 32767, and `vpdpwssd` (two code · int16 products per 32-bit lane). Keys
///   carry outlier channels, and q·s squares their weight (q is large where keys are); an int8
///   query per 32-channel block (q4_0's choice) moved peaked attention over such keys by 25 %
///   (tests/unit/cache/test_eviction.cpp), int16 moves each product by at most 1/65534 of the
///   head's largest q·s times the code;
/// - values: w·s (the weight times the token's scale of a channel group) to int8 per head, page
///   and channel group, and `vpdpbusd` (four u8 code · s8 products per lane), as q4_0 does: each
///   weight moves by at most 1/254 of the page's largest weight times the group's largest scale.
/// The minimums' sums (Σ q·m, Σ w·m) stay in fp32. tests/support/error_bound.hpp holds the bound.
///
/// Each step loads 16 bytes (32 codes) from four rows — four channels of one token group (keys)
/// or four tokens of one channel chunk (values) — and transposes them with one dword permute and
/// byte shuffles so that a lane holds the codes that share its operand; the low nibbles are
/// elements 0, 2, ..., 30 of the 32, the high nibbles 1, 3, ..., 31 (KiviLanes<4, G, avx512bw>'s
/// order).

#include <cstdint>
#include <cstring>
#include <limits>

#include "kvpack/kernels/cpu/integer_common.hpp"

#if KVPACK_KERNELS_HAVE_VNNI

namespace kvpack::inline v0::kernels::cpu::kivi_vnni {

/// Byte k of four 16-byte rows as the four bytes of lane k: `rows` holds row r in its 128-bit
/// lane r. A dword transpose brings dword L of every row into lane L, then a byte shuffle inside
/// each lane interleaves the rows.
KVPACK_ALWAYS_INLINE __m512i transpose_rows(__m512i rows) noexcept {
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, rows), bytes);
}

/// 16 bytes from each of four rows `stride` apart, row r in lane r.
KVPACK_ALWAYS_INLINE __m512i load_rows(const std::uint8_t* p, std::size_t stride) noexcept {
  if (stride == 16) return _mm512_loadu_si512(p);  // the rows are contiguous (keys of 32-token pages)
  __m512i rows = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  rows = _mm512_inserti32x4(rows, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1);
  rows = _mm512_inserti32x4(rows, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * stride)), 2);
  return _mm512_inserti32x4(rows, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * stride)), 3);
}

/// The transposed codes of four rows: elements 0, 2, ..., 30 (low nibbles) and 1, 3, ..., 31.
KVPACK_ALWAYS_INLINE void load_quads(const std::uint8_t* p, std::size_t stride, __m512i& even, __m512i& odd) noexcept {
  const __m512i quads = transpose_rows(load_rows(p, stride));
  const __m512i mask = _mm512_set1_epi8(0x0F);
  even = _mm512_and_si512(quads, mask);
  odd = _mm512_and_si512(_mm512_srli_epi16(quads, 4), mask);
}

/// The query of each head folded with one token group's channel scales and minimums (kivi.hpp's
/// fold_key_group) and quantized in the same pass: q16[h][c] · step[h] ≈ q_c·s_c, and
/// bias[h] = Σ_c q_c·m_c. `q16` holds [group][head_dim] int16. False when some q·s overflowed
/// (a query near fp32's largest): the caller then scores the group in fp32, which carries the Inf.
inline bool fold_query(xsimd::avx512bw, const float* queries, index_t group, index_t head_dim,
                       const std::uint16_t* scales, const std::uint16_t* mins, float* folded, std::int16_t* q16,
                       float* step, float* bias) noexcept {
  auto f16 = [](const std::uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  for (index_t h = 0; h < group; ++h) {
    const float* q = queries + h * head_dim;
    __m512 dot = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
    for (index_t c = 0; c < head_dim; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + c);
      const __m512 qs = _mm512_mul_ps(qc, f16(scales + c));
      _mm512_storeu_ps(folded + c, qs);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(qs));
      dot = _mm512_fmadd_ps(qc, f16(mins + c), dot);
    }
    const float amax = _mm512_reduce_max_ps(largest);
    if (!(amax <= std::numeric_limits<float>::max())) return false;
    step[h] = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const __m512 inverse = _mm512_set1_ps(1.0f / step[h]);
    for (index_t c = 0; c < head_dim; c += 16) {
      // |qs| · (1/step) ≤ 32767 up to rounding, which round-to-nearest and the saturating pack absorb.
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(folded + c), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + h * head_dim + c), _mm512_cvtsepi32_epi16(qi));
    }
    bias[h] = _mm512_reduce_add_ps(dot);
  }
  return true;
}

/// Scores of kG heads for 32 tokens of one key group from the codes at `codes` (channel c's row
/// row_bytes·c further on): step · Σ_c q16_c·code + bias, written in token order.
template <int kG>
KVPACK_ALWAYS_INLINE void score_tokens(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                       const std::int16_t* q16, const float* step, const float* bias, float* scores,
                                       index_t stride) noexcept {
  // After the dword permute, 128-bit lane L holds bytes 4L..4L+3 of rows 0..3 (4 bytes each);
  // these shuffles widen byte 4L+i of rows (0, 1) — or (2, 3) — into the two words of dword i.
  const __m512i rows01 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1));
  const __m512i rows23 = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1));
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i mask = _mm512_set1_epi16(0x0F);
  __m512i sum[kG][2];
  for (auto& head : sum) head[0] = head[1] = _mm512_setzero_si512();
  for (index_t c = 0; c < head_dim; c += 4) {
    const __m512i rows = _mm512_permutexvar_epi32(dwords, load_rows(codes + row_bytes * static_cast<std::size_t>(c), row_bytes));
    const __m512i pair01 = _mm512_shuffle_epi8(rows, rows01), pair23 = _mm512_shuffle_epi8(rows, rows23);
    const __m512i even01 = _mm512_and_si512(pair01, mask), odd01 = _mm512_and_si512(_mm512_srli_epi16(pair01, 4), mask);
    const __m512i even23 = _mm512_and_si512(pair23, mask), odd23 = _mm512_and_si512(_mm512_srli_epi16(pair23, 4), mask);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      std::int32_t pair[2];
      std::memcpy(pair, q16 + h * head_dim + c, sizeof(pair));
      const __m512i q01 = _mm512_set1_epi32(pair[0]), q23 = _mm512_set1_epi32(pair[1]);
      sum[h][0] = dot_pairs(dot_pairs(sum[h][0], even01, q01), even23, q23);
      sum[h][1] = dot_pairs(dot_pairs(sum[h][1], odd01, q01), odd23, q23);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int h = 0; h < kG; ++h) {
    const __m512 s = _mm512_set1_ps(step[h]), b = _mm512_set1_ps(bias[h]);
    const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][0]), s, b);
    const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][1]), s, b);
    _mm512_storeu_ps(scores + h * stride, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(scores + h * stride + 16, _mm512_permutex2var_ps(even, second, odd));
  }
}

/// One page's scaled weights w·s of one channel group (`scaled`, [group][page_size], ≥ 0) as
/// int8 per head: w8[h][t] · step[h] ≈ scaled[h][t], with step[h] = p_max[h] · s_max / 127 from
/// the head's largest weight and the group's largest scale on the page (a bound on max w·s, so
/// nothing saturates, found without a reduction per head and group). A step below the smallest
/// normal float is taken as 0: all its products are below it.
inline void quantize_scaled_weights(xsimd::avx512bw, const float* scaled, index_t group, index_t page_size,
                                    const float* p_max, float s_max, std::int8_t* w8, float* step) noexcept {
  for (index_t h = 0; h < group; ++h) {
    const float* w = scaled + static_cast<std::size_t>(h) * page_size;
    std::int8_t* out = w8 + static_cast<std::size_t>(h) * page_size;
    step[h] = p_max[h] * s_max / 127.0f;
    if (!(step[h] >= std::numeric_limits<float>::min())) {
      step[h] = 0.0f;
      std::memset(out, 0, static_cast<std::size_t>(page_size));
      continue;
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / step[h]);
    for (index_t t = 0; t < page_size; t += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + t), inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + t), _mm512_cvtsepi32_epi8(q));
    }
  }
}

/// Sums of kG heads over one page for 32 channels of one channel group, from the codes at
/// `codes` (token t's row row_bytes·t further on): sums[h][lane order] += step_h · Σ_t w8·code.
template <int kG>
KVPACK_ALWAYS_INLINE void accumulate_channels(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                              const std::int8_t* w8, const float* step, float* sums,
                                              index_t head_dim) noexcept {
  __m512i sum[kG][2];
  for (auto& head : sum) head[0] = head[1] = _mm512_setzero_si512();
  for (index_t t = 0; t < page_size; t += 4) {
    __m512i even, odd;
    load_quads(codes + row_bytes * static_cast<std::size_t>(t), row_bytes, even, odd);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m512i quad = broadcast_int8_quad(w8 + static_cast<std::size_t>(h) * page_size + t);
      sum[h][0] = dot_quads(sum[h][0], even, quad);
      sum[h][1] = dot_quads(sum[h][1], odd, quad);
    }
  }
  for (int h = 0; h < kG; ++h) {
    const __m512 s = _mm512_set1_ps(step[h]);
    float* out = sums + h * head_dim;
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][0]), s, _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][1]), s, _mm512_loadu_ps(out + 16)));
  }
}

}  // namespace kvpack::inline v0::kernels::cpu::kivi_vnni

#endif  // KVPACK_KERNELS_HAVE_VNNI
