#pragma once
/// \file integer.hpp
/// \brief SIMD decode-attention kernels for the 8-bit integer codecs quant::Int8 and quant::Q8_0
///        (pair tiles of quant/tile_layout.hpp, fp16 scales per token and block).
///
/// Three paths over the same bytes:
/// - AVX-512 with VNNI (the dispatch library's avx512 target): int16 dot products (`vpdpwssd`).
///   The query is quantized to int16 once per call (each element moves by at most 2^-16 of the
///   head's largest), each page's attention weights times the value scales to int16 per head
///   and block (see quantize_weights); int32 sums are scaled back once per block. An fp32-FMA
///   kernel needs more multiply-adds per second than the core has to read 8-bit codes at DRAM
///   speed (DESIGN.md §4); this path does not.
/// - AVX2 (integer_pairs_avx2.hpp): the same int16 operands on `vpmaddwd`.
/// - every other target, and page sizes the integer tiles do not divide: codes widened to fp32
///   and FMAs on (token, pair) lanes; the two lanes of a pair are added at the end of a tile.
/// Scores: s_t = Σ_b scale(t,b) · Σ_{c∈b} q_c · code(t,c).
/// Values: acc_c += Σ_t (w_t · scale(t,b(c))) · code(t,c).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/integer_common.hpp"
#include "kvpack/kernels/cpu/integer_pairs_avx2.hpp"
#include "kvpack/kernels/cpu/pair_tiles.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

// ---------------------------------------------------------------------------------------------
// Portable path: fp32 FMAs on (token, pair) lanes.
// ---------------------------------------------------------------------------------------------

/// Key scores of kG heads for W/2 tokens starting at t0. `duplicated_scales` holds, per block,
/// each token's scale twice ([blocks][2·page_size]) so it multiplies (token, pair) lanes directly.
template <class Codec, int kG, class A>
KVPACK_ALWAYS_INLINE void score_pairs_tile_fma(const std::byte* plane, index_t page_size, index_t head_dim,
                                               index_t t0, const float* q, const float* duplicated_scales,
                                               float* scores, index_t stride) noexcept {
  using batch = simd::f32<A>;
  const index_t block = scale_block<Codec>(head_dim);
  const auto* codes = reinterpret_cast<const std::int8_t*>(plane);
  batch total[kG];
  for (int h = 0; h < kG; ++h) total[h] = batch(0.0f);
  for (index_t b = 0; b < head_dim / block; ++b) {
    batch part[kG];
    for (int h = 0; h < kG; ++h) part[h] = batch(0.0f);
    for (index_t c = b * block; c < (b + 1) * block; c += 2) {
      const batch k = xsimd::to_float(simd::load_i8<A>(codes + (static_cast<std::size_t>(c / 2) * page_size + t0) * 2));
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) part[h] = xsimd::fma(broadcast_group<2, A>(q + h * head_dim + c), k, part[h]);
    }
    const batch scale = batch::load_unaligned(duplicated_scales + b * 2 * page_size + 2 * t0);
    for (int h = 0; h < kG; ++h) total[h] = xsimd::fma(part[h], scale, total[h]);
  }
  for (int h = 0; h < kG; ++h) store_group_sums<2, false, A>(total[h], scores + h * stride + t0);
}

template <class Codec, class A>
void score_pairs_fma(A, const ScoreArgs<quant::NoParams>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / scale_block<Codec>(run.head_dim);
  const std::size_t codes_bytes = Codec::codes_bytes({run.page_size, run.head_dim});
  float* duplicated_scales = args.scratch;  // [blocks][2 * page_size]
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, run.page_size / (kWidth / 2));
    const std::byte* plane = run.pages[i];
    replicate_scales<2>(plane, codes_bytes, run.page_size, blocks, duplicated_scales);
    float* scores = args.scores + i * run.page_size;
    for (index_t t0 = 0; t0 < run.page_size; t0 += kWidth / 2) {
      prefetcher.step();
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        score_pairs_tile_fma<Codec, decltype(block)::value, A>(plane, run.page_size, run.head_dim, t0,
                                                               args.queries + h0 * run.head_dim, duplicated_scales,
                                                               scores + h0 * args.score_stride, args.score_stride);
      });
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// Value accumulation of kG heads for W/2 channels starting at c0, lanes = (channel, token of
/// the pair). `scaled_weights` is [heads][blocks][page_size]: w_t · scale(t, b).
template <class Codec, int kG, class A>
KVPACK_ALWAYS_INLINE void accumulate_pairs_tile_fma(const std::byte* plane, index_t page_size, index_t head_dim,
                                                    index_t c0, const float* scaled_weights, float* acc) noexcept {
  using batch = simd::f32<A>;
  const index_t blocks = head_dim / scale_block<Codec>(head_dim);
  const index_t b = c0 / scale_block<Codec>(head_dim);
  const auto* codes = reinterpret_cast<const std::int8_t*>(plane);
  batch sum[kG];
  for (int h = 0; h < kG; ++h) sum[h] = batch(0.0f);
  for (index_t pair = 0; pair < page_size / 2; ++pair) {
    const batch v = xsimd::to_float(simd::load_i8<A>(codes + (static_cast<std::size_t>(pair) * head_dim + c0) * 2));
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const float* w = scaled_weights + (static_cast<std::size_t>(h) * blocks + b) * page_size;
      sum[h] = xsimd::fma(broadcast_group<2, A>(w + 2 * pair), v, sum[h]);
    }
  }
  for (int h = 0; h < kG; ++h) store_group_sums<2, true, A>(sum[h], acc + h * head_dim + c0);
}

template <class Codec, class A>
void accumulate_pairs_fma(A, const AccumulateArgs<quant::NoParams>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / scale_block<Codec>(run.head_dim);
  const std::size_t codes_bytes = Codec::codes_bytes({run.page_size, run.head_dim});
  float* scaled_weights = args.scratch;  // [group][blocks][page_size]
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    scale_weights(args.weights + i * run.page_size, args.weight_stride, args.group, plane, codes_bytes,
                  run.page_size, blocks, scaled_weights);
    for (index_t c0 = 0; c0 < run.head_dim; c0 += kWidth / 2) {
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        accumulate_pairs_tile_fma<Codec, decltype(block)::value, A>(
            plane, run.page_size, run.head_dim, c0, scaled_weights + static_cast<std::size_t>(h0) * blocks * run.page_size,
            args.acc + h0 * run.head_dim);
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI path: int16 × int16 → int32 dot products (vpdpwssd).
// ---------------------------------------------------------------------------------------------
#if KVPACK_KERNELS_HAVE_VNNI

// The xsimd::avx512bw parameter tags the symbol with its instruction set (STYLE.md §5.2).
inline Int16Query quantize_query_int16(xsimd::avx512bw, const float* q, index_t group, index_t head_dim,
                                       float* scratch) noexcept {
  Int16Query out{reinterpret_cast<std::int32_t*>(scratch), scratch + group * head_dim / 2};
  const index_t vector_end = head_dim - head_dim % 16;
  for (index_t h = 0; h < group; ++h) {
    const float* row = q + h * head_dim;
    __m512 lanes = _mm512_setzero_ps();
    for (index_t c = 0; c < vector_end; c += 16) lanes = _mm512_max_ps(lanes, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
    float amax = _mm512_reduce_max_ps(lanes);
    for (index_t c = vector_end; c < head_dim; ++c) amax = std::max(amax, std::fabs(row[c]));
    const float scale = amax > 0.0f ? amax / kInt16Max : 1.0f;
    const float inverse = 1.0f / scale;
    out.scale[h] = scale;
    // Little-endian int16 pairs: element c is the low half of pairs[c / 2] when c is even.
    auto* q16 = reinterpret_cast<std::int16_t*>(out.pairs + h * head_dim / 2);
    for (index_t c = 0; c < vector_end; c += 16) {
      // Clamped: amax · (1/scale) may round to just above 32767.
      const __m512 scaled = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(inverse)),
                                                        _mm512_set1_ps(-kInt16Max)),
                                          _mm512_set1_ps(kInt16Max));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + c), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(scaled)));
    }
    for (index_t c = vector_end; c < head_dim; ++c) {
      q16[c] = static_cast<std::int16_t>(std::clamp(std::nearbyint(row[c] * inverse), -kInt16Max, kInt16Max));
    }
  }
  return out;
}

/// Scores of kG heads for kTiles·16 tokens from t0: kG·kTiles int32 chains per channel block
/// keep the dot-product units busy (vpdpwssd has a latency of several cycles).
template <class Codec, int kG, int kTiles>
KVPACK_ALWAYS_INLINE void score_pairs_tile_vnni(const std::byte* plane, std::size_t codes_bytes, index_t page_size,
                                                index_t head_dim, index_t t0, const Int16Query& q, index_t h0,
                                                float* scores, index_t stride, PagePrefetcher& prefetcher) noexcept {
  const index_t block = scale_block<Codec>(head_dim);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t pairs_per_head = head_dim / 2;
  __m512 total[kG][kTiles];
  for (auto& head : total)
    for (__m512& t : head) t = _mm512_setzero_ps();
  for (index_t b = 0; b < head_dim / block; ++b) {
    __m512 scale[kTiles];
    for (int i = 0; i < kTiles; ++i) {
      scale[i] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t0 + 16 * i) * 2)));
    }
    for (index_t c_begin = b * block; c_begin < (b + 1) * block; c_begin += kMaxInt32Channels) {
      const index_t c_end = std::min(c_begin + kMaxInt32Channels, (b + 1) * block);
      __m512i sum[kG][kTiles];
      for (auto& head : sum)
        for (__m512i& x : head) x = _mm512_setzero_si512();
      for (index_t c = c_begin; c < c_end; c += 2) {
        prefetcher.step();
        __m512i k[kTiles];
        for (int i = 0; i < kTiles; ++i) {
          k[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              codes + (static_cast<std::size_t>(c / 2) * page_size + t0 + 16 * i) * 2)));
        }
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) {
          const __m512i qc = _mm512_set1_epi32(q.pairs[(h0 + h) * pairs_per_head + c / 2]);
          KVPACK_UNROLL
          for (int i = 0; i < kTiles; ++i) sum[h][i] = dot_pairs(sum[h][i], k[i], qc);
        }
      }
      for (int h = 0; h < kG; ++h) {
        for (int i = 0; i < kTiles; ++i) total[h][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][i]), scale[i], total[h][i]);
      }
    }
  }
  for (int h = 0; h < kG; ++h) {
    for (int i = 0; i < kTiles; ++i) {
      _mm512_storeu_ps(scores + h * stride + t0 + 16 * i, _mm512_mul_ps(total[h][i], _mm512_set1_ps(q.scale[h0 + h])));
    }
  }
}

template <class Codec>
void score_pairs_vnni(xsimd::avx512bw, const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const std::size_t codes_bytes = Codec::codes_bytes({run.page_size, run.head_dim});
  const Int16Query q = quantize_query_int16(xsimd::avx512bw{}, args.queries, args.group, run.head_dim, args.scratch);
  const index_t steps = std::max<index_t>(1, run.page_size / 32) * (run.head_dim / 2);
  score_pages_vnni(args, steps, [&](auto heads, auto tiles, const std::byte* plane, index_t t0, index_t h0,
                                    float* scores, PagePrefetcher& prefetcher) {
    score_pairs_tile_vnni<Codec, decltype(heads)::value, decltype(tiles)::value>(
        plane, codes_bytes, run.page_size, run.head_dim, t0, q, h0, scores, args.score_stride, prefetcher);
  });
}

/// Values of kG heads for kChunks 16-channel chunks from c0 (one scale block): 2·kG chains.
template <int kG, int kChunks>
KVPACK_ALWAYS_INLINE void accumulate_pairs_tile_vnni(const std::byte* plane, index_t page_size, index_t head_dim,
                                                     index_t blocks, index_t b, index_t c0,
                                                     const QuantizedWeights<std::int16_t>& w, index_t h0,
                                                     float* acc) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  __m512i sum[kG][kChunks];
  for (auto& head : sum)
    for (__m512i& x : head) x = _mm512_setzero_si512();
  for (index_t i = 0; i < page_size / 2; ++i) {
    __m512i v[kChunks];
    for (int j = 0; j < kChunks; ++j) {
      v[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          codes + (static_cast<std::size_t>(i) * head_dim + c0 + 16 * j) * 2)));
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      // Tokens 2i and 2i+1 of (head, block): one int32 holding both int16 weights.
      std::int32_t pair;
      std::memcpy(&pair, w.values + (static_cast<std::size_t>(h0 + h) * blocks + b) * page_size + 2 * i, 4);
      const __m512i weight = _mm512_set1_epi32(pair);
      KVPACK_UNROLL
      for (int j = 0; j < kChunks; ++j) sum[h][j] = dot_pairs(sum[h][j], v[j], weight);
    }
  }
  for (int h = 0; h < kG; ++h) {
    const __m512 step = _mm512_set1_ps(w.step[(h0 + h) * blocks + b]);
    for (int j = 0; j < kChunks; ++j) {
      float* out = acc + h * head_dim + c0 + 16 * j;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][j]), step, _mm512_loadu_ps(out)));
    }
  }
}

template <class Codec>
void accumulate_pairs_vnni(xsimd::avx512bw, const AccumulateArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t block_size = scale_block<Codec>(run.head_dim);
  const index_t blocks = run.head_dim / block_size;
  const std::size_t codes_bytes = Codec::codes_bytes({run.page_size, run.head_dim});
  const auto w = weights_in_scratch<std::int16_t>(args.scratch, args.group, blocks, run.page_size);
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    quantize_weights(xsimd::avx512bw{}, args.weights + i * run.page_size, args.weight_stride, args.group, plane,
                     codes_bytes, run.page_size, blocks, w);
    for_each_head_block(args.group, [&](auto block, index_t h0) {
      constexpr int kG = decltype(block)::value;
      float* acc = args.acc + h0 * run.head_dim;
      // Two 16-channel chunks at a time when both lie in one scale block.
      index_t c0 = 0;
      for (; c0 + 32 <= run.head_dim; c0 += 32) {
        if (c0 / block_size == (c0 + 31) / block_size) {
          accumulate_pairs_tile_vnni<kG, 2>(plane, run.page_size, run.head_dim, blocks, c0 / block_size, c0, w, h0, acc);
        } else {
          accumulate_pairs_tile_vnni<kG, 1>(plane, run.page_size, run.head_dim, blocks, c0 / block_size, c0, w, h0, acc);
          accumulate_pairs_tile_vnni<kG, 1>(plane, run.page_size, run.head_dim, blocks, (c0 + 16) / block_size, c0 + 16,
                                            w, h0, acc);
        }
      }
      for (; c0 < run.head_dim; c0 += 16) {
        accumulate_pairs_tile_vnni<kG, 1>(plane, run.page_size, run.head_dim, blocks, c0 / block_size, c0, w, h0, acc);
      }
    });
  }
}

#endif  // KVPACK_KERNELS_HAVE_VNNI

template <class Codec, class A>
void score_pairs(A arch, const ScoreArgs<quant::NoParams>& args) noexcept {
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    if (args.run.page_size % 16 == 0) return score_pairs_vnni<Codec>(arch, args);
  }
#endif
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
  if constexpr (std::is_same_v<A, avx2_arch>) {
    if (args.run.page_size % 16 == 0) return score_pairs_avx2<Codec>(arch, args);
  }
#endif
  score_pairs_fma<Codec>(arch, args);
}

template <class Codec, class A>
void accumulate_pairs(A arch, const AccumulateArgs<quant::NoParams>& args) noexcept {
  // Value tiles are 16 channels wide and the weights' quantization steps by 16 tokens; narrower
  // heads (int8 allows head_dim 8) and other page sizes (codecs allow even ones) take the FMA path.
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    if (args.run.head_dim % 16 == 0 && args.run.page_size % 16 == 0) return accumulate_pairs_vnni<Codec>(arch, args);
  }
#endif
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
  if constexpr (std::is_same_v<A, avx2_arch>) {
    if (args.run.head_dim % 16 == 0 && args.run.page_size % 16 == 0) return accumulate_pairs_avx2<Codec>(arch, args);
  }
#endif
  accumulate_pairs_fma<Codec>(arch, args);
}

template <class A>
void score_keys(A arch, std::type_identity<quant::Int8Codec<Plane::kKey>>, const ScoreArgs<quant::NoParams>& args) noexcept {
  score_pairs<quant::Int8Codec<Plane::kKey>>(arch, args);
}
template <class A>
void score_keys(A arch, std::type_identity<quant::Q8_0Codec<Plane::kKey>>, const ScoreArgs<quant::NoParams>& args) noexcept {
  score_pairs<quant::Q8_0Codec<Plane::kKey>>(arch, args);
}
template <class A>
void accumulate_values(A arch, std::type_identity<quant::Int8Codec<Plane::kValue>>,
                       const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_pairs<quant::Int8Codec<Plane::kValue>>(arch, args);
}
template <class A>
void accumulate_values(A arch, std::type_identity<quant::Q8_0Codec<Plane::kValue>>,
                       const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_pairs<quant::Q8_0Codec<Plane::kValue>>(arch, args);
}

}  // namespace kvpack::inline v0::kernels::cpu
