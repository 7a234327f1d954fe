#pragma once
/// \file ggml_blocks.hpp
/// \brief llama.cpp / ggml q8_0 and q4_0 blocks (32 elements) with their reference quantizers.
///
/// These reproduce ggml's `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref` bit for bit, so a
/// kvpack page holds exactly the scales and codes llama.cpp would store; the page codecs only
/// arrange them differently for the kernels (see q8_0.hpp and q4_0.hpp).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "kvpack/core/half.hpp"

namespace kvpack::inline v0::quant::ggml {

inline constexpr int kBlockSize = 32;  ///< QK8_0 == QK4_0 == 32

/// float → integer code as ggml converts it (`round` for q8_0, truncation for q4_0), but defined
/// for every input: when a block's largest magnitude is so small that 1/d overflows, ggml converts
/// inf or NaN to int8 (undefined behaviour); here such codes become `zero_code`, and the stored d
/// (which then rounds to fp16 0) decodes them to 0 as ggml's would.
inline std::int8_t to_code(float value, float lowest, float highest, std::int8_t zero_code) noexcept {
  if (std::isnan(value)) return zero_code;
  return static_cast<std::int8_t>(std::clamp(value, lowest, highest));
}

/// to_code(std::roundf(value), -127, 127, 0), ggml's q8_0 rounding (half away from zero) written
/// out: GCC calls roundf out of line at the x86-64 baseline (SSE4.1 has the instruction, SSE2 does
/// not), which took a quarter of a q8_0 append. Clamping before rounding gives the same code, as
/// the bounds are integers.
inline std::int8_t round_to_int8_code(float value) noexcept {
  if (std::isnan(value)) return 0;
  const float v = std::clamp(value, -127.0f, 127.0f);
  const auto whole = static_cast<int>(v);               // toward zero
  const float fraction = v - static_cast<float>(whole);  // exact (Sterbenz): v with its fraction dropped
  return static_cast<std::int8_t>(whole + (fraction >= 0.5f) - (fraction <= -0.5f));
}

/// a·b rounded to float, never fused with the addition that follows it. Where FMA is enabled,
/// GCC contracts a·b + c into one FMA even across statements (-ffp-contract=fast, its default for
/// GNU C++), which rounds once instead of twice and moves q4_0 codes that sit on a boundary: the
/// same source stored other bytes in kvpack's per-ISA kernel objects (FMA on) or a -march=native
/// build than at the x86-64 baseline. The empty asm makes the product a value the compiler must
/// materialise, so every build rounds twice, as ggml's reference reads.
inline float unfused_product(float a, float b) noexcept {
  float product = a * b;
#if defined(__GNUC__) && defined(__x86_64__)
  __asm__("" : "+x"(product));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(product));
#endif
  return product;
}

/// ggml `block_q8_0`: 34 bytes per 32 elements = 8.5 bits per element.
struct BlockQ8_0 {
  std::uint16_t d;                ///< scale, fp16 bits: amax / 127
  std::int8_t qs[kBlockSize];     ///< codes, x ≈ d · qs[j]
};
static_assert(sizeof(BlockQ8_0) == 34);

/// ggml `block_q4_0`: 18 bytes per 32 elements = 4.5 bits per element.
struct BlockQ4_0 {
  std::uint16_t d;                     ///< scale, fp16 bits: (signed value of largest |x|) / -8
  std::uint8_t qs[kBlockSize / 2];     ///< element j in the low nibble of qs[j], j+16 in the high
};
static_assert(sizeof(BlockQ4_0) == 18);

/// ggml's q8_0 reference quantizer for one block of 32 floats.
inline BlockQ8_0 quantize_q8_0(const float* x) noexcept {
  float amax = 0.0f;
  for (int j = 0; j < kBlockSize; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ8_0 block{};
  block.d = half(d).bits;
  for (int j = 0; j < kBlockSize; ++j) block.qs[j] = round_to_int8_code(x[j] * id);
  return block;
}

inline void dequantize_q8_0(const BlockQ8_0& block, float* y) noexcept {
  const float d = half::from_bits(block.d);
  for (int j = 0; j < kBlockSize; ++j) y[j] = static_cast<float>(block.qs[j]) * d;
}

/// ggml's q4_0 reference quantizer for one block of 32 floats (truncating, as ggml does).
inline BlockQ4_0 quantize_q4_0(const float* x) noexcept {
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < kBlockSize; ++j) {  // selects rather than branches: the branch mispredicts on data
    const bool larger = amax < std::fabs(x[j]);
    amax = larger ? std::fabs(x[j]) : amax;
    max = larger ? x[j] : max;
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ4_0 block{};
  block.d = half(d).bits;
  for (int j = 0; j < kBlockSize / 2; ++j) {
    // (int8_t)(x·id + 8.5) truncates toward zero, then MIN(15, ·): ggml's q4_0 rounding.
    const auto lo = static_cast<std::uint8_t>(to_code(std::trunc(unfused_product(x[j], id) + 8.5f), 0.0f, 15.0f, 8));
    const auto hi =
        static_cast<std::uint8_t>(to_code(std::trunc(unfused_product(x[j + 16], id) + 8.5f), 0.0f, 15.0f, 8));
    block.qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  return block;
}

inline void dequantize_q4_0(const BlockQ4_0& block, float* y) noexcept {
  const float d = half::from_bits(block.d);
  for (int j = 0; j < kBlockSize / 2; ++j) {
    y[j] = static_cast<float>((block.qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((block.qs[j] >> 4) - 8) * d;
  }
}

}  // namespace kvpack::inline v0::quant::ggml
