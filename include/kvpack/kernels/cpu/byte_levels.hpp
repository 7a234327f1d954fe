#pragma once
/// \file byte_levels.hpp
/// \brief What the kernels that multiply codebook levels as bytes share (KVQuant's and
///        TurboQuant's AVX-512 VNNI paths through kivi_vnni.hpp's loops, KVQuant's keys on AVX2
///        through kivi_avx2.hpp's): the codebook as a byte table, the −128 each byte level
///        carries, and (AVX-512) 3- and 2-bit codes widened to 4-bit ones.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvpack/kernels/cpu/integer_common.hpp"

namespace kvpack::inline v0::kernels::cpu {

/// A codebook of up to 16 levels as unsigned bytes for the integer products of kivi_vnni.hpp and
/// kivi_avx2.hpp (4- and 2-bit codes): byte_k = 128 + round(ℓ_k / step) with step = max_k |ℓ_k| /
/// 127, so each level is (byte_k − 128)·step within step/2, and Σ_t w8_t·ℓ(code_t) =
/// step·(Σ_t w8_t·byte − 128·Σ_t w8_t) (likewise Σ_c q16_c·ℓ(code_c) for keys). Codes past the
/// codebook's size read the zero level (the caller zero-pads `levels`).
struct LevelBytes {
  alignas(16) std::uint8_t bytes[16] = {};
  float step = 0.0f;  ///< 0 when no level is usable (all zero, or one not finite): the fp32 path

  /// With the step of `largest` ≥ every |ℓ_k|, so that two codebooks of one layer share a step
  /// (TurboQuant's sections of two widths); a `largest` that is 0 or not finite gives step 0.
  LevelBytes(const float (&levels)[16], float largest) noexcept {
    if (largest > 0.0f && largest <= std::numeric_limits<float>::max()) {
      step = largest / 127.0f;
      for (int k = 0; k < 16; ++k) bytes[k] = static_cast<std::uint8_t>(128 + std::lrint(levels[k] / step));
    }
  }

  /// max_k |ℓ_k|, or NaN when some level is not finite.
  static float largest(const float (&levels)[16]) noexcept {
    float top = 0.0f;
    for (float level : levels) {
      if (!std::isfinite(level)) return std::numeric_limits<float>::quiet_NaN();
      top = std::max(top, std::fabs(level));
    }
    return top;
  }
};

}  // namespace kvpack::inline v0::kernels::cpu

#if KVPACK_KERNELS_HAVE_VNNI

namespace kvpack::inline v0::kernels::cpu {

/// LevelBytes in every 128-bit lane, for the AVX-512 kernels: one byte shuffle per vector of
/// codes looks them up.
struct ByteLevels {
  __m512i table;
  float step = 0.0f;  ///< LevelBytes::step

  KVPACK_ALWAYS_INLINE explicit ByteLevels(const float (&levels)[16]) noexcept : ByteLevels(levels, largest(levels)) {}

  KVPACK_ALWAYS_INLINE ByteLevels(const float (&levels)[16], float largest) noexcept {
    const LevelBytes level_bytes(levels, largest);
    step = level_bytes.step;
    table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(level_bytes.bytes)));
  }

  static KVPACK_ALWAYS_INLINE float largest(const float (&levels)[16]) noexcept { return LevelBytes::largest(levels); }

  KVPACK_ALWAYS_INLINE __m512i bytes(__m512i codes) const noexcept { return _mm512_shuffle_epi8(table, codes); }
  /// Codes in words with a zero high byte: bit 7 set in the high byte makes the shuffle write 0 there.
  KVPACK_ALWAYS_INLINE __m512i words(__m512i codes) const noexcept {
    return _mm512_shuffle_epi8(table, _mm512_or_si512(codes, _mm512_set1_epi16(static_cast<short>(0x8000))));
  }
};

/// Σ of each head's int8 weights over a page (a multiple of 16 tokens): the −128 of every byte
/// level, taken out once per page.
KVPACK_ALWAYS_INLINE void sum_int8_weights(const std::int8_t* w8, index_t group, index_t page_size,
                                           std::int32_t* sums) noexcept {
  for (index_t h = 0; h < group; ++h) {
    __m512i sum = _mm512_setzero_si512();
    for (index_t t = 0; t < page_size; t += 16) {
      const auto* bytes = reinterpret_cast<const __m128i*>(w8 + h * page_size + t);
      sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
    }
    sums[h] = _mm512_reduce_add_epi32(sum);
  }
}

/// Four runs of 32 3-bit codes (48 bytes, packed from the low bit up as get_code<3> reads them;
/// bytes 48..63 of `bytes` are ignored) as four runs of 4-bit codes, 16 bytes each with even codes
/// in the low nibbles, run r in 128-bit lane r. There word j takes the two bytes that hold codes
/// 4j..4j+3 (bits 12j..12j+11), shifted down by 12j mod 8; two shift-and-select steps then move
/// its four 3-bit fields to nibbles 0..3. Only AVX-512BW: VBMI's byte permutes would save two
/// steps of eight, and the avx512 target does not require it.
KVPACK_ALWAYS_INLINE __m512i widen_3bit_runs(__m512i bytes) noexcept {
  const __m512i spread = _mm512_setr_epi32(0, 1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 0, 9, 10, 11, 0);
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11));
  const __m512i odd_words_by_4 = _mm512_set1_epi32(0x00040000);
  const __m512i low_6_bits = _mm512_set1_epi16(0x003F), low_3_bits = _mm512_set1_epi8(0x07);
  constexpr int kSelect = 0xE4;  // ternary logic "C ? A : B", bit by bit
  const __m512i words =
      _mm512_srlv_epi16(_mm512_shuffle_epi8(_mm512_permutexvar_epi32(spread, bytes), pairs), odd_words_by_4);
  // Fields at bits 0, 3 | 6, 9 to 0, 3 | 8, 11: each byte holds two fields (bits 6, 7 not yet clean).
  const __m512i halves = _mm512_ternarylogic_epi32(words, _mm512_slli_epi16(words, 2), low_6_bits, kSelect);
  // Then 0, 3 to 0, 4 in every byte, and the bits between cleared.
  const __m512i nibbles = _mm512_ternarylogic_epi32(halves, _mm512_slli_epi16(halves, 1), low_3_bits, kSelect);
  return _mm512_and_si512(nibbles, _mm512_set1_epi8(0x77));
}

/// Four runs of 32 2-bit codes (32 bytes, four codes per byte from the low bit up) as four runs
/// of 4-bit codes like widen_3bit_runs'. Byte x of the input becomes one word: fields at bits
/// 0, 2 | 4, 6 move to 0, 2 | 8, 10, then to 0, 4 | 8, 12, and the bits between are cleared.
KVPACK_ALWAYS_INLINE __m512i widen_2bit_runs(__m256i bytes) noexcept {
  constexpr int kSelect = 0xE4;  // ternary logic "C ? A : B", bit by bit
  const __m512i words = _mm512_cvtepu8_epi16(bytes);
  const __m512i bytes_apart =
      _mm512_ternarylogic_epi32(_mm512_slli_epi16(words, 4), words, _mm512_set1_epi16(static_cast<short>(0xFF00)),
                                kSelect);
  const __m512i nibbles = _mm512_ternarylogic_epi32(_mm512_slli_epi16(bytes_apart, 2), bytes_apart,
                                                    _mm512_set1_epi16(static_cast<short>(0xF0F0)), kSelect);
  return _mm512_and_si512(nibbles, _mm512_set1_epi8(0x33));
}

/// 3-bit codes rewritten as 4-bit ones, so that the 4-bit integer kernels take them: `chunks`
/// (a multiple of 4) contiguous runs of 32 codes, 12 bytes each, become 16 bytes each. Every page
/// the integer kernels take this way has a multiple of 4: d·P/32 key runs with d a multiple of
/// 16 and P of 32, P·d/32 value runs with P a multiple of 16 and d of 32.
///
/// Only the last load is masked: in cache, KVQuant-3 took 237-248 µs with masked loads and stores
/// here, 215 µs without (the kernels read the output right away; a masked store most likely does
/// not forward to those loads).
KVPACK_ALWAYS_INLINE void widen_3bit_codes(const std::uint8_t* in, std::size_t chunks, std::uint8_t* out) noexcept {
  for (std::size_t i = 0; i < chunks; i += 4) {
    // A full load reads 16 bytes past the four chunks: the next four's, except on the last pass.
    const __m512i bytes = i + 4 < chunks ? _mm512_loadu_si512(in + 12 * i)
                                         : _mm512_maskz_loadu_epi8(~0ULL >> 16, in + 12 * i);
    _mm512_storeu_si512(out + 16 * i, widen_3bit_runs(bytes));
  }
}

/// The same for 2-bit codes: `chunks` (a multiple of 4) contiguous runs of 8 bytes.
KVPACK_ALWAYS_INLINE void widen_2bit_codes(const std::uint8_t* in, std::size_t chunks, std::uint8_t* out) noexcept {
  for (std::size_t i = 0; i < chunks; i += 4) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 8 * i));
    _mm512_storeu_si512(out + 16 * i, widen_2bit_runs(bytes));
  }
}

/// One section of `rows` strided rows (`stride` bytes apart, `chunks` runs of 32 codes of `bits`
/// = 2 or 3 each) widened into contiguous 4-bit rows of 16·chunks bytes. A pass widens four runs:
/// with one or two runs per row, those of four or two rows (`rows` a multiple of 4), each row's
/// bytes masked into their place of one vector; otherwise one row at a time, its loads masked to
/// the section and its stores whole vectors, so `out` then needs 48 bytes past its last row (they
/// spill into the next row, which its own stores overwrite).
KVPACK_ALWAYS_INLINE void widen_code_rows(const std::uint8_t* in, std::size_t stride, index_t rows, index_t chunks,
                                          int bits, std::uint8_t* out) noexcept {
  const std::size_t run_bytes = bits == 3 ? 12 : 8;
  auto widen = [bits](__m512i bytes) KVPACK_ALWAYS_INLINE_LAMBDA {
    return bits == 3 ? widen_3bit_runs(bytes) : widen_2bit_runs(_mm512_castsi512_si256(bytes));
  };
  if (chunks == 1 || chunks == 2) {
    const index_t per_pass = 4 / chunks;
    const std::size_t section = run_bytes * static_cast<std::size_t>(chunks);
    const __mmask64 first = ~0ULL >> (64 - section);
    for (index_t t = 0; t < rows; t += per_pass) {
      const std::uint8_t* row = in + stride * static_cast<std::size_t>(t);
      __m512i bytes = _mm512_setzero_si512();
      for (index_t r = 0; r < per_pass; ++r) {
        // Row t + r's bytes land at byte r·section: loaded from r·section before them (stride ≥ section).
        const auto at = static_cast<std::size_t>(r);
        bytes = _mm512_mask_loadu_epi8(bytes, first << (at * section), row + at * (stride - section));
      }
      _mm512_storeu_si512(out + 16 * static_cast<std::size_t>(chunks) * t, widen(bytes));
    }
    return;
  }
  for (index_t t = 0; t < rows; ++t) {
    const std::uint8_t* row = in + stride * static_cast<std::size_t>(t);
    std::uint8_t* widened = out + 16 * static_cast<std::size_t>(chunks) * t;
    for (index_t i = 0; i < chunks; i += 4) {
      const auto runs = static_cast<std::size_t>(std::min<index_t>(4, chunks - i));
      const __mmask64 valid = ~0ULL >> (64 - runs * run_bytes);
      _mm512_storeu_si512(widened + 16 * i, widen(_mm512_maskz_loadu_epi8(valid, row + run_bytes * i)));
    }
  }
}

}  // namespace kvpack::inline v0::kernels::cpu

#endif  // KVPACK_KERNELS_HAVE_VNNI
