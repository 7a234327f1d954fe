#pragma once
/// \file q4_0_avx2.hpp
/// \brief q4_0's integer kernels on AVX2: the AVX-512 VNNI path's operands (q4_0.hpp: the query in
///        int8 per 32-channel block, each page's weights times the value scales in int8 per head
///        and block) on `vpmaddubsw`, so the error bounds of the two paths are the same.
///
/// Keys: a 32-byte row holds four code bytes for each of 8 tokens (channels 4j..4j+3 in the low
/// nibbles, 16+4j.. in the high); vpmaddubsw of the low and high nibbles against the query's
/// bytes leaves each token two int16 sums, which add up over the block's four rows without
/// leaving int16 (each sum gets 4 products of at most 15·127 per row, 16 per block: ≤ 30480),
/// then widen once per block. Values: a token quad's 64-byte row holds 16 channels' four tokens
/// per nibble half; two rows' int16 sums (≤ 4·15·127 = 7620) are added before widening.

#include <algorithm>
#include <cstdint>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/integer_avx2.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/q4_0_rows.hpp"
#include "kvpack/quant/q4_0.hpp"

namespace kvpack::inline v0::kernels::cpu {

#if KVPACK_KERNELS_HAVE_AVX2_INTEGER

/// The AVX-512 path's quantize_query_int8 (q4_0.hpp) on AVX2, step for step: the same integers
/// for finite input.
inline q4::Int8Query quantize_query_int8(avx2_arch, const float* q, index_t group, index_t head_dim,
                                         float* scratch) noexcept {
  const index_t blocks = head_dim / 32;
  float* after_values = scratch + static_cast<std::size_t>(group) * head_dim / 4;
  q4::Int8Query out{reinterpret_cast<std::int8_t*>(scratch), after_values,
                    reinterpret_cast<std::int32_t*>(after_values + group * blocks)};
  const __m256 limit = _mm256_set1_ps(127.0f);
  for (index_t h = 0; h < group; ++h) {
    for (index_t b = 0; b < blocks; ++b) {
      const float* x = q + h * head_dim + 32 * b;
      __m256 parts[4];
      __m256 largest = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        parts[i] = _mm256_loadu_ps(x + 8 * i);
        largest = _mm256_max_ps(largest, avx2::abs(parts[i]));
      }
      const float amax = avx2::reduce_max(largest);
      const float step = amax > 0.0f ? amax / 127.0f : 1.0f;
      const __m256 inverse = _mm256_set1_ps(1.0f / step);
      __m256i sum = _mm256_setzero_si256();
      std::int8_t* dst = out.values + h * head_dim + 32 * b;
      for (int i = 0; i < 4; ++i) {
        // Clamped: amax · (1/step) may round to just above 127; NaN becomes -127.
        const __m256 scaled = _mm256_mul_ps(parts[i], inverse);
        const __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(scaled, -limit), limit));
        sum = _mm256_add_epi32(sum, qi);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + 8 * i), avx2::saturate_to_int8(qi));
      }
      out.step[h * blocks + b] = step;
      out.block_sums[h * blocks + b] = avx2::reduce_add(sum);
    }
  }
  return out;
}

/// Scores of kG heads for kTiles·8 tokens from t0.
template <int kG, int kTiles>
KVPACK_ALWAYS_INLINE void score_q4_0_tile_avx2(const std::byte* plane, std::size_t codes_bytes, index_t page_size,
                                               index_t head_dim, index_t t0, const q4::Int8Query& q, index_t h0,
                                               float* scores, index_t stride, PagePrefetcher& prefetcher) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t blocks = head_dim / 32;
  // Every loop over heads and tiles unrolled, so that the arrays live in registers.
  __m256 total[kG][kTiles];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) total[h][i] = _mm256_setzero_ps();
  }
  for (index_t b = 0; b < blocks; ++b) {
    __m256i sum[kG][kTiles];
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      KVPACK_UNROLL
      for (int i = 0; i < kTiles; ++i) sum[h][i] = _mm256_setzero_si256();
    }
    KVPACK_UNROLL
    for (index_t j = 0; j < 4; ++j) {
      prefetcher.step();
      __m256i low[kTiles], high[kTiles];
      KVPACK_UNROLL
      for (int i = 0; i < kTiles; ++i) {
        avx2::split_nibbles(codes + q4::key_row_offset(page_size, b, j, t0 + 8 * i), low[i], high[i]);
      }
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const std::int8_t* qh = q.values + (h0 + h) * head_dim + 32 * b + 4 * j;
        const __m256i q_low = avx2::broadcast_dword(qh);
        const __m256i q_high = avx2::broadcast_dword(qh + 16);
        KVPACK_UNROLL
        for (int i = 0; i < kTiles; ++i) {
          const __m256i row =
              _mm256_add_epi16(_mm256_maddubs_epi16(low[i], q_low), _mm256_maddubs_epi16(high[i], q_high));
          sum[h][i] = _mm256_add_epi16(sum[h][i], row);
        }
      }
    }
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) {
      const __m256 scale =
          avx2::load_halves(plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t0 + 8 * i) * 2);
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const std::size_t hb = static_cast<std::size_t>(h0 + h) * blocks + b;
        const __m256i centred =
            _mm256_sub_epi32(avx2::widen_pairs(sum[h][i]), _mm256_slli_epi32(_mm256_set1_epi32(q.block_sums[hb]), 3));
        total[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(scale, _mm256_set1_ps(q.step[hb])),
                                      total[h][i]);
      }
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) _mm256_storeu_ps(scores + h * stride + t0 + 8 * i, total[h][i]);
  }
}

inline void score_q4_0_avx2(avx2_arch arch, const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const std::size_t codes_bytes = q4::KeyCodec::codes_bytes({run.page_size, run.head_dim});
  const q4::Int8Query q = quantize_query_int8(arch, args.queries, args.group, run.head_dim, args.scratch);
  // One step per (block, row) of a 16-token pass: a page's lines are all requested by the time
  // its last tile is scored, or sooner where a pass covers 8 tokens.
  const index_t steps = std::max<index_t>(1, run.page_size / 16) * (run.head_dim / 8);
  score_pages_avx2(args, steps, [&](auto heads, auto tiles, const std::byte* plane, index_t t0, index_t h0,
                                    float* scores, PagePrefetcher& prefetcher) {
    score_q4_0_tile_avx2<decltype(heads)::value, decltype(tiles)::value>(
        plane, codes_bytes, run.page_size, run.head_dim, t0, q, h0, scores, args.score_stride, prefetcher);
  });
}

/// Values of kG heads for channels 8·half .. 8·half + 7 of each nibble half of block b.
template <int kG>
KVPACK_ALWAYS_INLINE void accumulate_q4_0_tile_avx2(const std::byte* plane, index_t page_size, index_t head_dim,
                                                    index_t b, index_t half, const QuantizedWeights<std::int8_t>& w,
                                                    index_t h0, float* acc) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t blocks = head_dim / 32;
  __m256i low_sum[kG], high_sum[kG];
  const std::int8_t* weights[kG];
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    low_sum[h] = high_sum[h] = _mm256_setzero_si256();
    weights[h] = w.values + (static_cast<std::size_t>(h0 + h) * blocks + b) * page_size;
  }
  for (index_t i = 0; i < page_size / 4; i += 2) {  // page_size is a multiple of 8: quads in pairs
    __m256i low[2], high[2];
    KVPACK_UNROLL
    for (int k = 0; k < 2; ++k) {
      avx2::split_nibbles(codes + q4::value_row_offset(blocks, i + k, b) + 32 * half, low[k], high[k]);
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m256i w0 = avx2::broadcast_dword(weights[h] + 4 * i);
      const __m256i w1 = avx2::broadcast_dword(weights[h] + 4 * i + 4);
      const __m256i low_pair = _mm256_add_epi16(_mm256_maddubs_epi16(low[0], w0), _mm256_maddubs_epi16(low[1], w1));
      const __m256i high_pair = _mm256_add_epi16(_mm256_maddubs_epi16(high[0], w0), _mm256_maddubs_epi16(high[1], w1));
      low_sum[h] = _mm256_add_epi32(low_sum[h], avx2::widen_pairs(low_pair));
      high_sum[h] = _mm256_add_epi32(high_sum[h], avx2::widen_pairs(high_pair));
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const std::size_t hb = static_cast<std::size_t>(h0 + h) * blocks + b;
    const __m256 step = _mm256_set1_ps(w.step[hb]);
    // 8 · sum shifted in the vector: it wraps like the sums themselves instead of overflowing an
    // int (as on the AVX-512 path).
    const __m256i offset = _mm256_slli_epi32(_mm256_set1_epi32(w.sums[hb]), 3);
    float* out = acc + h * head_dim + 32 * b + 8 * half;
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(low_sum[h], offset)), step,
                                          _mm256_loadu_ps(out)));
    _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(high_sum[h], offset)), step,
                                               _mm256_loadu_ps(out + 16)));
  }
}

inline void accumulate_q4_0_avx2(avx2_arch arch, const AccumulateArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / 32;
  const std::size_t codes_bytes = q4::ValueCodec::codes_bytes({run.page_size, run.head_dim});
  const auto w = weights_in_scratch<std::int8_t>(args.scratch, args.group, blocks, run.page_size);
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    quantize_weights(arch, args.weights + i * run.page_size, args.weight_stride, args.group, plane, codes_bytes,
                     run.page_size, blocks, w);
    for (index_t b = 0; b < blocks; ++b) {
      for (index_t half = 0; half < 2; ++half) {
        for_each_head_block<4>(args.group, [&](auto block, index_t h0) {
          accumulate_q4_0_tile_avx2<decltype(block)::value>(plane, run.page_size, run.head_dim, b, half, w, h0,
                                                            args.acc + h0 * run.head_dim);
        });
      }
    }
  }
}

#endif  // KVPACK_KERNELS_HAVE_AVX2_INTEGER

}  // namespace kvpack::inline v0::kernels::cpu
