#pragma once
/// \file rope.hpp
/// \brief Scoring keys stored before RoPE: each page is decoded to token-major fp32 rows in L1,
///        every row rotated to its slot's position (core/rope.hpp's two-part tables), then scored
///        like the tail's full-precision rows.
///
/// Decoding uses `decode_key_rows(arch, codec, ...)`: codecs with a fast unpacker overload it
/// (declared before this file is included); every other codec falls back to its scalar
/// reference decoder, so any key codec can be stored
/// pre-RoPE (slowly) and the fast ones are those the dispatch library precompiles.

#include <cstdint>
#include <type_traits>

#include "kvpack/core/rope.hpp"
#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/softmax.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Lane i of a vector holds channel i ^ 1: the partner of an adjacent-pair channel.
struct SwapPairs {
  static constexpr unsigned get(unsigned i, unsigned) noexcept { return i ^ 1u; }
};

/// `out` = `in` (head_dim floats) rotated to `position`. `in` and `out` must not overlap.
template <class A>
KVPACK_ALWAYS_INLINE void rotate_row(A, const RopeView& rope, std::int32_t position, const float* in,
                                     float* out) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  const index_t d = rope.head_dim;
  const std::int64_t p = position < 0 ? 0 : (position > rope.max_position ? rope.max_position : position);
  const std::size_t lo = static_cast<std::size_t>(p & (RopeView::kFine - 1)) * d;
  const std::size_t hi = static_cast<std::size_t>(p >> RopeView::kFineBits) * d;
  const float* cos_lo = rope.fine_cos + lo;
  const float* sin_lo = rope.fine_sin + lo;
  const float* cos_hi = rope.coarse_cos + hi;
  const float* sin_hi = rope.coarse_sin + hi;
  const bool adjacent = rope.pairing == RopePairing::kAdjacent;
  const index_t half_dim = d / 2;
  if (d % kWidth == 0 && (adjacent || half_dim % kWidth == 0)) {
    constexpr auto kSwap = xsimd::make_batch_constant<xsimd::batch<std::uint32_t, A>, SwapPairs>();
    for (index_t c = 0; c < d; c += kWidth) {
      const batch cl = batch::load_unaligned(cos_lo + c), sl = batch::load_unaligned(sin_lo + c);
      const batch ch = batch::load_unaligned(cos_hi + c), sh = batch::load_unaligned(sin_hi + c);
      const batch cosine = xsimd::fnma(sh, sl, ch * cl);
      const batch sine = batch::load_unaligned(rope.sign + c) * xsimd::fma(ch, sl, sh * cl);
      const batch x = batch::load_unaligned(in + c);
      const batch partner = adjacent ? xsimd::swizzle(x, kSwap)
                                     : batch::load_unaligned(in + (c < half_dim ? c + half_dim : c - half_dim));
      xsimd::fma(partner, sine, x * cosine).store_unaligned(out + c);
    }
    return;
  }
  rotate_with_tables(rope, position, in, out);
}

/// A key page as token-major fp32 rows: the codec's own scalar decoder, for every codec without
/// a faster overload. `spare` (page_size · head_dim floats) is free for an overload's staging.
template <class KeyCodec, class A>
KVPACK_ALWAYS_INLINE void decode_key_rows(A, std::type_identity<KeyCodec>, quant::PageGeometry g,
                                          const std::byte* plane, const typename KeyCodec::params_type& params,
                                          float* rows, float* /*spare*/) noexcept {
  KeyCodec{}.decode(g, plane, params, rows);
}

template <class KeyCodec, class A>
void score_rotated_keys(A arch, std::type_identity<KeyCodec> codec,
                        const RotatedScoreArgs<typename KeyCodec::params_type>& args) noexcept {
  const ScoreArgs<typename KeyCodec::params_type>& score = args.score;
  const PageRun& run = score.run;
  const index_t page = run.page_size;
  const index_t d = run.head_dim;
  float* decoded = score.scratch;                                      // [page_size][head_dim]
  float* rotated = decoded + static_cast<std::size_t>(page) * d;       // [page_size][head_dim]
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    decode_key_rows(arch, codec, quant::PageGeometry{page, d}, run.pages[i], score.params, decoded, rotated);
    for (index_t t = 0; t < page; ++t) {
      rotate_row(arch, args.rope, args.positions[i][t], decoded + static_cast<std::size_t>(t) * d,
                 rotated + static_cast<std::size_t>(t) * d);
    }
    float* scores = score.scores + i * page;
    score_rows(arch, RowScoreArgs{rotated, page, d, d, score.queries, score.group, scores, score.score_stride});
    if (run.live != nullptr) mask_dead_slots(run.live[i], page, score.group, scores, score.score_stride);
  }
}

template <class A>
void score_rotated_rows(A arch, const RotatedRowScoreArgs& args) noexcept {
  const RowScoreArgs& rows = args.rows;
  for (index_t t = 0; t < rows.count; ++t) {
    rotate_row(arch, args.rope, args.positions[t], rows.rows + t * rows.row_stride,
               args.scratch + static_cast<std::size_t>(t) * rows.head_dim);
  }
  RowScoreArgs rotated = rows;
  rotated.rows = args.scratch;
  rotated.row_stride = rows.head_dim;
  score_rows(arch, rotated);
}

}  // namespace kvpack::inline v0::kernels::cpu
