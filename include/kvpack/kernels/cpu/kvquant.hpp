#pragma once
/// \file kvquant.hpp
/// \brief Decode-attention kernels for quant::KVQuant: each page is unpacked into an fp32 tile
///        in L1 through a per-vector table of the 2^b reconstructed levels (ℓ_k·r + z), its
///        outliers written over it, and the tile scored or accumulated by the element-format
///        kernels of float.hpp (keys channel-major, values token-major). Pre-RoPE keys unpack
///        token-major for rope.hpp's rotation.
///
/// Codes are read eight at a time: eight b-bit codes are exactly b bytes, one little-endian word.

#include <cstdint>
#include <cstring>
#include <type_traits>

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

/// Writes the page's exact outliers over a decoded tile, element (t, c) at tile[t·t_stride + c·c_stride].
KVPACK_ALWAYS_INLINE_LAMBDA inline void apply_nuq_outliers(const std::byte* section, std::size_t capacity,
                                                           index_t head_dim, float* tile, std::size_t t_stride,
                                                           std::size_t c_stride) noexcept {
  std::uint16_t count;
  std::memcpy(&count, section, 2);
  for (std::size_t i = 0; i < count && i < capacity; ++i) {
    std::uint16_t index, bits;
    std::memcpy(&index, section + 2 + 2 * i, 2);
    std::memcpy(&bits, section + 2 + 2 * capacity + 2 * i, 2);
    tile[(index / head_dim) * t_stride + (index % head_dim) * c_stride] = half::from_bits(bits);
  }
}

/// A KVQuant key page as fp32, element (t, c) at tile[t·t_stride + c·c_stride].
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void unpack_nuq_keys(A arch, quant::PageGeometry g, const std::byte* plane,
                                          const quant::KVQuantKeyParams& p, float* tile, std::size_t t_stride,
                                          std::size_t c_stride) noexcept {
  using Codec = quant::KVQuantKeyCodec<Bits>;
  alignas(64) float levels[16] = {};
  const int size = p.codebook->size;
  for (index_t c = 0; c < g.head_dim; ++c) {
    for (int k = 0; k < size; ++k) levels[k] = p.codebook->levels[k] * p.half_range[c] + p.offset[c];
    unpack_nuq_row<Bits>(arch, plane + Codec::row_bytes(g) * c, g.page_size, levels, tile + c * c_stride, t_stride);
  }
  apply_nuq_outliers(plane + Codec::outliers_offset(g), quant::kvquant_detail::outlier_capacity(p.outlier_fraction, g),
                     g.head_dim, tile, t_stride, c_stride);
}

/// A KVQuant value page as token-major fp32.
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void unpack_nuq_values(A arch, quant::PageGeometry g, const std::byte* plane,
                                            const quant::KVQuantValueParams& p, float* tile) noexcept {
  using Codec = quant::KVQuantValueCodec<Bits>;
  alignas(64) float levels[16] = {};
  const int size = p.codebook->size;
  for (index_t t = 0; t < g.page_size; ++t) {
    std::uint16_t offset_bits, range_bits;
    std::memcpy(&offset_bits, plane + Codec::offsets_offset(g) + 2 * t, 2);
    std::memcpy(&range_bits, plane + Codec::ranges_offset(g) + 2 * t, 2);
    const float offset = half::from_bits(offset_bits), half_range = half::from_bits(range_bits);
    for (int k = 0; k < size; ++k) levels[k] = p.codebook->levels[k] * half_range + offset;
    unpack_nuq_row<Bits>(arch, plane + Codec::row_bytes(g) * t, g.head_dim, levels, tile + t * g.head_dim, 1);
  }
  apply_nuq_outliers(plane + Codec::outliers_offset(g), quant::kvquant_detail::outlier_capacity(p.outlier_fraction, g),
                     g.head_dim, tile, g.head_dim, 1);
}

template <int Bits, class A>
void score_keys(A arch, std::type_identity<quant::KVQuantKeyCodec<Bits>>,
                const ScoreArgs<quant::KVQuantKeyParams>& args) noexcept {
  const PageRun& run = args.run;
  const index_t page = run.page_size;
  const quant::PageGeometry geometry{page, run.head_dim};
  float* tile = args.scratch;  // [head_dim][page_size]
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  const PageRun tile_run{&tile_page, nullptr, 1, 0, page, run.head_dim, 0, 0};
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    unpack_nuq_keys<Bits>(arch, geometry, run.pages[i], args.params, tile, 1, page);
    float* scores = args.scores + i * page;
    score_element_keys<float>(arch, ScoreArgs<quant::NoParams>{tile_run, {}, args.queries, args.group, scores,
                                                               args.score_stride, nullptr});
    if (run.live != nullptr) mask_dead_slots(run.live[i], page, args.group, scores, args.score_stride);
  }
}

template <int Bits, class A>
void accumulate_values(A arch, std::type_identity<quant::KVQuantValueCodec<Bits>>,
                       const AccumulateArgs<quant::KVQuantValueParams>& args) noexcept {
  const PageRun& run = args.run;
  const quant::PageGeometry geometry{run.page_size, run.head_dim};
  float* tile = args.scratch;  // [page_size][head_dim]
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  const PageRun tile_run{&tile_page, nullptr, 1, 0, run.page_size, run.head_dim, 0, 0};
  for (index_t i = 0; i < run.count; ++i) {
    unpack_nuq_values<Bits>(arch, geometry, run.pages[i] + run.value_offset, args.params, tile);
    // Dead slots carry weight 0, so their decoded rows add nothing.
    accumulate_element_values<float>(arch, AccumulateArgs<quant::NoParams>{tile_run, {}, args.weights + i * run.page_size,
                                                                           args.weight_stride, args.group, args.acc,
                                                                           nullptr});
  }
}

/// Pre-RoPE keys: token-major, for rope.hpp's rotation (which must be included after this file
/// to see this overload).
template <int Bits, class A>
KVPACK_ALWAYS_INLINE void decode_key_rows(A arch, std::type_identity<quant::KVQuantKeyCodec<Bits>>,
                                          quant::PageGeometry g, const std::byte* plane,
                                          const quant::KVQuantKeyParams& params, float* rows) noexcept {
  unpack_nuq_keys<Bits>(arch, g, plane, params, rows, g.head_dim, 1);
}

}  // namespace kvpack::inline v0::kernels::cpu
