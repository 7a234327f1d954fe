#pragma once
/// \file float.hpp
/// \brief SIMD decode-attention kernels for element-wise formats: quant::Float<float|half|bf16>
///        and quant::FP8<E4M3FN|E5M2>.
///
/// Keys are channel-major in the page, so for a tile of W tokens (W = vector width) the score of
/// every query head is W-wide FMAs with the query element broadcast: no horizontal sums. One key
/// vector is converted once and reused by all heads of the GQA group. Values are token-major:
/// acc[h][c0:c0+W] += w[h][t] · v[t][c0:c0+W]. The FP8 scale multiplies the finished sums, so
/// the inner loops see only the codes.

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/simd_compat.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// What the vector loads below return, relative to the stored value: 2^-8 for E4M3FN (its fp16
/// route), 1 for every other format. Kernels divide their final scale by it.
template <class Storage>
inline constexpr float kLoadFactor = std::is_same_v<Storage, quant::E4M3FN> ? 1.0f / 256.0f : 1.0f;

/// W elements of a plane, starting at element `index`, as fp32 lanes times kLoadFactor.
template <class Storage, class A>
KVPACK_ALWAYS_INLINE simd::f32<A> load_elements(const std::byte* plane, std::size_t index) noexcept {
  if constexpr (std::is_same_v<Storage, float>) {
    return simd::f32<A>::load_unaligned(reinterpret_cast<const float*>(plane) + index);
  } else if constexpr (std::is_same_v<Storage, half>) {
    return simd::load_f16<A>(reinterpret_cast<const std::uint16_t*>(plane) + index);
  } else if constexpr (std::is_same_v<Storage, bfloat16>) {
    return simd::load_bf16<A>(reinterpret_cast<const std::uint16_t*>(plane) + index);
  } else if constexpr (std::is_same_v<Storage, quant::E4M3FN>) {
    return simd::load_e4m3fn_over_256<A>(reinterpret_cast<const std::uint8_t*>(plane) + index);
  } else {
    static_assert(std::is_same_v<Storage, quant::E5M2>, "no SIMD load for this storage type");
    return simd::load_e5m2<A>(reinterpret_cast<const std::uint8_t*>(plane) + index);
  }
}

/// One element, for the channels left over when head_dim is not a multiple of the vector width.
template <class Storage>
KVPACK_ALWAYS_INLINE float load_element(const std::byte* plane, std::size_t index) noexcept {
  Storage value;
  std::memcpy(&value, plane + index * sizeof(Storage), sizeof(Storage));
  return static_cast<float>(value);
}

/// The multiplier a plane's decoded sums need: the FP8 scale, or 1.
template <class Params>
KVPACK_ALWAYS_INLINE float plane_scale(const Params& params) noexcept {
  if constexpr (std::is_same_v<Params, quant::FP8Params>) {
    return params.scale;
  } else {
    return 1.0f;
  }
}

/// Sets the scores of dead slots to -inf so the softmax gives them weight 0.
KVPACK_ALWAYS_INLINE void mask_dead_slots(const std::uint64_t* live, index_t page_size, index_t group,
                                          float* scores, index_t stride) noexcept {
  if (live == nullptr) return;
  for (index_t t = 0; t < page_size; ++t) {
    if ((live[t / 64] >> (t % 64)) & 1u) continue;
    for (index_t h = 0; h < group; ++h) scores[h * stride + t] = -std::numeric_limits<float>::infinity();
  }
}

/// Independent FMA chains the kernels keep in flight: FMA latency (4 cycles) times issue width
/// (2 per cycle). With fewer, a loop waits on its own accumulators instead of on memory.
inline constexpr int kFmaChains = 8;

/// Accumulator sets the channels of a score tile are split over, for kFmaChains chains.
constexpr int channel_split(int heads, int tiles) noexcept {
  return heads * tiles >= kFmaChains ? 1 : kFmaChains / (heads * tiles);
}

/// Tiles of W tokens (and chunks of W value channels) a kernel pass covers. Two, so a pass reads
/// one 32-token page at a time: passes spanning two pages (four tiles) were faster in cache but
/// measured 47 % against 71 % of the DRAM stream rate for fp16, the two interleaved page streams
/// defeating the hardware prefetcher.
inline constexpr int kTilesPerPass = 2;

/// W consecutive tokens of one page: where their key rows start and where their scores go.
struct ScoreTile {
  const std::byte* plane;  ///< the page's key plane
  index_t t0;              ///< first token
  float* scores;           ///< score of token t0 for the first head of the block
};

/// Scores of kG heads for kTiles tiles (possibly from different pages) of channel-major key
/// planes; `load(plane, c, t0)` gives channel c of tokens t0 .. t0 + W - 1 as fp32 lanes. Channels
/// are split over kSplit accumulator sets so that kG·kTiles·kSplit chains run.
template <int kG, int kTiles, class A, class LoadKeys>
KVPACK_ALWAYS_INLINE void score_channel_major_tiles(const ScoreTile (&tiles)[kTiles], index_t head_dim,
                                                    const float* q, float scale, index_t stride,
                                                    PagePrefetcher& prefetcher, const LoadKeys& load) noexcept {
  using batch = simd::f32<A>;
  constexpr int kSplit = channel_split(kG, kTiles);
  batch acc[kSplit][kG][kTiles];
  for (auto& split : acc)
    for (auto& head : split)
      for (batch& a : head) a = batch(0.0f);
  const index_t split_end = head_dim - head_dim % kSplit;
  auto step = [&](int split, index_t c) KVPACK_ALWAYS_INLINE_LAMBDA {
    batch k[kTiles];
    KVPACK_UNROLL
    for (int i = 0; i < kTiles; ++i) {
      k[i] = load(tiles[i].plane, c, tiles[i].t0);
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const batch qc(q[h * head_dim + c]);
      KVPACK_UNROLL
      for (int i = 0; i < kTiles; ++i) acc[split][h][i] = xsimd::fma(qc, k[i], acc[split][h][i]);
    }
  };
  for (index_t c = 0; c < split_end; c += kSplit) {
    prefetcher.step();
    KVPACK_UNROLL
    for (int split = 0; split < kSplit; ++split) step(split, c + split);
  }
  for (index_t c = split_end; c < head_dim; ++c) step(0, c);
  for (int h = 0; h < kG; ++h) {
    for (int i = 0; i < kTiles; ++i) {
      batch total = acc[0][h][i];
      for (int split = 1; split < kSplit; ++split) total += acc[split][h][i];
      (total * batch(scale)).store_unaligned(tiles[i].scores + h * stride);
    }
  }
}

/// Scores (times `scale`) of every slot of a run of channel-major key planes, dead slots
/// included; `load` as for score_channel_major_tiles (page_size must be a multiple of the vector
/// width). The W-token tiles of the run are scored kTilesPerPass at a time (across a page
/// boundary only when a page holds fewer tiles, e.g. 16-token pages).
template <class A, class LoadKeys>
KVPACK_ALWAYS_INLINE void score_channel_major_keys(const PageRun& run, const float* queries, index_t group,
                                                   float* scores, index_t score_stride, float scale,
                                                   const LoadKeys& load) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const index_t tiles_per_page = run.page_size / kWidth;
  const index_t total_tiles = run.count * tiles_per_page;
  for_each_head_block(group, [&](auto block, index_t h0) {
    constexpr int kG = decltype(block)::value;
    constexpr int kTiles = kTilesPerPass;
    const float* q = queries + h0 * run.head_dim;
    // The first head block requests the pages ahead; later blocks find them in cache.
    const bool prefetching = h0 == 0;
    auto tile = [&](index_t n) {
      const index_t page = n / tiles_per_page;
      const index_t t0 = n % tiles_per_page * kWidth;
      return ScoreTile{run.pages[page], t0, scores + h0 * score_stride + page * run.page_size + t0};
    };
    index_t n = 0;
    for (; n + kTiles <= total_tiles; n += kTiles) {
      // Batches start on page boundaries when kTiles is a multiple of the tiles per page (the
      // usual case), so consecutive batches request consecutive pages.
      const index_t first_page = n / tiles_per_page;
      const index_t pages = (n + kTiles - 1) / tiles_per_page - first_page + 1;
      PagePrefetcher prefetcher(run, first_page, prefetching ? pages : 0, run.head_dim / channel_split(kG, kTiles));
      ScoreTile tiles[kTiles];
      for (int i = 0; i < kTiles; ++i) tiles[i] = tile(n + i);
      score_channel_major_tiles<kG, kTiles, A>(tiles, run.head_dim, q, scale, score_stride, prefetcher, load);
    }
    for (; n < total_tiles; ++n) {
      PagePrefetcher prefetcher(run, n / tiles_per_page, prefetching ? 1 : 0, run.head_dim / channel_split(kG, 1));
      const ScoreTile tiles[1] = {tile(n)};
      score_channel_major_tiles<kG, 1, A>(tiles, run.head_dim, q, scale, score_stride, prefetcher, load);
    }
  });
}

/// Key kernel for element-wise formats (page_size must be a multiple of the vector width).
template <class Storage, class Params, class A>
void score_element_keys(A, const ScoreArgs<Params>& args) noexcept {
  const PageRun& run = args.run;
  const std::size_t page_size = static_cast<std::size_t>(run.page_size);
  score_channel_major_keys<A>(run, args.queries, args.group, args.scores, args.score_stride,
                              plane_scale(args.params) / kLoadFactor<Storage>,
                              [page_size](const std::byte* plane, index_t c, index_t t0) KVPACK_ALWAYS_INLINE_LAMBDA {
                                return load_elements<Storage, A>(plane, static_cast<std::size_t>(c) * page_size + t0);
                              });
  if (run.live != nullptr) {
    for (index_t i = 0; i < run.count; ++i) {
      mask_dead_slots(run.live[i], run.page_size, args.group, args.scores + i * run.page_size, args.score_stride);
    }
  }
}

/// acc[h][c0 : c0 + kChunks·W] += scale · Σ_t w[h][t] · v[t][...] for kG heads of a token-major
/// plane, `load(plane, t, c)` giving channels c .. c + W - 1 of token t as fp32 lanes; tokens are
/// split over kSplit accumulator sets to keep kFmaChains chains in flight.
template <int kG, int kChunks, class A, class LoadValues>
KVPACK_ALWAYS_INLINE void accumulate_token_major_tile(const std::byte* plane, index_t rows, index_t head_dim,
                                                      index_t c0, const float* w, index_t w_stride, float scale,
                                                      float* acc, const LoadValues& load) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  constexpr int kSplit = kG * kChunks >= kFmaChains ? 1 : kFmaChains / (kG * kChunks);
  batch sum[kSplit][kG][kChunks];
  for (auto& split : sum)
    for (auto& head : split)
      for (batch& a : head) a = batch(0.0f);
  auto step = [&](int split, index_t t) KVPACK_ALWAYS_INLINE_LAMBDA {
    batch v[kChunks];
    KVPACK_UNROLL
    for (int j = 0; j < kChunks; ++j) {
      v[j] = load(plane, t, c0 + j * kWidth);
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const batch wt(w[h * w_stride + t]);
      KVPACK_UNROLL
      for (int j = 0; j < kChunks; ++j) sum[split][h][j] = xsimd::fma(wt, v[j], sum[split][h][j]);
    }
  };
  const index_t split_end = rows - rows % kSplit;
  for (index_t t = 0; t < split_end; t += kSplit) {
    KVPACK_UNROLL
    for (int split = 0; split < kSplit; ++split) step(split, t + split);
  }
  for (index_t t = split_end; t < rows; ++t) step(0, t);
  for (int h = 0; h < kG; ++h) {
    for (int j = 0; j < kChunks; ++j) {
      batch total = sum[0][h][j];
      for (int split = 1; split < kSplit; ++split) total += sum[split][h][j];
      float* out = acc + h * head_dim + c0 + j * kWidth;
      xsimd::fma(total, batch(scale), batch::load_unaligned(out)).store_unaligned(out);
    }
  }
}

/// acc[h][c] += scale · Σ_t w[h][t] · v[t][c] for every head of the group and the channels
/// c < head_dim − head_dim % W of one token-major plane of `rows` tokens; `load` as for
/// accumulate_token_major_tile. The caller adds the channels left over.
template <class A, class LoadValues>
KVPACK_ALWAYS_INLINE void accumulate_token_major_vectors(const std::byte* plane, index_t rows, index_t head_dim,
                                                         const float* w, index_t w_stride, index_t group, float scale,
                                                         float* acc, const LoadValues& load) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const index_t vector_end = head_dim - head_dim % kWidth;
  for_each_head_block(group, [&](auto block, index_t h0) {
    constexpr int kG = decltype(block)::value;
    const float* head_w = w + h0 * w_stride;
    float* head_acc = acc + h0 * head_dim;
    index_t c0 = 0;
    for (; c0 + kTilesPerPass * kWidth <= vector_end; c0 += kTilesPerPass * kWidth) {
      accumulate_token_major_tile<kG, kTilesPerPass, A>(plane, rows, head_dim, c0, head_w, w_stride, scale, head_acc,
                                                        load);
    }
    for (; c0 < vector_end; c0 += kWidth) {
      accumulate_token_major_tile<kG, 1, A>(plane, rows, head_dim, c0, head_w, w_stride, scale, head_acc, load);
    }
  });
}

/// Value kernel for element-wise formats; any page_size, any head_dim.
template <class Storage, class Params, class A>
void accumulate_element_values(A, const AccumulateArgs<Params>& args) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const PageRun& run = args.run;
  const float scale = plane_scale(args.params);
  const std::size_t head_dim = static_cast<std::size_t>(run.head_dim);
  auto load = [head_dim](const std::byte* plane, index_t t, index_t c) KVPACK_ALWAYS_INLINE_LAMBDA {
    return load_elements<Storage, A>(plane, static_cast<std::size_t>(t) * head_dim + c);
  };
  const index_t vector_end = run.head_dim - run.head_dim % kWidth;
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    const float* w = args.weights + i * run.page_size;
    accumulate_token_major_vectors<A>(plane, run.page_size, run.head_dim, w, args.weight_stride, args.group,
                                      scale / kLoadFactor<Storage>, args.acc, load);
    for (index_t c = vector_end; c < run.head_dim; ++c) {
      for (index_t h = 0; h < args.group; ++h) {
        float sum = 0.0f;
        for (index_t t = 0; t < run.page_size; ++t) {
          sum += w[h * args.weight_stride + t] *
                 load_element<Storage>(plane, static_cast<std::size_t>(t) * run.head_dim + c);
        }
        args.acc[h * run.head_dim + c] += scale * sum;
      }
    }
  }
}

template <class T, class A>
void score_keys(A arch, std::type_identity<quant::FloatCodec<T, Plane::kKey>>,
                const ScoreArgs<quant::NoParams>& args) noexcept {
  score_element_keys<T>(arch, args);
}
template <class T, class A>
void accumulate_values(A arch, std::type_identity<quant::FloatCodec<T, Plane::kValue>>,
                       const AccumulateArgs<quant::NoParams>& args) noexcept {
  accumulate_element_values<T>(arch, args);
}
template <class Format, class A>
void score_keys(A arch, std::type_identity<quant::FP8Codec<Format, Plane::kKey>>,
                const ScoreArgs<quant::FP8Params>& args) noexcept {
  score_element_keys<Format>(arch, args);
}
template <class Format, class A>
void accumulate_values(A arch, std::type_identity<quant::FP8Codec<Format, Plane::kValue>>,
                       const AccumulateArgs<quant::FP8Params>& args) noexcept {
  accumulate_element_values<Format>(arch, args);
}

}  // namespace kvpack::inline v0::kernels::cpu
