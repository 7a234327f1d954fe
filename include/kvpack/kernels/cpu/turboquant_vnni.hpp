#pragma once
/// \file turboquant_vnni.hpp
/// \brief The AVX-512 VNNI path of TurboQuant's and QJL's kernels (turboquant.hpp): integer dot
///        products with the centroids as bytes (ByteLevels) and the sign bits as 0/1 bytes
///        instead of fp32 tiles. It takes MSE codes of 4, 3 or 2 bits, the half rates' two widths
///        in sections of whole 32-channel chunks (3- and 2-bit codes widened to 4 bits first, one
///        step for both codebooks), and sign rows in blocks of 128 (Prod's residual, QJL).
///
/// - Keys: s_t = n_t · Σ_c (Rq)_c · C(code_tc). The rotated query is quantized to int8 per head
///   (step max_c |(Rq)_c| / 127) and `vpdpbusd` multiplies it with the byte levels. The rotation
///   spreads a key's outlier channels over every coordinate, and the query's with them, so int8
///   loses little here where KIVI's raw channels need int16 (kivi_vnni.hpp). Each product moves
///   by at most |C|·step/2 + |(Rq)_c|·e, e = max_k |C_k − its byte copy| ≤ max|C| / 254
///   (tests/support/error_bound.hpp).
/// - Signs (Prod's and QJL's keys): f_t · Σ_j z_j·σ_tj with z = S R q (Prod) or S q (QJL) as int8
///   per head, f_t = √(π/2)/d · n_t·γ_t or √(π/2)/m · n_t; each product moves by at most
///   max|z|/254.
/// - Values (MSE only): Σ_t w_t·n_t·C(code_tc), KVQuant's integer value loop
///   (kivi_vnni::accumulate_channels) with the norms as the tokens' ranges and no offsets: w·n to
///   int8 per head and page.
///
/// The key loop scores 16 tokens at a time from token-major rows (16 bytes per 32 channels, the
/// even channels in the low nibbles): vector i holds the same 16 bytes of tokens t0 + i, + 4,
/// + 8 and + 12 in its four 128-bit lanes, so one 128-bit broadcast of the query's bytes serves
/// all four, and a head's four accumulators reduce to its 16 scores in token order with two
/// unpack-and-add steps. A half rate's two sections add into the same accumulators, one after
/// the other, each with its own byte table and row stride (a 4-bit section is read in place).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpack/kernels/cpu/byte_levels.hpp"
#include "kvpack/kernels/cpu/float.hpp"
#include "kvpack/kernels/cpu/group_blocks.hpp"
#include "kvpack/kernels/cpu/kivi.hpp"
#include "kvpack/kernels/cpu/kivi_vnni.hpp"
#include "kvpack/kernels/cpu/prefetch.hpp"
#include "kvpack/kernels/kernel_args.hpp"
#include "kvpack/quant/turboquant.hpp"

#if KVPACK_KERNELS_HAVE_VNNI

namespace kvpack::inline v0::kernels::cpu::turbo_vnni {

using quant::turbo_detail::LayerView;

/// How this path reads a layer's rows: one or two sections of whole 32-channel chunks (the
/// high-rate channels first, as TurboRate splits them), each of 4-bit codes as stored or of 3- or
/// 2-bit codes widened to 4 bits. count 0: the layer takes the fp32 path (1-bit sections, a split
/// or head_dim off the 32-channel grid, head_dim above 256, which int32 sums of d products 127·255
/// could overflow, or pages of partial 16-token tiles).
struct Sections {
  int count = 0;
  int bits[2] = {};
  index_t first_chunk[2] = {}, chunks[2] = {};
  std::size_t byte_offset[2] = {};  ///< where the section starts in a stored row
};

KVPACK_ALWAYS_INLINE Sections sections(const LayerView& v, index_t page_size) noexcept {
  Sections s;
  const index_t d = v.dim;
  if (d % 32 != 0 || d > 256 || page_size % 16 != 0 || v.high_channels % 32 != 0) return s;
  auto add = [&](index_t first, index_t channels, int bits) KVPACK_ALWAYS_INLINE_LAMBDA {
    if (channels == 0) return true;
    if (bits < 2 || bits > 4) return false;
    s.bits[s.count] = bits;
    s.first_chunk[s.count] = first / 32;
    s.chunks[s.count] = channels / 32;
    s.byte_offset[s.count] = v.bit_offset(first) / 8;
    ++s.count;
    return true;
  };
  if (!add(0, v.high_channels, v.high_bits) || !add(v.high_channels, d - v.high_channels, v.low_bits)) s.count = 0;
  return s;
}

/// Each section's centroids as bytes, with one step for both, so that a head's sums over both
/// sections scale alike (step 0 when a centroid is not finite or all are 0: the fp32 path).
struct SectionLevels {
  ByteLevels section[2];
  [[nodiscard]] float step() const noexcept { return section[0].step; }
};

KVPACK_ALWAYS_INLINE SectionLevels section_levels(const LayerView& v, const Sections& s) noexcept {
  float books[2][16] = {};
  for (int i = 0; i < s.count; ++i) {
    const float* centroids = i == 0 && v.high_channels > 0 ? v.high_centroids : v.low_centroids;
    for (int k = 0; k < (1 << s.bits[i]); ++k) books[i][k] = centroids[k];
  }
  const float a = ByteLevels::largest(books[0]), b = ByteLevels::largest(books[1]);
  const float largest = std::isnan(a) || std::isnan(b) ? a + b : std::max(a, b);
  return {{ByteLevels(books[0], largest), ByteLevels(books[1], largest)}};
}

/// Where a section's 4-bit rows of one page start, and how far apart they are.
struct SectionRows {
  const std::uint8_t* rows = nullptr;
  std::size_t stride = 0;
};

/// The bytes four_bit_rows may write: P rows of d/2 bytes and the 48 that widen_code_rows'
/// last store spills.
KVPACK_ALWAYS_INLINE std::size_t widened_bytes(index_t P, index_t d) noexcept {
  return static_cast<std::size_t>(P) * static_cast<std::size_t>(d / 2) + 48;
}

/// Each section of a page as 4-bit rows: a 4-bit section as stored, a 3- or 2-bit one widened
/// into `widened` (widened_bytes). A page of one section has contiguous rows: it is widened in
/// one pass of P·d/32 runs (a multiple of 4: P is one of 16).
KVPACK_ALWAYS_INLINE void four_bit_rows(const std::byte* plane, const Sections& s, std::size_t row_bytes, index_t P,
                                        std::uint8_t* widened, SectionRows (&out)[2]) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  for (int i = 0; i < s.count; ++i) {
    if (s.bits[i] == 4) {
      out[i] = {codes + s.byte_offset[i], row_bytes};
      continue;
    }
    const auto width = 16 * static_cast<std::size_t>(s.chunks[i]);
    if (s.count == 1) {
      const std::size_t runs = static_cast<std::size_t>(P) * static_cast<std::size_t>(s.chunks[i]);
      if (s.bits[i] == 3) {
        widen_3bit_codes(codes, runs, widened);
      } else {
        widen_2bit_codes(codes, runs, widened);
      }
    } else {
      widen_code_rows(codes + s.byte_offset[i], row_bytes, P, s.chunks[i], s.bits[i], widened);
    }
    out[i] = {widened, width};
    widened += width * static_cast<std::size_t>(P);
  }
}

/// P fp16 values (norms, γ) as fp32 (out[P]); false when some value is not finite.
KVPACK_ALWAYS_INLINE bool load_halves(const std::byte* at, index_t P, float* out) noexcept {
  const auto* halves = reinterpret_cast<const __m256i*>(at);
  __mmask16 not_finite = 0;
  for (index_t t = 0; t < P; t += 16) {
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(halves + t / 16));
    not_finite |= _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
    _mm512_storeu_ps(out + t, x);
  }
  return not_finite == 0;
}

/// Each head's rotated query as int8 in the key loop's order ([group][d]: per 32-channel chunk,
/// its 16 even channels, then its 16 odd ones; `even_odd` false: in channel order, as the sign
/// loop reads the sketched query), step[h] = max_c |(Rq)_c| / 127 (1 for a zero
/// query) and sum[h] = Σ_c q8 (for the byte levels' 128). False when some (Rq)_c is not finite
/// or the largest is below 127 times the smallest normal float.
/// The xsimd::avx512bw parameters here and below tag the symbols with their ISA (STYLE.md §5.2).
inline bool quantize_query(xsimd::avx512bw, const float* rotated, index_t group, index_t d, std::int8_t* q8,
                           float* step, std::int32_t* sum, bool even_odd = true) noexcept {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (index_t h = 0; h < group; ++h) {
    const float* q = rotated + h * d;
    __m512 largest = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (index_t c = 0; c < d; c += 16) {
      const __m512 x = _mm512_loadu_ps(q + c);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(x));
    }
    const float top = _mm512_reduce_max_ps(largest);
    if (nan != 0 || !(top <= std::numeric_limits<float>::max())) return false;
    // A step below the smallest normal float would make 1/step overflow: the fp32 path scores it.
    if (top > 0.0f && top < 127.0f * std::numeric_limits<float>::min()) return false;
    step[h] = top > 0.0f ? top / 127.0f : 1.0f;
    const __m512 inverse = _mm512_set1_ps(1.0f / step[h]);
    __m512i total = _mm512_setzero_si512();
    for (index_t c = 0; c < d; c += 32) {
      // |q|·(1/step) ≤ 127 up to rounding, which the saturating narrowing absorbs.
      const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c), inverse));
      const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c + 16), inverse));
      const __m128i evens = _mm512_cvtsepi32_epi8(even_odd ? _mm512_permutex2var_epi32(low, even, high) : low);
      const __m128i odds = _mm512_cvtsepi32_epi8(even_odd ? _mm512_permutex2var_epi32(low, odd, high) : high);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + h * d + c), evens);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + h * d + c + 16), odds);
      total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_cvtepi8_epi32(evens), _mm512_cvtepi8_epi32(odds)));
    }
    sum[h] = _mm512_reduce_add_epi32(total);
  }
  return true;
}

/// A head's four tile accumulators as its 16 scores in token order: 128-bit lane r of sum[h][i]
/// holds four partial sums of token t0 + i + 4r; after the two steps lane 4r + i holds their total.
template <int kG>
KVPACK_ALWAYS_INLINE void sum_tile(const __m512i (&sum)[kG][4], __m512i (&out)[kG]) noexcept {
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(sum[h][0], sum[h][1]),
                                       _mm512_unpackhi_epi32(sum[h][0], sum[h][1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(sum[h][2], sum[h][3]),
                                       _mm512_unpackhi_epi32(sum[h][2], sum[h][3]));
    out[h] = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  }
}

/// Σ_c q8_c·byte(code_tc) of kG heads for the 16 tokens t0.. of a page's sections, lane j for
/// token t0 + j.
template <int kG>
KVPACK_ALWAYS_INLINE void score_tile(const SectionRows (&rows)[2], const Sections& s, const SectionLevels& levels,
                                     index_t t0, index_t d, const std::int8_t* q8, __m512i (&out)[kG]) noexcept {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i sum[kG][4];
  for (auto& head : sum) head[0] = head[1] = head[2] = head[3] = _mm512_setzero_si512();
  for (int part = 0; part < s.count; ++part) {
    const std::size_t stride = rows[part].stride;
    const std::uint8_t* tile = rows[part].rows + stride * static_cast<std::size_t>(t0);
    const ByteLevels& codebook = levels.section[part];
    const std::int8_t* section_query = q8 + 32 * s.first_chunk[part];
    for (index_t k = 0; k < s.chunks[part]; ++k) {
      __m512i low[4], high[4];
      KVPACK_UNROLL
      for (int i = 0; i < 4; ++i) {
        const __m512i bytes = kivi_vnni::load_rows(tile + stride * i + 16 * k, 4 * stride);
        low[i] = codebook.bytes(_mm512_and_si512(bytes, nibble));
        high[i] = codebook.bytes(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
      }
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const auto* q = reinterpret_cast<const __m128i*>(section_query + h * d + 32 * k);
        const __m512i even = _mm512_broadcast_i32x4(_mm_loadu_si128(q));
        const __m512i odd = _mm512_broadcast_i32x4(_mm_loadu_si128(q + 1));
        KVPACK_UNROLL
        for (int i = 0; i < 4; ++i) sum[h][i] = dot_quads(dot_quads(sum[h][i], low[i], even), high[i], odd);
      }
    }
  }
  sum_tile(sum, out);
}

/// Σ_j z8_j·bit_tj of kG heads for the 16 tokens t0.. whose sign rows (`sign_bytes` apart, bit j
/// of a row = 1 when sign j is +) start at `signs`, lane j for token t0 + j; z8 is [kG][rows] in
/// channel order, rows a multiple of 128. Per 128 signs, vector i takes 16 bytes of the rows of
/// tokens t0 + i, + 4, + 8, + 12 in its four lanes (as score_tile). For signs 16k..16k+15, a byte
/// shuffle gives byte j of every lane the lane's byte 2k + j/8, a test against bit j mod 8 makes
/// it a mask bit, and a masked move of ones makes that a 0/1 byte: each lane then meets one
/// 16-byte broadcast of z8. (A word permute, the masks stored and loaded back into mask registers,
/// measured the same: 0.48 against 0.51× fp16 for Prod in cache, within the noise.)
template <int kG>
KVPACK_ALWAYS_INLINE void sign_tile(const std::uint8_t* signs, std::size_t sign_bytes, index_t rows,
                                    const std::int8_t* z8, __m512i (&out)[kG]) noexcept {
  const __m512i bit = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128));
  const __m512i first_pair = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m512i one = _mm512_set1_epi8(1);
  __m512i sum[kG][4];
  for (auto& head : sum) head[0] = head[1] = head[2] = head[3] = _mm512_setzero_si512();
  for (index_t block = 0; block < rows / 128; ++block) {
    __m512i bytes[4];
    KVPACK_UNROLL
    for (int i = 0; i < 4; ++i) bytes[i] = kivi_vnni::load_rows(signs + sign_bytes * i + 16 * block, 4 * sign_bytes);
    KVPACK_UNROLL
    for (int k = 0; k < 8; ++k) {
      const __m512i pair = _mm512_add_epi8(first_pair, _mm512_set1_epi8(static_cast<char>(2 * k)));
      __m512i bits[4];
      KVPACK_UNROLL
      for (int i = 0; i < 4; ++i) {
        bits[i] = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_shuffle_epi8(bytes[i], pair), bit), one);
      }
      KVPACK_UNROLL
      for (int h = 0; h < kG; ++h) {
        const auto* z = reinterpret_cast<const __m128i*>(z8 + h * rows + 128 * block + 16 * k);
        const __m512i query = _mm512_broadcast_i32x4(_mm_loadu_si128(z));
        KVPACK_UNROLL
        for (int i = 0; i < 4; ++i) sum[h][i] = dot_quads(sum[h][i], bits[i], query);
      }
    }
  }
  sum_tile(sum, out);
}

/// z = S·x in fp32 for the sign loop, from S's columns ([d][rows], rows a multiple of 128): each
/// z_j is a chain of d multiply-adds, 128 rows at a time in eight vectors. Its rounding, at most
/// d·2⁻²⁴·Σ_c |S_jc·x_c| on z_j, is far below the int8 step that follows. (The fp32 path sketches
/// in double from S's rows, d·m products per head and call; as a row-by-row dot product in
/// vectors this was still a third of Prod's key time once its products ran on integers.)
inline void sketch_query(xsimd::avx512bw, const float* columns, index_t rows, index_t d, const float* x,
                         float* z) noexcept {
  for (index_t j0 = 0; j0 < rows; j0 += 128) {
    __m512 sum[8];
    for (__m512& s : sum) s = _mm512_setzero_ps();
    for (index_t c = 0; c < d; ++c) {
      const __m512 xc = _mm512_set1_ps(x[c]);
      const float* column = columns + static_cast<std::size_t>(c) * rows + j0;
      KVPACK_UNROLL
      for (int b = 0; b < 8; ++b) sum[b] = _mm512_fmadd_ps(_mm512_loadu_ps(column + 16 * b), xc, sum[b]);
    }
    for (int b = 0; b < 8; ++b) _mm512_storeu_ps(z + j0 + 16 * b, sum[b]);
  }
}

/// A key plane's sign sketch as the integer loop reads it (Prod's residual signs, QJL's): the
/// sketch S (by columns) and the query it sketches ([group][d]: R q for Prod, q for QJL), and the
/// factor `scale` · n_t (· γ_t for Prod) that multiplies each token's ⟨z, σ_t⟩, z = S·query.
struct SignSketch {
  const float* columns = nullptr;  ///< S transposed, [d][rows]
  const float* query = nullptr;
  index_t rows = 0;
  float scale = 0.0f;   ///< √(π/2)/d (Prod) or √(π/2)/m (QJL)
  bool gammas = false;  ///< Prod: the page's γ_t multiply the factor too
};

/// Scores every page of `run`: scores[h][slot] = n_t · Σ_c (Rq)_c·C(code_tc) (when `rotated`,
/// [group][d] in channel order, is given: the plane's MSE codes) + f_t · Σ_j z_j·σ_tj (when
/// `signs` is given), dead slots masked. The sketched query is int8 per head like Rq, and with
/// σ = 2·bit − 1, Σ_j z8_j·σ_j = 2·Σ_j z8_j·bit_j − Σ_j z8_j. `work` holds scratch_floats' page
/// tile (P·d floats). False, with nothing written, when the layer or the query does not take this
/// path.
inline bool score_keys(xsimd::avx512bw arch, const PageRun& run, const LayerView& v, const float* rotated,
                       const SignSketch* signs, index_t group, float* scores, index_t score_stride,
                       float* work) noexcept {
  const index_t d = run.head_dim, P = run.page_size;
  const bool codes = rotated != nullptr;
  const Sections parts = codes ? sections(v, P) : Sections{};
  const SectionLevels levels = section_levels(v, parts);
  if (codes && (parts.count == 0 || levels.step() == 0.0f)) return false;
  const index_t m = signs != nullptr ? signs->rows : 0;
  if (signs != nullptr && (m % 128 != 0 || m > 2 * quant::kMaxRotationDim || P % 16 != 0)) {
    return false;
  }
  // The work area: int8 queries [group][d] and widened rows (codes), int8 sketched queries
  // [group][m] (signs), then per head the steps and sums of both, the page's norms and sign
  // factors [P]. A group too large for it takes the fp32 path.
  const std::size_t g = static_cast<std::size_t>(group);
  const std::size_t code_bytes = codes ? g * d + widened_bytes(P, d) : 0;
  const std::size_t float_start = (code_bytes + g * m + 3) / 4;
  if (float_start + 4 * g + 2 * static_cast<std::size_t>(P) > static_cast<std::size_t>(P) * d) return false;
  auto* q8 = reinterpret_cast<std::int8_t*>(work);
  auto* widened = reinterpret_cast<std::uint8_t*>(q8 + g * d);
  auto* z8 = reinterpret_cast<std::int8_t*>(work) + code_bytes;
  float* step = work + float_start;
  auto* sum = reinterpret_cast<std::int32_t*>(step + group);
  float* sign_step = reinterpret_cast<float*>(sum + group);
  auto* sign_sum = reinterpret_cast<std::int32_t*>(sign_step + group);
  float* norm = reinterpret_cast<float*>(sign_sum + group);
  float* factor = norm + P;
  if (codes && !quantize_query(arch, rotated, group, d, q8, step, sum)) return false;
  for (index_t h = 0; h < group && signs != nullptr; ++h) {
    float sketched[2 * quant::kMaxRotationDim];
    sketch_query(arch, signs->columns, m, d, signs->query + h * d, sketched);
    if (!quantize_query(arch, sketched, 1, m, z8 + h * m, sign_step + h, sign_sum + h, false)) return false;
  }
  for (index_t h = 0; h < group; ++h) step[h] *= levels.step();
  const std::size_t row_bytes = v.row_bytes(), sign_bytes = static_cast<std::size_t>(m) / 8;
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, P / 16);
    const std::byte* plane = run.pages[i];
    float* page_scores = scores + i * P;
    SectionRows rows[2];
    if (codes) four_bit_rows(plane, parts, row_bytes, P, widened, rows);
    // A score carries a norm's (or γ's) Inf or NaN as the reference does.
    load_halves(plane + v.norms_offset(P), P, norm);
    if (signs != nullptr) {
      if (signs->gammas) load_halves(plane + v.gammas_offset(P), P, factor);
      for (index_t t = 0; t < P; t += 16) {
        const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(norm + t), _mm512_set1_ps(signs->scale));
        _mm512_storeu_ps(factor + t, signs->gammas ? _mm512_mul_ps(scaled, _mm512_loadu_ps(factor + t)) : scaled);
      }
    }
    const auto* sign_rows = reinterpret_cast<const std::uint8_t*>(plane + v.signs_offset(P));
    for (index_t t0 = 0; t0 < P; t0 += 16) {
      prefetcher.step();
      const __m512 n = _mm512_loadu_ps(norm + t0);
      const __m512 f = signs != nullptr ? _mm512_loadu_ps(factor + t0) : _mm512_setzero_ps();
      for_each_head_block<4>(group, [&](auto block, index_t h0) {
        constexpr int kG = decltype(block)::value;
        __m512i dots[kG], sign_dots[kG];
        if (codes) score_tile<kG>(rows, parts, levels, t0, d, q8 + h0 * d, dots);
        if (signs != nullptr) sign_tile<kG>(sign_rows + sign_bytes * t0, sign_bytes, m, z8 + h0 * m, sign_dots);
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) {
          __m512 s = _mm512_setzero_ps();
          if (codes) {
            const __m512i centred = _mm512_sub_epi32(dots[h], _mm512_set1_epi32(128 * sum[h0 + h]));
            s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(step[h0 + h])), n);
          }
          if (signs != nullptr) {
            const __m512i signed_sum =
                _mm512_sub_epi32(_mm512_slli_epi32(sign_dots[h], 1), _mm512_set1_epi32(sign_sum[h0 + h]));
            const __m512 e = _mm512_mul_ps(_mm512_cvtepi32_ps(signed_sum), _mm512_set1_ps(sign_step[h0 + h]));
            s = codes ? _mm512_fmadd_ps(e, f, s) : _mm512_mul_ps(e, f);
          }
          _mm512_storeu_ps(page_scores + (h0 + h) * score_stride + t0, s);
        }
      });
    }
    if (run.live != nullptr) mask_dead_slots(run.live[i], P, group, page_scores, score_stride);
  }
  return true;
}

/// The integer value path of one call: pages add w·n·C into `sums` (kivi_vnni's lane order),
/// finish() adds them, in channel order, to the rotated accumulators. A page whose norms or
/// weights are not all finite is refused (add_page false) and takes the fp32 path: int8 weights
/// would drop a NaN or an Inf where the reference carries it. A is xsimd::avx512bw (the tag).
template <class A>
class ValueSums {
 public:
  /// `sums` holds [group][d] floats; `work` holds `work_floats` floats.
  ValueSums(const LayerView& v, index_t group, index_t page_size, float* sums, float* work,
            std::size_t work_floats) noexcept
      : parts_(sections(v, page_size)),
        levels_(section_levels(v, parts_)),
        group_(group),
        P_(page_size),
        d_(v.dim),
        row_bytes_(v.row_bytes()),
        sums_(sums) {
    // The work area: per head step, largest weight, bias and Σ w8; the norms [P], zero offsets
    // [P], a sink for their sums [16], then int8 weights [group][P] and widened rows.
    const std::size_t floats = 4 * static_cast<std::size_t>(group) + 2 * static_cast<std::size_t>(P_) + 16 +
                               (static_cast<std::size_t>(group) * P_ + widened_bytes(P_, d_) + 3) / 4;
    if (parts_.count == 0 || levels_.step() == 0.0f || floats > work_floats) return;
    step_ = work;
    head_max_ = step_ + group;
    bias_ = head_max_ + group;
    weight_sums_ = reinterpret_cast<std::int32_t*>(bias_ + group);
    norm_ = reinterpret_cast<float*>(weight_sums_ + group);
    zeros_ = norm_ + P_;
    sink_ = zeros_ + P_;
    w8_ = reinterpret_cast<std::int8_t*>(sink_ + 16);
    widened_ = reinterpret_cast<std::uint8_t*>(w8_ + static_cast<std::size_t>(group) * P_);
    std::fill(zeros_, zeros_ + P_, 0.0f);
    std::fill(bias_, bias_ + group, 0.0f);
    std::fill(sums_, sums_ + static_cast<std::size_t>(group) * d_, 0.0f);
    usable_ = true;
  }

  [[nodiscard]] bool usable() const noexcept { return usable_; }

  /// Adds page i of `run` (weights w: [group][weight_stride], this page's first slot at w).
  bool add_page(const PageRun& run, index_t i, const LayerView& v, const float* w, index_t weight_stride) noexcept {
    const std::byte* plane = run.pages[i] + run.value_offset;
    if (!load_halves(plane + v.norms_offset(P_), P_, norm_)) return false;
    __mmask16 not_finite = 0;
    for (index_t h = 0; h < group_; ++h) {  // weights are exp(·) ≥ 0
      __m512 largest = _mm512_setzero_ps();
      for (index_t t = 0; t < P_; t += 16) {
        const __m512 wt = _mm512_loadu_ps(w + h * weight_stride + t);
        not_finite |= _mm512_cmp_ps_mask(wt, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
        largest = _mm512_max_ps(largest, wt);
      }
      head_max_[h] = _mm512_reduce_max_ps(largest);
    }
    if (not_finite != 0) return false;
    kivi_vnni::quantize_group_weights(xsimd::avx512bw{}, w, weight_stride, group_, P_, norm_, zeros_, head_max_, sink_,
                                      0, w8_, step_);
    sum_int8_weights(w8_, group_, P_, weight_sums_);
    for (index_t h = 0; h < group_; ++h) {
      step_[h] *= levels_.step();
      bias_[h] -= 128.0f * step_[h] * static_cast<float>(weight_sums_[h]);
    }
    SectionRows rows[2];
    four_bit_rows(plane, parts_, row_bytes_, P_, widened_, rows);
    PagePrefetcher prefetcher(run, i, 1, d_ / 32 * P_ / 4, Plane::kValue);
    for (int part = 0; part < parts_.count; ++part) {
      for (index_t k = 0; k < parts_.chunks[part]; ++k) {
        const index_t chunk = parts_.first_chunk[part] + k;
        for_each_head_block<4>(group_, [&](auto block, index_t h0) {
          constexpr int kG = decltype(block)::value;
          kivi_vnni::accumulate_channels<kG>(rows[part].rows + 16 * k, rows[part].stride, P_,
                                             w8_ + static_cast<std::size_t>(h0) * P_, step_ + h0,
                                             sums_ + h0 * d_ + 32 * chunk, d_, prefetcher, levels_.section[part]);
        });
      }
    }
    return true;
  }

  /// rotated[h][perm(c)] += the sums of channel c (perm null: the channel order itself). d is a
  /// multiple of 32 (sections are whole 32-channel chunks).
  void finish(float* rotated, const index_t* perm) const noexcept {
    float ordered[quant::kMaxRotationDim];
    for (index_t h = 0; h < group_; ++h) {
      float* r = rotated + h * d_;
      if (perm == nullptr) {  // every page took this path: in place, with vectors
        const __m512 bias = _mm512_set1_ps(bias_[h]);
        for (index_t c = 0; c < d_; c += 16) _mm512_storeu_ps(r + c, _mm512_add_ps(_mm512_loadu_ps(r + c), bias));
        add_value_sums_in_order<4, 32, xsimd::avx512bw>(sums_ + h * d_, d_, r);
        continue;
      }
      std::fill(ordered, ordered + d_, bias_[h]);
      add_value_sums_in_order<4, 32, xsimd::avx512bw>(sums_ + h * d_, d_, ordered);
      for (index_t c = 0; c < d_; ++c) r[perm[c]] += ordered[c];
    }
  }

 private:
  Sections parts_;
  SectionLevels levels_;
  index_t group_, P_, d_;
  std::size_t row_bytes_;
  float* sums_;
  bool usable_ = false;
  float *step_ = nullptr, *head_max_ = nullptr, *bias_ = nullptr, *norm_ = nullptr, *zeros_ = nullptr,
        *sink_ = nullptr;
  std::int32_t* weight_sums_ = nullptr;
  std::int8_t* w8_ = nullptr;
  std::uint8_t* widened_ = nullptr;
};

}  // namespace kvpack::inline v0::kernels::cpu::turbo_vnni

#endif  // KVPACK_KERNELS_HAVE_VNNI
