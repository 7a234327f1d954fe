#pragma once
/// \file integer_avx2.hpp
/// \brief What the AVX2 integer kernels (q4_0_avx2.hpp, integer_pairs_avx2.hpp) share: lane
///        reductions, fp16 scale rows, the page loop of the key kernels, and a page's weights
///        quantized to int8 or int16.
///
/// AVX2 has no vpdpbusd, but `vpmaddubsw` multiplies 32 u8·s8 pairs into 16 int16 sums of two
/// and `vpmaddwd` against ones widens those to 8 int32 sums of four: 32 products in two
/// instructions, where the fp32 path spends a widening, a conversion and an FMA on 8.
/// vpmaddubsw saturates its int16 sums, so every caller bounds them (4-bit codes ≤ 15 times
/// |int8| ≤ 127: a pair sums to at most 3810, and up to eight such sums fit in an int16).
/// 8-bit codes take `vpmaddwd` on int16 operands instead, as vpdpwssd does on AVX-512.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/integer_common.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"

#if XSIMD_WITH_FMA3_AVX2 && defined(__F16C__)
#define KVPACK_KERNELS_HAVE_AVX2_INTEGER 1
#else
#define KVPACK_KERNELS_HAVE_AVX2_INTEGER 0
#endif

namespace kvpack::inline v0::kernels::cpu {

#if KVPACK_KERNELS_HAVE_AVX2_INTEGER

using avx2_arch = xsimd::fma3<xsimd::avx2>;

namespace avx2 {

KVPACK_ALWAYS_INLINE float reduce_max(__m256 x) noexcept {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

KVPACK_ALWAYS_INLINE std::int32_t reduce_add(__m256i x) noexcept {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

KVPACK_ALWAYS_INLINE float reduce_add(__m256 x) noexcept {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVPACK_ALWAYS_INLINE __m256 abs(__m256 x) noexcept {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
}

/// Eight fp16 values at p as fp32.
KVPACK_ALWAYS_INLINE __m256 load_halves(const std::byte* p) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// The 4 bytes at p in every 32-bit lane.
KVPACK_ALWAYS_INLINE __m256i broadcast_dword(const void* p) noexcept {
  std::int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _mm256_set1_epi32(bits);
}

/// Each 32-bit lane's four int16 (the sums vpmaddubsw left in it, two per lane) added as int32.
KVPACK_ALWAYS_INLINE __m256i widen_pairs(__m256i sums16) noexcept {
  return _mm256_madd_epi16(sums16, _mm256_set1_epi16(1));
}

/// The low and high nibbles of 32 bytes, each as unsigned bytes.
KVPACK_ALWAYS_INLINE void split_nibbles(const std::uint8_t* p, __m256i& low, __m256i& high) noexcept {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  low = _mm256_and_si256(raw, mask);
  high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
}

/// Eight int32 lanes as int16 with signed saturation (vpmovsdw's result).
KVPACK_ALWAYS_INLINE __m128i saturate_to_int16(__m256i x) noexcept {
  return _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/// Eight int32 lanes as int8 with signed saturation (vpmovsdb's result), in the low 8 bytes.
KVPACK_ALWAYS_INLINE __m128i saturate_to_int8(__m256i x) noexcept {
  const __m128i words = saturate_to_int16(x);
  return _mm_packs_epi16(words, words);
}

}  // namespace avx2

/// The page loop of the AVX2 integer key kernels (score_pages_vnni's): for every page and block
/// of at most four query heads (their sums and fp32 totals, with the codes, fill the 16
/// registers), `tile(kG, kTiles, plane, t0, h0, scores, prefetcher)` scores kTiles·8 tokens from
/// t0, two tiles a pass below four heads; then dead slots are masked.
template <class Tile>
KVPACK_ALWAYS_INLINE void score_pages_avx2(const ScoreArgs<quant::NoParams>& args, index_t steps, Tile&& tile) {
  const PageRun& run = args.run;
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, steps);
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * run.page_size;
    for_each_head_block<4>(args.group, [&](auto block, index_t h0) {
      constexpr int kTiles = decltype(block)::value >= 4 ? 1 : 2;
      float* out = scores + h0 * args.score_stride;
      index_t t0 = 0;
      for (; t0 + 8 * kTiles <= run.page_size; t0 += 8 * kTiles) {
        tile(block, std::integral_constant<int, kTiles>{}, plane, t0, h0, out, prefetcher);
      }
      for (; t0 < run.page_size; t0 += 8) tile(block, std::integral_constant<int, 1>{}, plane, t0, h0, out, prefetcher);
    });
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// QuantizedWeights on AVX2, with the AVX-512 path's arithmetic (integer_common.hpp): the same
/// steps, the same rounding (vcvtps2dq, nearest even), the same saturation, so for finite input
/// both paths give every weight the same integer.
template <class T>
void quantize_weights(avx2_arch, const float* weights, index_t weight_stride, index_t group, const std::byte* plane,
                      std::size_t codes_bytes, index_t page_size, index_t blocks,
                      const QuantizedWeights<T>& out) noexcept {
  constexpr float kMax = std::is_same_v<T, std::int16_t> ? 32767.0f : 127.0f;
  float scale_max[64];  // blocks <= head_dim / 32 <= 64 (codecs cap head_dim at 2048)
  for (index_t b = 0; b < blocks; ++b) {
    __m256 lanes = _mm256_setzero_ps();
    float* unit = out.unit_scales + static_cast<std::size_t>(b) * page_size;
    for (index_t t = 0; t < page_size; t += 8) {
      const __m256 s = avx2::load_halves(plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t) * 2);
      _mm256_storeu_ps(unit + t, s);
      lanes = _mm256_max_ps(lanes, avx2::abs(s));
    }
    scale_max[b] = avx2::reduce_max(lanes);
    const __m256 normalise = _mm256_set1_ps(scale_max[b] > 0.0f ? kMax / scale_max[b] : 0.0f);
    for (index_t t = 0; t < page_size; t += 8) {
      _mm256_storeu_ps(unit + t, _mm256_mul_ps(_mm256_loadu_ps(unit + t), normalise));
    }
  }
  for (index_t h = 0; h < group; ++h) {
    const float* w = weights + h * weight_stride;
    __m256 lanes = _mm256_setzero_ps();
    for (index_t t = 0; t < page_size; t += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(w + t));
    const float p_max = avx2::reduce_max(lanes);  // weights are exp(.) >= 0
    const __m256 p_normalise = _mm256_set1_ps(p_max > 0.0f ? 1.0f / p_max : 0.0f);
    for (index_t b = 0; b < blocks; ++b) {
      out.step[h * blocks + b] = p_max * scale_max[b] / kMax;
      T* q = out.values + (static_cast<std::size_t>(h) * blocks + b) * page_size;
      const float* unit = out.unit_scales + static_cast<std::size_t>(b) * page_size;
      __m256i sum = _mm256_setzero_si256();
      for (index_t t = 0; t < page_size; t += 8) {
        const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(w + t), p_normalise);
        const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(p, _mm256_loadu_ps(unit + t)));
        sum = _mm256_add_epi32(sum, qi);
        if constexpr (std::is_same_v<T, std::int16_t>) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + t), avx2::saturate_to_int16(qi));
        } else {
          _mm_storel_epi64(reinterpret_cast<__m128i*>(q + t), avx2::saturate_to_int8(qi));
        }
      }
      out.sums[h * blocks + b] = avx2::reduce_add(sum);
    }
  }
}

#endif  // KVPACK_KERNELS_HAVE_AVX2_INTEGER

}  // namespace kvpack::inline v0::kernels::cpu
