#pragma once
/// \file kvquant.hpp
/// \brief Decode-attention kernels for quant::KVQuant, fused with the codebook lookup: scores and
///        sums are computed from the packed codes through a 16-lane table of the codebook's levels
///        (one permute per vector of codes), the per-vector ranges folded into the operand that
///        multiplies them (the query for keys, the weights for values), and each outlier added as
///        a correction x − x̂. Pre-RoPE keys are decoded to fp32 for rope.hpp's rotation:
///        channel-major tiles as stored, or rows by a transpose.
///
/// Codes are read eight at a time: eight b-bit codes are exactly b bytes, one little-endian word.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvpack/kernels/cpu/channel_major.hpp"
#include "kvpack/kernels/cpu/float.hpp"
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

/// Calls f(t, c, exact) for each outlier a page's section holds. The index t·head_dim + c is
/// split by a multiply instead of a division: with c = ⌈2³²/d⌉, ⌊n/d⌋ = ⌊c·n/2³²⌋ exactly for
/// 16-bit n and d (Lemire, Kaser & Kurz, "Faster remainder by direct computation", 2019).
template <class A, class F>
KVPACK_ALWAYS_INLINE void for_each_nuq_outlier(const std::byte* section, std::size_t capacity, index_t head_dim,
                                               F&& f) noexcept {
  using quant::kvquant_detail::get_u16;
  const std::size_t count = std::min<std::size_t>(get_u16(section), capacity);
  const std::uint64_t magic = UINT64_C(0xFFFFFFFF) / static_cast<std::uint64_t>(head_dim) + 1;
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t index = get_u16(section + 2 + 2 * i);
    const auto t = static_cast<index_t>((index * magic) >> 32);
    f(t, static_cast<index_t>(index) - t * head_dim, simd::f16_to_f32<A>(get_u16(section + 2 + 2 * capacity + 2 * i)));
  }
}

/// Writes the page's exact outliers over a decoded tile, element (t, c) at tile[t·t_stride + c·c_stride].
template <class A>
KVPACK_ALWAYS_INLINE void apply_nuq_outliers(const std::byte* section, std::size_t capacity, index_t head_dim,
                                             float* tile, std::size_t t_stride, std::size_t c_stride) noexcept {
  for_each_nuq_outlier<A>(section, capacity, head_dim, [&](index_t t, index_t c, float exact) {
    tile[static_cast<std::size_t>(t) * t_stride + static_cast<std::size_t>(c) * c_stride] = exact;
  });
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
  for (index_t h = 0; h < args.group; ++h) {
    const float* q = args.queries + h * d;
    float sum = 0.0f;
    for (index_t c = 0; c < d; ++c) {
      folded[h * d + c] = q[c] * p.half_range[c];
      sum += q[c] * p.offset[c];
    }
    bias[h] = sum;
  }
  const NuqLevels levels(*p.codebook);
  const std::size_t row_bytes = Codec::row_bytes(g);
  score_channel_major_keys<A>(run, folded, args.group, args.scores, args.score_stride, 1.0f,
                              [&](const std::byte* plane, index_t c, index_t t0) KVPACK_ALWAYS_INLINE_LAMBDA {
                                return load_levels<Bits, A>(plane + row_bytes * static_cast<std::size_t>(c), t0, levels);
                              });
  const std::size_t capacity = quant::kvquant_detail::outlier_capacity(p.outlier_fraction, g);
  for (index_t i = 0; i < run.count; ++i) {
    float* scores = args.scores + i * P;
    for (index_t h = 0; h < args.group; ++h) {
      for (index_t t = 0; t < P; ++t) scores[h * args.score_stride + t] += bias[h];
    }
    const std::byte* plane = run.pages[i];
    for_each_nuq_outlier<A>(plane + Codec::outliers_offset(g), capacity, d, [&](index_t t, index_t c, float exact) {
      const unsigned code = quant::kvquant_detail::get_code<Bits>(plane + row_bytes * static_cast<std::size_t>(c), t);
      const float correction = exact - (levels.level[code] * p.half_range[c] + p.offset[c]);
      for (index_t h = 0; h < args.group; ++h) scores[h * args.score_stride + t] += args.queries[h * d + c] * correction;
    });
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, args.group, scores, args.score_stride);
  }
}

/// Values, fused with the lookup: with x̂_tc = ℓ(code_tc)·r_t + z_t (each token's own range),
/// Σ_t w_t·x̂_tc = Σ_t (w_t·r_t)·ℓ(code_tc) + Σ_t w_t·z_t. Each page's weights are scaled by its
/// tokens' ranges once, the second sum is one number per head added once per call, and an
/// outlier adds w_t·(x − x̂_tc) to its channel.
template <int Bits, class A>
void accumulate_values(A, std::type_identity<quant::KVQuantValueCodec<Bits>>,
                       const AccumulateArgs<quant::KVQuantValueParams>& args) noexcept {
  using Codec = quant::KVQuantValueCodec<Bits>;
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const PageRun& run = args.run;
  const index_t d = run.head_dim, P = run.page_size;
  const quant::PageGeometry g{P, d};
  float* scaled = args.scratch;                  // [group][page_size]: w_t·r_t
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
  for (index_t i = 0; i < run.count; ++i) {
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
    for_each_nuq_outlier<A>(plane + Codec::outliers_offset(g), capacity, d, [&](index_t t, index_t c, float exact) {
      const unsigned code = quant::kvquant_detail::get_code<Bits>(plane + row_bytes * static_cast<std::size_t>(t), c);
      const float correction = exact - (levels.level[code] * range[t] + offset[t]);
      for (index_t h = 0; h < args.group; ++h) args.acc[h * d + c] += w[h * args.weight_stride + t] * correction;
    });
  }
  for (index_t h = 0; h < args.group; ++h) {
    for (index_t c = 0; c < d; ++c) args.acc[h * d + c] += bias[h];
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
