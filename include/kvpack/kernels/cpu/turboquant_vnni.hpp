#pragma once
/// \file turboquant_vnni.hpp
/// \brief The AVX-512 VNNI path of TurboQuant-MSE's kernels (turboquant.hpp) for layers whose
///        every channel has a 4-bit code, or a 3-bit one (widened to 4 bits first): integer dot
///        products with the centroids as bytes (ByteLevels) instead of an fp32 tile of centroids.
///
/// - Keys: s_t = n_t · Σ_c (Rq)_c · C(code_tc). The rotated query is quantized to int8 per head
///   (step max_c |(Rq)_c| / 127) and `vpdpbusd` multiplies it with the byte levels. The rotation
///   spreads a key's outlier channels over every coordinate, and the query's with them, so int8
///   loses little here where KIVI's raw channels need int16 (kivi_vnni.hpp). Each product moves
///   by at most |C|·step/2 + |(Rq)_c|·e, e = max_k |C_k − its byte copy| ≤ max|C| / 254
///   (tests/support/error_bound.hpp).
/// - Values: Σ_t w_t·n_t·C(code_tc), KVQuant's integer value loop (kivi_vnni::accumulate_channels)
///   with the norms as the tokens' ranges and no offsets: w·n to int8 per head and page.
///
/// The key loop scores 16 tokens at a time from token-major rows (16 bytes per 32 channels, the
/// even channels in the low nibbles): vector i holds the same 16 bytes of tokens t0 + i, + 4,
/// + 8 and + 12 in its four 128-bit lanes, so one 128-bit broadcast of the query's bytes serves
/// all four, and a head's four accumulators reduce to its 16 scores in token order with two
/// unpack-and-add steps.

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

/// The code width of every channel when this path takes a layer's pages (4, or 3 to be widened),
/// else 0: MSE rows of one width, head_dim a multiple of 32 up to 256 (so that int32 sums of d
/// products 127·255 cannot overflow), whole 16-token tiles.
KVPACK_ALWAYS_INLINE int code_bits(const LayerView& v, index_t page_size) noexcept {
  const index_t d = v.dim;
  if (v.sketch_rows != 0 || d % 32 != 0 || d > 256 || page_size % 16 != 0) return 0;
  const int bits = v.high_channels > 0 ? v.high_bits : v.low_bits;
  if ((v.high_channels > 0 && v.high_bits != bits) || (v.high_channels < d && v.low_bits != bits)) return 0;
  return bits == 4 || bits == 3 ? bits : 0;
}

/// The centroids of a layer's codes (code_bits ≠ 0) as bytes.
KVPACK_ALWAYS_INLINE ByteLevels byte_levels(const LayerView& v) noexcept {
  const float* centroids = v.high_channels > 0 ? v.high_centroids : v.low_centroids;
  const int bits = v.high_channels > 0 ? v.high_bits : v.low_bits;
  float levels[16] = {};
  for (int k = 0; k < (1 << bits); ++k) levels[k] = centroids[k];
  return ByteLevels(levels);
}

/// A page's codes as 4-bit rows of d/2 bytes: the plane itself, or its 3-bit rows widened into
/// `widened` (P·d/2 bytes; the rows are contiguous, so the page is P·d/32 runs of 32 codes).
KVPACK_ALWAYS_INLINE const std::uint8_t* four_bit_rows(const std::byte* plane, int bits, index_t P, index_t d,
                                                       std::uint8_t* widened) noexcept {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(plane);
  if (bits == 4) return codes;
  widen_3bit_codes(codes, static_cast<std::size_t>(P) * (d / 32), widened);
  return widened;
}

/// A page's fp16 norms as fp32 (out[P]); false when some norm is not finite.
KVPACK_ALWAYS_INLINE bool load_norms(const std::byte* plane, const LayerView& v, index_t P, float* out) noexcept {
  const auto* norms = reinterpret_cast<const __m256i*>(plane + v.norms_offset(P));
  __mmask16 not_finite = 0;
  for (index_t t = 0; t < P; t += 16) {
    const __m512 n = _mm512_cvtph_ps(_mm256_loadu_si256(norms + t / 16));
    not_finite |= _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
    _mm512_storeu_ps(out + t, n);
  }
  return not_finite == 0;
}

/// Each head's rotated query as int8 in the key loop's order ([group][d]: per 32-channel chunk,
/// its 16 even channels, then its 16 odd ones), step[h] = max_c |(Rq)_c| / 127 (1 for a zero
/// query) and sum[h] = Σ_c q8 (for the byte levels' 128). False when some (Rq)_c is not finite
/// or the largest is below 127 times the smallest normal float.
/// The xsimd::avx512bw parameters here and below tag the symbols with their ISA (STYLE.md §5.2).
inline bool quantize_query(xsimd::avx512bw, const float* rotated, index_t group, index_t d, std::int8_t* q8,
                           float* step, std::int32_t* sum) noexcept {
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
      const __m128i evens = _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(low, even, high));
      const __m128i odds = _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(low, odd, high));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + h * d + c), evens);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + h * d + c + 16), odds);
      total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_cvtepi8_epi32(evens), _mm512_cvtepi8_epi32(odds)));
    }
    sum[h] = _mm512_reduce_add_epi32(total);
  }
  return true;
}

/// Σ_c q8_c·byte(code_tc) of kG heads for the 16 tokens whose rows start at `rows` (token t0),
/// lane j for token t0 + j.
template <int kG>
KVPACK_ALWAYS_INLINE void score_tile(const std::uint8_t* rows, std::size_t row_bytes, index_t d, const std::int8_t* q8,
                                     const ByteLevels& levels, __m512i (&out)[kG]) noexcept {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i sum[kG][4];
  for (auto& head : sum) head[0] = head[1] = head[2] = head[3] = _mm512_setzero_si512();
  for (index_t k = 0; k < d / 32; ++k) {
    __m512i low[4], high[4];
    KVPACK_UNROLL
    for (int i = 0; i < 4; ++i) {
      const __m512i bytes = kivi_vnni::load_rows(rows + row_bytes * i + 16 * k, 4 * row_bytes);
      low[i] = levels.bytes(_mm512_and_si512(bytes, nibble));
      high[i] = levels.bytes(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
    }
    KVPACK_UNROLL
    for (int h = 0; h < kG; ++h) {
      const auto* q = reinterpret_cast<const __m128i*>(q8 + h * d + 32 * k);
      const __m512i even = _mm512_broadcast_i32x4(_mm_loadu_si128(q));
      const __m512i odd = _mm512_broadcast_i32x4(_mm_loadu_si128(q + 1));
      KVPACK_UNROLL
      for (int i = 0; i < 4; ++i) sum[h][i] = dot_quads(dot_quads(sum[h][i], low[i], even), high[i], odd);
    }
  }
  // 128-bit lane r of sum[h][i] holds four partial sums of token t0 + i + 4r: after the two steps
  // lane 4r + i holds their total.
  KVPACK_UNROLL
  for (int h = 0; h < kG; ++h) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(sum[h][0], sum[h][1]),
                                       _mm512_unpackhi_epi32(sum[h][0], sum[h][1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(sum[h][2], sum[h][3]),
                                       _mm512_unpackhi_epi32(sum[h][2], sum[h][3]));
    out[h] = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  }
}

/// Scores every page of `run`: scores[h][slot] = n_t · Σ_c (Rq)_c·C(code_tc), dead slots masked.
/// `rotated` is [group][d] in channel order; `work` holds scratch_floats' page tile (P·d floats).
/// False, with nothing written, when the layer or the query does not take this path.
inline bool score_keys(xsimd::avx512bw arch, const PageRun& run, const LayerView& v, const float* rotated,
                       index_t group, float* scores, index_t score_stride, float* work) noexcept {
  const index_t d = run.head_dim, P = run.page_size;
  const int bits = code_bits(v, P);
  if (bits == 0) return false;
  const ByteLevels levels = byte_levels(v);
  if (levels.step == 0.0f) return false;
  // The work area (the page tile's P·d floats): int8 queries [group][d], widened rows [P][d/2],
  // per head step and sum, the page's norms [P]. A group too large for it takes the fp32 path.
  if (static_cast<std::size_t>(group) * (d + 8) + static_cast<std::size_t>(P) * (d / 2 + 4) >
      static_cast<std::size_t>(P) * d * sizeof(float)) {
    return false;
  }
  auto* q8 = reinterpret_cast<std::int8_t*>(work);
  auto* widened = reinterpret_cast<std::uint8_t*>(q8 + static_cast<std::size_t>(group) * d);
  auto* step = reinterpret_cast<float*>(widened + static_cast<std::size_t>(P) * d / 2);
  auto* sum = reinterpret_cast<std::int32_t*>(step + group);
  float* norm = reinterpret_cast<float*>(sum + group);
  if (!quantize_query(arch, rotated, group, d, q8, step, sum)) return false;
  for (index_t h = 0; h < group; ++h) step[h] *= levels.step;
  const std::size_t row_bytes = static_cast<std::size_t>(d) / 2;
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, P / 16);
    const std::byte* plane = run.pages[i];
    float* page_scores = scores + i * P;
    const std::uint8_t* rows = four_bit_rows(plane, bits, P, d, widened);
    load_norms(plane, v, P, norm);  // a score carries a norm's Inf or NaN as the reference does
    for (index_t t0 = 0; t0 < P; t0 += 16) {
      prefetcher.step();
      const __m512 n = _mm512_loadu_ps(norm + t0);
      for_each_head_block<4>(group, [&](auto block, index_t h0) {
        constexpr int kG = decltype(block)::value;
        __m512i dots[kG];
        score_tile<kG>(rows + row_bytes * t0, row_bytes, d, q8 + h0 * d, levels, dots);
        KVPACK_UNROLL
        for (int h = 0; h < kG; ++h) {
          const __m512i centred = _mm512_sub_epi32(dots[h], _mm512_set1_epi32(128 * sum[h0 + h]));
          const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(step[h0 + h]));
          _mm512_storeu_ps(page_scores + (h0 + h) * score_stride + t0, _mm512_mul_ps(s, n));
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
      : levels_(byte_levels(v)), group_(group), P_(page_size), d_(v.dim), bits_(code_bits(v, page_size)), sums_(sums) {
    // The work area: per head step, largest weight, bias and Σ w8; the norms [P], zero offsets
    // [P], a sink for their sums [16], then int8 weights [group][P] and widened rows [P][d/2].
    const std::size_t floats = 4 * static_cast<std::size_t>(group) + 2 * static_cast<std::size_t>(P_) + 16 +
                               (static_cast<std::size_t>(group) * P_ + static_cast<std::size_t>(P_) * d_ / 2 + 3) / 4;
    if (bits_ == 0 || levels_.step == 0.0f || floats > work_floats) return;
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
    if (!load_norms(plane, v, P_, norm_)) return false;
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
      step_[h] *= levels_.step;
      bias_[h] -= 128.0f * step_[h] * static_cast<float>(weight_sums_[h]);
    }
    const std::uint8_t* rows = four_bit_rows(plane, bits_, P_, d_, widened_);
    const std::size_t row_bytes = static_cast<std::size_t>(d_) / 2;
    PagePrefetcher prefetcher(run, i, 1, d_ / 32 * P_ / 4, Plane::kValue);
    for (index_t k = 0; k < d_ / 32; ++k) {
      for_each_head_block<4>(group_, [&](auto block, index_t h0) {
        constexpr int kG = decltype(block)::value;
        kivi_vnni::accumulate_channels<kG>(rows + 16 * k, row_bytes, P_, w8_ + static_cast<std::size_t>(h0) * P_,
                                           step_ + h0, sums_ + h0 * d_ + 32 * k, d_, prefetcher, levels_);
      });
    }
    return true;
  }

  /// rotated[h][perm(c)] += the sums of channel c (perm null: the channel order itself).
  void finish(float* rotated, const index_t* perm) const noexcept {
    float ordered[quant::kMaxRotationDim];
    for (index_t h = 0; h < group_; ++h) {
      std::fill(ordered, ordered + d_, bias_[h]);
      add_value_sums_in_order<4, 32, xsimd::avx512bw>(sums_ + h * d_, d_, ordered);
      float* r = rotated + h * d_;
      for (index_t c = 0; c < d_; ++c) r[perm != nullptr ? perm[c] : c] += ordered[c];
    }
  }

 private:
  ByteLevels levels_;
  index_t group_, P_, d_;
  int bits_;
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
