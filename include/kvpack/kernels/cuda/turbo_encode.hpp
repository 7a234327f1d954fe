#pragma once
/// \file turbo_encode.hpp
/// \brief TurboQuant-MSE's page encoder for the device, one token per unit: the norm, the unit
///        row rotated by R, each rotated channel's code against the layer's boundaries, with
///        the arithmetic of the scalar `encode` (quant/turboquant.hpp and quant/rotation.hpp:
///        sums and products in double, each rounded once, in the same order), so the bytes are
///        the host's. Each thread keeps a row of doubles (8 KiB at head_dim 1024) in local memory.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvpack/config.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/quant/rotation.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace turbo_encode_detail {

// Rounded once each, as on the host: nvcc would otherwise fuse a product into the next sum.
KVPACK_HOST_DEVICE double mul(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
KVPACK_HOST_DEVICE double add(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
KVPACK_HOST_DEVICE double sub(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

}  // namespace turbo_encode_detail

/// One token per unit: its row's bytes (zeroed, then each code or-ed in as the host does) and
/// its fp16 norm.
template <Plane P>
struct TurboMseEncoder {
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size; }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, const TurboDeviceParams& p,
                                             std::byte* plane, quant::PageGeometry g, index_t t) noexcept {
    using namespace turbo_encode_detail;
    const index_t d = g.head_dim;
    const float* x = src + t * row_stride;
    double norm2 = 0.0;
    for (index_t c = 0; c < d; ++c) norm2 = add(norm2, mul(static_cast<double>(x[c]), x[c]));
    const double norm = sqrt(norm2);
    auto unit = [&](index_t c) { return norm > 0.0 ? static_cast<float>(x[c] / norm) : 0.0f; };
    double rotated[quant::kMaxRotationDim];  // R·unit, before the final rounding to float
    if (p.hadamard != 0) {
      // quant::rotate's Hadamard branch: signs, an unnormalised transform, then 1/√d.
      for (index_t c = 0; c < d; ++c) rotated[c] = mul(static_cast<double>(unit(c)), p.rotation[c]);
      for (index_t h = 1; h < d; h *= 2) {
        for (index_t i = 0; i < d; i += 2 * h) {
          for (index_t j = i; j < i + h; ++j) {
            const double a = rotated[j], b = rotated[j + h];
            rotated[j] = add(a, b);
            rotated[j + h] = sub(a, b);
          }
        }
      }
      const double scale = 1.0 / sqrt(static_cast<double>(d));
      for (index_t c = 0; c < d; ++c) rotated[c] = mul(rotated[c], scale);
    } else {
      float units[quant::kMaxRotationDim];
      for (index_t c = 0; c < d; ++c) units[c] = unit(c);
      for (index_t i = 0; i < d; ++i) {
        const float* row = p.rotation + static_cast<std::size_t>(i) * d;
        double sum = 0.0;
        for (index_t c = 0; c < d; ++c) sum = add(sum, mul(static_cast<double>(row[c]), units[c]));
        rotated[i] = sum;
      }
    }
    std::byte* codes = plane + static_cast<std::size_t>(p.row_bytes) * t;
    for (std::uint32_t b = 0; b < p.row_bytes; ++b) codes[b] = std::byte{0};
    for (index_t c = 0; c < d; ++c) {
      const auto channel = static_cast<std::uint32_t>(c);
      const bool high = channel < p.high_channels;
      const std::uint32_t bits = high ? p.high_bits : p.low_bits;
      if (bits == 0) continue;
      const float y = static_cast<float>(rotated[c]);
      const float* boundaries = p.boundaries[high ? 0 : 1];
      unsigned code = 0;
      for (std::uint32_t k = 0; k + 1 < (1u << bits); ++k) code += y > boundaries[k] ? 1u : 0u;
      const std::uint32_t bit =
          high ? channel * p.high_bits : p.high_channels * p.high_bits + (channel - p.high_channels) * p.low_bits;
      const unsigned shifted = code << (bit % 8);
      codes[bit / 8] |= static_cast<std::byte>(shifted & 0xFFu);
      if (bit % 8 + bits > 8) codes[bit / 8 + 1] |= static_cast<std::byte>(shifted >> 8);
    }
    const std::uint16_t norm_bits = half(static_cast<float>(norm)).bits;
    std::byte* at = plane + p.norms_offset + 2 * static_cast<std::size_t>(t);
    at[0] = static_cast<std::byte>(norm_bits & 0xFFu);
    at[1] = static_cast<std::byte>(norm_bits >> 8);
  }
};

}  // namespace kvpack::inline v0::kernels::cuda
