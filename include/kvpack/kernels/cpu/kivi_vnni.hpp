#pragma once
/// \file kivi_vnni.hpp
/// \brief The AVX-512 VNNI path of the fused 2- and 4-bit KIVI kernels (kivi.hpp): integer dot
///        products on the packed codes instead of fp32 FMAs.
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
/// The kernels take what a code stands for as a parameter: the code itself for KIVI (RawCodes),
/// a byte copy of a codebook's levels for KVQuant and TurboQuant (ByteLevels, byte_levels.hpp).
///
/// 4-bit codes: each step loads 16 bytes (32 codes) from four rows — four channels of one token
/// group (keys) or four tokens of one channel chunk (values) — and transposes them with one dword
/// permute and byte shuffles so that a lane holds the codes that share its operand; the low
/// nibbles are elements 0, 2, ..., 30 of the 32, the high nibbles 1, 3, ..., 31
/// (KiviLanes<4, G, avx512bw>'s order).
///
/// 2-bit codes: each step loads 8 bytes (32 codes) from eight rows — eight channels (keys) or
/// eight tokens (values) — and one word permute gives 128-bit lane m bytes 2m and 2m + 1 of every
/// row. Byte shuffles then put in each 32-bit lane the bytes of two channels (keys, widened to
/// words) or four tokens (values) that meet one operand, alternating between two operands from
/// lane to lane so that one 64-bit broadcast serves both; the four codes of a byte are shifted
/// out into four vectors. Adjacent lanes are summed at the end (lane_pairs_in_order).

#include <cstdint>
#include <limits>

#include "kvpack/kernels/cpu/integer_common.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"

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

/// The operand the kernels below multiply for a vector of codes: KIVI multiplies the codes
/// themselves; KVQuant and TurboQuant look up their codebook's levels (ByteLevels). `bytes`
/// takes one code per byte (values), `words` one per word with a zero high byte (keys).
struct RawCodes {
  KVPACK_ALWAYS_INLINE __m512i bytes(__m512i codes) const noexcept { return codes; }
  KVPACK_ALWAYS_INLINE __m512i words(__m512i codes) const noexcept { return codes; }
};

/// The query of each head folded with per-channel scales and minimums (16 channels at a time
/// from scale(c) and min(c)) and quantized: q16[h][c] · step[h] ≈ q_c·s_c, and bias[h] =
/// Σ_c q_c·m_c. `folded` holds [group][head_dim] fp32 q·s and `q16` [group][head_dim] int16.
/// False when some q·s overflowed (a query near fp32's largest): the caller then scores in fp32,
/// which carries the Inf. Each pass runs over all heads before the next, so that one head's
/// reductions and division need not finish before other heads' work starts (with the scales
/// converted once, a fold measured ~280 → ~260 cycles in isolation; README "KIVI's per-page work").
template <class Scale, class Min>
KVPACK_ALWAYS_INLINE bool fold_query(const float* queries, index_t group, index_t head_dim, Scale scale, Min min,
                                     float* folded, std::int16_t* q16, float* step, float* bias) noexcept {
  for (index_t h = 0; h < group; ++h) {
    const float* q = queries + h * head_dim;
    float* qs_h = folded + h * head_dim;
    __m512 dot = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
    for (index_t c = 0; c < head_dim; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + c);
      const __m512 qs = _mm512_mul_ps(qc, scale(c));
      _mm512_storeu_ps(qs_h + c, qs);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(qs));
      dot = _mm512_fmadd_ps(qc, min(c), dot);
    }
    step[h] = _mm512_reduce_max_ps(largest);  // the largest |q·s| until the loop below
    bias[h] = _mm512_reduce_add_ps(dot);
  }
  for (index_t h = 0; h < group; ++h) {
    if (!(step[h] <= std::numeric_limits<float>::max())) return false;
    step[h] = step[h] > 0.0f ? step[h] / 32767.0f : 1.0f;
  }
  for (index_t h = 0; h < group; ++h) {
    const __m512 inverse = _mm512_set1_ps(1.0f / step[h]);
    for (index_t c = 0; c < head_dim; c += 16) {
      // |qs| · (1/step) ≤ 32767 up to rounding, which round-to-nearest and the saturating pack absorb.
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(folded + h * head_dim + c), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + h * head_dim + c), _mm512_cvtsepi32_epi16(qi));
    }
  }
  return true;
}

/// KIVI's fold of one token group (kivi.hpp's fold_key_group): fp16 scales and minimums,
/// converted once for all heads into `converted` ([2][head_dim]).
inline bool fold_query(xsimd::avx512bw, const float* queries, index_t group, index_t head_dim,
                       const std::uint16_t* scales, const std::uint16_t* mins, float* converted, float* folded,
                       std::int16_t* q16, float* step, float* bias) noexcept {
  auto f16 = [](const std::uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  for (index_t c = 0; c < head_dim; c += 16) {
    _mm512_storeu_ps(converted + c, f16(scales + c));
    _mm512_storeu_ps(converted + head_dim + c, f16(mins + c));
  }
  return fold_query(
      queries, group, head_dim, [&](index_t c) { return _mm512_loadu_ps(converted + c); },
      [&](index_t c) { return _mm512_loadu_ps(converted + head_dim + c); }, folded, q16, step, bias);
}

/// Scores of kG heads for 32 tokens of one key group from the codes at `codes` (channel c's row
/// row_bytes·c further on): step · Σ_c q16_c·operand(code) + bias, written in token order.
template <int kG, class Operand = RawCodes>
KVPACK_ALWAYS_INLINE void score_tokens(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                       const std::int16_t* q16, const float* step, const float* bias, float* scores,
                                       index_t stride, PagePrefetcher& prefetcher,
                                       const Operand& operand = {}) noexcept {
  // After the dword permute, 128-bit lane L holds bytes 4L..4L+3 of rows 0..3 (4 bytes each);
  // these shuffles widen byte 4L+i of rows (0, 1) — or (2, 3) — into the two words of dword i.
  const __m512i rows01 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1));
  const __m512i rows23 = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1));
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i mask = _mm512_set1_epi16(0x0F);
  __m512i sum[kG][2];
  for (auto& head : sum) head[0] = head[1] = _mm512_setzero_si512();
  for (index_t c = 0; c < head_dim; c += 4) {
    prefetcher.step();
    const __m512i rows = _mm512_permutexvar_epi32(dwords, load_rows(codes + row_bytes * static_cast<std::size_t>(c), row_bytes));
    const __m512i pair01 = _mm512_shuffle_epi8(rows, rows01), pair23 = _mm512_shuffle_epi8(rows, rows23);
    const __m512i even01 = operand.words(_mm512_and_si512(pair01, mask));
    const __m512i odd01 = operand.words(_mm512_and_si512(_mm512_srli_epi16(pair01, 4), mask));
    const __m512i even23 = operand.words(_mm512_and_si512(pair23, mask));
    const __m512i odd23 = operand.words(_mm512_and_si512(_mm512_srli_epi16(pair23, 4), mask));
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const std::int16_t* q = q16 + h * head_dim + c;
      const __m512i q01 = broadcast_dword(q), q23 = broadcast_dword(q + 2);
      sum[h][0] = dot_pairs(dot_pairs(sum[h][0], even01, q01), even23, q23);
      sum[h][1] = dot_pairs(dot_pairs(sum[h][1], odd01, q01), odd23, q23);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  KVPACK_UNROLL  // the accumulators stay in registers
  for (int h = 0; h < kG; ++h) {
    const __m512 s = _mm512_set1_ps(step[h]), b = _mm512_set1_ps(bias[h]);
    const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][0]), s, b);
    const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][1]), s, b);
    _mm512_storeu_ps(scores + h * stride, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(scores + h * stride + 16, _mm512_permutex2var_ps(even, second, odd));
  }
}

/// One page's weights times per-token scales as int8, in one pass per head: each head's weights
/// w (≥ 0, rows `weight_stride` apart) times `scales` ([page_size]: KIVI's token scales of one
/// channel group, KVQuant's token ranges, TurboQuant's norms), w8[h][t] · step[h] ≈
/// w[h][t]·scales[t], with step[h] = p_max[h] · s_max / 127 from the head's largest weight and the
/// largest |scale| (a bound on max |w·s|, so nothing saturates, found without a reduction per
/// head). Encoders store scales ≥ 0, but a page admitted with PageCheck::kFinite may hold any
/// finite ones, and the reference decodes them as they are. Σ_t w·mins[t] is added to the head's
/// 16 partial sums at `min_sums + h·min_stride`. Neither product is stored in fp32.
inline void quantize_group_weights(xsimd::avx512bw, const float* weights, index_t weight_stride, index_t group,
                                   index_t page_size, const float* scales, const float* mins, const float* p_max,
                                   float* min_sums, index_t min_stride, std::int8_t* w8, float* step) noexcept {
  __m512 largest = _mm512_setzero_ps();
  for (index_t t = 0; t < page_size; t += 16) {
    largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(scales + t)));
  }
  const float s_max = _mm512_reduce_max_ps(largest);
  for (index_t h = 0; h < group; ++h) {
    const float* w = weights + static_cast<std::size_t>(h) * weight_stride;
    std::int8_t* out = w8 + static_cast<std::size_t>(h) * page_size;
    float* min_sum = min_sums + static_cast<std::size_t>(h) * min_stride;
    step[h] = p_max[h] * s_max / 127.0f;
    // Below the smallest normal float every product is too: the codes become 0 and so does the step.
    const bool negligible = !(step[h] >= std::numeric_limits<float>::min());
    const __m512 inverse = _mm512_set1_ps(negligible ? 0.0f : 1.0f / step[h]);
    if (negligible) step[h] = 0.0f;
    __m512 sum = _mm512_loadu_ps(min_sum);
    for (index_t t = 0; t < page_size; t += 16) {
      const __m512 wt = _mm512_loadu_ps(w + t);
      sum = _mm512_fmadd_ps(wt, _mm512_loadu_ps(mins + t), sum);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(wt, _mm512_loadu_ps(scales + t)), inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + t), _mm512_cvtsepi32_epi8(q));
    }
    _mm512_storeu_ps(min_sum, sum);
  }
}

/// Sums of kG heads over one page for 32 channels of one channel group, from the codes at
/// `codes` (token t's row row_bytes·t further on): sums[h][lane order] += step_h · Σ_t w8·operand(code).
template <int kG, class Operand = RawCodes>
KVPACK_ALWAYS_INLINE void accumulate_channels(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                              const std::int8_t* w8, const float* step, float* sums,
                                              index_t head_dim, PagePrefetcher& prefetcher,
                                              const Operand& operand = {}) noexcept {
  __m512i sum[kG][2];
  for (auto& head : sum) head[0] = head[1] = _mm512_setzero_si512();
  for (index_t t = 0; t < page_size; t += 4) {
    prefetcher.step();
    __m512i even, odd;
    load_quads(codes + row_bytes * static_cast<std::size_t>(t), row_bytes, even, odd);
    even = operand.bytes(even);
    odd = operand.bytes(odd);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m512i quad = broadcast_dword(w8 + static_cast<std::size_t>(h) * page_size + t);
      sum[h][0] = dot_quads(sum[h][0], even, quad);
      sum[h][1] = dot_quads(sum[h][1], odd, quad);
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m512 s = _mm512_set1_ps(step[h]);
    float* out = sums + h * head_dim;
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][0]), s, _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][1]), s, _mm512_loadu_ps(out + 16)));
  }
}

/// Eight 8-byte rows `stride` apart, row r in 64-bit lane r.
KVPACK_ALWAYS_INLINE __m512i load_eight_rows(const std::uint8_t* p, std::size_t stride) noexcept {
  if (stride == 8) return _mm512_loadu_si512(p);  // contiguous (keys of 32-token pages)
  auto two = [&](std::size_t r) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + r * stride)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + (r + 1) * stride)));
  };
  __m512i rows = _mm512_castsi128_si512(two(0));
  rows = _mm512_inserti32x4(rows, two(2), 1);
  rows = _mm512_inserti32x4(rows, two(4), 2);
  return _mm512_inserti32x4(rows, two(6), 3);
}

/// Bytes 2m and 2m + 1 of each of the eight rows into 128-bit lane m, row r at bytes 2r, 2r + 1.
KVPACK_ALWAYS_INLINE __m512i byte_pairs_by_lane(__m512i rows) noexcept {
  alignas(64) static constexpr std::int16_t kWords[32] = {0, 4, 8,  12, 16, 20, 24, 28, 1, 5, 9,  13, 17, 21, 25, 29,
                                                          2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kWords), rows);
}

/// Code j (bits 2j, 2j + 1) of every byte of `packed`, in place.
template <int J>
KVPACK_ALWAYS_INLINE __m512i two_bit_codes(__m512i packed, __m512i mask) noexcept {
  if constexpr (J == 0) return _mm512_and_si512(packed, mask);
  return _mm512_and_si512(_mm512_srli_epi16(packed, 2 * J), mask);
}

/// The four vectors of 2-bit sums, lane 4m + i holding element 4k + J for k = 2m + i / 2 (half of
/// it in lane i even, half in lane i odd), as 32 sums in element order.
KVPACK_ALWAYS_INLINE void lane_pairs_in_order(const __m512 (&sums)[4], __m512& first, __m512& second) noexcept {
  auto pair_sums = [](__m512 x) {  // lane 2k: lanes 2k + 2k+1
    return _mm512_add_ps(x, _mm512_castsi512_ps(_mm512_srli_epi64(_mm512_castps_si512(x), 32)));
  };
  auto odd_from = [](__m512 even, __m512 x) {  // lane 2k of x into lane 2k + 1
    return _mm512_mask_blend_ps(0xAAAA, even, _mm512_castsi512_ps(_mm512_slli_epi64(_mm512_castps_si512(x), 32)));
  };
  // 64-bit lane k: elements 4k, 4k + 1 (e01) and 4k + 2, 4k + 3 (e23).
  const __m512d e01 = _mm512_castps_pd(odd_from(pair_sums(sums[0]), pair_sums(sums[1])));
  const __m512d e23 = _mm512_castps_pd(odd_from(pair_sums(sums[2]), pair_sums(sums[3])));
  // 128-bit lane m: elements 8m .. 8m + 3 (low) and 8m + 4 .. 8m + 7 (high).
  const __m512d low = _mm512_unpacklo_pd(e01, e23), high = _mm512_unpackhi_pd(e01, e23);
  first = _mm512_castpd_ps(_mm512_permutex2var_pd(low, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), high));
  second = _mm512_castpd_ps(_mm512_permutex2var_pd(low, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), high));
}

/// Scores of kG heads for 32 tokens of one 2-bit key group from the codes at `codes` (channel c's
/// row row_bytes·c further on): step · Σ_c q16_c·operand(code) + bias, written in token order.
template <int kG, class Operand = RawCodes>
KVPACK_ALWAYS_INLINE void score_tokens_2bit(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                            const std::int16_t* q16, const float* step, const float* bias,
                                            float* scores, index_t stride, PagePrefetcher& prefetcher,
                                            const Operand& operand = {}) noexcept {
  // Dword i of 128-bit lane m: channels (0, 1) for i even, (2, 3) for i odd — or (4, 5) and (6, 7)
  // — each byte 2m + i / 2 widened to a word.
  const __m512i pairs0123 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 2, -1, 4, -1, 6, -1, 1, -1, 3, -1, 5, -1, 7, -1));
  const __m512i pairs4567 = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -1, 10, -1, 12, -1, 14, -1, 9, -1, 11, -1, 13, -1, 15, -1));
  const __m512i mask = _mm512_set1_epi16(3);
  __m512i sum[kG][4];
  for (auto& head : sum) head[0] = head[1] = head[2] = head[3] = _mm512_setzero_si512();
  for (index_t c = 0; c < head_dim; c += 8) {
    prefetcher.step();
    const __m512i bytes = byte_pairs_by_lane(load_eight_rows(codes + row_bytes * static_cast<std::size_t>(c), row_bytes));
    const __m512i low = _mm512_shuffle_epi8(bytes, pairs0123), high = _mm512_shuffle_epi8(bytes, pairs4567);
    const __m512i low_codes[4] = {
        operand.words(two_bit_codes<0>(low, mask)), operand.words(two_bit_codes<1>(low, mask)),
        operand.words(two_bit_codes<2>(low, mask)), operand.words(_mm512_srli_epi16(low, 6))};
    const __m512i high_codes[4] = {
        operand.words(two_bit_codes<0>(high, mask)), operand.words(two_bit_codes<1>(high, mask)),
        operand.words(two_bit_codes<2>(high, mask)), operand.words(_mm512_srli_epi16(high, 6))};
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      // The int16 query of channels c .. c + 3 and c + 4 .. c + 7.
      const std::int16_t* q = q16 + h * head_dim + c;
      const __m512i q_low = broadcast_qword(q), q_high = broadcast_qword(q + 4);
      KVPACK_UNROLL
      for (int j = 0; j < 4; ++j) sum[h][j] = dot_pairs(dot_pairs(sum[h][j], low_codes[j], q_low), high_codes[j], q_high);
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m512 s = _mm512_set1_ps(step[h]);
    const __m512 scaled[4] = {_mm512_mul_ps(_mm512_cvtepi32_ps(sum[h][0]), s), _mm512_mul_ps(_mm512_cvtepi32_ps(sum[h][1]), s),
                              _mm512_mul_ps(_mm512_cvtepi32_ps(sum[h][2]), s), _mm512_mul_ps(_mm512_cvtepi32_ps(sum[h][3]), s)};
    __m512 first, second;
    lane_pairs_in_order(scaled, first, second);
    const __m512 b = _mm512_set1_ps(bias[h]);
    _mm512_storeu_ps(scores + h * stride, _mm512_add_ps(first, b));
    _mm512_storeu_ps(scores + h * stride + 16, _mm512_add_ps(second, b));
  }
}

/// Sums of kG heads over one page for 32 channels of one 2-bit channel group, from the codes at
/// `codes` (token t's row row_bytes·t further on): sums[h][0..63] += step_h · Σ_t w8·operand(code),
/// in the lane order lane_pairs_in_order puts back.
template <int kG, class Operand = RawCodes>
KVPACK_ALWAYS_INLINE void accumulate_channels_2bit(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                                   const std::int8_t* w8, const float* step, float* sums,
                                                   index_t sums_stride, PagePrefetcher& prefetcher,
                                                   const Operand& operand = {}) noexcept {
  // Dword i of 128-bit lane m: byte 2m + i / 2 of tokens 0..3 for i even, 4..7 for i odd.
  const __m512i tokens = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m512i mask = _mm512_set1_epi8(3);
  __m512i sum[kG][4];
  for (auto& head : sum) head[0] = head[1] = head[2] = head[3] = _mm512_setzero_si512();
  for (index_t t = 0; t < page_size; t += 8) {
    prefetcher.step();
    const __m512i quads = _mm512_shuffle_epi8(
        byte_pairs_by_lane(load_eight_rows(codes + row_bytes * static_cast<std::size_t>(t), row_bytes)), tokens);
    const __m512i code[4] = {
        operand.bytes(two_bit_codes<0>(quads, mask)), operand.bytes(two_bit_codes<1>(quads, mask)),
        operand.bytes(two_bit_codes<2>(quads, mask)), operand.bytes(two_bit_codes<3>(quads, mask))};
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m512i w = broadcast_qword(w8 + static_cast<std::size_t>(h) * page_size + t);  // tokens t .. t + 7
      KVPACK_UNROLL
      for (int j = 0; j < 4; ++j) sum[h][j] = dot_quads(sum[h][j], code[j], w);
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m512 s = _mm512_set1_ps(step[h]);
    float* out = sums + h * sums_stride;
    KVPACK_UNROLL
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_ps(out + 16 * j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][j]), s, _mm512_loadu_ps(out + 16 * j)));
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu::kivi_vnni

#endif  // KVPACK_KERNELS_HAVE_VNNI
