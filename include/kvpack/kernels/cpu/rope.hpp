#pragma once
/// \file rope.hpp
/// \brief Scoring keys stored before RoPE.
///
/// A page whose slots hold consecutive positions p0 + t (a page written in order: the usual case)
/// is scored against the queries turned back by p0 once, each slot turned by its offset t from
/// the slot tables inside the fp32 key loop (core/rope.hpp); element formats are read in place,
/// other codecs decoded to a channel-major fp32 tile first. Any other page is decoded to
/// token-major rows, every row rotated to its own position through the two-part tables, then
/// scored like the tail's full-precision rows.
///
/// Rows come from `decode_key_rows(arch, codec, ...)`, tiles from `decode_key_tile(arch, codec,
/// ...)`: the element formats' overloads are below, KVQuant's in kvquant.hpp (included before
/// this file); every other codec falls back to its scalar reference decoder (and a transpose for
/// tiles), so any key codec can be stored pre-RoPE (slowly) and the fast ones are those the
/// dispatch library precompiles. Nothing here constructs a codec that has an overload: a codec holding tables
/// would otherwise put their untagged destructors into the per-ISA objects (STYLE.md §5.2).

#include <cstdint>
#include <type_traits>

#include "kvpack/core/rope.hpp"
#include "kvpack/kernels/cpu/channel_major.hpp"
#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/softmax.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Lane i of a vector holds channel i ^ 1: the partner of an adjacent-pair channel.
struct SwapPairs {
  static constexpr unsigned get(unsigned i, unsigned) noexcept { return i ^ 1u; }
};

/// `rows` rows of head_dim floats, `in` to `out`, rotated to `position` or back from it with
/// `inverse`: cos and sin are formed once for all of them. `in` and `out` must not overlap.
template <class A>
KVPACK_ALWAYS_INLINE void rotate_rows(A, const RopeView& rope, std::int32_t position, const float* in, index_t rows,
                                      float* out, bool inverse = false) noexcept {
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
      const batch sign = batch::load_unaligned(rope.sign + c);
      const batch sine = (inverse ? -sign : sign) * xsimd::fma(ch, sl, sh * cl);
      for (index_t r = 0; r < rows; ++r) {
        const float* row = in + static_cast<std::size_t>(r) * d;
        const batch x = batch::load_unaligned(row + c);
        const batch partner = adjacent ? xsimd::swizzle(x, kSwap)
                                       : batch::load_unaligned(row + (c < half_dim ? c + half_dim : c - half_dim));
        xsimd::fma(partner, sine, x * cosine).store_unaligned(out + static_cast<std::size_t>(r) * d + c);
      }
    }
    return;
  }
  for (index_t r = 0; r < rows; ++r) {
    rotate_with_tables(rope, position, in + static_cast<std::size_t>(r) * d, out + static_cast<std::size_t>(r) * d,
                       inverse);
  }
}

/// Whether slot t holds position positions[0] + t for every slot of the page, all of them inside
/// the tables (so nothing is clamped).
inline bool holds_consecutive_positions(const std::int32_t* positions, index_t page_size,
                                        std::int64_t max_position) noexcept {
  const std::int64_t first = positions[0];
  if (first < 0 || first + page_size - 1 > max_position || page_size > RopeView::kSlots) return false;
  for (index_t t = 1; t < page_size; ++t) {
    if (positions[t] != first + t) return false;
  }
  return true;
}

/// Scores (times `scale`) of kG heads for the kTiles vectors of slots from t0 of a page written in
/// order, against queries `q` turned back to the page's first position. `load(c, t)` gives channel
/// c of slots t .. t + W − 1 before RoPE. Each pair (a, b) is loaded once and turned by the slot
/// tables (s = sign_a·sin = −sin): r_a = x_a·cos + x_b·s, r_b = x_b·cos − x_a·s; the a and b
/// products go to separate accumulators so that 2·kG·kTiles chains run.
template <int kG, int kTiles, RopePairing kPairing, class A, class Load>
KVPACK_ALWAYS_INLINE void score_turned_tiles(const RopeView& rope, index_t t0, index_t head_dim, const float* q,
                                             float scale, float* scores, index_t stride, const Load& load) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  batch acc[2][kG][kTiles];
  for (auto& channel : acc)
    for (auto& head : channel)
      for (batch& a : head) a = batch(0.0f);
  const index_t pairs = head_dim / 2;
  for (index_t j = 0; j < pairs; ++j) {
    const index_t a = kPairing == RopePairing::kAdjacent ? 2 * j : j;
    const index_t b = kPairing == RopePairing::kAdjacent ? 2 * j + 1 : j + pairs;
    batch ra[kTiles], rb[kTiles];
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) {
      const index_t t = t0 + i * kWidth;
      const std::size_t slot = static_cast<std::size_t>(a) * RopeView::kSlots + t;
      const batch cosine = batch::load_unaligned(rope.slot_cos + slot);
      const batch sine = batch::load_unaligned(rope.slot_sin + slot);
      const batch xa = load(a, t), xb = load(b, t);
      ra[i] = xsimd::fma(xb, sine, xa * cosine);
      rb[i] = xsimd::fnma(xa, sine, xb * cosine);
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const batch qa(q[h * head_dim + a]), qb(q[h * head_dim + b]);
      KVPACK_UNROLL
      for (int i = 0; i < kTiles; ++i) {
        acc[0][h][i] = xsimd::fma(qa, ra[i], acc[0][h][i]);
        acc[1][h][i] = xsimd::fma(qb, rb[i], acc[1][h][i]);
      }
    }
  }
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) {
      ((acc[0][h][i] + acc[1][h][i]) * batch(scale)).store_unaligned(scores + h * stride + t0 + i * kWidth);
    }
  }
}

/// Every slot of one page written in order (`load` as for score_turned_tiles): blocks of up to 4
/// heads, two vectors of slots at a time where the page holds them.
template <class A, class Load>
KVPACK_ALWAYS_INLINE void score_turned_page(const RopeView& rope, index_t page_size, index_t head_dim,
                                            const float* turned_queries, index_t group, float scale, float* scores,
                                            index_t stride, const Load& load) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  auto score = [&]<RopePairing kPairing>() {
    for_each_head_block<4>(group, [&](auto block, index_t h0) {
      constexpr int kG = decltype(block)::value;
      const float* q = turned_queries + h0 * head_dim;
      float* head_scores = scores + h0 * stride;
      index_t t0 = 0;
      for (; t0 + 2 * kWidth <= page_size; t0 += 2 * kWidth) {
        score_turned_tiles<kG, 2, kPairing, A>(rope, t0, head_dim, q, scale, head_scores, stride, load);
      }
      for (; t0 < page_size; t0 += kWidth) {
        score_turned_tiles<kG, 1, kPairing, A>(rope, t0, head_dim, q, scale, head_scores, stride, load);
      }
    });
  };
  if (rope.pairing == RopePairing::kAdjacent) {
    score.template operator()<RopePairing::kAdjacent>();
  } else {
    score.template operator()<RopePairing::kHalfSplit>();
  }
}

/// A key page as token-major fp32 rows: the codec's own scalar decoder, for every codec without
/// a faster overload. `spare` (page_size · head_dim floats) is free for an overload's staging.
template <class KeyCodec, class A>
KVPACK_ALWAYS_INLINE void decode_key_rows(A, std::type_identity<KeyCodec>, quant::PageGeometry g,
                                          const std::byte* plane, const typename KeyCodec::params_type& params,
                                          float* rows, float* /*spare*/) noexcept {
  KeyCodec{}.decode(g, plane, params, rows);
}

/// Element key planes, channel-major already: converted a vector at a time into `spare`, then
/// transposed to rows (the codecs' scalar decoders took most of a gapped page's time).
template <class Storage, class KeyCodec, class A>
KVPACK_ALWAYS_INLINE void decode_element_key_rows(quant::PageGeometry g, const std::byte* plane,
                                                  const typename KeyCodec::params_type& params, float* rows,
                                                  float* spare) noexcept {
  decode_elements_channel_major<Storage, Plane::kKey, KeyCodec, A>(
      DecodePlaneArgs<KeyCodec>{nullptr, params, plane, g.page_size, g.head_dim, spare, nullptr});
  transpose_rows(spare, g.head_dim, g.page_size, rows);
}
template <class T, class A>
KVPACK_ALWAYS_INLINE void decode_key_rows(A, std::type_identity<quant::FloatCodec<T, Plane::kKey>>,
                                          quant::PageGeometry g, const std::byte* plane, const quant::NoParams& params,
                                          float* rows, float* spare) noexcept {
  decode_element_key_rows<T, quant::FloatCodec<T, Plane::kKey>, A>(g, plane, params, rows, spare);
}
template <class Format, class A>
KVPACK_ALWAYS_INLINE void decode_key_rows(A, std::type_identity<quant::FP8Codec<Format, Plane::kKey>>,
                                          quant::PageGeometry g, const std::byte* plane,
                                          const quant::FP8Params& params, float* rows, float* spare) noexcept {
  decode_element_key_rows<Format, quant::FP8Codec<Format, Plane::kKey>, A>(g, plane, params, rows, spare);
}

/// A key page as a channel-major fp32 tile ([head_dim][page_size]): its rows, transposed, for
/// every codec without a faster overload. `spare` (page_size · head_dim floats) holds the rows.
template <class KeyCodec, class A>
KVPACK_ALWAYS_INLINE void decode_key_tile(A arch, std::type_identity<KeyCodec> codec, quant::PageGeometry g,
                                          const std::byte* plane, const typename KeyCodec::params_type& params,
                                          float* tile, float* spare) noexcept {
  decode_key_rows(arch, codec, g, plane, params, spare, tile);
  transpose_rows(spare, g.page_size, g.head_dim, tile);
}

/// The element type of a key plane stored as plain elements, channel-major (Float, FP8), which
/// the kernels read in place; void for every other codec.
template <class Codec>
struct KeyElements {
  using type = void;
};
template <class T>
struct KeyElements<quant::FloatCodec<T, Plane::kKey>> {
  using type = T;
};
template <class Format>
struct KeyElements<quant::FP8Codec<Format, Plane::kKey>> {
  using type = Format;
};

/// A page written in order: element formats read in place, every other codec decoded to a
/// channel-major fp32 tile first ([head_dim][page_size]; `spare` is [page_size][head_dim] for the
/// decoder).
template <class KeyCodec, class A>
KVPACK_ALWAYS_INLINE void score_page_in_order(A arch, std::type_identity<KeyCodec> codec, const RopeView& rope,
                                              const PageRun& run, const std::byte* plane,
                                              const typename KeyCodec::params_type& params,
                                              const float* turned_queries, index_t group, float* scores,
                                              index_t stride, float* tile, float* spare) noexcept {
  using Elements = typename KeyElements<KeyCodec>::type;
  const index_t page = run.page_size;
  const std::size_t rows = static_cast<std::size_t>(page);
  if constexpr (!std::is_void_v<Elements>) {
    score_turned_page<A>(rope, page, run.head_dim, turned_queries, group, plane_scale(params) / kLoadFactor<Elements>,
                         scores, stride, [plane, rows](index_t c, index_t t) KVPACK_ALWAYS_INLINE_LAMBDA {
                           return load_elements<Elements, A>(plane, static_cast<std::size_t>(c) * rows + t);
                         });
  } else {
    decode_key_tile(arch, codec, quant::PageGeometry{page, run.head_dim}, plane, params, tile, spare);
    score_turned_page<A>(rope, page, run.head_dim, turned_queries, group, 1.0f, scores, stride,
                         [tile, rows](index_t c, index_t t) KVPACK_ALWAYS_INLINE_LAMBDA {
                           return simd::f32<A>::load_unaligned(tile + static_cast<std::size_t>(c) * rows + t);
                         });
  }
}

template <class KeyCodec, class A>
void score_rotated_keys(A arch, std::type_identity<KeyCodec> codec,
                        const RotatedScoreArgs<typename KeyCodec::params_type>& args) noexcept {
  const ScoreArgs<typename KeyCodec::params_type>& score = args.score;
  const PageRun& run = score.run;
  const index_t page = run.page_size;
  const index_t d = run.head_dim;
  const RopeView& rope = args.rope;
  // A page's decoded keys (rows, or a channel-major tile), its rotated rows (or the decoder's
  // spare), and the queries turned back to a page's first position.
  float* decoded = score.scratch;                                        // page_size · head_dim
  float* rotated = decoded + static_cast<std::size_t>(page) * d;         // page_size · head_dim
  float* turned_queries = rotated + static_cast<std::size_t>(page) * d;  // [group][head_dim]
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    const std::int32_t* positions = args.positions[i];
    float* scores = score.scores + i * page;
    if (holds_consecutive_positions(positions, page, rope.max_position)) {
      rotate_rows(arch, rope, positions[0], score.queries, score.group, turned_queries, /*inverse=*/true);
      score_page_in_order(arch, codec, rope, run, run.pages[i], score.params, turned_queries, score.group, scores,
                          score.score_stride, decoded, rotated);
    } else {
      decode_key_rows(arch, codec, quant::PageGeometry{page, d}, run.pages[i], score.params, decoded, rotated);
      for (index_t t = 0; t < page; ++t) {
        rotate_rows(arch, rope, positions[t], decoded + static_cast<std::size_t>(t) * d, 1,
                    rotated + static_cast<std::size_t>(t) * d);
      }
      score_rows(arch, RowScoreArgs{rotated, page, d, d, score.queries, score.group, scores, score.score_stride});
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], page, score.group, scores, score.score_stride);
  }
}

template <class A>
void score_rotated_rows(A arch, const RotatedRowScoreArgs& args) noexcept {
  const RowScoreArgs& rows = args.rows;
  for (index_t t = 0; t < rows.count; ++t) {
    rotate_rows(arch, args.rope, args.positions[t], rows.rows + t * rows.row_stride, 1,
                args.scratch + static_cast<std::size_t>(t) * rows.head_dim);
  }
  RowScoreArgs rotated = rows;
  rotated.rows = args.scratch;
  rotated.row_stride = rows.head_dim;
  score_rows(arch, rotated);
}

}  // namespace kvpack::inline v0::kernels::cpu
