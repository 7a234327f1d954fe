#pragma once
/// \file kivi_avx2.hpp
/// \brief KIVI's integer kernels on AVX2 (both code widths): the AVX-512 VNNI path's operands
///        (kivi_vnni.hpp: q·s in int16 per head for keys, w·s in int8 per head, page and channel
///        group for values), the same steps and rounding, so the same integers and error bound.
///
/// Keys take `vpmaddwd`: a step interleaves the bytes of two channel rows and widens them to
/// words, so that dword k holds both channels' codes of one token (4-bit: token 2k in the low
/// nibbles, 2k + 1 in the high; 2-bit: token 4k + j in bits 2j), against the two channels' int16
/// query. On AVX2 that is two instructions (product, add) per 16 products, as many as fp32 FMAs:
/// what the integers save is the conversion of every code.
///
/// Values take `vpmaddubsw` (32 u8 code · s8 weight products in one instruction): a step
/// interleaves four token rows byte by byte, tokens t, t + 1 in the low 128-bit lane and t + 2,
/// t + 3 in the high one, against each head's weights (w_t, w_t+1 | w_t+2, w_t+3). The int16 sums
/// last 8 steps (32 tokens): a word adds two products of at most 15·128 per step (a NaN weight
/// quantizes to −128), ≤ 30720. Then each lane is widened, the two lanes (the same channels,
/// other tokens) added and scaled into the fp32 sums, in KiviLanes<Bits, Group, avx2>'s order
/// (what add_value_sums_in_order puts back).

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kvpack/kernels/cpu/byte_levels.hpp"
#include "kvpack/kernels/cpu/integer_avx2.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"

#if KVPACK_KERNELS_HAVE_AVX2_INTEGER

namespace kvpack::inline v0::kernels::cpu::kivi_avx2 {

/// kivi_vnni::fold_query on AVX2, pass for pass: the same q16, steps and bias (up to the order
/// of the bias's fp32 sum) for finite input, from fp32 scales and minimums (head_dim of each, a
/// multiple of 8). KVQuant folds its calibrated ranges and offsets here.
inline bool fold_query(avx2_arch, const float* queries, index_t group, index_t head_dim, const float* scales,
                       const float* mins, float* folded, std::int16_t* q16, float* step, float* bias) noexcept {
  for (index_t h = 0; h < group; ++h) {
    const float* q = queries + h * head_dim;
    float* qs_h = folded + h * head_dim;
    __m256 dot = _mm256_setzero_ps(), largest = _mm256_setzero_ps();
    for (index_t c = 0; c < head_dim; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      const __m256 qs = _mm256_mul_ps(qc, _mm256_loadu_ps(scales + c));
      _mm256_storeu_ps(qs_h + c, qs);
      largest = _mm256_max_ps(largest, avx2::abs(qs));
      dot = _mm256_fmadd_ps(qc, _mm256_loadu_ps(mins + c), dot);
    }
    step[h] = avx2::reduce_max(largest);  // the largest |q·s| until the loop below
    bias[h] = avx2::reduce_add(dot);
  }
  for (index_t h = 0; h < group; ++h) {
    if (!(step[h] <= std::numeric_limits<float>::max())) return false;
    step[h] = step[h] > 0.0f ? step[h] / 32767.0f : 1.0f;
  }
  for (index_t h = 0; h < group; ++h) {
    const __m256 inverse = _mm256_set1_ps(1.0f / step[h]);
    for (index_t c = 0; c < head_dim; c += 8) {
      const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(folded + h * head_dim + c), inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q16 + h * head_dim + c), avx2::saturate_to_int16(qi));
    }
  }
  return true;
}

/// KIVI's fold of one token group: its fp16 scales and minimums converted once for all heads
/// into `converted` ([2][head_dim]).
inline bool fold_query(avx2_arch arch, const float* queries, index_t group, index_t head_dim,
                       const std::uint16_t* scales, const std::uint16_t* mins, float* converted, float* folded,
                       std::int16_t* q16, float* step, float* bias) noexcept {
  for (index_t c = 0; c < head_dim; c += 8) {
    _mm256_storeu_ps(converted + c, avx2::load_halves(reinterpret_cast<const std::byte*>(scales + c)));
    _mm256_storeu_ps(converted + head_dim + c, avx2::load_halves(reinterpret_cast<const std::byte*>(mins + c)));
  }
  return fold_query(arch, queries, group, head_dim, converted, converted + head_dim, folded, q16, step, bias);
}

/// What the key kernels multiply for a vector of codes in words (high byte zero): KIVI the codes
/// themselves, KVQuant its codebook's levels as bytes (LevelBytes) through a byte shuffle.
struct RawCodes {
  KVPACK_ALWAYS_INLINE __m256i words(__m256i codes) const noexcept { return codes; }
};

struct ByteLevels {
  __m256i table;
  float step = 0.0f;  ///< LevelBytes::step

  KVPACK_ALWAYS_INLINE explicit ByteLevels(const float (&levels)[16]) noexcept {
    const LevelBytes level_bytes(levels, LevelBytes::largest(levels));
    step = level_bytes.step;
    table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(level_bytes.bytes)));
  }
  /// Bit 7 set in each high byte makes the shuffle write 0 there.
  KVPACK_ALWAYS_INLINE __m256i words(__m256i codes) const noexcept {
    return _mm256_shuffle_epi8(table, _mm256_or_si256(codes, _mm256_set1_epi16(static_cast<short>(0x8000))));
  }
};

/// The 8 bytes at p.
KVPACK_ALWAYS_INLINE __m128i load_eight(const std::uint8_t* p) noexcept {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

/// Byte k of the 8 at `first` and of the 8 at `second` as the two words of dword k.
KVPACK_ALWAYS_INLINE __m256i channel_pair_words(const std::uint8_t* first, const std::uint8_t* second) noexcept {
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(load_eight(first), load_eight(second)));
}

/// Even and odd tokens' fp32 scores (lane k: tokens 2k and 2k + 1) stored as 16 tokens in order.
KVPACK_ALWAYS_INLINE void store_interleaved(__m256 even, __m256 odd, float* out) noexcept {
  const __m256 low = _mm256_unpacklo_ps(even, odd);   // tokens 0..3 | 8..11
  const __m256 high = _mm256_unpackhi_ps(even, odd);  // tokens 4..7 | 12..15
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(low, high, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(low, high, 0x31));
}

/// Scores of kG heads for 16 tokens (8 bytes of each 4-bit channel row at `codes`, channel c's
/// row row_bytes·c further on): step · Σ_c q16_c·code + bias. A prefetch step per 4 channels.
template <int kG, class Operand>
KVPACK_ALWAYS_INLINE void score_16_tokens(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                          const std::int16_t* q16, const float* step, const float* bias, float* scores,
                                          index_t stride, PagePrefetcher& prefetcher, const Operand& operand) noexcept {
  const __m256i mask = _mm256_set1_epi16(0x0F);
  __m256i even[kG], odd[kG];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) even[h] = odd[h] = _mm256_setzero_si256();
  for (index_t c = 0; c < head_dim; c += 4) {
    prefetcher.step();
    KVPACK_UNROLL
    for (index_t pair = c; pair < c + 4; pair += 2) {
      const std::uint8_t* row = codes + row_bytes * static_cast<std::size_t>(pair);
      const __m256i words = channel_pair_words(row, row + row_bytes);
      const __m256i low = operand.words(_mm256_and_si256(words, mask));
      const __m256i high = operand.words(_mm256_srli_epi16(words, 4));
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const __m256i q = avx2::broadcast_dword(q16 + h * head_dim + pair);
        even[h] = _mm256_add_epi32(even[h], _mm256_madd_epi16(low, q));
        odd[h] = _mm256_add_epi32(odd[h], _mm256_madd_epi16(high, q));
      }
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m256 s = _mm256_set1_ps(step[h]), b = _mm256_set1_ps(bias[h]);
    store_interleaved(_mm256_fmadd_ps(_mm256_cvtepi32_ps(even[h]), s, b),
                      _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd[h]), s, b), scores + h * stride);
  }
}

/// kivi_vnni::score_tokens on AVX2: kG ≤ 4 heads for the 32 tokens of 16 bytes of each 4-bit
/// channel row, in two passes of 16 (four heads' accumulators of 32 tokens would not fit the 16
/// registers). head_dim / 2 prefetch steps.
template <int kG, class Operand = RawCodes>
KVPACK_ALWAYS_INLINE void score_tokens(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                       const std::int16_t* q16, const float* step, const float* bias, float* scores,
                                       index_t stride, PagePrefetcher& prefetcher,
                                       const Operand& operand = {}) noexcept {
  score_16_tokens<kG>(codes, row_bytes, head_dim, q16, step, bias, scores, stride, prefetcher, operand);
  score_16_tokens<kG>(codes + 8, row_bytes, head_dim, q16, step, bias, scores + 16, stride, prefetcher, operand);
}

/// kivi_vnni::score_tokens_2bit on AVX2: kG ≤ 2 heads for the 32 tokens of 8 bytes of each 2-bit
/// channel row (four accumulators per head: lane k of vector j is token 4k + j). head_dim / 8
/// prefetch steps.
template <int kG, class Operand = RawCodes>
KVPACK_ALWAYS_INLINE void score_tokens_2bit(const std::uint8_t* codes, std::size_t row_bytes, index_t head_dim,
                                            const std::int16_t* q16, const float* step, const float* bias,
                                            float* scores, index_t stride, PagePrefetcher& prefetcher,
                                            const Operand& operand = {}) noexcept {
  const __m256i mask = _mm256_set1_epi16(3);
  __m256i sum[kG][4];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) sum[h][0] = sum[h][1] = sum[h][2] = sum[h][3] = _mm256_setzero_si256();
  for (index_t c = 0; c < head_dim; c += 2) {
    if (c % 8 == 0) prefetcher.step();
    const std::uint8_t* row = codes + row_bytes * static_cast<std::size_t>(c);
    const __m256i words = channel_pair_words(row, row + row_bytes);
    const __m256i code[4] = {operand.words(_mm256_and_si256(words, mask)),
                             operand.words(_mm256_and_si256(_mm256_srli_epi16(words, 2), mask)),
                             operand.words(_mm256_and_si256(_mm256_srli_epi16(words, 4), mask)),
                             operand.words(_mm256_srli_epi16(words, 6))};
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m256i q = avx2::broadcast_dword(q16 + h * head_dim + c);
      KVPACK_UNROLL
      for (int j = 0; j < 4; ++j) sum[h][j] = _mm256_add_epi32(sum[h][j], _mm256_madd_epi16(code[j], q));
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m256 s = _mm256_set1_ps(step[h]), b = _mm256_set1_ps(bias[h]);
    __m256 x[4];
    KVPACK_UNROLL
    for (int j = 0; j < 4; ++j) x[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][j]), s, b);
    // A 4×4 transpose in each 128-bit lane: lanes k = 0..3 hold tokens 0..15, k = 4..7 16..31.
    const __m256 t01 = _mm256_unpacklo_ps(x[0], x[1]), t23 = _mm256_unpacklo_ps(x[2], x[3]);  // 0, 1, 4, 5 | 2, 3, 6, 7
    const __m256 u01 = _mm256_unpackhi_ps(x[0], x[1]), u23 = _mm256_unpackhi_ps(x[2], x[3]);  // 8, 9, 12, 13 | ...
    const __m256 first = _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0));   // 0..3 | 16..19
    const __m256 second = _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2));  // 4..7 | 20..23
    const __m256 third = _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0));   // 8..11 | 24..27
    const __m256 fourth = _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2));  // 12..15 | 28..31
    float* out = scores + h * stride;
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(first, second, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(third, fourth, 0x20));
    _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(first, second, 0x31));
    _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(third, fourth, 0x31));
  }
}

/// kivi_vnni::quantize_group_weights on AVX2, step for step: the same int8 weights and steps;
/// each head's Σ_t w·mins[t] goes to its 8 partial sums at `min_sums + h·min_stride`.
inline void quantize_group_weights(avx2_arch, const float* weights, index_t weight_stride, index_t group,
                                   index_t page_size, const float* scales, const float* mins, const float* p_max,
                                   float* min_sums, index_t min_stride, std::int8_t* w8, float* step) noexcept {
  __m256 largest = _mm256_setzero_ps();
  for (index_t t = 0; t < page_size; t += 8) largest = _mm256_max_ps(largest, avx2::abs(_mm256_loadu_ps(scales + t)));
  const float s_max = avx2::reduce_max(largest);
  for (index_t h = 0; h < group; ++h) {
    const float* w = weights + static_cast<std::size_t>(h) * weight_stride;
    std::int8_t* out = w8 + static_cast<std::size_t>(h) * page_size;
    float* min_sum = min_sums + static_cast<std::size_t>(h) * min_stride;
    step[h] = p_max[h] * s_max / 127.0f;
    // Below the smallest normal float every product is too: the codes become 0 and so does the step.
    const bool negligible = !(step[h] >= std::numeric_limits<float>::min());
    const __m256 inverse = _mm256_set1_ps(negligible ? 0.0f : 1.0f / step[h]);
    if (negligible) step[h] = 0.0f;
    __m256 sum = _mm256_loadu_ps(min_sum);
    for (index_t t = 0; t < page_size; t += 8) {
      const __m256 wt = _mm256_loadu_ps(w + t);
      sum = _mm256_fmadd_ps(wt, _mm256_loadu_ps(mins + t), sum);
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(wt, _mm256_loadu_ps(scales + t)), inverse));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + t), avx2::saturate_to_int8(q));
    }
    _mm256_storeu_ps(min_sum, sum);
  }
}

/// Four token rows from `row` (row_bytes apart) as the value kernels' byte pairs: 16 bytes each
/// give two vectors, bytes 0..7 (`low`) and 8..15 (`high`) of tokens t, t + 1 in the low lane and
/// of t + 2, t + 3 in the high one; 8 bytes each give `low` only.
KVPACK_ALWAYS_INLINE void token_quad_pairs(const std::uint8_t* row, std::size_t row_bytes, __m256i& low,
                                           __m256i& high) noexcept {
  auto load = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + row_bytes * r)); };
  const __m256i even = _mm256_inserti128_si256(_mm256_castsi128_si256(load(0)), load(2), 1);
  const __m256i odd = _mm256_inserti128_si256(_mm256_castsi128_si256(load(1)), load(3), 1);
  low = _mm256_unpacklo_epi8(even, odd);
  high = _mm256_unpackhi_epi8(even, odd);
}

KVPACK_ALWAYS_INLINE __m256i token_quad_pairs(const std::uint8_t* row, std::size_t row_bytes) noexcept {
  const __m128i first = _mm_unpacklo_epi8(load_eight(row), load_eight(row + row_bytes));
  const __m128i second = _mm_unpacklo_epi8(load_eight(row + 2 * row_bytes), load_eight(row + 3 * row_bytes));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1);
}

/// Each head's int8 weights of tokens t..t + 3 as (w_t, w_t+1) in every word of the low lane and
/// (w_t+2, w_t+3) in the high one.
KVPACK_ALWAYS_INLINE __m256i weight_pairs(const std::int8_t* w) noexcept {
  const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  //
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  return _mm256_shuffle_epi8(avx2::broadcast_dword(w), pairs);
}

/// The value kernels' page loop for 32 channels: `codes_of(row, code)` fills the four vectors of
/// u8 codes of four token rows; each head's int16 sums are widened, their lanes added and scaled
/// into `sums + h·sums_stride + 8j` (vector j) every 32 tokens. A prefetch step per 8 tokens.
template <int kG, class Codes>
KVPACK_ALWAYS_INLINE void accumulate_32_channels(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                                 const std::int8_t* w8, const float* step, float* sums,
                                                 index_t sums_stride, PagePrefetcher& prefetcher,
                                                 Codes&& codes_of) noexcept {
  for (index_t t0 = 0; t0 < page_size; t0 += 32) {
    __m256i sum[kG][4];
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) sum[h][0] = sum[h][1] = sum[h][2] = sum[h][3] = _mm256_setzero_si256();
    const index_t end = std::min<index_t>(t0 + 32, page_size);
    for (index_t t = t0; t < end; t += 4) {
      if (t % 8 == 0) prefetcher.step();
      __m256i code[4];
      codes_of(codes + row_bytes * static_cast<std::size_t>(t), code);
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const __m256i w = weight_pairs(w8 + static_cast<std::size_t>(h) * page_size + t);
        KVPACK_UNROLL
        for (int j = 0; j < 4; ++j) sum[h][j] = _mm256_add_epi16(sum[h][j], _mm256_maddubs_epi16(code[j], w));
      }
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m256 s = _mm256_set1_ps(step[h]);
      float* out = sums + h * sums_stride;
      KVPACK_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256i total = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sum[h][j])),
                                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sum[h][j], 1)));
        _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), s, _mm256_loadu_ps(out + 8 * j)));
      }
    }
  }
}

/// kivi_vnni::accumulate_channels on AVX2: kG ≤ 2 heads over one page for the 32 channels of 16
/// bytes of each 4-bit token row. Vectors 0..3: channels 0, 2, .., 14 | 1, 3, .., 15 | 16, .., 30
/// | 17, .., 31 (KiviLanes<4, Group, avx2>'s two chunks of 16). page_size / 8 prefetch steps.
template <int kG>
KVPACK_ALWAYS_INLINE void accumulate_channels(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                              const std::int8_t* w8, const float* step, float* sums,
                                              index_t sums_stride, PagePrefetcher& prefetcher) noexcept {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  accumulate_32_channels<kG>(codes, row_bytes, page_size, w8, step, sums, sums_stride, prefetcher,
                             [&](const std::uint8_t* row, __m256i (&code)[4]) KVPACK_ALWAYS_INLINE_LAMBDA {
                               __m256i low, high;
                               token_quad_pairs(row, row_bytes, low, high);
                               code[0] = _mm256_and_si256(low, mask);
                               code[1] = _mm256_and_si256(_mm256_srli_epi16(low, 4), mask);
                               code[2] = _mm256_and_si256(high, mask);
                               code[3] = _mm256_and_si256(_mm256_srli_epi16(high, 4), mask);
                             });
}

/// kivi_vnni::accumulate_channels_2bit on AVX2: kG ≤ 2 heads over one page for the 32 channels of
/// 8 bytes of each 2-bit token row. Vector j: channels 4k + j (KiviLanes<2, Group, avx2>'s
/// order). page_size / 8 prefetch steps.
template <int kG>
KVPACK_ALWAYS_INLINE void accumulate_channels_2bit(const std::uint8_t* codes, std::size_t row_bytes,
                                                   index_t page_size, const std::int8_t* w8, const float* step,
                                                   float* sums, index_t sums_stride,
                                                   PagePrefetcher& prefetcher) noexcept {
  const __m256i mask = _mm256_set1_epi8(3);
  accumulate_32_channels<kG>(codes, row_bytes, page_size, w8, step, sums, sums_stride, prefetcher,
                             [&](const std::uint8_t* row, __m256i (&code)[4]) KVPACK_ALWAYS_INLINE_LAMBDA {
                               const __m256i packed = token_quad_pairs(row, row_bytes);
                               code[0] = _mm256_and_si256(packed, mask);
                               code[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 2), mask);
                               code[2] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
                               code[3] = _mm256_and_si256(_mm256_srli_epi16(packed, 6), mask);
                             });
}

/// KVQuant's value sums (4- or 2-bit codes) for kG ≤ 2 heads over one page and 32 channels (16 or
/// 8 bytes of each token row at `codes`): sums[h][8j..] += step_h · Σ_t w16[h][t]·byte(code_tc),
/// in KiviLanes<Bits, 32, avx2>'s order. The byte levels reach 255, so vpmaddubsw (the KIVI value
/// kernels' product, ≤ 2·255·128 a pair) would saturate; instead a step widens two token rows'
/// bytes to words, dword k holding byte k of both tokens, looks the levels up as words and
/// multiplies them by the pair (w_t, w_t+1) on vpmaddwd: the same integers as the AVX-512 path,
/// half as many products an instruction. The int8 weights come as int16 (|w| ≤ 128): a page's
/// sum stays below 256·255·128. page_size / 8 prefetch steps.
template <int Bits, int kG>
KVPACK_ALWAYS_INLINE void accumulate_level_pairs(const std::uint8_t* codes, std::size_t row_bytes, index_t page_size,
                                                 const std::int16_t* w16, const float* step, float* sums,
                                                 index_t sums_stride, PagePrefetcher& prefetcher,
                                                 const ByteLevels& levels) noexcept {
  __m256i sum[kG][4];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) sum[h][0] = sum[h][1] = sum[h][2] = sum[h][3] = _mm256_setzero_si256();
  for (index_t t = 0; t < page_size; t += 2) {
    if (t % 8 == 0) prefetcher.step();
    const std::uint8_t* row = codes + row_bytes * static_cast<std::size_t>(t);
    __m256i level[4];
    if constexpr (Bits == 4) {  // vectors 0..3: channels 0, 2, .., 14 | 1, .., 15 | 16, .., 30 | 17, .., 31
      const __m256i mask = _mm256_set1_epi16(0x0F);
      KVPACK_UNROLL
      for (int half = 0; half < 2; ++half) {
        const __m256i words = channel_pair_words(row + 8 * half, row + row_bytes + 8 * half);
        level[2 * half] = levels.words(_mm256_and_si256(words, mask));
        level[2 * half + 1] = levels.words(_mm256_srli_epi16(words, 4));
      }
    } else {  // vector j: channels 4k + j
      const __m256i mask = _mm256_set1_epi16(3);
      const __m256i words = channel_pair_words(row, row + row_bytes);
      level[0] = levels.words(_mm256_and_si256(words, mask));
      level[1] = levels.words(_mm256_and_si256(_mm256_srli_epi16(words, 2), mask));
      level[2] = levels.words(_mm256_and_si256(_mm256_srli_epi16(words, 4), mask));
      level[3] = levels.words(_mm256_srli_epi16(words, 6));
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m256i w = avx2::broadcast_dword(w16 + static_cast<std::size_t>(h) * page_size + t);
      KVPACK_UNROLL
      for (int j = 0; j < 4; ++j) sum[h][j] = _mm256_add_epi32(sum[h][j], _mm256_madd_epi16(level[j], w));
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m256 s = _mm256_set1_ps(step[h]);
    float* out = sums + h * sums_stride;
    KVPACK_UNROLL
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][j]), s, _mm256_loadu_ps(out + 8 * j)));
    }
  }
}

/// Two runs of 32 3-bit codes (24 bytes, packed from the low bit up as get_code<3> reads them;
/// bytes 24..31 of `bytes` are ignored) as two runs of 4-bit codes, 16 bytes each with even codes
/// in the low nibbles, run r in 128-bit lane r: byte_levels.hpp's widen_3bit_runs in AVX2's steps.
/// Word j of a lane takes the two bytes that hold codes 4j..4j+3 (bits 12j..12j+11), the odd
/// words shifted down by 4 (a blend: AVX2 has no per-word shift); two shift-and-mask steps then
/// move the four 3-bit fields to nibbles 0..3.
KVPACK_ALWAYS_INLINE __m256i widen_3bit_runs(__m256i bytes) noexcept {
  const __m256i spread = _mm256_setr_epi32(0, 1, 2, 0, 3, 4, 5, 0);
  const __m256i pairs = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11));
  const __m256i words = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(bytes, spread), pairs);
  const __m256i aligned = _mm256_blend_epi16(words, _mm256_srli_epi16(words, 4), 0xAA);
  // Fields at bits 0, 3, 6, 9 to 0, 3 | 8, 11, then to 0, 4 | 8, 12; the masks clear the bits between.
  const __m256i halves = _mm256_or_si256(_mm256_and_si256(aligned, _mm256_set1_epi16(0x003F)),
                                         _mm256_and_si256(_mm256_slli_epi16(aligned, 2), _mm256_set1_epi16(0x3F00)));
  return _mm256_or_si256(_mm256_and_si256(halves, _mm256_set1_epi16(0x0707)),
                         _mm256_and_si256(_mm256_slli_epi16(halves, 1), _mm256_set1_epi16(0x7070)));
}

/// 3-bit codes rewritten as 4-bit ones for the 4-bit kernels, as byte_levels.hpp's
/// widen_3bit_codes on AVX-512: `chunks` (even) contiguous runs of 32 codes, 12 bytes each, become
/// 16 bytes each.
KVPACK_ALWAYS_INLINE void widen_3bit_codes(const std::uint8_t* in, std::size_t chunks, std::uint8_t* out) noexcept {
  const __m256i first_six_dwords = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
  for (std::size_t i = 0; i < chunks; i += 2) {
    const auto* at = in + 12 * i;
    // A full load reads 8 bytes past the two runs: the next runs', except on the last pass.
    const __m256i bytes = i + 2 < chunks ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                         : _mm256_maskload_epi32(reinterpret_cast<const int*>(at), first_six_dwords);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), widen_3bit_runs(bytes));
  }
}

/// Each head's int8 weights ([group][page_size], page_size a multiple of 16) as int16 into `w16`,
/// and their sums: the −128 of every byte level, taken out once per page.
inline void widen_weights(avx2_arch, const std::int8_t* w8, index_t group, index_t page_size, std::int16_t* w16,
                          std::int32_t* sums) noexcept {
  for (index_t h = 0; h < group; ++h) {
    __m256i sum = _mm256_setzero_si256();
    for (index_t t = 0; t < page_size; t += 16) {
      const std::size_t at = static_cast<std::size_t>(h) * page_size + t;
      const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + at)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w16 + at), words);
      sum = _mm256_add_epi32(sum, avx2::widen_pairs(words));
    }
    sums[h] = avx2::reduce_add(sum);
  }
}

}  // namespace kvpack::inline v0::kernels::cpu::kivi_avx2

#endif  // KVPACK_KERNELS_HAVE_AVX2_INTEGER
