#pragma once
/// \file integer_pairs_avx2.hpp
/// \brief int8's and q8_0's integer kernels on AVX2: the AVX-512 VNNI path's operands (integer.hpp:
///        the query in int16 per head, each page's weights times the value scales in int16 per head
///        and block) on `vpmaddwd`, so the error bounds of the two paths are the same.
///
/// A pair tile keeps a token's two channels (keys) or a channel's two tokens (values) in adjacent
/// bytes: sixteen bytes widened to int16 and multiplied by a broadcast int16 pair give eight int32
/// sums of two products, where vpdpwssd gives sixteen and adds them in the same instruction.

#include <algorithm>
#include <cstdint>

#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/integer_avx2.hpp"
#include "kvpack/kernels/cpu/pair_tiles.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"

namespace kvpack::inline v0::kernels::cpu {

#if KVPACK_KERNELS_HAVE_AVX2_INTEGER

/// The AVX-512 path's quantize_query_int16 (integer.hpp) on AVX2, step for step: the same
/// integers for finite input. head_dim is a multiple of 8 (int8's and q8_0's rule).
inline Int16Query quantize_query_int16(avx2_arch, const float* q, index_t group, index_t head_dim,
                                       float* scratch) noexcept {
  Int16Query out{reinterpret_cast<std::int32_t*>(scratch), scratch + group * head_dim / 2};
  const __m256 limit = _mm256_set1_ps(kInt16Max);
  for (index_t h = 0; h < group; ++h) {
    const float* row = q + h * head_dim;
    __m256 lanes = _mm256_setzero_ps();
    for (index_t c = 0; c < head_dim; c += 8) lanes = _mm256_max_ps(lanes, avx2::abs(_mm256_loadu_ps(row + c)));
    const float amax = avx2::reduce_max(lanes);
    const float scale = amax > 0.0f ? amax / kInt16Max : 1.0f;
    const float inverse = 1.0f / scale;
    out.scale[h] = scale;
    // Little-endian int16 pairs: element c is the low half of pairs[c / 2] when c is even.
    auto* q16 = reinterpret_cast<std::int16_t*>(out.pairs + h * head_dim / 2);
    for (index_t c = 0; c < head_dim; c += 8) {
      // Clamped: amax · (1/scale) may round to just above 32767.
      const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(row + c), _mm256_set1_ps(inverse));
      const __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(scaled, -limit), limit));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q16 + c), avx2::saturate_to_int16(qi));
    }
  }
  return out;
}

/// Scores of kG heads for kTiles·8 tokens from t0.
template <class Codec, int kG, int kTiles>
KVPACK_ALWAYS_INLINE void score_pairs_tile_avx2(const std::byte* plane, std::size_t codes_bytes, index_t page_size,
                                                index_t head_dim, index_t t0, const Int16Query& q, index_t h0,
                                                float* scores, index_t stride, PagePrefetcher& prefetcher) noexcept {
  const index_t block = scale_block<Codec>(head_dim);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t pairs_per_head = head_dim / 2;
  // Every loop over heads and tiles unrolled, so that the arrays live in registers.
  __m256 total[kG][kTiles];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) total[h][i] = _mm256_setzero_ps();
  }
  for (index_t b = 0; b < head_dim / block; ++b) {
    for (index_t c_begin = b * block; c_begin < (b + 1) * block; c_begin += kMaxInt32Channels) {
      const index_t c_end = std::min(c_begin + kMaxInt32Channels, (b + 1) * block);
      __m256i sum[kG][kTiles];
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        KVPACK_UNROLL
        for (int i = 0; i < kTiles; ++i) sum[h][i] = _mm256_setzero_si256();
      }
      for (index_t c = c_begin; c < c_end; c += 2) {
        prefetcher.step();
        __m256i k[kTiles];
        KVPACK_UNROLL
        for (int i = 0; i < kTiles; ++i) {
          k[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
              codes + (static_cast<std::size_t>(c / 2) * page_size + t0 + 8 * i) * 2)));
        }
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) {
          const __m256i qc = _mm256_set1_epi32(q.pairs[(h0 + h) * pairs_per_head + c / 2]);
          KVPACK_UNROLL
          for (int i = 0; i < kTiles; ++i) sum[h][i] = _mm256_add_epi32(sum[h][i], _mm256_madd_epi16(k[i], qc));
        }
      }
      KVPACK_UNROLL
      for (int i = 0; i < kTiles; ++i) {
        const __m256 scale =
            avx2::load_halves(plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t0 + 8 * i) * 2);
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) total[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][i]), scale, total[h][i]);
      }
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) {
      _mm256_storeu_ps(scores + h * stride + t0 + 8 * i, _mm256_mul_ps(total[h][i], _mm256_set1_ps(q.scale[h0 + h])));
    }
  }
}

template <class Codec>
void score_pairs_avx2(avx2_arch arch, const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const std::size_t codes_bytes = Codec::codes_bytes({run.page_size, run.head_dim});
  const Int16Query q = quantize_query_int16(arch, args.queries, args.group, run.head_dim, args.scratch);
  // One step per channel pair of a 16-token pass (q4_0_avx2.hpp's rule).
  const index_t steps = std::max<index_t>(1, run.page_size / 16) * (run.head_dim / 2);
  score_pages_avx2(args, steps, [&](auto heads, auto tiles, const std::byte* plane, index_t t0, index_t h0,
                                    float* scores, PagePrefetcher& prefetcher) {
    score_pairs_tile_avx2<Codec, decltype(heads)::value, decltype(tiles)::value>(
        plane, codes_bytes, run.page_size, run.head_dim, t0, q, h0, scores, args.score_stride, prefetcher);
  });
}

/// Values of kG heads for the 16 channels from c0 (inside one scale block b): 2·kG chains.
template <int kG>
KVPACK_ALWAYS_INLINE void accumulate_pairs_tile_avx2(const std::byte* plane, index_t page_size, index_t head_dim,
                                                     index_t blocks, index_t b, index_t c0,
                                                     const QuantizedWeights<std::int16_t>& w, index_t h0,
                                                     float* acc) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  __m256i sum[kG][2];
  const std::int16_t* weights[kG];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    sum[h][0] = sum[h][1] = _mm256_setzero_si256();
    weights[h] = w.values + (static_cast<std::size_t>(h0 + h) * blocks + b) * page_size;
  }
  for (index_t i = 0; i < page_size / 2; ++i) {
    __m256i v[2];
    KVPACK_UNROLL
    for (int j = 0; j < 2; ++j) {
      v[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          codes + (static_cast<std::size_t>(i) * head_dim + c0 + 8 * j) * 2)));
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      // Tokens 2i and 2i+1 of (head, block): one int32 holding both int16 weights.
      const __m256i weight = avx2::broadcast_dword(weights[h] + 2 * i);
      KVPACK_UNROLL
      for (int j = 0; j < 2; ++j) sum[h][j] = _mm256_add_epi32(sum[h][j], _mm256_madd_epi16(v[j], weight));
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m256 step = _mm256_set1_ps(w.step[(h0 + h) * blocks + b]);
    KVPACK_UNROLL
    for (int j = 0; j < 2; ++j) {
      float* out = acc + h * head_dim + c0 + 8 * j;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][j]), step, _mm256_loadu_ps(out)));
    }
  }
}

/// Needs head_dim % 16 == 0: 16-channel tiles, which never straddle a q8_0 block.
template <class Codec>
void accumulate_pairs_avx2(avx2_arch arch, const AccumulateArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t block_size = scale_block<Codec>(run.head_dim);
  const index_t blocks = run.head_dim / block_size;
  const std::size_t codes_bytes = Codec::codes_bytes({run.page_size, run.head_dim});
  const auto w = weights_in_scratch<std::int16_t>(args.scratch, args.group, blocks, run.page_size);
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    quantize_weights(arch, args.weights + i * run.page_size, args.weight_stride, args.group, plane, codes_bytes,
                     run.page_size, blocks, w);
    for (index_t c0 = 0; c0 < run.head_dim; c0 += 16) {
      for_each_head_block<4>(args.group, [&](auto block, index_t h0) {
        accumulate_pairs_tile_avx2<decltype(block)::value>(plane, run.page_size, run.head_dim, blocks, c0 / block_size,
                                                           c0, w, h0, args.acc + h0 * run.head_dim);
      });
    }
  }
}

#endif  // KVPACK_KERNELS_HAVE_AVX2_INTEGER

}  // namespace kvpack::inline v0::kernels::cpu
