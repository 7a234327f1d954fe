#pragma once
/// \file integer_common.hpp
/// \brief What the integer-code kernels (integer.hpp: int8, q8_0; q4_0.hpp; kivi_vnni.hpp) share:
///        scale access, group broadcasts and reductions for the portable path, and the AVX-512
///        VNNI helpers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpack/core/half.hpp"
#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"

#if defined(__AVX512VNNI__) && XSIMD_WITH_AVX512BW
#define KVPACK_KERNELS_HAVE_VNNI 1
#else
#define KVPACK_KERNELS_HAVE_VNNI 0
#endif

namespace kvpack::inline v0::kernels::cpu {

/// fp16 scale of (token t, block b) of a plane whose scales start at `codes_bytes`, laid out
/// [blocks][page_size] (every integer codec's layout).
KVPACK_ALWAYS_INLINE float scale_at(const std::byte* plane, std::size_t codes_bytes,
                                    index_t page_size, index_t t, index_t b) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t) * 2, 2);
  return half::from_bits(bits);
}

/// Broadcasts kR consecutive floats (kR = 2 or 4) to every group of kR lanes.
template <int kR, class A>
KVPACK_ALWAYS_INLINE simd::f32<A> broadcast_group(const float* p) noexcept {
  if constexpr (kR == 2) {
    double pair;
    std::memcpy(&pair, p, sizeof(pair));
    return xsimd::bitwise_cast<simd::f32<A>>(xsimd::batch<double, A>(pair));
  } else {
    static_assert(kR == 4, "groups of 2 or 4 lanes");
    return simd::broadcast_quad<A>(p);
  }
}

/// out[i] (+)= the sum of lanes kR·i .. kR·i + kR - 1, for the W / kR groups of `x`.
template <int kR, bool kAdd, class A>
KVPACK_ALWAYS_INLINE void store_group_sums(simd::f32<A> x, float* out) noexcept {
  constexpr std::size_t kWidth = simd::f32<A>::size;
  alignas(64) float lanes[kWidth];
  x.store_aligned(lanes);
  for (std::size_t i = 0; i < kWidth / kR; ++i) {
    float sum = 0.0f;
    for (int r = 0; r < kR; ++r) sum += lanes[kR * i + r];
    if constexpr (kAdd) {
      out[i] += sum;
    } else {
      out[i] = sum;
    }
  }
}

/// Each token's scale kR times per block ([blocks][kR·page_size]), so it multiplies lanes that
/// hold kR values of one token directly (the portable key kernels).
template <int kR>
KVPACK_ALWAYS_INLINE void replicate_scales(const std::byte* plane, std::size_t codes_bytes, index_t page_size, index_t blocks,
                      float* out) noexcept {
  for (index_t b = 0; b < blocks; ++b) {
    for (index_t t = 0; t < page_size; ++t) {
      const float s = scale_at(plane, codes_bytes, page_size, t, b);
      for (int r = 0; r < kR; ++r) out[(static_cast<std::size_t>(b) * page_size + t) * kR + r] = s;
    }
  }
}

/// w_t · scale(t, b) for every head and block of one page ([group][blocks][page_size]): the
/// portable value kernels' weights.
KVPACK_ALWAYS_INLINE void scale_weights(const float* weights, index_t weight_stride, index_t group, const std::byte* plane,
                          std::size_t codes_bytes, index_t page_size, index_t blocks, float* out) noexcept {
  for (index_t h = 0; h < group; ++h) {
    const float* w = weights + h * weight_stride;
    for (index_t b = 0; b < blocks; ++b) {
      float* row = out + (static_cast<std::size_t>(h) * blocks + b) * page_size;
      for (index_t t = 0; t < page_size; ++t) row[t] = w[t] * scale_at(plane, codes_bytes, page_size, t, b);
    }
  }
}

/// One page's attention weights times its value scales, quantized per (head, block) to integers
/// of type T (int16 for 8-bit codes, int8 for 4-bit codes): q[(h·blocks + b)·P + t] ≈
/// w_t · scale(t, b) / step[h·blocks + b].
template <class T>
struct QuantizedWeights {
  T* values;            // [group][blocks][page_size]
  float* step;          // [group][blocks]
  std::int32_t* sums;   // [group][blocks]: Σ_t q (q4_0's -8 offset)
  float* unit_scales;   // [blocks][page_size]: scale(t, b) / max_t |scale(t, b)| · kMax
};

/// Carves QuantizedWeights out of a kernel's scratch floats.
template <class T>
KVPACK_ALWAYS_INLINE QuantizedWeights<T> weights_in_scratch(float* scratch, index_t group, index_t blocks,
                                                          index_t page_size) noexcept {
  const std::size_t values = static_cast<std::size_t>(group) * blocks * page_size;
  const std::size_t value_floats = (values * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  float* after = scratch + value_floats;
  return {reinterpret_cast<T*>(scratch), after, reinterpret_cast<std::int32_t*>(after + group * blocks),
          after + 2 * group * blocks};
}

#if KVPACK_KERNELS_HAVE_VNNI

/// The page loop of the AVX-512 integer key kernels: for every page and block of query heads,
/// `tile(kG, kTiles, plane, t0, h0, scores, prefetcher)` scores kTiles·16 tokens from t0 (two
/// 16-token tiles per pass give 2·kG accumulator chains; eight heads already give eight), then
/// dead slots are masked. `steps` is the number of prefetcher steps a tile pass takes per page.
template <class Tile>
KVPACK_ALWAYS_INLINE void score_pages_vnni(const ScoreArgs<quant::NoParams>& args, index_t steps, Tile&& tile) {
  const PageRun& run = args.run;
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, steps);
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * run.page_size;
    for_each_head_block(args.group, [&](auto block, index_t h0) {
      constexpr int kG = decltype(block)::value;
      constexpr int kTiles = kG >= 8 ? 1 : 2;
      float* out = scores + h0 * args.score_stride;
      index_t t0 = 0;
      for (; t0 + 16 * kTiles <= run.page_size; t0 += 16 * kTiles) {
        tile(block, std::integral_constant<int, kTiles>{}, plane, t0, h0, out, prefetcher);
      }
      for (; t0 < run.page_size; t0 += 16) tile(block, std::integral_constant<int, 1>{}, plane, t0, h0, out, prefetcher);
    });
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// The 4 bytes at p (four int8 values, or two int16) in every 32-bit lane, broadcast straight
/// from memory: through a general register (memcpy, then set1) it costs a shuffle-port uop.
KVPACK_ALWAYS_INLINE __m512i broadcast_dword(const void* p) noexcept {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
}
/// The 8 bytes at p in every 64-bit lane, from memory.
KVPACK_ALWAYS_INLINE __m512i broadcast_qword(const void* p) noexcept {
  return _mm512_broadcastq_epi64(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}

// GCC 12 surrounds the vpdpwssd/vpdpbusd builtins with a register copy of the accumulator for
// every call (measured 1.45x slower score loops); the instructions through inline asm keep the
// accumulator in place. AT&T operand order: source 2, source 1, destination.

/// acc + Σ of the two int16·int16 products in each 32-bit lane (vpdpwssd).
KVPACK_ALWAYS_INLINE __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm512_dpwssd_epi32(acc, a, b);
#endif
}

/// acc + Σ of the four u8(a)·s8(b) products in each 32-bit lane (vpdpbusd).
KVPACK_ALWAYS_INLINE __m512i dot_quads(__m512i acc, __m512i unsigned_a, __m512i signed_b) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(unsigned_a), "v"(signed_b));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, unsigned_a, signed_b);
#endif
}

/// w_t · scale(t, b) as T, per head and block, with the step p_max(h) · s_max(b) / kMax (kMax the
/// largest |T| used): the scales are normalised once per page for all heads, so each (head,
/// block) costs one multiply, one conversion and one pack per 16 tokens. The step bounds every
/// |w·s| (p ≤ p_max, |s| ≤ s_max), so nothing saturates, and rounding moves each weight by at
/// most half a step. The xsimd::avx512bw parameter tags the symbol with its ISA (STYLE.md §5.2).
template <class T>
void quantize_weights(xsimd::avx512bw, const float* weights, index_t weight_stride, index_t group,
                      const std::byte* plane, std::size_t codes_bytes, index_t page_size, index_t blocks,
                      const QuantizedWeights<T>& out) noexcept {
  constexpr float kMax = std::is_same_v<T, std::int16_t> ? 32767.0f : 127.0f;
  float scale_max[64];  // blocks <= head_dim / 32 <= 64 (codecs cap head_dim at 2048)
  for (index_t b = 0; b < blocks; ++b) {
    __m512 lanes = _mm512_setzero_ps();
    float* unit = out.unit_scales + static_cast<std::size_t>(b) * page_size;
    for (index_t t = 0; t < page_size; t += 16) {
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t) * 2)));
      _mm512_storeu_ps(unit + t, s);
      lanes = _mm512_max_ps(lanes, _mm512_abs_ps(s));
    }
    scale_max[b] = _mm512_reduce_max_ps(lanes);
    const __m512 normalise = _mm512_set1_ps(scale_max[b] > 0.0f ? kMax / scale_max[b] : 0.0f);
    for (index_t t = 0; t < page_size; t += 16) {
      _mm512_storeu_ps(unit + t, _mm512_mul_ps(_mm512_loadu_ps(unit + t), normalise));
    }
  }
  for (index_t h = 0; h < group; ++h) {
    const float* w = weights + h * weight_stride;
    __m512 lanes = _mm512_setzero_ps();
    for (index_t t = 0; t < page_size; t += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(w + t));
    const float p_max = _mm512_reduce_max_ps(lanes);  // weights are exp(.) >= 0
    const __m512 p_normalise = _mm512_set1_ps(p_max > 0.0f ? 1.0f / p_max : 0.0f);
    for (index_t b = 0; b < blocks; ++b) {
      out.step[h * blocks + b] = p_max * scale_max[b] / kMax;
      T* q = out.values + (static_cast<std::size_t>(h) * blocks + b) * page_size;
      const float* unit = out.unit_scales + static_cast<std::size_t>(b) * page_size;
      __m512i sum = _mm512_setzero_si512();
      for (index_t t = 0; t < page_size; t += 16) {
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(w + t), p_normalise);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(p, _mm512_loadu_ps(unit + t)));
        sum = _mm512_add_epi32(sum, qi);
        if constexpr (std::is_same_v<T, std::int16_t>) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + t), _mm512_cvtsepi32_epi16(qi));
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + t), _mm512_cvtsepi32_epi8(qi));
        }
      }
      out.sums[h * blocks + b] = _mm512_reduce_add_epi32(sum);
    }
  }
}

#endif  // KVPACK_KERNELS_HAVE_VNNI

}  // namespace kvpack::inline v0::kernels::cpu
