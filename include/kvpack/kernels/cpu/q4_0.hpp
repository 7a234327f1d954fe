#pragma once
/// \file q4_0.hpp
/// \brief SIMD decode-attention kernels for quant::Q4_0 (quad tiles of quant/tile_layout.hpp:
///        low nibbles channels 0–15 of a block, high nibbles 16–31; fp16 scales per token and
///        32-channel block; code q stands for (q - 8)·d).
///
/// Three paths over the same bytes:
/// - AVX-512 with VNNI: `vpdpbusd`, four u8·s8 products per 32-bit lane, twice the products per
///   instruction of the int16 path the 8-bit codecs use: at DRAM speed 4-bit pages need about
///   180 M token-head steps per second, which int16 dot products cannot issue on one core.
///   The price is 8-bit operands: the query is quantized to int8 per 32-channel block (each
///   element moves by at most 1/254 of its block's largest, well inside q4_0's own key error of
///   up to 1/16 of a block's largest), and each page's weights times the value scales to int8 per
///   head and block (each weight moves by at most 1/254 of that page's largest).
/// - AVX2 (q4_0_avx2.hpp): the same int8 operands on `vpmaddubsw`.
/// - every other target, and page sizes the integer tiles do not divide: codes widened to fp32
///   and FMAs on (token, quad) lanes.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/integer_common.hpp"
#include "kvpack/kernels/cpu/q4_0_avx2.hpp"
#include "kvpack/kernels/cpu/q4_0_rows.hpp"
#include "kvpack/quant/q4_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

// ---------------------------------------------------------------------------------------------
// Portable path: fp32 FMAs on (token, quad) lanes.
// ---------------------------------------------------------------------------------------------

/// Key scores of kG heads for W/4 tokens from t0; lanes are (token, channel of the quad).
/// `quad_scales` holds each token's scale four times per block ([blocks][4·page_size]).
template <int kG, class A>
KVPACK_ALWAYS_INLINE void score_q4_0_tile_fma(const std::byte* plane, index_t page_size, index_t head_dim,
                                              index_t t0, const float* q, const float* quad_scales, float* scores,
                                              index_t stride) noexcept {
  using batch = simd::f32<A>;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  batch total[kG];
  for (int h = 0; h < kG; ++h) total[h] = batch(0.0f);
  for (index_t b = 0; b < head_dim / 32; ++b) {
    batch part[kG];
    for (int h = 0; h < kG; ++h) part[h] = batch(0.0f);
    for (index_t j = 0; j < 4; ++j) {
      const simd::i32<A> raw = simd::load_u8<A>(codes + q4::key_row_offset(page_size, b, j, t0));
      const batch low = xsimd::to_float(raw & simd::i32<A>(0xF)) - batch(8.0f);
      const batch high = xsimd::to_float(raw >> 4) - batch(8.0f);
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const float* qh = q + h * head_dim + 32 * b + 4 * j;
        part[h] = xsimd::fma(broadcast_group<4, A>(qh), low, part[h]);
        part[h] = xsimd::fma(broadcast_group<4, A>(qh + 16), high, part[h]);
      }
    }
    const batch scale = batch::load_unaligned(quad_scales + b * 4 * page_size + 4 * t0);
    for (int h = 0; h < kG; ++h) total[h] = xsimd::fma(part[h], scale, total[h]);
  }
  for (int h = 0; h < kG; ++h) store_group_sums<4, false, A>(total[h], scores + h * stride + t0);
}

template <class A>
void score_q4_0_fma(A, const ScoreArgs<quant::NoParams>& args) noexcept {
  constexpr index_t kTokens = static_cast<index_t>(simd::f32<A>::size) / 4;
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / 32;
  const std::size_t codes_bytes = q4::KeyCodec::codes_bytes({run.page_size, run.head_dim});
  float* quad_scales = args.scratch;  // [blocks][4 * page_size]
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, run.page_size / kTokens);
    const std::byte* plane = run.pages[i];
    replicate_scales<4>(plane, codes_bytes, run.page_size, blocks, quad_scales);
    float* scores = args.scores + i * run.page_size;
    for (index_t t0 = 0; t0 < run.page_size; t0 += kTokens) {
      prefetcher.step();
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        score_q4_0_tile_fma<decltype(block)::value, A>(plane, run.page_size, run.head_dim, t0,
                                                        args.queries + h0 * run.head_dim, quad_scales,
                                                        scores + h0 * args.score_stride, args.score_stride);
      });
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// Values of kG heads for W/4 channels k0.. of each half of block b; lanes are (channel, token
/// of the quad). `scaled_weights` is [heads][blocks][page_size]: w_t · scale(t, b).
template <int kG, class A>
KVPACK_ALWAYS_INLINE void accumulate_q4_0_tile_fma(const std::byte* plane, index_t page_size, index_t head_dim,
                                                   index_t b, index_t k0, const float* scaled_weights,
                                                   float* acc) noexcept {
  using batch = simd::f32<A>;
  const index_t blocks = head_dim / 32;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  batch low_sum[kG], high_sum[kG];
  for (int h = 0; h < kG; ++h) low_sum[h] = high_sum[h] = batch(0.0f);
  for (index_t i = 0; i < page_size / 4; ++i) {
    const simd::i32<A> raw = simd::load_u8<A>(codes + q4::value_row_offset(blocks, i, b) + 4 * k0);
    const batch low = xsimd::to_float(raw & simd::i32<A>(0xF)) - batch(8.0f);
    const batch high = xsimd::to_float(raw >> 4) - batch(8.0f);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const batch w = broadcast_group<4, A>(scaled_weights + (static_cast<std::size_t>(h) * blocks + b) * page_size + 4 * i);
      low_sum[h] = xsimd::fma(w, low, low_sum[h]);
      high_sum[h] = xsimd::fma(w, high, high_sum[h]);
    }
  }
  for (int h = 0; h < kG; ++h) {
    store_group_sums<4, true, A>(low_sum[h], acc + h * head_dim + 32 * b + k0);
    store_group_sums<4, true, A>(high_sum[h], acc + h * head_dim + 32 * b + 16 + k0);
  }
}

template <class A>
void accumulate_q4_0_fma(A, const AccumulateArgs<quant::NoParams>& args) noexcept {
  constexpr index_t kChannels = static_cast<index_t>(simd::f32<A>::size) / 4;
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / 32;
  const std::size_t codes_bytes = q4::ValueCodec::codes_bytes({run.page_size, run.head_dim});
  float* scaled_weights = args.scratch;  // [group][blocks][page_size]
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    scale_weights(args.weights + i * run.page_size, args.weight_stride, args.group, plane, codes_bytes,
                  run.page_size, blocks, scaled_weights);
    for (index_t b = 0; b < blocks; ++b) {
      for (index_t k0 = 0; k0 < 16; k0 += kChannels) {
        for_each_head_block(args.group, [&](auto block, index_t h0) {
          accumulate_q4_0_tile_fma<decltype(block)::value, A>(
              plane, run.page_size, run.head_dim, b, k0,
              scaled_weights + static_cast<std::size_t>(h0) * blocks * run.page_size, args.acc + h0 * run.head_dim);
        });
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI path: u8 codes × s8 operands → int32 (vpdpbusd).
// ---------------------------------------------------------------------------------------------
#if KVPACK_KERNELS_HAVE_VNNI

inline q4::Int8Query quantize_query_int8(xsimd::avx512bw, const float* q, index_t group, index_t head_dim,
                                     float* scratch) noexcept {
  const index_t blocks = head_dim / 32;
  float* after_values = scratch + static_cast<std::size_t>(group) * head_dim / 4;
  q4::Int8Query out{reinterpret_cast<std::int8_t*>(scratch), after_values,
                reinterpret_cast<std::int32_t*>(after_values + group * blocks)};
  for (index_t h = 0; h < group; ++h) {
    for (index_t b = 0; b < blocks; ++b) {
      const float* x = q + h * head_dim + 32 * b;
      const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float step = amax > 0.0f ? amax / 127.0f : 1.0f;
      const __m512 inverse = _mm512_set1_ps(1.0f / step);
      const __m512 limit = _mm512_set1_ps(127.0f);
      // Clamped: amax · (1/step) may round to just above 127.
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(lo, inverse), -limit), limit));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(hi, inverse), -limit), limit));
      std::int8_t* dst = out.values + h * head_dim + 32 * b;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      out.step[h * blocks + b] = step;
      out.block_sums[h * blocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
  }
  return out;
}

/// The low and high nibbles of 64 bytes, each as unsigned bytes.
KVPACK_ALWAYS_INLINE void split_nibbles(const std::uint8_t* p, __m512i& low, __m512i& high) noexcept {
  const __m512i raw = _mm512_loadu_si512(p);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  low = _mm512_and_si512(raw, mask);
  high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
}

/// Scores of kG heads for kTiles·16 tokens from t0.
template <int kG, int kTiles>
KVPACK_ALWAYS_INLINE void score_q4_0_tile_vnni(const std::byte* plane, std::size_t codes_bytes, index_t page_size,
                                               index_t head_dim, index_t t0, const q4::Int8Query& q, index_t h0,
                                               float* scores, index_t stride, PagePrefetcher& prefetcher) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t blocks = head_dim / 32;
  __m512 total[kG][kTiles];
  for (auto& head : total)
    for (__m512& t : head) t = _mm512_setzero_ps();
  for (index_t b = 0; b < blocks; ++b) {
    __m512i sum[kG][kTiles];
    for (auto& head : sum)
      for (__m512i& x : head) x = _mm512_setzero_si512();
    for (index_t j = 0; j < 4; ++j) {
      prefetcher.step();
      __m512i low[kTiles], high[kTiles];
      for (int i = 0; i < kTiles; ++i) split_nibbles(codes + q4::key_row_offset(page_size, b, j, t0 + 16 * i), low[i], high[i]);
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const std::int8_t* qh = q.values + (h0 + h) * head_dim + 32 * b + 4 * j;
        const __m512i q_low = broadcast_dword(qh);
        const __m512i q_high = broadcast_dword(qh + 16);
        KVPACK_UNROLL
        for (int i = 0; i < kTiles; ++i) {
          sum[h][i] = dot_quads(sum[h][i], low[i], q_low);
          sum[h][i] = dot_quads(sum[h][i], high[i], q_high);
        }
      }
    }
    for (int i = 0; i < kTiles; ++i) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t0 + 16 * i) * 2)));
      for (int h = 0; h < kG; ++h) {
        const std::size_t hb = static_cast<std::size_t>(h0 + h) * blocks + b;
        const __m512i centred = _mm512_sub_epi32(sum[h][i], _mm512_slli_epi32(_mm512_set1_epi32(q.block_sums[hb]), 3));
        total[h][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(scale, _mm512_set1_ps(q.step[hb])),
                                      total[h][i]);
      }
    }
  }
  for (int h = 0; h < kG; ++h) {
    for (int i = 0; i < kTiles; ++i) _mm512_storeu_ps(scores + h * stride + t0 + 16 * i, total[h][i]);
  }
}

inline void score_q4_0_vnni(xsimd::avx512bw, const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const std::size_t codes_bytes = q4::KeyCodec::codes_bytes({run.page_size, run.head_dim});
  const q4::Int8Query q = quantize_query_int8(xsimd::avx512bw{}, args.queries, args.group, run.head_dim, args.scratch);
  const index_t steps = std::max<index_t>(1, run.page_size / 32) * (run.head_dim / 8);
  score_pages_vnni(args, steps, [&](auto heads, auto tiles, const std::byte* plane, index_t t0, index_t h0,
                                    float* scores, PagePrefetcher& prefetcher) {
    score_q4_0_tile_vnni<decltype(heads)::value, decltype(tiles)::value>(
        plane, codes_bytes, run.page_size, run.head_dim, t0, q, h0, scores, args.score_stride, prefetcher);
  });
}

/// Values of kG heads for block b: one 64-byte row per token quad feeds the block's 16 low and
/// 16 high channels, so kG heads keep 2·kG chains.
template <int kG>
KVPACK_ALWAYS_INLINE void accumulate_q4_0_tile_vnni(const std::byte* plane, index_t page_size, index_t head_dim,
                                                    index_t b, const QuantizedWeights<std::int8_t>& w, index_t h0,
                                                    float* acc) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t blocks = head_dim / 32;
  __m512i low_sum[kG], high_sum[kG];
  for (int h = 0; h < kG; ++h) low_sum[h] = high_sum[h] = _mm512_setzero_si512();
  for (index_t i = 0; i < page_size / 4; ++i) {
    __m512i low, high;
    split_nibbles(codes + q4::value_row_offset(blocks, i, b), low, high);
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m512i weight =
          broadcast_dword(w.values + (static_cast<std::size_t>(h0 + h) * blocks + b) * page_size + 4 * i);
      low_sum[h] = dot_quads(low_sum[h], low, weight);
      high_sum[h] = dot_quads(high_sum[h], high, weight);
    }
  }
  for (int h = 0; h < kG; ++h) {
    const std::size_t hb = static_cast<std::size_t>(h0 + h) * blocks + b;
    const __m512 step = _mm512_set1_ps(w.step[hb]);
    // 8 · sum shifted in the vector: it wraps like the sums themselves instead of overflowing an
    // int (|sum| <= 127 · 256 for finite input; NaN/Inf with check_inputs off give INT_MIN lanes).
    const __m512i offset = _mm512_slli_epi32(_mm512_set1_epi32(w.sums[hb]), 3);
    float* out = acc + h * head_dim + 32 * b;
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(low_sum[h], offset)), step,
                                          _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(high_sum[h], offset)), step,
                                               _mm512_loadu_ps(out + 16)));
  }
}

inline void accumulate_q4_0_vnni(xsimd::avx512bw, const AccumulateArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / 32;
  const std::size_t codes_bytes = q4::ValueCodec::codes_bytes({run.page_size, run.head_dim});
  const auto w = weights_in_scratch<std::int8_t>(args.scratch, args.group, blocks, run.page_size);
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    quantize_weights(xsimd::avx512bw{}, args.weights + i * run.page_size, args.weight_stride, args.group, plane,
                     codes_bytes, run.page_size, blocks, w);
    for (index_t b = 0; b < blocks; ++b) {
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        accumulate_q4_0_tile_vnni<decltype(block)::value>(plane, run.page_size, run.head_dim, b, w, h0,
                                                          args.acc + h0 * run.head_dim);
      });
    }
  }
}

#endif  // KVPACK_KERNELS_HAVE_VNNI

template <class A>
void score_keys(A arch, std::type_identity<q4::KeyCodec>, const ScoreArgs<quant::NoParams>& args) noexcept {
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    if (args.run.page_size % 16 == 0) return score_q4_0_vnni(arch, args);
  }
#endif
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
  if constexpr (std::is_same_v<A, avx2_arch>) {
    if (args.run.page_size % 16 == 0) return score_q4_0_avx2(arch, args);
  }
#endif
  score_q4_0_fma(arch, args);
}

template <class A>
void accumulate_values(A arch, std::type_identity<q4::ValueCodec>, const AccumulateArgs<quant::NoParams>& args) noexcept {
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    if (args.run.page_size % 16 == 0) return accumulate_q4_0_vnni(arch, args);
  }
#endif
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
  if constexpr (std::is_same_v<A, avx2_arch>) {
    if (args.run.page_size % 16 == 0) return accumulate_q4_0_avx2(arch, args);
  }
#endif
  accumulate_q4_0_fma(arch, args);
}

}  // namespace kvpack::inline v0::kernels::cpu
