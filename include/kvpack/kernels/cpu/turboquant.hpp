#pragma once
/// \file turboquant.hpp
/// \brief Decode-attention kernels for quant::TurboCodec (MSE and Prod) and quant::QjlKeyCodec
///        that never leave the rotated space for keys.
///
/// Keys: q · x̃ = n · ⟨R q, c[idx]⟩ (+ √(π/2)/d · γ · n · ⟨S R q, s⟩ for Prod), so each call
/// rotates the group's queries once (and sketches them once), then scores every page straight
/// from its codes: a page's codes are looked up in the centroid table, times the token's norm,
/// into a channel-major fp32 tile in L1 that the element-format kernel of float.hpp scores
/// against the rotated query (the sign bits the same way, as ±coefficients, against S R q).
/// Values: the call's accumulator is rotated in once, every page adds its rotated-space rows
/// (c[idx] · n, and Prod's signs into a second, sketch-space sum folded in with Sᵀ once), and
/// the sum is un-rotated once. attend_stream calls the value kernel once per chunk of 512
/// tokens, so "once" is once per head per chunk: exact (R is orthogonal, the softmax's rescaling
/// is linear) and leaves attend_stream and the tail's fp32 accumulation untouched.
///
/// Rotations are computed in double (rotation.hpp), so the rotated query is exact to fp32
/// rounding. Helpers are always inlined or templated on the arch (STYLE.md §5.2).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace kvpack::inline v0::kernels::cpu {

namespace turbo {

/// Scales rows [h][0, rows) of `sketch · x_h` (sketch [rows][dim]) into out[h][rows], in double.
KVPACK_ALWAYS_INLINE void sketch_rows(const float* sketch, index_t first_row, index_t rows, index_t dim,
                                      const float* x, float* out) noexcept {
  for (index_t j = 0; j < rows; ++j) {
    const float* s = sketch + static_cast<std::size_t>(first_row + j) * dim;
    double sum = 0.0;
    for (index_t c = 0; c < dim; ++c) sum += static_cast<double>(s[c]) * x[c];
    out[j] = static_cast<float>(sum);
  }
}

/// A page's MSE codes as n_t · c[idx_tc]: channel-major (`tile[c·P + t]`) for keys,
/// token-major (`tile[t·d + c]`) for values.
template <bool kChannelMajor, class A>
KVPACK_ALWAYS_INLINE void unpack_codes(A, quant::PageGeometry g, const quant::turbo_detail::LayerView& v,
                                       const std::byte* plane, float* tile) noexcept {
  const index_t d = g.head_dim;
  const index_t P = g.page_size;
  const std::size_t row_bytes = v.row_bytes();
  const std::byte* norms = plane + v.norms_offset(P);
  for (index_t t = 0; t < P; ++t) {
    const std::byte* row = plane + row_bytes * static_cast<std::size_t>(t);
    const float n = quant::turbo_detail::load_half(norms + 2 * static_cast<std::size_t>(t));
    float high[quant::turbo_detail::kMaxLevels], low[quant::turbo_detail::kMaxLevels];
    for (int k = 0; k < (1 << v.high_bits); ++k) high[k] = v.high_centroids[k] * n;
    for (int k = 0; k < (1 << v.low_bits); ++k) low[k] = v.low_centroids[k] * n;
    std::size_t bit = 0;
    for (index_t c = 0; c < d; ++c) {
      const bool is_high = c < v.high_channels;
      const int bits = is_high ? v.high_bits : v.low_bits;
      const unsigned code = bits > 0 ? quant::turbo_detail::get_bits(row, bit, bits) : 0u;
      bit += static_cast<std::size_t>(bits);
      const float x = (is_high ? high : low)[code];
      if constexpr (kChannelMajor) {
        tile[static_cast<std::size_t>(c) * P + t] = x;
      } else {
        tile[static_cast<std::size_t>(t) * d + c] = x;
      }
    }
  }
}

/// A page's sign bits as ±coef_t (coef_t = √(π/2)/m · scale_t · extra_t), rows [first, first +
/// rows) of the sketch; channel-major (`tile[j·P + t]`) or token-major (`tile[t·rows + j]`).
template <bool kChannelMajor>
KVPACK_ALWAYS_INLINE void unpack_signs(const std::byte* signs, std::size_t sign_bytes, index_t P, index_t first,
                                       index_t rows, index_t m, const std::byte* scales, const std::byte* extras,
                                       float* tile) noexcept {
  for (index_t t = 0; t < P; ++t) {
    const std::byte* row = signs + sign_bytes * static_cast<std::size_t>(t);
    float coef = static_cast<float>(quant::turbo_detail::kSqrtHalfPi / m) *
                 quant::turbo_detail::load_half(scales + 2 * static_cast<std::size_t>(t));
    if (extras != nullptr) coef *= quant::turbo_detail::load_half(extras + 2 * static_cast<std::size_t>(t));
    for (index_t j = 0; j < rows; ++j) {
      const index_t bit = first + j;
      const bool positive = (static_cast<unsigned>(row[bit / 8]) >> (bit % 8)) & 1u;
      const float x = positive ? coef : -coef;
      if constexpr (kChannelMajor) {
        tile[static_cast<std::size_t>(j) * P + t] = x;
      } else {
        tile[static_cast<std::size_t>(t) * rows + j] = x;
      }
    }
  }
}

/// A run of one fp32 tile (its plane at offset 0) of `dim` channels.
KVPACK_ALWAYS_INLINE PageRun tile_of(const std::byte* const* tile, index_t page_size, index_t dim) noexcept {
  return PageRun{tile, nullptr, 1, 0, page_size, dim, 0, 0};
}

}  // namespace turbo

template <quant::TurboVariant V, class A>
void score_keys(A arch, std::type_identity<quant::TurboCodec<V, Plane::kKey>>,
                const ScoreArgs<quant::turbo_detail::Params>& args) noexcept {
  const PageRun& run = args.run;
  if (run.count == 0) return;
  const index_t d = run.head_dim;
  const index_t P = run.page_size;
  const quant::turbo_detail::LayerView& v = quant::turbo_detail::layer_view(args.params, d);
  float* tile = args.scratch;                                      // [d][P]
  float* rotated = tile + static_cast<std::size_t>(P) * d;         // [group][d]: R q
  float* sketched = rotated + static_cast<std::size_t>(args.group) * d;  // [group][d]: S R q
  float* extra = sketched + static_cast<std::size_t>(args.group) * d;    // [group][P]
  for (index_t h = 0; h < args.group; ++h) {
    quant::rotate(v.rotation, args.queries + h * d, rotated + h * d);
    if constexpr (V == quant::TurboVariant::kProd) turbo::sketch_rows(v.sketch, 0, d, d, rotated + h * d, sketched + h * d);
  }
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * P;
    turbo::unpack_codes<true>(arch, quant::PageGeometry{P, d}, v, plane, tile);
    score_element_keys<float>(arch, ScoreArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, d), {}, rotated, args.group,
                                                                scores, args.score_stride, nullptr});
    if constexpr (V == quant::TurboVariant::kProd) {
      turbo::unpack_signs<true>(plane + v.signs_offset(P), v.sign_bytes(), P, 0, d, d, plane + v.norms_offset(P),
                                plane + v.gammas_offset(P), tile);
      score_element_keys<float>(arch, ScoreArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, d), {}, sketched,
                                                                  args.group, extra, P, nullptr});
      for (index_t h = 0; h < args.group; ++h) {
        for (index_t t = 0; t < P; ++t) scores[h * args.score_stride + t] += extra[h * P + t];
      }
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, args.group, scores, args.score_stride);
  }
}

template <quant::TurboVariant V, class A>
void accumulate_values(A arch, std::type_identity<quant::TurboCodec<V, Plane::kValue>>,
                       const AccumulateArgs<quant::turbo_detail::Params>& args) noexcept {
  const PageRun& run = args.run;
  if (run.count == 0) return;
  const index_t d = run.head_dim;
  const index_t P = run.page_size;
  const quant::turbo_detail::LayerView& v = quant::turbo_detail::layer_view(args.params, d);
  float* tile = args.scratch;                                              // [P][d]
  float* rotated = tile + static_cast<std::size_t>(P) * d;                 // [group][d]: R acc
  float* sketch_sum = rotated + static_cast<std::size_t>(args.group) * d;  // [group][d]: Σ w ±coef
  for (index_t h = 0; h < args.group; ++h) quant::rotate(v.rotation, args.acc + h * d, rotated + h * d);
  if constexpr (V == quant::TurboVariant::kProd) {
    std::fill(sketch_sum, sketch_sum + static_cast<std::size_t>(args.group) * d, 0.0f);
  }
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    const float* w = args.weights + i * P;
    // Dead slots carry weight 0, so their rows add nothing.
    turbo::unpack_codes<false>(arch, quant::PageGeometry{P, d}, v, plane, tile);
    accumulate_element_values<float>(arch, AccumulateArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, d), {}, w,
                                                                             args.weight_stride, args.group, rotated,
                                                                             nullptr});
    if constexpr (V == quant::TurboVariant::kProd) {
      turbo::unpack_signs<false>(plane + v.signs_offset(P), v.sign_bytes(), P, 0, d, d, plane + v.norms_offset(P),
                                 plane + v.gammas_offset(P), tile);
      accumulate_element_values<float>(arch, AccumulateArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, d), {}, w,
                                                                               args.weight_stride, args.group,
                                                                               sketch_sum, nullptr});
    }
  }
  for (index_t h = 0; h < args.group; ++h) {
    float* r = rotated + h * d;
    if constexpr (V == quant::TurboVariant::kProd) {
      // r += Sᵀ · sketch_sum, in double.
      const float* z = sketch_sum + h * d;
      for (index_t c = 0; c < d; ++c) {
        double sum = r[c];
        for (index_t j = 0; j < d; ++j) sum += static_cast<double>(v.sketch[static_cast<std::size_t>(j) * d + c]) * z[j];
        r[c] = static_cast<float>(sum);
      }
    }
    quant::unrotate(v.rotation, r, args.acc + h * d);
  }
}

template <class A>
void score_keys(A arch, std::type_identity<quant::QjlKeyCodec>, const ScoreArgs<quant::turbo_detail::Params>& args) noexcept {
  const PageRun& run = args.run;
  if (run.count == 0) return;
  const index_t d = run.head_dim;
  const index_t P = run.page_size;
  const quant::turbo_detail::LayerView& v = quant::turbo_detail::layer_view(args.params, d);
  const index_t M = v.sketch_rows;
  // Sketch rows in blocks of at most head_dim, so one block's tile fits the page tile.
  const index_t block = std::min<index_t>(M, d);
  float* tile = args.scratch;                                // [block][P]
  float* sketched = tile + static_cast<std::size_t>(P) * d;  // per block: [group][rows] of S q (M ≤ 2d)
  float* extra = sketched + static_cast<std::size_t>(args.group) * M;  // [group][P]
  for (index_t first = 0; first < M; first += block) {
    const index_t rows = std::min<index_t>(block, M - first);
    for (index_t h = 0; h < args.group; ++h) {
      turbo::sketch_rows(v.sketch, first, rows, d, args.queries + h * d,
                         sketched + static_cast<std::size_t>(args.group) * first + h * rows);
    }
  }
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * P;
    for (index_t first = 0; first < M; first += block) {
      const index_t rows = std::min<index_t>(block, M - first);
      turbo::unpack_signs<true>(plane, v.sign_bytes(), P, first, rows, M, plane + v.norms_offset(P), nullptr, tile);
      score_element_keys<float>(arch, ScoreArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, rows), {},
                                                                  sketched + static_cast<std::size_t>(args.group) * first,
                                                                  args.group, first == 0 ? scores : extra,
                                                                  first == 0 ? args.score_stride : P, nullptr});
      if (first > 0) {
        for (index_t h = 0; h < args.group; ++h) {
          for (index_t t = 0; t < P; ++t) scores[h * args.score_stride + t] += extra[h * P + t];
        }
      }
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, args.group, scores, args.score_stride);
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
