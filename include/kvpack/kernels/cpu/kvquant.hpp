#pragma once
/// \file kvquant.hpp
/// \brief Decode-attention kernels for quant::KVQuant, fused with the codebook lookup: scores and
///        sums are computed from the packed codes through a 16-lane table of the codebook's levels
///        (one permute per vector of codes), the per-vector ranges folded into the operand that
///        multiplies them (the query for keys, the weights for values), and each outlier added as
///        a correction x − x̂ (nuq_outliers.hpp). Pre-RoPE keys are decoded to fp32 for rope.hpp's rotation:
///        channel-major tiles as stored, or rows by a transpose.
///
/// Codes are read eight at a time: eight b-bit codes are exactly b bytes, one little-endian word.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvpack/kernels/cpu/byte_levels.hpp"
#include "kvpack/kernels/cpu/channel_major.hpp"
#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/kivi.hpp"
#include "kvpack/kernels/cpu/kivi_vnni.hpp"
#include "kvpack/kernels/cpu/nuq_outliers.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/quant/kvquant.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Writes `count` (a multiple of 8) codes of a packed row through `levels` (16 floats, the
/// 2^b reconstructed values first) to out[i · stride]. With stride 1 and whole vectors, one
/// vector of codes at a time (simd::load_codes) looked up in one table permute; otherwise one
/// code at a time.
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void unpack_nuq_row(A, const std::byte* row, index_t count, const float* levels, float* out,
                                         std::size_t stride) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  constexpr std::uint32_t kMask = (1u << Bits) - 1;
  if (stride == 1 && count % kWidth == 0 && count % 8 == 0) {
    for (index_t first = 0; first < count; first += kWidth) {
      simd::lookup16<A>(simd::load_codes<Bits, A>(row, first), levels).store_unaligned(out + first);
    }
    return;
  }
  for (index_t group = 0; group < count / 8; ++group) {
    const auto word = static_cast<std::uint32_t>(simd::load_le<Bits>(row + static_cast<std::size_t>(group) * Bits));
    float* at = out + static_cast<std::size_t>(group) * 8 * stride;
    for (int j = 0; j < 8; ++j) at[j * stride] = levels[(word >> (Bits * j)) & kMask];
  }
}

/// A KVQuant key page as fp32, element (t, c) at tile[t·t_stride + c·c_stride].
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void unpack_nuq_keys(A arch, quant::PageGeometry g, const std::byte* plane,
                                          const quant::KVQuantKeyParams& p, float* tile, std::size_t t_stride,
                                          std::size_t c_stride) noexcept {
  using Codec = quant::KVQuantKeyCodec<Bits>;
  alignas(64) float levels[16];
  for (index_t c = 0; c < g.head_dim; ++c) {
    // All 16 entries, as the codec's decode reads them (zero levels past the codebook's size).
    for (int k = 0; k < 16; ++k) levels[k] = p.codebook->levels[k] * p.half_range[c] + p.offset[c];
    unpack_nuq_row<Bits>(arch, plane + Codec::row_bytes(g) * c, g.page_size, levels, tile + c * c_stride, t_stride);
  }
  apply_nuq_outliers<A>(plane + Codec::outliers_offset(g), quant::kvquant_detail::outlier_capacity(p.outlier_fraction, g),
                     g.head_dim, tile, t_stride, c_stride);
}

/// The codebook's levels, zero-padded to 16 lanes for simd::lookup16 (a corrupted code past the
/// codebook's size reads 0, as in the codec's decode).
struct NuqLevels {
  alignas(64) float level[16] = {};
  explicit NuqLevels(const quant::nuq::Codebook& codebook) noexcept {
    for (int k = 0; k < codebook.size && k < 16; ++k) level[k] = codebook.levels[static_cast<std::size_t>(k)];
  }
};

/// The codebook level of W consecutive codes of a packed row, from code `first` (a multiple of W).
template <int Bits, class A>
KVPACK_ALWAYS_INLINE simd::f32<A> load_levels(const std::byte* row, index_t first, const NuqLevels& levels) noexcept {
  return simd::lookup16<A>(simd::load_codes<Bits, A>(row, first), levels.level);
}

/// Keys, fused with the lookup: with x̂_tc = ℓ(code_tc)·r_c + z_c (per-channel calibrated ranges),
/// Σ_c q_c·x̂_tc = Σ_c (q_c·r_c)·ℓ(code_tc) + Σ_c q_c·z_c. The query is scaled by the ranges once
/// per call, the second sum is one bias per head, and each code costs a table permute and one FMA
/// per query head (the element-format loop of float.hpp). An outlier adds q_c·(x − x̂_tc) to its
/// token's score. q_c·r_c is formed in fp32: a query within a factor r_c of fp32's largest value
/// overflows here where the decoded product might not.
///
/// On AVX-512 with VNNI and on AVX2, every width takes KIVI's integer key products (kivi_vnni.hpp,
/// kivi_avx2.hpp): q·r to int16 per head, once per call since the ranges are fixed, times the
/// levels as bytes (LevelBytes); 3-bit pages are first widened to 4-bit codes
/// (KiviIntegerKernels::widen_3bit_codes). A score then moves by at most
/// (d·max_c|q_c·r_c| / 65534 + Σ_c |q_c·r_c| / 254) · max|ℓ| (tests/support/error_bound.hpp).
template <int Bits, class A>
void score_keys(A, std::type_identity<quant::KVQuantKeyCodec<Bits>>,
                const ScoreArgs<quant::KVQuantKeyParams>& args) noexcept {
  using Codec = quant::KVQuantKeyCodec<Bits>;
  const PageRun& run = args.run;
  const index_t d = run.head_dim, P = run.page_size;
  const quant::PageGeometry g{P, d};
  const quant::KVQuantKeyParams& p = args.params;
  float* folded = args.scratch;             // [group][head_dim]: q_c·r_c
  float* bias = folded + args.group * d;    // [group]: Σ_c q_c·z_c
  const NuqLevels levels(*p.codebook);
  const std::size_t row_bytes = Codec::row_bytes(g);
  const std::size_t capacity = quant::kvquant_detail::outlier_capacity(p.outlier_fraction, g);
  // Past the integer path's q16: the outliers' multipliers and targets head-minor (AVX-512 and
  // AVX2, nuq_outliers.hpp), the queries [head_dim][group] and one page's score corrections
  // [page_size][group]; then 3-bit pages widened to 4-bit codes.
  float* outlier_queries = bias + 2 * args.group + args.group * d / 2 + 1;
  float* outlier_scores = outlier_queries + args.group * d;
  auto* widened = reinterpret_cast<std::uint8_t*>(outlier_scores + P * args.group);
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
  if constexpr (kNuqOutlierVectors<A>) to_head_minor(A{}, args.queries, d, args.group, d, outlier_queries);
#endif
  auto add_outliers_and_mask = [&](index_t i, float* scores) KVPACK_ALWAYS_INLINE_LAMBDA {
    const std::byte* plane = run.pages[i];
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
    if constexpr (kNuqOutlierVectors<A>) {
      std::fill(outlier_scores, outlier_scores + P * args.group, 0.0f);
      add_nuq_outlier_corrections<Bits>(A{}, plane + Codec::outliers_offset(g), capacity, d,
                                        {plane, row_bytes, true, levels.level, p.half_range, p.offset,
                                         outlier_queries, outlier_scores, args.group});
      add_head_minor(A{}, outlier_scores, args.group, P, scores, args.score_stride);
    }
#endif
    if constexpr (!kNuqOutlierVectors<A>) {
      for_each_nuq_outlier<A>(plane + Codec::outliers_offset(g), capacity, d, [&](index_t t, index_t c, float exact) {
        const unsigned code = quant::kvquant_detail::get_code<Bits>(plane + row_bytes * static_cast<std::size_t>(c), t);
        const float correction = exact - (levels.level[code] * p.half_range[c] + p.offset[c]);
        for (index_t h = 0; h < args.group; ++h) scores[h * args.score_stride + t] += args.queries[h * d + c] * correction;
      });
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, args.group, scores, args.score_stride);
  };
  // The integer path (KiviIntegerKernels: AVX-512 VNNI or AVX2, 3-bit pages widened first).
  using Integer = KiviIntegerKernels<A>;
  if constexpr (Integer::kAvailable) {
    float* steps = bias + args.group;                                 // [group]
    auto* q16 = reinterpret_cast<std::int16_t*>(steps + args.group);  // [group][head_dim]
    const typename Integer::ByteLevels byte_levels(levels.level);
    // d ≤ 256 keeps the int32 sums of d products |q16|·byte ≤ 32767·255 from overflowing.
    if (byte_levels.step > 0.0f && d % 16 == 0 && d <= 256 && P % 32 == 0 &&
        Integer::fold_query(args.queries, args.group, d, p.half_range, p.offset, folded, q16, steps, bias)) {
      for (index_t h = 0; h < args.group; ++h) {
        std::int32_t query_sum = 0;
        for (index_t c = 0; c < d; ++c) query_sum += q16[h * d + c];
        steps[h] *= byte_levels.step;
        bias[h] -= 128.0f * steps[h] * static_cast<float>(query_sum);
      }
      constexpr int kCodeBits = Bits == 3 ? 4 : Bits;  // the layout the integer kernels read
      for (index_t i = 0; i < run.count; ++i) {
        PagePrefetcher prefetcher(run, i, 1, P / 32 * Integer::key_steps(kCodeBits, d));
        const auto* codes = reinterpret_cast<const std::uint8_t*>(run.pages[i]);
        std::size_t code_row_bytes = row_bytes;
        if constexpr (Bits == 3) {
          Integer::widen_3bit_codes(codes, static_cast<std::size_t>(d) * (P / 32), widened);
          codes = widened;
          code_row_bytes = P / 2;
        }
        float* scores = args.scores + i * P;
        for (index_t k = 0; k < P / 32; ++k) {  // 32 tokens, 4·b bytes of each channel's row (widened: 16)
          for_each_head_block<Integer::template kKeyHeads<kCodeBits>>(args.group, [&](auto block, index_t h0) {
            Integer::template score<kCodeBits, decltype(block)::value>(
                codes + 4 * kCodeBits * k, code_row_bytes, d, q16 + h0 * d, steps + h0, bias + h0,
                scores + h0 * args.score_stride + 32 * k, args.score_stride, prefetcher, byte_levels);
          });
        }
        add_outliers_and_mask(i, scores);
      }
      return;
    }
  }
  for (index_t h = 0; h < args.group; ++h) {
    const float* q = args.queries + h * d;
    float sum = 0.0f;
    for (index_t c = 0; c < d; ++c) {
      folded[h * d + c] = q[c] * p.half_range[c];
      sum += q[c] * p.offset[c];
    }
    bias[h] = sum;
  }
  score_channel_major_keys<A>(run, folded, args.group, args.scores, args.score_stride, 1.0f,
                              [&](const std::byte* plane, index_t c, index_t t0) KVPACK_ALWAYS_INLINE_LAMBDA {
                                return load_levels<Bits, A>(plane + row_bytes * static_cast<std::size_t>(c), t0, levels);
                              });
  for (index_t i = 0; i < run.count; ++i) {
    float* scores = args.scores + i * P;
    for (index_t h = 0; h < args.group; ++h) {
      const float b = bias[h];  // a local: scores may alias bias for all the compiler knows
      for (index_t t = 0; t < P; ++t) scores[h * args.score_stride + t] += b;
    }
    add_outliers_and_mask(i, scores);
  }
}

/// Values, fused with the lookup: with x̂_tc = ℓ(code_tc)·r_t + z_t (each token's own range),
/// Σ_t w_t·x̂_tc = Σ_t (w_t·r_t)·ℓ(code_tc) + Σ_t w_t·z_t. Each page's weights are scaled by its
/// tokens' ranges once, the second sum is one number per head added once per call, and an
/// outlier adds w_t·(x − x̂_tc) to its channel.
///
/// On AVX-512 with VNNI and on AVX2, every width takes integer products (kivi_vnni.hpp, AVX2's
/// accumulate_level_pairs; 3-bit pages widened to 4-bit codes first): the scaled weights w·r to
/// int8 per head and page (step: the head's largest weight on the page times the page's largest
/// range, / 127), the levels to bytes (ByteLevels). Per page and channel, the sum then moves by at most
/// (page max of w) / 254 · 2·P·(page max of r)·max|ℓ| (tests/support/error_bound.hpp).
template <int Bits, class A>
void accumulate_values(A, std::type_identity<quant::KVQuantValueCodec<Bits>>,
                       const AccumulateArgs<quant::KVQuantValueParams>& args) noexcept {
  using Codec = quant::KVQuantValueCodec<Bits>;
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const PageRun& run = args.run;
  const index_t d = run.head_dim, P = run.page_size;
  const quant::PageGeometry g{P, d};
  float* scaled = args.scratch;                  // [group][page_size]: w_t·r_t (integer pages: [group][16] Σ w·z)
  float* range = scaled + args.group * P;        // [page_size]
  float* offset = range + P;                     // [page_size]
  float* bias = offset + P;                      // [group]: Σ_t w_t·z_t over the call
  for (index_t h = 0; h < args.group; ++h) bias[h] = 0.0f;
  const NuqLevels levels(*args.params.codebook);
  const std::size_t row_bytes = Codec::row_bytes(g);
  const std::size_t capacity = quant::kvquant_detail::outlier_capacity(args.params.outlier_fraction, g);
  auto load = [&](const std::byte* plane, index_t t, index_t c) KVPACK_ALWAYS_INLINE_LAMBDA {
    return load_levels<Bits, A>(plane + row_bytes * static_cast<std::size_t>(t), c, levels);
  };
  const index_t vector_end = d - d % kWidth;
  // The value planes ahead (kValueKernelPrefetches): spread over the integer loop where it runs,
  // else all at once.
  index_t prefetch_steps = 1;
  // The integer path (AVX-512 VNNI or AVX2, 3-bit pages widened to 4-bit codes): the value sums
  // in its lane order ([group][sums_stride], put in order at the end), per head the steps, the
  // page's largest weight and the int8 weights' sum, and the int8 weights [group][page_size].
  using Integer = KiviIntegerKernels<A>;
  constexpr bool kInteger = Integer::kAvailable;
  constexpr int kCodeBits = Bits == 3 ? 4 : Bits;  // the layout the integer kernels read
  const index_t sums_stride = kKiviSplitValueLanes<kCodeBits, A> ? 2 * d : d;
  float* sums = bias + args.group;
  float* steps = sums + args.group * sums_stride;
  float* head_max = steps + args.group;
  auto* weight_sums = reinterpret_cast<std::int32_t*>(head_max + args.group);
  auto* w8 = reinterpret_cast<std::int8_t*>(weight_sums + args.group);
  // Then the outliers' multipliers and targets head-minor (AVX-512 and AVX2, nuq_outliers.hpp),
  // one page's weights [page_size][group] and the call's corrections [head_dim][group]; AVX2's
  // int16 weights [group][page_size]; 3-bit pages widened to 4-bit codes.
  float* outlier_weights = reinterpret_cast<float*>(w8) + (args.group * P + 3) / 4;
  float* outlier_sums = outlier_weights + P * args.group;
  auto* w16 = reinterpret_cast<std::int16_t*>(outlier_sums + d * args.group);
  [[maybe_unused]] auto* widened = reinterpret_cast<std::uint8_t*>(w16 + args.group * P);
  const typename Integer::ByteLevels byte_levels(levels.level);
  const bool integer = kInteger && byte_levels.step > 0.0f && d % 32 == 0 && P % 16 == 0;
  if (integer) std::fill(sums, sums + args.group * sums_stride, 0.0f);
  if (integer) prefetch_steps = d / 32 * Integer::value_steps(kCodeBits, P);
  if constexpr (kNuqOutlierVectors<A>) std::fill(outlier_sums, outlier_sums + d * args.group, 0.0f);
  // A page's codes as the integer kernels read them: 3-bit ones widened to 4-bit rows of d / 2 bytes.
  [[maybe_unused]] auto integer_codes = [&](const std::byte* plane, std::size_t& code_row_bytes)
                                            KVPACK_ALWAYS_INLINE_LAMBDA -> const std::uint8_t* {
    code_row_bytes = row_bytes;
    const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
    if constexpr (kInteger && Bits == 3) {
      Integer::widen_3bit_codes(codes, static_cast<std::size_t>(P) * (d / 32), widened);
      code_row_bytes = d / 2;
      return widened;
    }
    return codes;
  };
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, prefetch_steps, Plane::kValue);
    if (prefetch_steps == 1) prefetcher.step();
    const std::byte* plane = run.pages[i] + run.value_offset;
    const float* w = args.weights + i * P;
    const auto* ranges = reinterpret_cast<const std::uint16_t*>(plane + Codec::ranges_offset(g));
    const auto* offsets = reinterpret_cast<const std::uint16_t*>(plane + Codec::offsets_offset(g));
    const index_t vector_tokens = P - P % kWidth;
    for (index_t t = 0; t < vector_tokens; t += kWidth) {
      simd::load_f16<A>(ranges + t).store_unaligned(range + t);
      simd::load_f16<A>(offsets + t).store_unaligned(offset + t);
    }
    for (index_t t = vector_tokens; t < P; ++t) {
      range[t] = simd::f16_to_f32<A>(quant::kvquant_detail::get_u16(plane + Codec::ranges_offset(g) + 2 * t));
      offset[t] = simd::f16_to_f32<A>(quant::kvquant_detail::get_u16(plane + Codec::offsets_offset(g) + 2 * t));
    }
    bool summed = false;
#if KVPACK_KERNELS_HAVE_VNNI
    if constexpr (kKiviVnni<A>) {
      // Ranges are ≥ 0; one that is not finite (or NaN) sends the page to fp32.
      __mmask16 not_finite = 0;
      for (index_t t = 0; integer && t < P; t += 16) {
        not_finite |= _mm512_cmp_ps_mask(_mm512_loadu_ps(range + t), _mm512_set1_ps(std::numeric_limits<float>::max()),
                                         _CMP_NLE_UQ);
      }
      if (integer && not_finite == 0) {
        page_head_max<A>(w, args.weight_stride, args.group, P, head_max);
        // Σ_t w·z into 16 partial sums per head (in `scaled`, unused on this path), then into bias.
        std::fill(scaled, scaled + 16 * args.group, 0.0f);
        kivi_vnni::quantize_group_weights(A{}, w, args.weight_stride, args.group, P, range, offset, head_max, scaled,
                                          16, w8, steps);
        sum_int8_weights(w8, args.group, P, weight_sums);
        for (index_t h = 0; h < args.group; ++h) {
          steps[h] *= byte_levels.step;
          bias[h] += _mm512_reduce_add_ps(_mm512_loadu_ps(scaled + 16 * h)) -
                     128.0f * steps[h] * static_cast<float>(weight_sums[h]);
        }
        std::size_t code_row_bytes = 0;
        const std::uint8_t* codes = integer_codes(plane, code_row_bytes);
        for (index_t k = 0; k < d / 32; ++k) {  // 32 channels, 4·Bits bytes of each token's row (widened: 16)
          for_each_head_block<4>(args.group, [&](auto block, index_t h0) {
            constexpr int kG = decltype(block)::value;
            const std::int8_t* wh = w8 + static_cast<std::size_t>(h0) * P;
            float* out = sums + h0 * sums_stride + 32 * k * (sums_stride / d);
            if constexpr (Bits != 2) {
              kivi_vnni::accumulate_channels<kG>(codes + 16 * k, code_row_bytes, P, wh, steps + h0, out,
                                                 sums_stride, prefetcher, byte_levels);
            } else {
              kivi_vnni::accumulate_channels_2bit<kG>(codes + 8 * k, code_row_bytes, P, wh, steps + h0, out,
                                                      sums_stride, prefetcher, byte_levels);
            }
          });
        }
        summed = true;
      }
    }
#endif
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
    if constexpr (kInteger && std::is_same_v<A, avx2_arch>) {
      // Ranges are ≥ 0; one that is not finite (or NaN) sends the page to fp32.
      const bool finite = std::all_of(range, range + P, [](float r) { return r <= std::numeric_limits<float>::max(); });
      if (integer && finite) {
        page_head_max<A>(w, args.weight_stride, args.group, P, head_max);
        // Σ_t w·z into 8 partial sums per head (in `scaled`, unused on this path), then into bias.
        std::fill(scaled, scaled + 8 * args.group, 0.0f);
        kivi_avx2::quantize_group_weights(A{}, w, args.weight_stride, args.group, P, range, offset, head_max, scaled, 8,
                                          w8, steps);
        kivi_avx2::widen_weights(A{}, w8, args.group, P, w16, weight_sums);
        for (index_t h = 0; h < args.group; ++h) {
          steps[h] *= byte_levels.step;
          bias[h] += simd::reduce_sum<A>(batch::load_unaligned(scaled + 8 * h)) -
                     128.0f * steps[h] * static_cast<float>(weight_sums[h]);
        }
        std::size_t code_row_bytes = 0;
        const std::uint8_t* codes = integer_codes(plane, code_row_bytes);
        for (index_t k = 0; k < d / 32; ++k) {  // 32 channels, 4·b bytes of each token's row (widened: 16)
          for_each_head_block<Integer::template kValueHeads<kCodeBits>>(args.group, [&](auto block, index_t h0) {
            kivi_avx2::accumulate_level_pairs<kCodeBits, decltype(block)::value>(
                codes + 4 * kCodeBits * k, code_row_bytes, P, w16 + static_cast<std::size_t>(h0) * P, steps + h0,
                sums + h0 * sums_stride + 32 * k, sums_stride, prefetcher, byte_levels);
          });
        }
        summed = true;
      }
    }
#endif
    if (!summed) {
      for (index_t h = 0; h < args.group; ++h) {
        const float* wh = w + h * args.weight_stride;
        batch sum(0.0f);
        for (index_t t = 0; t < vector_tokens; t += kWidth) {
          const batch wt = batch::load_unaligned(wh + t);
          (wt * batch::load_unaligned(range + t)).store_unaligned(scaled + h * P + t);
          sum = xsimd::fma(wt, batch::load_unaligned(offset + t), sum);
        }
        float tail = 0.0f;
        for (index_t t = vector_tokens; t < P; ++t) {
          scaled[h * P + t] = wh[t] * range[t];
          tail += wh[t] * offset[t];
        }
        bias[h] += simd::reduce_sum<A>(sum) + tail;
      }
      accumulate_token_major_vectors<A>(plane, P, d, scaled, P, args.group, 1.0f, args.acc, load);
      for (index_t c = vector_end; c < d; ++c) {
        for (index_t h = 0; h < args.group; ++h) {
          float sum = 0.0f;
          for (index_t t = 0; t < P; ++t) {
            sum += scaled[h * P + t] * levels.level[quant::kvquant_detail::get_code<Bits>(plane + row_bytes * t, c)];
          }
          args.acc[h * d + c] += sum;
        }
      }
    }
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
    if constexpr (kNuqOutlierVectors<A>) {
      to_head_minor(A{}, w, args.weight_stride, args.group, P, outlier_weights);
      add_nuq_outlier_corrections<Bits>(A{}, plane + Codec::outliers_offset(g), capacity, d,
                                        {plane, row_bytes, false, levels.level, range, offset, outlier_weights,
                                         outlier_sums, args.group});
    }
#endif
    if constexpr (!kNuqOutlierVectors<A>) {
      for_each_nuq_outlier<A>(plane + Codec::outliers_offset(g), capacity, d, [&](index_t t, index_t c, float exact) {
        const unsigned code = quant::kvquant_detail::get_code<Bits>(plane + row_bytes * static_cast<std::size_t>(t), c);
        const float correction = exact - (levels.level[code] * range[t] + offset[t]);
        for (index_t h = 0; h < args.group; ++h) args.acc[h * d + c] += w[h * args.weight_stride + t] * correction;
      });
    }
  }
  if constexpr (kInteger) {
    if (integer) {
      for (index_t h = 0; h < args.group; ++h) {
        add_value_sums_in_order<kCodeBits, 32, A>(sums + h * sums_stride, d, args.acc + h * d);
      }
    }
  }
#if KVPACK_KERNELS_HAVE_AVX2_INTEGER
  if constexpr (kNuqOutlierVectors<A>) add_head_minor(A{}, outlier_sums, args.group, d, args.acc, d);
#endif
  for (index_t h = 0; h < args.group; ++h) {
    const float b = bias[h];  // a local: acc may alias bias for all the compiler knows
    for (index_t c = 0; c < d; ++c) args.acc[h * d + c] += b;
  }
}

/// Pre-RoPE keys in a page written in order: a channel-major fp32 tile, as the codes are stored.
/// rope.hpp must be included after this file to see this overload and the next.
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void decode_key_tile(A arch, std::type_identity<quant::KVQuantKeyCodec<Bits>>,
                                          quant::PageGeometry g, const std::byte* plane,
                                          const quant::KVQuantKeyParams& params, float* tile, float* /*spare*/) noexcept {
  unpack_nuq_keys<Bits>(arch, g, plane, params, tile, 1, static_cast<std::size_t>(g.page_size));
}

/// Pre-RoPE keys in any other page: token-major, for a rotation per row. Rows are unpacked whole
/// vectors at a time into `spare`, channel-major as they are stored, and transposed: writing
/// each code to its token's row directly costs a shift, a mask, a load and a strided store per
/// code.

template <int Bits, class A>
KVPACK_ALWAYS_INLINE void decode_key_rows(A arch, std::type_identity<quant::KVQuantKeyCodec<Bits>>,
                                          quant::PageGeometry g, const std::byte* plane,
                                          const quant::KVQuantKeyParams& params, float* rows, float* spare) noexcept {
  if (g.page_size % 4 == 0 && g.head_dim % 4 == 0) {
    unpack_nuq_keys<Bits>(arch, g, plane, params, spare, 1, static_cast<std::size_t>(g.page_size));
    transpose_by_4x4(spare, g.head_dim, g.page_size, rows);
  } else {
    unpack_nuq_keys<Bits>(arch, g, plane, params, rows, static_cast<std::size_t>(g.head_dim), 1);
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
