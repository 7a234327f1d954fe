#pragma once
/// \file integer.hpp
/// \brief SIMD decode-attention kernels for the integer codecs: quant::Int8, quant::Q8_0,
///        quant::Q4_0 (pair tiles of quant/tile_layout.hpp, fp16 scales per token and block).
///
/// Two paths over the same bytes:
/// - AVX-512 with VNNI (the dispatch library's avx512 target): integer dot products with
///   `vpdpwssd`. The query is quantized to int16 once per call (relative error ≤ 2^-16 of its
///   largest element), each page's attention weights times the value scales to int16 per head
///   and block; int32 sums are scaled back once per block. Below 8 bits an fp32-FMA kernel is
///   compute-bound and cannot reach DRAM speed (DESIGN.md §4); this path can.
/// - every other target: codes widened to fp32 and FMAs on (token, pair) lanes, pairs added at
///   the end of a tile.
/// Scores: s_t = Σ_b scale(t,b) · Σ_{c∈b} q_c · code(t,c)  (minus 8·Σ q_c for q4_0).
/// Values: acc_c += Σ_t (w_t · scale(t,b(c))) · code(t,c)  (minus 8·Σ_t w_t·scale for q4_0).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

#if defined(__AVX512VNNI__) && XSIMD_WITH_AVX512BW
#define KVPACK_KERNELS_HAVE_VNNI 1
#else
#define KVPACK_KERNELS_HAVE_VNNI 0
#endif

namespace kvpack::inline v0::kernels::cpu {

/// What the integer kernels need to know about a codec's plane.
template <class Codec>
struct IntegerPlane;

template <Plane kPlane>
struct IntegerPlane<quant::Int8Codec<kPlane>> {
  static constexpr bool kNibbles = false;
  /// One scale per token: the scale block is the whole head.
  static constexpr index_t scale_block(index_t head_dim) noexcept { return head_dim; }
};
template <Plane kPlane>
struct IntegerPlane<quant::Q8_0Codec<kPlane>> {
  static constexpr bool kNibbles = false;
  static constexpr index_t scale_block(index_t) noexcept { return 32; }
};
template <Plane kPlane>
struct IntegerPlane<quant::Q4_0Codec<kPlane>> {
  static constexpr bool kNibbles = true;
  static constexpr index_t scale_block(index_t) noexcept { return 32; }
};

/// Bytes of codes in a plane: one per element, or one per two for nibbles.
template <class Codec>
constexpr std::size_t integer_codes_bytes(index_t page_size, index_t head_dim) noexcept {
  const std::size_t elements = static_cast<std::size_t>(page_size) * head_dim;
  return IntegerPlane<Codec>::kNibbles ? elements / 2 : elements;
}

/// fp16 scale of (token t, block b) of a plane whose codes take `codes_bytes` bytes.
KVPACK_ALWAYS_INLINE float scale_at(const std::byte* plane, std::size_t codes_bytes,
                                    index_t page_size, index_t t, index_t b) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, plane + codes_bytes + (static_cast<std::size_t>(b) * page_size + t) * 2, 2);
  return half::from_bits(bits);
}

/// Broadcasts the float pair (p[0], p[1]) to every pair of lanes.
template <class A>
KVPACK_ALWAYS_INLINE simd::f32<A> broadcast_pair(const float* p) noexcept {
  double pair;
  std::memcpy(&pair, p, sizeof(pair));
  return xsimd::bitwise_cast<simd::f32<A>>(xsimd::batch<double, A>(pair));
}

// ---------------------------------------------------------------------------------------------
// Portable path: fp32 FMAs on (token, pair) lanes.
// ---------------------------------------------------------------------------------------------

/// Key scores of kG heads for W/2 tokens starting at t0. `duplicated_scales` holds, per block,
/// each token's scale twice ([blocks][2·page_size]) so it multiplies (token, pair) lanes directly.
template <class Codec, int kG, class A>
KVPACK_ALWAYS_INLINE void score_integer_tile_fma(const std::byte* plane, index_t page_size,
                                                 index_t head_dim, index_t t0, const float* q,
                                                 const float* duplicated_scales, float* scores,
                                                 index_t stride) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t block = IntegerPlane<Codec>::scale_block(head_dim);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  batch total[kG];
  for (int h = 0; h < kG; ++h) total[h] = batch(0.0f);
  for (index_t b = 0; b < head_dim / block; ++b) {
    batch part[kG];
    for (int h = 0; h < kG; ++h) part[h] = batch(0.0f);
    if constexpr (IntegerPlane<Codec>::kNibbles) {
      for (index_t pair = 0; pair < 8; ++pair) {
        const simd::i32<A> raw =
            simd::load_u8<A>(codes + ((static_cast<std::size_t>(b) * 8 + pair) * page_size + t0) * 2);
        const batch low = xsimd::to_float(raw & simd::i32<A>(0xF)) - batch(8.0f);
        const batch high = xsimd::to_float((raw >> 4)) - batch(8.0f);
        const index_t c = b * 32 + 2 * pair;
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) {
          part[h] = xsimd::fma(broadcast_pair<A>(q + h * head_dim + c), low, part[h]);
          part[h] = xsimd::fma(broadcast_pair<A>(q + h * head_dim + c + 16), high, part[h]);
        }
      }
    } else {
      for (index_t c = b * block; c < (b + 1) * block; c += 2) {
        const batch k = xsimd::to_float(simd::load_i8<A>(
            reinterpret_cast<const std::int8_t*>(codes) + (static_cast<std::size_t>(c / 2) * page_size + t0) * 2));
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) part[h] = xsimd::fma(broadcast_pair<A>(q + h * head_dim + c), k, part[h]);
      }
    }
    const batch scale = batch::load_unaligned(duplicated_scales + b * 2 * page_size + 2 * t0);
    for (int h = 0; h < kG; ++h) total[h] = xsimd::fma(part[h], scale, total[h]);
  }
  for (int h = 0; h < kG; ++h) {
    alignas(64) float lanes[kWidth];
    total[h].store_aligned(lanes);
    for (index_t i = 0; i < kWidth / 2; ++i) scores[h * stride + t0 + i] = lanes[2 * i] + lanes[2 * i + 1];
  }
}

template <class Codec, class A>
void score_integer_keys_fma(A, const ScoreArgs<quant::NoParams>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / IntegerPlane<Codec>::scale_block(run.head_dim);
  const std::size_t codes_bytes = integer_codes_bytes<Codec>(run.page_size, run.head_dim);
  float* duplicated_scales = args.scratch;  // [blocks][2 * page_size]
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, run.page_size / (kWidth / 2));
    const std::byte* plane = run.pages[i];
    for (index_t b = 0; b < blocks; ++b) {
      for (index_t t = 0; t < run.page_size; ++t) {
        const float s = scale_at(plane, codes_bytes, run.page_size, t, b);
        duplicated_scales[b * 2 * run.page_size + 2 * t] = s;
        duplicated_scales[b * 2 * run.page_size + 2 * t + 1] = s;
      }
    }
    float* scores = args.scores + i * run.page_size;
    for (index_t t0 = 0; t0 < run.page_size; t0 += kWidth / 2) {
      prefetcher.step();
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        score_integer_tile_fma<Codec, decltype(block)::value, A>(
            plane, run.page_size, run.head_dim, t0, args.queries + h0 * run.head_dim,
            duplicated_scales, scores + h0 * args.score_stride, args.score_stride);
      });
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// Value accumulation of kG heads for W/2 channels starting at c0, lanes = (channel, token of
/// the pair). `scaled_weights` is [heads][blocks][page_size]: w_t · scale(t, b).
template <class Codec, int kG, class A>
KVPACK_ALWAYS_INLINE void accumulate_integer_tile_fma(const std::byte* plane, index_t page_size,
                                                      index_t head_dim, index_t c0,
                                                      const float* scaled_weights, float* acc) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t block_size = IntegerPlane<Codec>::scale_block(head_dim);
  const index_t blocks = head_dim / block_size;
  const index_t b = c0 / block_size;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  batch sum[kG];
  for (int h = 0; h < kG; ++h) sum[h] = batch(0.0f);
  for (index_t pair = 0; pair < page_size / 2; ++pair) {
    batch v;
    if constexpr (IntegerPlane<Codec>::kNibbles) {
      const index_t in_block = c0 % 32;
      const std::size_t row = (static_cast<std::size_t>(pair) * blocks + b) * 32;
      const simd::i32<A> raw = simd::load_u8<A>(codes + row + 2 * (in_block % 16));
      const simd::i32<A> nibble = in_block < 16 ? (raw & simd::i32<A>(0xF)) : (raw >> 4);
      v = xsimd::to_float(nibble) - batch(8.0f);
    } else {
      v = xsimd::to_float(simd::load_i8<A>(reinterpret_cast<const std::int8_t*>(codes) +
                                            (static_cast<std::size_t>(pair) * head_dim + c0) * 2));
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const float* w = scaled_weights + (static_cast<std::size_t>(h) * blocks + b) * page_size;
      sum[h] = xsimd::fma(broadcast_pair<A>(w + 2 * pair), v, sum[h]);
    }
  }
  for (int h = 0; h < kG; ++h) {
    alignas(64) float lanes[kWidth];
    sum[h].store_aligned(lanes);
    for (index_t k = 0; k < kWidth / 2; ++k) acc[h * head_dim + c0 + k] += lanes[2 * k] + lanes[2 * k + 1];
  }
}

template <class Codec, class A>
void accumulate_integer_values_fma(A, const AccumulateArgs<quant::NoParams>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / IntegerPlane<Codec>::scale_block(run.head_dim);
  const std::size_t codes_bytes = integer_codes_bytes<Codec>(run.page_size, run.head_dim);
  float* scaled_weights = args.scratch;  // [group][blocks][page_size]
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    for (index_t h = 0; h < args.group; ++h) {
      const float* w = args.weights + h * args.weight_stride + i * run.page_size;
      for (index_t b = 0; b < blocks; ++b) {
        float* row = scaled_weights + (static_cast<std::size_t>(h) * blocks + b) * run.page_size;
        for (index_t t = 0; t < run.page_size; ++t) row[t] = w[t] * scale_at(plane, codes_bytes, run.page_size, t, b);
      }
    }
    for (index_t c0 = 0; c0 < run.head_dim; c0 += kWidth / 2) {
      for_each_head_block(args.group, [&](auto block, index_t h0) {
        accumulate_integer_tile_fma<Codec, decltype(block)::value, A>(
            plane, run.page_size, run.head_dim, c0,
            scaled_weights + static_cast<std::size_t>(h0) * blocks * run.page_size,
            args.acc + h0 * run.head_dim);
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI path: int16 × int16 → int32 dot products (vpdpwssd).
// ---------------------------------------------------------------------------------------------
#if KVPACK_KERNELS_HAVE_VNNI

/// acc + Σ pairs of a·b per 32-bit lane (vpdpwssd). GCC 12 surrounds the builtin with a register
/// copy of the accumulator for every call (measured 1.45x slower score loops); the same
/// instruction through inline asm keeps the accumulator in place.
KVPACK_ALWAYS_INLINE __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm512_dpwssd_epi32(acc, a, b);
#endif
}

/// Largest |int16| used: symmetric, so negation never overflows.
inline constexpr float kInt16Max = 32767.0f;
/// Channels summed in int32 before converting: 256 · 32767 · 127 < 2^31.
inline constexpr index_t kMaxInt32Channels = 256;

/// The query as int16 pairs, per head: pairs[h][c/2] = (q16[c], q16[c+1]); value = q16 · scale[h].
struct Int16Query {
  std::int32_t* pairs;       // [group][head_dim / 2]
  float* scale;              // [group]
  std::int32_t* block_sums;  // [group][head_dim / 32]: Σ q16 over each 32-channel block (q4_0)
};

// The xsimd::avx512bw parameter tags the symbol with its instruction set (STYLE.md §5.2).
inline Int16Query quantize_query_int16(xsimd::avx512bw, const float* q, index_t group, index_t head_dim,
                                       float* scratch) noexcept {
  Int16Query out{reinterpret_cast<std::int32_t*>(scratch), scratch + group * head_dim / 2,
                 reinterpret_cast<std::int32_t*>(scratch + group * head_dim / 2 + group)};
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
    for (index_t b = 0; b < head_dim / 32; ++b) {
      std::int32_t sum = 0;
      for (index_t c = 32 * b; c < 32 * b + 32; ++c) sum += q16[c];
      out.block_sums[h * (head_dim / 32) + b] = sum;
    }
  }
  return out;
}

/// Scores of kG heads for kTiles·16 tokens from t0: kG·kTiles int32 chains per channel block
/// keep the dot-product units busy (vpdpwssd has a latency of several cycles).
template <class Codec, int kG, int kTiles>
KVPACK_ALWAYS_INLINE void score_integer_tile_vnni(const std::byte* plane, std::size_t codes_bytes,
                                                  index_t page_size, index_t head_dim, index_t t0,
                                                  const Int16Query& q, index_t h0, float* scores,
                                                  index_t stride, PagePrefetcher& prefetcher) noexcept {
  const index_t block = IntegerPlane<Codec>::scale_block(head_dim);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t pairs_per_head = head_dim / 2;
  auto codes_at = [&](index_t row, int tile) KVPACK_ALWAYS_INLINE_LAMBDA {
    return reinterpret_cast<const __m256i*>(codes + (static_cast<std::size_t>(row) * page_size + t0 + 16 * tile) * 2);
  };
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
      if constexpr (IntegerPlane<Codec>::kNibbles) {
        // Row (b·8 + pair) holds channel pair b·32 + 2·pair (low nibbles) and that + 16 (high).
        for (index_t pair = 0; pair < 8; ++pair) {
          prefetcher.step();
          __m512i low[kTiles], high[kTiles];
          for (int i = 0; i < kTiles; ++i) {
            const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(codes_at(b * 8 + pair, i)));
            low[i] = _mm512_and_si512(raw, _mm512_set1_epi16(0xF));
            high[i] = _mm512_srli_epi16(raw, 4);
          }
          const index_t p = b * 16 + pair;
          KVPACK_UNROLL
          for (int h = 0; h < kG; ++h) {
            const std::int32_t* qp = q.pairs + (h0 + h) * pairs_per_head;
            const __m512i q_low = _mm512_set1_epi32(qp[p]);
            const __m512i q_high = _mm512_set1_epi32(qp[p + 8]);
            KVPACK_UNROLL
            for (int i = 0; i < kTiles; ++i) {
              sum[h][i] = dot_pairs(sum[h][i], low[i], q_low);
              sum[h][i] = dot_pairs(sum[h][i], high[i], q_high);
            }
          }
        }
        for (int h = 0; h < kG; ++h) {
          const __m512i offset = _mm512_set1_epi32(8 * q.block_sums[(h0 + h) * (head_dim / 32) + b]);
          for (int i = 0; i < kTiles; ++i) sum[h][i] = _mm512_sub_epi32(sum[h][i], offset);
        }
      } else {
        for (index_t c = c_begin; c < c_end; c += 2) {
          prefetcher.step();
          __m512i k[kTiles];
          for (int i = 0; i < kTiles; ++i) k[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(codes_at(c / 2, i)));
          KVPACK_UNROLL
          for (int h = 0; h < kG; ++h) {
            const __m512i qc = _mm512_set1_epi32(q.pairs[(h0 + h) * pairs_per_head + c / 2]);
            KVPACK_UNROLL
            for (int i = 0; i < kTiles; ++i) sum[h][i] = dot_pairs(sum[h][i], k[i], qc);
          }
        }
      }
      for (int h = 0; h < kG; ++h) {
        for (int i = 0; i < kTiles; ++i) {
          total[h][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[h][i]), scale[i], total[h][i]);
        }
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
void score_integer_keys_vnni(xsimd::avx512bw, const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const std::size_t codes_bytes = integer_codes_bytes<Codec>(run.page_size, run.head_dim);
  const Int16Query q = quantize_query_int16(xsimd::avx512bw{}, args.queries, args.group, run.head_dim, args.scratch);
  // Inner steps per page for a group of up to four heads: two 16-token tiles per pass.
  const index_t steps = std::max<index_t>(1, run.page_size / 32) *
                        (IntegerPlane<Codec>::kNibbles ? run.head_dim / 4 : run.head_dim / 2);
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, steps);
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * run.page_size;
    for_each_head_block(args.group, [&](auto block, index_t h0) {
      constexpr int kG = decltype(block)::value;
      // Two 16-token tiles per pass give 2·kG chains; eight heads already give eight.
      constexpr int kTiles = kG >= 8 ? 1 : 2;
      index_t t0 = 0;
      for (; t0 + 16 * kTiles <= run.page_size; t0 += 16 * kTiles) {
        score_integer_tile_vnni<Codec, kG, kTiles>(plane, codes_bytes, run.page_size, run.head_dim, t0, q, h0,
                                                   scores + h0 * args.score_stride, args.score_stride,
                                                   prefetcher);
      }
      for (; t0 < run.page_size; t0 += 16) {
        score_integer_tile_vnni<Codec, kG, 1>(plane, codes_bytes, run.page_size, run.head_dim, t0, q, h0,
                                              scores + h0 * args.score_stride, args.score_stride, prefetcher);
      }
    });
    if (run.live != nullptr) mask_dead_slots(run.live[i], run.page_size, args.group, scores, args.score_stride);
  }
}

/// One page's weights times value scales, as int16 pairs per (head, block):
/// pairs[(h·blocks + b)·P/2 + i] = (w16[2i], w16[2i+1]), value = w16 · scale[h·blocks + b].
struct Int16Weights {
  std::int32_t* pairs;  // [group][blocks][page_size / 2]
  float* scale;         // [group][blocks]
  std::int32_t* sums;   // [group][blocks]: Σ_t w16 (q4_0's −8 offset)
  float* unit_scales;   // [blocks][page_size]: scale(t, b) / max_t |scale(t, b)| · 32767
};

/// w_t · scale(t, b) in int16, per head and block, with the step p_max(h) · s_max(b) / 32767: the
/// scales are normalised once per page for all heads, so each (head, block) costs one multiply,
/// one conversion and one pack per 16 tokens. That step bounds every |w·s| (p ≤ p_max, |s| ≤
/// s_max), so nothing saturates, and its rounding error is at most half a step per weight.
inline void quantize_weights_int16(xsimd::avx512bw, const float* weights, index_t weight_stride, index_t group,
                                   const std::byte* plane, std::size_t codes_bytes, index_t page_size,
                                   index_t blocks, const Int16Weights& out) noexcept {
  float scale_max[64];  // blocks <= head_dim / 32 <= 64 (head_dim <= 2048)
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
    const __m512 normalise = _mm512_set1_ps(scale_max[b] > 0.0f ? kInt16Max / scale_max[b] : 0.0f);
    for (index_t t = 0; t < page_size; t += 16) _mm512_storeu_ps(unit + t, _mm512_mul_ps(_mm512_loadu_ps(unit + t), normalise));
  }
  for (index_t h = 0; h < group; ++h) {
    const float* w = weights + h * weight_stride;
    __m512 lanes = _mm512_setzero_ps();
    for (index_t t = 0; t < page_size; t += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(w + t));
    const float p_max = _mm512_reduce_max_ps(lanes);  // weights are exp(·) >= 0
    const __m512 p_normalise = _mm512_set1_ps(p_max > 0.0f ? 1.0f / p_max : 0.0f);
    for (index_t b = 0; b < blocks; ++b) {
      out.scale[h * blocks + b] = p_max * scale_max[b] / kInt16Max;
      auto* w16 = reinterpret_cast<std::int16_t*>(out.pairs + (static_cast<std::size_t>(h) * blocks + b) * (page_size / 2));
      const float* unit = out.unit_scales + static_cast<std::size_t>(b) * page_size;
      __m512i sum = _mm512_setzero_si512();
      for (index_t t = 0; t < page_size; t += 16) {
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(w + t), p_normalise);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(p, _mm512_loadu_ps(unit + t)));
        sum = _mm512_add_epi32(sum, q);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w16 + t), _mm512_cvtsepi32_epi16(q));
      }
      out.sums[h * blocks + b] = _mm512_reduce_add_epi32(sum);
    }
  }
}

/// Values of kG heads for the channels from c0: q4_0 rows give two 16-channel tiles per load
/// (low and high nibbles); 8-bit codes take kChunks 16-channel tiles. Either way 2·kG chains.
template <class Codec, int kG, int kChunks>
KVPACK_ALWAYS_INLINE void accumulate_integer_tile_vnni(const std::byte* plane, index_t page_size,
                                                       index_t head_dim, index_t blocks, index_t c0,
                                                       const Int16Weights& w, index_t h0, float* acc) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  const index_t block_size = head_dim / blocks;
  const index_t b = c0 / block_size;
  const index_t pairs = page_size / 2;
  constexpr int kTiles = IntegerPlane<Codec>::kNibbles ? 2 : kChunks;
  __m512i sum[kG][kTiles];
  for (auto& head : sum)
    for (__m512i& x : head) x = _mm512_setzero_si512();
  for (index_t i = 0; i < pairs; ++i) {
    __m512i v[kTiles];
    if constexpr (IntegerPlane<Codec>::kNibbles) {
      // One 32-byte row per (token pair, block): channels c0..c0+15 in the low nibbles,
      // c0+16..c0+31 in the high ones.
      const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          codes + (static_cast<std::size_t>(i) * blocks + b) * 32)));
      v[0] = _mm512_and_si512(raw, _mm512_set1_epi16(0xF));
      v[1] = _mm512_srli_epi16(raw, 4);
    } else {
      for (int j = 0; j < kTiles; ++j) {
        v[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            codes + (static_cast<std::size_t>(i) * head_dim + c0 + 16 * j) * 2)));
      }
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const __m512i weight = _mm512_set1_epi32(w.pairs[(static_cast<std::size_t>(h0 + h) * blocks + b) * pairs + i]);
      KVPACK_UNROLL
      for (int j = 0; j < kTiles; ++j) sum[h][j] = dot_pairs(sum[h][j], v[j], weight);
    }
  }
  for (int h = 0; h < kG; ++h) {
    const __m512 scale = _mm512_set1_ps(w.scale[(h0 + h) * blocks + b]);
    const __m512i offset = _mm512_set1_epi32(IntegerPlane<Codec>::kNibbles ? 8 * w.sums[(h0 + h) * blocks + b] : 0);
    for (int j = 0; j < kTiles; ++j) {
      float* out = acc + h * head_dim + c0 + 16 * j;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[h][j], offset)), scale,
                                            _mm512_loadu_ps(out)));
    }
  }
}

template <class Codec>
void accumulate_integer_values_vnni(xsimd::avx512bw, const AccumulateArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t blocks = run.head_dim / IntegerPlane<Codec>::scale_block(run.head_dim);
  const std::size_t codes_bytes = integer_codes_bytes<Codec>(run.page_size, run.head_dim);
  const std::size_t pair_count = static_cast<std::size_t>(args.group) * blocks * (run.page_size / 2);
  float* const after_pairs = args.scratch + pair_count;
  const Int16Weights w{reinterpret_cast<std::int32_t*>(args.scratch), after_pairs,
                       reinterpret_cast<std::int32_t*>(after_pairs + args.group * blocks),
                       after_pairs + 2 * args.group * blocks};
  const index_t block_size = run.head_dim / blocks;
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    quantize_weights_int16(xsimd::avx512bw{}, args.weights + i * run.page_size, args.weight_stride, args.group, plane,
                           codes_bytes, run.page_size, blocks, w);
    for_each_head_block(args.group, [&](auto block, index_t h0) {
      constexpr int kG = decltype(block)::value;
      float* acc = args.acc + h0 * run.head_dim;
      if constexpr (IntegerPlane<Codec>::kNibbles) {
        for (index_t c0 = 0; c0 < run.head_dim; c0 += 32) {
          accumulate_integer_tile_vnni<Codec, kG, 2>(plane, run.page_size, run.head_dim, blocks, c0, w, h0, acc);
        }
      } else {
        // Two 16-channel chunks at a time when both lie in one scale block.
        index_t c0 = 0;
        for (; c0 + 32 <= run.head_dim; c0 += 32) {
          if (c0 / block_size == (c0 + 31) / block_size) {
            accumulate_integer_tile_vnni<Codec, kG, 2>(plane, run.page_size, run.head_dim, blocks, c0, w, h0, acc);
          } else {
            accumulate_integer_tile_vnni<Codec, kG, 1>(plane, run.page_size, run.head_dim, blocks, c0, w, h0, acc);
            accumulate_integer_tile_vnni<Codec, kG, 1>(plane, run.page_size, run.head_dim, blocks, c0 + 16, w, h0, acc);
          }
        }
        for (; c0 < run.head_dim; c0 += 16) {
          accumulate_integer_tile_vnni<Codec, kG, 1>(plane, run.page_size, run.head_dim, blocks, c0, w, h0, acc);
        }
      }
    });
  }
}

#endif  // KVPACK_KERNELS_HAVE_VNNI

template <class Codec, class A>
void score_integer_keys(A arch, const ScoreArgs<quant::NoParams>& args) noexcept {
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    score_integer_keys_vnni<Codec>(arch, args);
    return;
  }
#endif
  score_integer_keys_fma<Codec>(arch, args);
}

template <class Codec, class A>
void accumulate_integer_values(A arch, const AccumulateArgs<quant::NoParams>& args) noexcept {
#if KVPACK_KERNELS_HAVE_VNNI
  // Value tiles are 16 channels wide; narrower heads (int8 allows head_dim 8) take the FMA path.
  if constexpr (std::is_same_v<A, xsimd::avx512bw>) {
    if (args.run.head_dim % 16 == 0) {
      accumulate_integer_values_vnni<Codec>(arch, args);
      return;
    }
  }
#endif
  accumulate_integer_values_fma<Codec>(arch, args);
}

template <class A>
void score_keys(A arch, std::type_identity<quant::Int8Codec<Plane::kKey>>, const ScoreArgs<quant::NoParams>& args) noexcept {
  score_integer_keys<quant::Int8Codec<Plane::kKey>>(arch, args);
}
template <class A>
void score_keys(A arch, std::type_identity<quant::Q8_0Codec<Plane::kKey>>, const ScoreArgs<quant::NoParams>& args) noexcept {
  score_integer_keys<quant::Q8_0Codec<Plane::kKey>>(arch, args);
}
template <class A>
void score_keys(A arch, std::type_identity<quant::Q4_0Codec<Plane::kKey>>, const ScoreArgs<quant::NoParams>& args) noexcept {
  score_integer_keys<quant::Q4_0Codec<Plane::kKey>>(arch, args);
}
template <class A>
void accumulate_values(A arch, std::type_identity<quant::Int8Codec<Plane::kValue>>, const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_integer_values<quant::Int8Codec<Plane::kValue>>(arch, args);
}
template <class A>
void accumulate_values(A arch, std::type_identity<quant::Q8_0Codec<Plane::kValue>>, const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_integer_values<quant::Q8_0Codec<Plane::kValue>>(arch, args);
}
template <class A>
void accumulate_values(A arch, std::type_identity<quant::Q4_0Codec<Plane::kValue>>, const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_integer_values<quant::Q4_0Codec<Plane::kValue>>(arch, args);
}

}  // namespace kvpack::inline v0::kernels::cpu
