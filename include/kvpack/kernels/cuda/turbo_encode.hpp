#pragma once
/// \file turbo_encode.hpp
/// \brief TurboQuant-MSE's page encoder for the device, one token per unit: the norm, the unit
///        row rotated by R, each rotated channel's code against the layer's boundaries, with
///        the arithmetic of the scalar `encode` (quant/turboquant.hpp and quant/rotation.hpp:
///        sums and products in double, each rounded once, in the same order), so the bytes are
///        the host's.
///
/// No thread keeps a row: the driver reserves a kernel's local memory for every thread the
/// device can hold, so a row of doubles per thread (8 KiB at head_dim 1024) would cost gigabytes.
/// Each rotated channel is computed on its own instead, from the unit row's elements recomputed
/// as needed: a dense row of Q as one sum, a Hadamard output by walking the transform's
/// butterflies that lead to it (a stack of log₂ d partial sums), which gives the in-place
/// transform's values bit for bit, since each is the same operation on the same operands.
/// O(d²) work per token instead of O(d log d): correct, not fast.

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
    std::byte* codes = plane + static_cast<std::size_t>(p.row_bytes) * t;
    for (std::uint32_t b = 0; b < p.row_bytes; ++b) codes[b] = std::byte{0};
    for (index_t c = 0; c < d; ++c) {
      const auto channel = static_cast<std::uint32_t>(c);
      const bool high = channel < p.high_channels;
      const std::uint32_t bits = high ? p.high_bits : p.low_bits;
      if (bits == 0) continue;
      const float y = static_cast<float>(p.hadamard != 0 ? hadamard_channel(x, norm, p.rotation, d, channel)
                                                         : dense_channel(x, norm, p.rotation, d, channel));
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

 private:
  /// Element c of the unit row, as the host rounds it.
  KVPACK_HOST_DEVICE static float unit(const float* x, double norm, index_t c) noexcept {
    return norm > 0.0 ? static_cast<float>(x[c] / norm) : 0.0f;
  }

  /// Channel i of Q·unit: quant::rotate's dense branch for one row.
  KVPACK_HOST_DEVICE static double dense_channel(const float* x, double norm, const float* q, index_t d,
                                                 std::uint32_t i) noexcept {
    using namespace turbo_encode_detail;
    const float* row = q + static_cast<std::size_t>(i) * d;
    double sum = 0.0;
    for (index_t c = 0; c < d; ++c) sum = add(sum, mul(static_cast<double>(row[c]), unit(x, norm, c)));
    return sum;
  }

  /// Channel i of quant::rotate's Hadamard branch: the signed unit row through the unnormalised
  /// transform, then 1/√d. Level k of the in-place transform sets element p from the elements
  /// p without and with bit k, as their sum (bit k of p clear) or difference (set); output i is
  /// the root of a tree of those operations over all d inputs, in which every node at level k
  /// takes bit k of i. The inputs are visited in order, each completing the subtrees it closes
  /// (like a binary counter's carries) with the left halves pending on a stack.
  KVPACK_HOST_DEVICE static double hadamard_channel(const float* x, double norm, const float* signs, index_t d,
                                                    std::uint32_t i) noexcept {
    using namespace turbo_encode_detail;
    static_assert(quant::kMaxRotationDim <= 1024);
    double pending[11];  // a left half per level, and the root: log₂ d + 1 ≤ 11
    for (std::uint32_t m = 0; m < static_cast<std::uint32_t>(d); ++m) {
      double value = mul(static_cast<double>(unit(x, norm, static_cast<index_t>(m))), signs[m]);
      int k = 0;
      for (; (m >> k) & 1u; ++k) value = (i >> k) & 1u ? sub(pending[k], value) : add(pending[k], value);
      pending[k] = value;
    }
    int levels = 0;
    while ((index_t{1} << levels) < d) ++levels;
    return mul(pending[levels], 1.0 / sqrt(static_cast<double>(d)));
  }
};

}  // namespace kvpack::inline v0::kernels::cuda
