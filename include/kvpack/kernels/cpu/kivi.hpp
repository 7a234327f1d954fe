#pragma once
/// \file kivi.hpp
/// \brief Decode-attention kernels for quant::KIVI: each page is unpacked into an fp32 tile in
///        L1 (keys channel-major, values token-major: the layouts of quant::Float<float>) and
///        scored or accumulated there by the element-format kernels of float.hpp.
///
/// Never more than one page is decoded at a time (page_size · head_dim floats of the call's
/// scratch), so the cache is still read in its packed form. Where whole vectors fit, a row is
/// unpacked in a permuted ("sliced") order — code j of every byte together — and the scores or
/// sums are put back in order once per page or call. The unpacking repeats the codec's decode
/// here, templated on the arch, so each instruction set compiles its own copy. Folding the
/// per-channel scales into the query and scoring straight from the codes (ALGORITHMS.md §1) is
/// the faster design still to come; this path is correct on every ISA first.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/softmax.hpp"
#include "kvpack/quant/kivi.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// Every byte's 8/b codes as floats, little-end first (KIVI packs code j at bit b·j): unpacking
/// is one table row copied per byte instead of a shift, mask and convert per code.
template <int Bits>
struct KiviCodeTable {
  float codes[256][8 / Bits];
};

/// One table per arch (the template argument keeps each ISA's object file's copy its own).
template <int Bits, class A>
inline constexpr KiviCodeTable<Bits> kKiviCodeTable = [] {
  KiviCodeTable<Bits> table{};
  for (int byte = 0; byte < 256; ++byte) {
    for (int j = 0; j < 8 / Bits; ++j) table.codes[byte][j] = static_cast<float>((byte >> (Bits * j)) & ((1 << Bits) - 1));
  }
  return table;
}();

KVPACK_ALWAYS_INLINE float kivi_half(const std::byte* at) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  return half::from_bits(bits);
}

/// Whether rows of `count` codes unpack with whole vectors of A: each of a byte's 8/b codes gives
/// one "slice" (code j of every byte), which must be whole vectors, and one vector of bytes
/// (8/b · W codes) must stay inside one scale group.
template <int Bits, class A>
constexpr bool slices_fit(index_t count, index_t group) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  constexpr index_t kPerByte = 8 / Bits;
  return (count / kPerByte) % kWidth == 0 && group % (kPerByte * kWidth) == 0;
}

/// Where the sliced order puts code e of a row of `count`: slice e % (8/b), then byte e / (8/b).
template <int Bits>
constexpr index_t sliced_position(index_t e, index_t count) noexcept {
  constexpr index_t kPerByte = 8 / Bits;
  return e % kPerByte * (count / kPerByte) + e / kPerByte;
}

/// `count` codes of a packed row as x̂ = code · scale + min (`group` consecutive codes share one
/// fp16 scale and minimum, at `scales[g]`/`mins[g]`, `meta_stride` bytes apart). When
/// slices_fit, in the *sliced* order (sliced_position): whole vectors of bytes are widened, each
/// slice shifted out and masked, no per-code work. Otherwise in row order, one table row per byte.
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void unpack_kivi_row(const std::byte* row, index_t count, index_t group, const std::byte* scales,
                                          const std::byte* mins, std::size_t meta_stride, float* out) noexcept {
  using batch = simd::f32<A>;
  constexpr index_t kWidth = static_cast<index_t>(batch::size);
  constexpr index_t kPerByte = 8 / Bits;
  if (slices_fit<Bits, A>(count, group)) {
    const index_t bytes = count / kPerByte;
    const auto* data = reinterpret_cast<const std::uint8_t*>(row);
    const simd::i32<A> mask((1 << Bits) - 1);
    for (index_t q0 = 0; q0 < bytes; q0 += kWidth) {
      const simd::i32<A> packed = simd::load_u8<A>(data + q0);
      const index_t g = kPerByte * q0 / group;
      const batch scale(kivi_half(scales + g * meta_stride));
      const batch min(kivi_half(mins + g * meta_stride));
      KVPACK_UNROLL
      for (index_t j = 0; j < kPerByte; ++j) {
        const batch codes = xsimd::to_float((packed >> static_cast<int>(Bits * j)) & mask);
        xsimd::fma(codes, scale, min).store_unaligned(out + j * bytes + q0);
      }
    }
    return;
  }
  const KiviCodeTable<Bits>& table = kKiviCodeTable<Bits, A>;
  for (index_t k = 0; k < count / kPerByte; ++k) {
    std::memcpy(out + k * kPerByte, table.codes[static_cast<unsigned>(row[k])], sizeof(table.codes[0]));
  }
  for (index_t g = 0; g < count / group; ++g) {
    const batch scale(kivi_half(scales + g * meta_stride));
    const batch min(kivi_half(mins + g * meta_stride));
    // Group sizes (32..128) are multiples of every vector width.
    for (index_t i = g * group; i < (g + 1) * group; i += kWidth) {
      xsimd::fma(batch::load_unaligned(out + i), scale, min).store_unaligned(out + i);
    }
  }
}

/// A key page as fp32, channel-major (`tile[c·page_size + t]`). Templated on the arch so each
/// instruction set's copy stays its own (STYLE.md §5.2).
template <int Bits, int Group, class A>
KVPACK_ALWAYS_INLINE void unpack_kivi_keys(A, quant::PageGeometry g, const std::byte* plane, float* tile) noexcept {
  using Codec = quant::KiviKeyCodec<Bits, Group>;
  const std::size_t meta_stride = static_cast<std::size_t>(g.head_dim) * 2;  // scale[group][channel]
  for (index_t c = 0; c < g.head_dim; ++c) {
    unpack_kivi_row<Bits, A>(plane + Codec::row_bytes(g) * static_cast<std::size_t>(c), g.page_size, Group,
                             plane + Codec::scales_offset(g) + 2 * static_cast<std::size_t>(c),
                             plane + Codec::mins_offset(g) + 2 * static_cast<std::size_t>(c), meta_stride,
                             tile + static_cast<std::size_t>(c) * g.page_size);
  }
}

/// A per-token plane (values, or the ablation's keys) as fp32, token-major (`tile[t·head_dim + c]`).
template <int Bits, int Group, Plane kPlane, class A>
KVPACK_ALWAYS_INLINE void unpack_kivi_tokens(A, quant::PageGeometry g, const std::byte* plane, float* tile) noexcept {
  using Codec = quant::KiviTokenCodec<Bits, Group, kPlane>;
  const std::size_t groups = static_cast<std::size_t>(g.head_dim / Group);  // scale[token][group]
  for (index_t t = 0; t < g.page_size; ++t) {
    unpack_kivi_row<Bits, A>(plane + Codec::row_bytes(g) * static_cast<std::size_t>(t), g.head_dim, Group,
                             plane + Codec::scales_offset(g) + 2 * groups * static_cast<std::size_t>(t),
                             plane + Codec::mins_offset(g) + 2 * groups * static_cast<std::size_t>(t), 2,
                             tile + static_cast<std::size_t>(t) * g.head_dim);
  }
}

/// A run of one fp32 page at `tile` (its K or V plane at offset 0).
KVPACK_ALWAYS_INLINE PageRun tile_run(const std::byte* const* tile, const PageRun& run) noexcept {
  return PageRun{tile, nullptr, 1, 0, run.page_size, run.head_dim, 0, 0};
}

template <int Bits, int Group, class A>
void score_keys(A arch, std::type_identity<quant::KiviKeyCodec<Bits, Group>>,
                const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t page = run.page_size;
  const quant::PageGeometry geometry{page, run.head_dim};
  float* tile = args.scratch;  // [head_dim][page_size], tokens in sliced order when they fit
  float* sliced_scores = tile + static_cast<std::size_t>(page) * run.head_dim;  // [group][page_size]
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  const bool sliced = slices_fit<Bits, A>(page, Group);
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    unpack_kivi_keys<Bits, Group>(arch, geometry, run.pages[i], tile);
    float* scores = args.scores + i * page;
    const ScoreArgs<quant::NoParams> tile_args{tile_run(&tile_page, run), {}, args.queries, args.group,
                                               sliced ? sliced_scores : scores, sliced ? page : args.score_stride,
                                               nullptr};
    score_element_keys<float>(arch, tile_args);
    if (sliced) {  // back to token order
      for (index_t h = 0; h < args.group; ++h) {
        for (index_t t = 0; t < page; ++t) {
          scores[h * args.score_stride + t] = sliced_scores[h * page + sliced_position<Bits>(t, page)];
        }
      }
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], page, args.group, scores, args.score_stride);
  }
}

/// The ablation's per-token keys: token-major rows, scored like the tail's full-precision rows
/// (with the query permuted into the rows' channel order when they are sliced).
template <int Bits, int Group, class A>
void score_keys(A arch, std::type_identity<quant::KiviTokenCodec<Bits, Group, Plane::kKey>>,
                const ScoreArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t d = run.head_dim;
  const quant::PageGeometry geometry{run.page_size, d};
  float* tile = args.scratch;  // [page_size][head_dim]
  const float* queries = args.queries;
  if (slices_fit<Bits, A>(d, Group)) {
    float* sliced_queries = tile + static_cast<std::size_t>(run.page_size) * d;  // [group][head_dim]
    for (index_t h = 0; h < args.group; ++h) {
      for (index_t c = 0; c < d; ++c) sliced_queries[h * d + sliced_position<Bits>(c, d)] = args.queries[h * d + c];
    }
    queries = sliced_queries;
  }
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    unpack_kivi_tokens<Bits, Group, Plane::kKey>(arch, geometry, run.pages[i], tile);
    score_rows(arch, RowScoreArgs{tile, run.page_size, d, d, queries, args.group, args.scores + i * run.page_size,
                                  args.score_stride});
    if (run.live != nullptr) {
      mask_dead_slots(run.live[i], run.page_size, args.group, args.scores + i * run.page_size, args.score_stride);
    }
  }
}

template <int Bits, int Group, class A>
void accumulate_values(A arch, std::type_identity<quant::KiviValueCodec<Bits, Group>>,
                       const AccumulateArgs<quant::NoParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t d = run.head_dim;
  const quant::PageGeometry geometry{run.page_size, d};
  float* tile = args.scratch;  // [page_size][head_dim], channels in sliced order when they fit
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  const bool sliced = slices_fit<Bits, A>(d, Group);
  // Sliced channels accumulate into a local sum, added back in channel order at the end.
  float* acc = sliced ? tile + static_cast<std::size_t>(run.page_size) * d : args.acc;  // [group][head_dim]
  if (sliced) std::fill(acc, acc + static_cast<std::size_t>(args.group) * d, 0.0f);
  for (index_t i = 0; i < run.count; ++i) {
    unpack_kivi_tokens<Bits, Group, Plane::kValue>(arch, geometry, run.pages[i] + run.value_offset, tile);
    // Dead slots carry weight 0, so their decoded rows add nothing.
    const AccumulateArgs<quant::NoParams> page{tile_run(&tile_page, run), {}, args.weights + i * run.page_size,
                                               args.weight_stride, args.group, acc, nullptr};
    accumulate_element_values<float>(arch, page);
  }
  if (sliced) {
    for (index_t h = 0; h < args.group; ++h) {
      for (index_t c = 0; c < d; ++c) args.acc[h * d + c] += acc[h * d + sliced_position<Bits>(c, d)];
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
