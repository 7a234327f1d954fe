#pragma once
/// \file turboquant.hpp
/// \brief Decode-attention kernels for quant::TurboCodec (MSE and Prod) and quant::QjlKeyCodec
///        that never leave the rotated space for keys.
///
/// Keys: q · x̃ = n · ⟨R q, c[idx]⟩ (+ √(π/2)/d · γ · n · ⟨S R q, s⟩ for Prod), so each call
/// rotates the group's queries once (and sketches them once), then scores every page straight
/// from its codes: the codes are looked up in the centroid table (whole bytes at a time) into a
/// token-major fp32 tile in L1, scored against the rotated query by the full-precision row
/// scorer, and the per-token norm multiplies the finished scores (the sign bits the same way, as
/// ±1, against S R q, times √(π/2)/d · n · γ).
/// Values: the call's accumulator is rotated in once; every page adds its rotated-space rows with
/// the weights pre-multiplied by the norms (Prod's signs go into a second, sketch-space sum that
/// Sᵀ folds in once); the sum is un-rotated once. attend_stream calls the value kernel once per
/// chunk of 512 tokens, so "once" is once per head per chunk: exact (R is orthogonal, the
/// softmax's rescaling is linear) and leaves attend_stream and the tail's fp32 sums untouched.
/// On AVX-512 with VNNI, keys whose MSE codes are 4, 3 or 2 bits (the half rates' two widths in
/// whole 32-channel sections) and whose signs come in blocks of 128 (Prod, QJL), and MSE values
/// of those widths, skip the fp32 tiles: integer products of the centroids as bytes and of the
/// signs as 0/1 bytes (turboquant_vnni.hpp).
///
/// Rotations are computed in double (rotation.hpp; on AVX-512 in vectors, rotate.hpp), so the
/// rotated query is exact to fp32 rounding. Helpers are always inlined or templated on the arch
/// (STYLE.md §5.2).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/cpu/rotate.hpp"
#include "kvpack/kernels/cpu/softmax.hpp"
#include "kvpack/kernels/cpu/turboquant_vnni.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// The most tokens a page holds (CacheConfig: page_size ≤ 256), for per-page factor buffers.
inline constexpr index_t kMaxPageTokens = 256;

namespace turbo {

/// out[j] = (sketch · x)[first + j] for j < rows (sketch [·][dim] row-major), in double.
KVPACK_ALWAYS_INLINE void sketch_rows(const float* sketch, index_t first_row, index_t rows, index_t dim,
                                      const float* x, float* out) noexcept {
  for (index_t j = 0; j < rows; ++j) {
    const float* s = sketch + static_cast<std::size_t>(first_row + j) * dim;
    double sum = 0.0;
    for (index_t c = 0; c < dim; ++c) sum += static_cast<double>(s[c]) * x[c];
    out[j] = static_cast<float>(sum);
  }
}

/// `count` codes of `bits` bits starting at bit `bit` of `row`, as centroids (no norm), in order
/// (SSE2, and sections whose sizes do not fill whole vectors). Whole bytes at a time when the
/// section starts on a byte: two codes per byte at 4 bits, four at 2, eight at 1, eight per
/// three bytes at 3.
KVPACK_ALWAYS_INLINE void unpack_section(const std::byte* row, std::size_t bit, index_t count, int bits,
                                         const float* centroids, float* out) noexcept {
  index_t done = 0;
  if (bits == 0) {
    for (index_t c = 0; c < count; ++c) out[c] = centroids[0];
    return;
  }
  if (bit % 8 == 0) {
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(row) + bit / 8;
    if (bits == 4) {
      for (; done + 2 <= count; done += 2) {
        const unsigned b = bytes[done / 2];
        out[done] = centroids[b & 15u];
        out[done + 1] = centroids[b >> 4];
      }
    } else if (bits == 2) {
      for (; done + 4 <= count; done += 4) {
        const unsigned b = bytes[done / 4];
        out[done] = centroids[b & 3u];
        out[done + 1] = centroids[(b >> 2) & 3u];
        out[done + 2] = centroids[(b >> 4) & 3u];
        out[done + 3] = centroids[b >> 6];
      }
    } else if (bits == 1) {
      for (; done + 8 <= count; done += 8) {
        const unsigned b = bytes[done / 8];
        KVPACK_UNROLL
        for (int j = 0; j < 8; ++j) out[done + j] = centroids[(b >> j) & 1u];
      }
    } else if (bits == 3) {
      for (; done + 8 <= count; done += 8) {
        const std::uint8_t* g = bytes + done / 8 * 3;
        const unsigned w = g[0] | (static_cast<unsigned>(g[1]) << 8) | (static_cast<unsigned>(g[2]) << 16);
        KVPACK_UNROLL
        for (int j = 0; j < 8; ++j) out[done + j] = centroids[(w >> (3 * j)) & 7u];
      }
    }
  }
  for (index_t c = done; c < count; ++c) {
    out[c] = centroids[quant::turbo_detail::get_bits(row, bit + static_cast<std::size_t>(c) * bits, bits)];
  }
}

/// Whether A looks up 16-entry float tables in registers (vpermps): AVX-512 and AVX2.
template <class A>
inline constexpr bool kHasTableLookup = std::is_base_of_v<xsimd::avx512bw, A> || std::is_base_of_v<xsimd::avx2, A>;

#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE simd::f32<A> lookup16(const float* table, simd::i32<A> codes,
                                           simd::requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_permutexvar_ps(codes, _mm512_loadu_ps(table));
}
#endif
#if XSIMD_WITH_AVX2
template <class A>
KVPACK_ALWAYS_INLINE simd::f32<A> lookup16(const float* table, simd::i32<A> codes,
                                           simd::requires_arch<xsimd::avx2>) noexcept {
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), codes);
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), codes);
  // Bit 3 of the code picks the upper half: moved to the sign bit, blendv's selector.
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}
#endif
#if XSIMD_WITH_AVX512BW
template <class A>
KVPACK_ALWAYS_INLINE simd::i32<A> gather_words(const std::uint8_t* base, simd::i32<A> byte_offsets,
                                               simd::requires_arch<xsimd::avx512bw>) noexcept {
  return _mm512_i32gather_epi32(byte_offsets, base, 1);
}
#endif
#if XSIMD_WITH_AVX2
template <class A>
KVPACK_ALWAYS_INLINE simd::i32<A> gather_words(const std::uint8_t* base, simd::i32<A> byte_offsets,
                                               simd::requires_arch<xsimd::avx2>) noexcept {
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), byte_offsets, 1);
}
#endif
/// The 32-bit little-endian words at base + byte_offsets[i] (unaligned).
template <class A>
KVPACK_ALWAYS_INLINE simd::i32<A> gather_words(const std::uint8_t* base, simd::i32<A> byte_offsets) noexcept {
  return gather_words<A>(base, byte_offsets, A{});
}

/// table[codes[i]] in every lane (table holds 16 floats).
template <class A>
KVPACK_ALWAYS_INLINE simd::f32<A> lookup16(const float* table, simd::i32<A> codes) noexcept {
  return lookup16<A>(table, codes, A{});
}

/// Whether a section of `count` codes of `bits` bits starting at bit `bit` unpacks in the sliced
/// order on A: 2- or 4-bit codes, byte-aligned, whole vectors of bytes.
template <class A>
constexpr bool section_sliced(std::size_t bit, index_t count, int bits) noexcept {
  if constexpr (!kHasTableLookup<A>) {
    return false;
  } else {
    constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
    if (bit % 8 != 0) return false;
    if (bits == 3) return count % (8 * kWidth) == 0;  // one 3-byte group of 8 codes per lane
    return (bits == 2 || bits == 4) && count * bits % 8 == 0 && (count * bits / 8) % kWidth == 0;
  }
}

/// Where the sliced order puts code e of a sliced section. A unit is one byte (8/b codes) at 2
/// and 4 bits, three bytes (8 codes) at 3; vectors of W units are unpacked together, code j of
/// every unit side by side (j = e mod codes per unit), then the next j.
template <class A>
constexpr index_t sliced_index(index_t e, int bits) noexcept {
  constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
  const index_t per_unit = bits == 3 ? 8 : 8 / bits;
  const index_t unit = e / per_unit;
  return unit / kWidth * (kWidth * per_unit) + e % per_unit * kWidth + unit % kWidth;
}

/// A sliced section: whole vectors of units widened (or gathered, at 3 bits), each code shifted
/// out, masked and looked up.
template <class A>
KVPACK_ALWAYS_INLINE void unpack_section_sliced(const std::byte* row, std::size_t bit, index_t count, int bits,
                                                const float* centroids, float* out) noexcept {
  if constexpr (kHasTableLookup<A>) {
    constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(row) + bit / 8;
    const index_t total = count * bits / 8;
    const simd::i32<A> mask((1 << bits) - 1);
    if (bits == 3) {
      // Lane i reads the 32-bit word at byte 3i of its group of W units: the word's low 24 bits
      // are the unit's 8 codes (the one byte beyond is still inside the plane: the norms follow).
      alignas(64) const std::int32_t kUnitBytes[16] = {0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42, 45};
      const simd::i32<A> offsets = simd::i32<A>::load_aligned(kUnitBytes);
      for (index_t u0 = 0; u0 < count / 8; u0 += kWidth) {
        const simd::i32<A> words = gather_words<A>(bytes + 3 * u0, offsets);
        KVPACK_UNROLL
        for (int j = 0; j < 8; ++j) {
          lookup16<A>(centroids, (words >> (3 * j)) & mask).store_unaligned(out + 8 * u0 + j * kWidth);
        }
      }
    } else if (bits == 4) {
      for (index_t q0 = 0; q0 < total; q0 += kWidth) {
        const simd::i32<A> packed = simd::load_u8<A>(bytes + q0);
        lookup16<A>(centroids, packed & mask).store_unaligned(out + 2 * q0);
        lookup16<A>(centroids, packed >> 4).store_unaligned(out + 2 * q0 + kWidth);
      }
    } else {
      for (index_t q0 = 0; q0 < total; q0 += kWidth) {
        const simd::i32<A> packed = simd::load_u8<A>(bytes + q0);
        KVPACK_UNROLL
        for (int j = 0; j < 4; ++j) {
          lookup16<A>(centroids, (packed >> (2 * j)) & mask).store_unaligned(out + 4 * q0 + j * kWidth);
        }
      }
    }
  }
}

/// The channel order a page row unpacks in on A: perm[c] = where channel c lands. Returns false
/// (and leaves perm alone) when it is the channel order itself.
template <class A>
KVPACK_ALWAYS_INLINE bool row_order(const quant::turbo_detail::LayerView& v, index_t* perm) noexcept {
  const index_t d = v.dim;
  const index_t high = v.high_channels;
  const std::size_t low_bit = v.bit_offset(high);
  const bool high_sliced = high > 0 && section_sliced<A>(0, high, v.high_bits);
  const bool low_sliced = section_sliced<A>(low_bit, d - high, v.low_bits);
  if (!high_sliced && !low_sliced) return false;
  for (index_t c = 0; c < high; ++c) perm[c] = high_sliced ? sliced_index<A>(c, v.high_bits) : c;
  for (index_t c = high; c < d; ++c) perm[c] = high + (low_sliced ? sliced_index<A>(c - high, v.low_bits) : c - high);
  return true;
}

/// A page's codes as centroids (no norm), token-major: tile[t·d + perm(c)] with perm the
/// row_order of A.
template <class A>
KVPACK_ALWAYS_INLINE void unpack_codes(index_t P, const quant::turbo_detail::LayerView& v, const std::byte* plane,
                                       float* tile) noexcept {
  const index_t d = v.dim;
  const index_t high = v.high_channels;
  const std::size_t row_bytes = v.row_bytes();
  const std::size_t low_bit = v.bit_offset(high);
  const bool high_sliced = high > 0 && section_sliced<A>(0, high, v.high_bits);
  const bool low_sliced = section_sliced<A>(low_bit, d - high, v.low_bits);
  for (index_t t = 0; t < P; ++t) {
    const std::byte* row = plane + row_bytes * static_cast<std::size_t>(t);
    float* out = tile + static_cast<std::size_t>(t) * d;
    if (high > 0) {
      if (high_sliced) {
        unpack_section_sliced<A>(row, 0, high, v.high_bits, v.high_centroids, out);
      } else {
        unpack_section(row, 0, high, v.high_bits, v.high_centroids, out);
      }
    }
    if (low_sliced) {
      unpack_section_sliced<A>(row, low_bit, d - high, v.low_bits, v.low_centroids, out + high);
    } else {
      unpack_section(row, low_bit, d - high, v.low_bits, v.low_centroids, out + high);
    }
  }
}

/// x in the order `perm` (out[perm[c]] = x[c]), or back (inverse: out[c] = x[perm[c]]).
KVPACK_ALWAYS_INLINE void permute(const index_t* perm, index_t d, float* x, bool inverse) noexcept {
  float copy[quant::kMaxRotationDim];
  for (index_t c = 0; c < d; ++c) copy[c] = x[c];
  for (index_t c = 0; c < d; ++c) {
    if (inverse) {
      x[c] = copy[perm[c]];
    } else {
      x[perm[c]] = copy[c];
    }
  }
}

/// Whether sign bits [first, first + rows) unpack sliced on A (one byte = 8 signs per lane).
template <class A>
constexpr bool signs_sliced(index_t first, index_t rows) noexcept {
  if constexpr (!kHasTableLookup<A>) {
    return false;
  } else {
    return first % 8 == 0 && rows % (8 * static_cast<index_t>(simd::f32<A>::size)) == 0;
  }
}

/// Sign bits [first, first + rows) of every token as ±1, token-major: tile[t·rows + perm(j)]
/// with perm the sliced order (sliced_index at 1 bit) when signs_sliced, else j.
template <class A>
KVPACK_ALWAYS_INLINE void unpack_signs(const std::byte* signs, std::size_t sign_bytes, index_t P, index_t first,
                                       index_t rows, float* tile) noexcept {
  if constexpr (kHasTableLookup<A>) {
    if (signs_sliced<A>(first, rows)) {
      constexpr index_t kWidth = static_cast<index_t>(simd::f32<A>::size);
      const float table[16] = {-1.0f, 1.0f};
      const simd::i32<A> one(1);
      for (index_t t = 0; t < P; ++t) {
        const auto* row = reinterpret_cast<const std::uint8_t*>(signs + sign_bytes * static_cast<std::size_t>(t)) + first / 8;
        float* out = tile + static_cast<std::size_t>(t) * rows;
        for (index_t q0 = 0; q0 < rows / 8; q0 += kWidth) {
          const simd::i32<A> packed = simd::load_u8<A>(row + q0);
          KVPACK_UNROLL
          for (int j = 0; j < 8; ++j) lookup16<A>(table, (packed >> j) & one).store_unaligned(out + 8 * q0 + j * kWidth);
        }
      }
      return;
    }
  }
  for (index_t t = 0; t < P; ++t) {
    const auto* row = reinterpret_cast<const std::uint8_t*>(signs + sign_bytes * static_cast<std::size_t>(t));
    float* out = tile + static_cast<std::size_t>(t) * rows;
    for (index_t j = 0; j < rows; ++j) {
      const index_t bit = first + j;
      out[j] = ((row[bit / 8] >> (bit % 8)) & 1u) != 0 ? 1.0f : -1.0f;
    }
  }
}

/// x[0, rows) into the sliced order of signs_sliced (or back, `inverse`), when it applies.
template <class A>
KVPACK_ALWAYS_INLINE void permute_signs(index_t first, index_t rows, float* x, bool inverse) noexcept {
  if (!signs_sliced<A>(first, rows)) return;
  float copy[quant::kMaxRotationDim];
  for (index_t j = 0; j < rows; ++j) copy[j] = x[j];
  for (index_t j = 0; j < rows; ++j) {
    if (inverse) {
      x[j] = copy[sliced_index<A>(j, 1)];
    } else {
      x[sliced_index<A>(j, 1)] = copy[j];
    }
  }
}

/// fp16 per-token factors of a page (norms, or √(π/2)/m · norm · γ), into out[P].
KVPACK_ALWAYS_INLINE void token_factors(index_t P, const std::byte* first, const std::byte* second, float scale,
                                        float* out) noexcept {
  for (index_t t = 0; t < P; ++t) {
    float f = scale * quant::turbo_detail::load_half(first + 2 * static_cast<std::size_t>(t));
    if (second != nullptr) f *= quant::turbo_detail::load_half(second + 2 * static_cast<std::size_t>(t));
    out[t] = f;
  }
}

/// A run of one fp32 tile (its plane at offset 0) of `dim` channels.
KVPACK_ALWAYS_INLINE PageRun tile_of(const std::byte* const* tile, index_t page_size, index_t dim) noexcept {
  return PageRun{tile, nullptr, 1, 0, page_size, dim, 0, 0};
}

}  // namespace turbo

// Keys: tile = centroids of one page, token-major; scores = n_t · (R q · tile_t) (+ the sketch
// term with coef_t = √(π/2)/d · n_t · γ_t for Prod) — the norm multiplies the finished score.
template <quant::TurboVariant V, class A>
void score_keys(A arch, std::type_identity<quant::TurboCodec<V, Plane::kKey>>,
                const ScoreArgs<quant::turbo_detail::Params>& args) noexcept {
  const PageRun& run = args.run;
  if (run.count == 0) return;
  const index_t d = run.head_dim;
  const index_t P = run.page_size;
  const quant::turbo_detail::LayerView& v = quant::turbo_detail::layer_view(args.params, d);
  float* tile = args.scratch;                                            // [P][d]
  float* rotated = tile + static_cast<std::size_t>(P) * d;               // [group][d]: R q
  float* sketched = rotated + static_cast<std::size_t>(args.group) * d;  // [group][d]: S R q
  float* extra = sketched + static_cast<std::size_t>(args.group) * d;    // [group][P] sketch scores, then [P] factors
  for (index_t h = 0; h < args.group; ++h) turbo::rotate(arch, v.rotation, args.queries + h * d, rotated + h * d);
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (kKiviVnni<A>) {
    const auto scale = static_cast<float>(quant::turbo_detail::kSqrtHalfPi / d);
    const turbo_vnni::SignSketch signs{v.sketch_columns, rotated, d, scale, true};
    if (turbo_vnni::score_keys(arch, run, v, rotated, V == quant::TurboVariant::kProd ? &signs : nullptr, args.group,
                               args.scores, args.score_stride, tile)) {
      return;
    }
  }
#endif
  if constexpr (V == quant::TurboVariant::kProd) {
    for (index_t h = 0; h < args.group; ++h) {
      turbo::sketch_rows(v.sketch, 0, d, d, rotated + h * d, sketched + h * d);
      turbo::permute_signs<A>(0, d, sketched + h * d, false);  // the sign tile's order
    }
  }
  index_t perm[quant::kMaxRotationDim];
  if (turbo::row_order<A>(v, perm)) {
    for (index_t h = 0; h < args.group; ++h) turbo::permute(perm, d, rotated + h * d, false);  // the tile's order
  }
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * P;
    turbo::unpack_codes<A>(P, v, plane, tile);
    score_rows(arch, RowScoreArgs{tile, P, d, d, rotated, args.group, scores, args.score_stride});
    if constexpr (V == quant::TurboVariant::kProd) {
      turbo::unpack_signs<A>(plane + v.signs_offset(P), v.sign_bytes(), P, 0, d, tile);
      score_rows(arch, RowScoreArgs{tile, P, d, d, sketched, args.group, extra, P});
      float coef[kMaxPageTokens];
      turbo::token_factors(P, plane + v.norms_offset(P), plane + v.gammas_offset(P),
                           static_cast<float>(quant::turbo_detail::kSqrtHalfPi / d), coef);
      float norm[kMaxPageTokens];
      turbo::token_factors(P, plane + v.norms_offset(P), nullptr, 1.0f, norm);
      for (index_t h = 0; h < args.group; ++h) {
        float* s = scores + h * args.score_stride;
        const float* e = extra + h * P;
        for (index_t t = 0; t < P; ++t) s[t] = norm[t] * s[t] + coef[t] * e[t];
      }
    } else {
      float norm[kMaxPageTokens];
      turbo::token_factors(P, plane + v.norms_offset(P), nullptr, 1.0f, norm);
      for (index_t h = 0; h < args.group; ++h) {
        float* s = scores + h * args.score_stride;
        for (index_t t = 0; t < P; ++t) s[t] *= norm[t];
      }
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, args.group, scores, args.score_stride);
  }
}

// Values: the norm (and Prod's coefficient) multiplies the weights, so the tile is centroids
// (or ±1) only; the sums stay in the rotated (and sketch) space until the end of the call.
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
  float* sketch_sum = rotated + static_cast<std::size_t>(args.group) * d;  // [group][d]: Σ w coef ±1
  float* weights = sketch_sum + static_cast<std::size_t>(args.group) * d;  // [group][P]
  for (index_t h = 0; h < args.group; ++h) turbo::rotate(arch, v.rotation, args.acc + h * d, rotated + h * d);
  // The fp32 pages add in the code tile's channel order: the sums are put in it before the first.
  index_t perm[quant::kMaxRotationDim];
  bool sliced = false, tile_order = false;
  auto to_tile_order = [&]() KVPACK_ALWAYS_INLINE_LAMBDA {
    if (tile_order) return;
    tile_order = true;
    sliced = turbo::row_order<A>(v, perm);
    if (!sliced) return;
    for (index_t h = 0; h < args.group; ++h) turbo::permute(perm, d, rotated + h * d, false);
  };
  if constexpr (V == quant::TurboVariant::kProd) {
    std::fill(sketch_sum, sketch_sum + static_cast<std::size_t>(args.group) * d, 0.0f);
  }
#if KVPACK_KERNELS_HAVE_VNNI
  // MSE has no sketch: its [group][d] holds the integer path's sums, and the rest of the scratch
  // past the weights its per-page work.
  std::optional<turbo_vnni::ValueSums<A>> integer;
  if constexpr (V == quant::TurboVariant::kMse && kKiviVnni<A>) {
    const std::size_t used = static_cast<std::size_t>(P) * d + 2 * static_cast<std::size_t>(args.group) * d +
                             static_cast<std::size_t>(args.group) * P;
    integer.emplace(v, args.group, P, sketch_sum, weights + static_cast<std::size_t>(args.group) * P,
                    scratch_floats(args.group, P, d) - used);
    if (!integer->usable()) integer.reset();
  }
#endif
  const std::byte* tile_page = reinterpret_cast<const std::byte*>(tile);
  auto scaled_weights = [&](const float* w, const float* factor) KVPACK_ALWAYS_INLINE_LAMBDA {
    for (index_t h = 0; h < args.group; ++h) {
      for (index_t t = 0; t < P; ++t) weights[h * P + t] = w[h * args.weight_stride + t] * factor[t];
    }
  };
  for (index_t i = 0; i < run.count; ++i) {
    const std::byte* plane = run.pages[i] + run.value_offset;
    const float* w = args.weights + i * P;
#if KVPACK_KERNELS_HAVE_VNNI
    if (integer && integer->add_page(run, i, v, w, args.weight_stride)) continue;
#endif
    to_tile_order();
    float factor[kMaxPageTokens];
    // Dead slots carry weight 0, so their rows add nothing.
    turbo::token_factors(P, plane + v.norms_offset(P), nullptr, 1.0f, factor);
    scaled_weights(w, factor);
    turbo::unpack_codes<A>(P, v, plane, tile);
    accumulate_element_values<float>(arch, AccumulateArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, d), {}, weights,
                                                                             P, args.group, rotated, nullptr});
    if constexpr (V == quant::TurboVariant::kProd) {
      turbo::token_factors(P, plane + v.norms_offset(P), plane + v.gammas_offset(P),
                           static_cast<float>(quant::turbo_detail::kSqrtHalfPi / d), factor);
      scaled_weights(w, factor);
      turbo::unpack_signs<A>(plane + v.signs_offset(P), v.sign_bytes(), P, 0, d, tile);
      accumulate_element_values<float>(arch, AccumulateArgs<quant::NoParams>{turbo::tile_of(&tile_page, P, d), {},
                                                                               weights, P, args.group, sketch_sum,
                                                                               nullptr});
    }
  }
#if KVPACK_KERNELS_HAVE_VNNI
  if (integer) integer->finish(rotated, sliced ? perm : nullptr);
#endif
  for (index_t h = 0; h < args.group; ++h) {
    float* r = rotated + h * d;
    if (sliced) turbo::permute(perm, d, r, true);
    if constexpr (V == quant::TurboVariant::kProd) {
      // r += Sᵀ · sketch_sum, in double.
      float* z = sketch_sum + h * d;
      turbo::permute_signs<A>(0, d, z, true);
      double sum[quant::kMaxRotationDim];
      for (index_t c = 0; c < d; ++c) sum[c] = r[c];
      for (index_t j = 0; j < d; ++j) {
        const float* row = v.sketch + static_cast<std::size_t>(j) * d;
        const double zj = z[j];
        for (index_t c = 0; c < d; ++c) sum[c] += static_cast<double>(row[c]) * zj;
      }
      for (index_t c = 0; c < d; ++c) r[c] = static_cast<float>(sum[c]);
    }
    turbo::unrotate(arch, v.rotation, r, args.acc + h * d);
  }
}

// QJL keys: scores = √(π/2)/m · ‖k‖ · ⟨S q, s⟩, the sketch in blocks of at most head_dim rows.
template <class A>
void score_keys(A arch, std::type_identity<quant::QjlKeyCodec>, const ScoreArgs<quant::turbo_detail::Params>& args) noexcept {
  const PageRun& run = args.run;
  if (run.count == 0) return;
  const index_t d = run.head_dim;
  const index_t P = run.page_size;
  const quant::turbo_detail::LayerView& v = quant::turbo_detail::layer_view(args.params, d);
  const index_t M = v.sketch_rows;
  const index_t block = std::min<index_t>(M, d);
  float* tile = args.scratch;                                          // [P][block]
  float* sketched = tile + static_cast<std::size_t>(P) * d;            // per block: [group][rows] of S q (M ≤ 2d)
  float* extra = sketched + static_cast<std::size_t>(args.group) * M;  // [group][P]
#if KVPACK_KERNELS_HAVE_VNNI
  if constexpr (kKiviVnni<A>) {
    const auto scale = static_cast<float>(quant::turbo_detail::kSqrtHalfPi / M);
    const turbo_vnni::SignSketch signs{v.sketch_columns, args.queries, M, scale, false};
    if (turbo_vnni::score_keys(arch, run, v, nullptr, &signs, args.group, args.scores, args.score_stride, tile)) return;
  }
#endif
  for (index_t first = 0; first < M; first += block) {
    const index_t rows = std::min<index_t>(block, M - first);
    for (index_t h = 0; h < args.group; ++h) {
      float* block_query = sketched + static_cast<std::size_t>(args.group) * first + h * rows;
      turbo::sketch_rows(v.sketch, first, rows, d, args.queries + h * d, block_query);
      turbo::permute_signs<A>(first, rows, block_query, false);  // the sign tile's order
    }
  }
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher(run, i, 1, 1).step();
    const std::byte* plane = run.pages[i];
    float* scores = args.scores + i * P;
    for (index_t first = 0; first < M; first += block) {
      const index_t rows = std::min<index_t>(block, M - first);
      turbo::unpack_signs<A>(plane, v.sign_bytes(), P, first, rows, tile);
      score_rows(arch, RowScoreArgs{tile, P, rows, rows, sketched + static_cast<std::size_t>(args.group) * first,
                                    args.group, first == 0 ? scores : extra, first == 0 ? args.score_stride : P});
      if (first > 0) {
        for (index_t h = 0; h < args.group; ++h) {
          for (index_t t = 0; t < P; ++t) scores[h * args.score_stride + t] += extra[h * P + t];
        }
      }
    }
    float coef[kMaxPageTokens];
    turbo::token_factors(P, plane + v.norms_offset(P), nullptr, static_cast<float>(quant::turbo_detail::kSqrtHalfPi / M),
                         coef);
    for (index_t h = 0; h < args.group; ++h) {
      for (index_t t = 0; t < P; ++t) scores[h * args.score_stride + t] *= coef[t];
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, args.group, scores, args.score_stride);
  }
}

}  // namespace kvpack::inline v0::kernels::cpu
