#pragma once
/// \file element_encode.hpp
/// \brief Page encoding split into independent units, one per CUDA thread: what the device's
///        append path runs.
///
/// A codec's page plane is cut into units that write disjoint bytes: one element (Float, FP8), one
/// token (Int8: its scale covers the row), one (token, 32-channel block) (Q8_0, Q4_0), one
/// (channel, token group) for KIVI keys and one (token, channel group) for KIVI values.
/// `ElementEncoder<Codec>::encode_unit` writes unit u of a plane from fp32 rows with exactly the
/// arithmetic of the codec's scalar `encode` (no fused multiply-adds where the host has none), so
/// the bytes are identical: the host test suite checks that, unit by unit, on every CI run, and the
/// CUDA tests check the device's bytes against the host's. KVQuant, whose outliers are chosen
/// over a whole page, is encoded in stages of such units (`StagedEncoder`, kvquant_encode.hpp);
/// TurboQuant-MSE one token per unit (turbo_encode.hpp).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvpack/config.hpp"
#include "kvpack/core/fp8.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/kernels/cuda/kvquant_encode.hpp"
#include "kvpack/kernels/cuda/turbo_encode.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/ggml_blocks.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "kvpack/quant/tile_layout.hpp"

namespace kvpack::inline v0::kernels::cuda {

namespace encode_detail {

/// a · b + c rounded twice, as the host computes it: nvcc would otherwise fuse it.
KVPACK_HOST_DEVICE float mul_add_unfused(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(a, b), c);
#else
  return a * b + c;
#endif
}

/// ggml's float → code conversion (ggml_blocks.hpp: NaN → zero_code, else clamped and truncated).
KVPACK_HOST_DEVICE std::int8_t to_code(float value, float lowest, float highest, std::int8_t zero_code) noexcept {
  if (value != value) return zero_code;
  return static_cast<std::int8_t>(value < lowest ? lowest : (highest < value ? highest : value));
}

template <class T>
KVPACK_HOST_DEVICE void store(std::byte* at, T value) noexcept {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<T*>(at) = value;
#else
  std::memcpy(at, &value, sizeof(T));
#endif
}

KVPACK_HOST_DEVICE float round_half_away(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return roundf(x);
#else
  return std::round(x);
#endif
}

/// One q8_0-style block: scale amax/127 stored as fp16, codes round(x / scale).
struct SymmetricInt8 {
  std::uint16_t scale_bits = 0;
  float inverse = 0.0f;
};
KVPACK_HOST_DEVICE SymmetricInt8 symmetric_int8(const float* x, index_t n) noexcept {
  float amax = 0.0f;
  for (index_t j = 0; j < n; ++j) amax = fmaxf(amax, fabsf(x[j]));
  const float scale = amax / 127.0f;
  return {half(scale).bits, scale != 0.0f ? 1.0f / scale : 0.0f};
}

/// Writes the n codes of such a block: code j at byte_of(j).
template <class ByteOf>
KVPACK_HOST_DEVICE void store_int8_codes(const float* x, index_t n, float inverse, std::byte* plane,
                                         ByteOf byte_of) noexcept {
  for (index_t j = 0; j < n; ++j) {
    plane[byte_of(j)] = static_cast<std::byte>(to_code(round_half_away(x[j] * inverse), -127.0f, 127.0f, 0));
  }
}

}  // namespace encode_detail

template <class Codec>
struct ElementEncoder;

/// Codecs the device can encode.
template <class Codec>
concept DeviceEncodable = requires { ElementEncoder<Codec>::kSupported; };

/// An encoder whose units run in `kStages` stages with a barrier between them, sharing
/// `scratch_bytes(g)` of block memory; its units take device parameters (device_params_t).
template <class Encoder>
concept StagedEncoder = requires { Encoder::kStages; };

template <class T, Plane P>
struct ElementEncoder<quant::FloatCodec<T, P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size * g.head_dim; }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::NoParams,
                                             std::byte* plane, quant::PageGeometry g, index_t unit) noexcept {
    const index_t t = unit / g.head_dim;
    const index_t c = unit % g.head_dim;
    encode_detail::store(plane + quant::tile::element(g, P, t, c) * sizeof(T), static_cast<T>(src[t * row_stride + c]));
  }
};

template <class Format, Plane P>
struct ElementEncoder<quant::FP8Codec<Format, P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size * g.head_dim; }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::FP8Params params,
                                             std::byte* plane, quant::PageGeometry g, index_t unit) noexcept {
    const index_t t = unit / g.head_dim;
    const index_t c = unit % g.head_dim;
    plane[quant::tile::element(g, P, t, c)] = std::byte{Format(src[t * row_stride + c] / params.scale).bits};
  }
};

template <Plane P>
struct ElementEncoder<quant::Int8Codec<P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size; }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::NoParams,
                                             std::byte* plane, quant::PageGeometry g, index_t t) noexcept {
    const float* row = src + t * row_stride;
    const auto block = encode_detail::symmetric_int8(row, g.head_dim);
    encode_detail::store(plane + quant::Int8Codec<P>::codes_bytes(g) + static_cast<std::size_t>(t) * 2, block.scale_bits);
    encode_detail::store_int8_codes(row, g.head_dim, block.inverse, plane,
                                    [&](index_t c) { return quant::Int8Codec<P>::code_byte(g, t, c); });
  }
};

template <Plane P>
struct ElementEncoder<quant::Q8_0Codec<P>> {
  static constexpr bool kSupported = true;
  using Codec = quant::Q8_0Codec<P>;
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size * (g.head_dim / 32); }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::NoParams,
                                             std::byte* plane, quant::PageGeometry g, index_t unit) noexcept {
    const index_t t = unit / (g.head_dim / 32);
    const index_t b = unit % (g.head_dim / 32);
    const float* x = src + t * row_stride + b * 32;
    const auto block = encode_detail::symmetric_int8(x, 32);
    encode_detail::store(plane + Codec::scale_byte(g, t, b), block.scale_bits);
    encode_detail::store_int8_codes(x, 32, block.inverse, plane, [&](index_t j) { return Codec::code_byte(g, t, b * 32 + j); });
  }
};

template <Plane P>
struct ElementEncoder<quant::Q4_0Codec<P>> {
  static constexpr bool kSupported = true;
  using Codec = quant::Q4_0Codec<P>;
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size * (g.head_dim / 32); }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::NoParams,
                                             std::byte* plane, quant::PageGeometry g, index_t unit) noexcept {
    const index_t t = unit / (g.head_dim / 32);
    const index_t b = unit % (g.head_dim / 32);
    const float* x = src + t * row_stride + b * 32;
    // ggml's q4_0: the signed value of the largest magnitude (first one on ties) over -8.
    float amax = 0.0f;
    float max = 0.0f;
    for (index_t j = 0; j < 32; ++j) {
      if (amax < fabsf(x[j])) {
        amax = fabsf(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    encode_detail::store(plane + Codec::scale_byte(g, t, b), half(d).bits);
    // Channels j and j + 16 share a byte, so this unit writes both nibbles of each of its bytes.
    for (index_t j = 0; j < 16; ++j) {
      const auto lo = static_cast<unsigned>(static_cast<std::uint8_t>(
          encode_detail::to_code(truncf(encode_detail::mul_add_unfused(x[j], id, 8.5f)), 0.0f, 15.0f, 8)));
      const auto hi = static_cast<unsigned>(static_cast<std::uint8_t>(
          encode_detail::to_code(truncf(encode_detail::mul_add_unfused(x[j + 16], id, 8.5f)), 0.0f, 15.0f, 8)));
      const quant::tile::NibbleAddress at =
          P == Plane::kKey ? quant::tile::key_nibble(g, t, b * 32 + j) : quant::tile::value_nibble(g, t, b * 32 + j);
      plane[at.byte] = static_cast<std::byte>(lo | (hi << 4));
    }
  }
};

namespace encode_detail {

/// KIVI's group range and code (kivi.hpp), with the host's unfused arithmetic.
template <int Bits>
KVPACK_HOST_DEVICE quant::kivi_detail::GroupRange kivi_range(float lo, float hi) noexcept {
  return {static_cast<float>(half((hi - lo) / static_cast<float>((1 << Bits) - 1))), static_cast<float>(half(lo))};
}
template <int Bits>
KVPACK_HOST_DEVICE unsigned kivi_code(float x, quant::kivi_detail::GroupRange r) noexcept {
  if (r.scale == 0.0f) return 0;
  float q = (x - r.min) / r.scale;
  const float top = static_cast<float>((1 << Bits) - 1);
  q = q < 0.0f ? 0.0f : (top < q ? top : q);
  return static_cast<unsigned>(rintf(q));  // nearest, ties to even: std::nearbyint's default mode
}

}  // namespace encode_detail

template <int Bits, int Group>
struct ElementEncoder<quant::KiviKeyCodec<Bits, Group>> {
  static constexpr bool kSupported = true;
  using Codec = quant::KiviKeyCodec<Bits, Group>;
  /// One unit per (token group, channel): Group tokens' codes are whole bytes of the channel's row.
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return (g.page_size / Group) * g.head_dim; }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::NoParams,
                                             std::byte* plane, quant::PageGeometry g, index_t unit) noexcept {
    const index_t group = unit / g.head_dim;
    const index_t c = unit % g.head_dim;
    float lo = INFINITY, hi = -INFINITY;
    for (index_t t = group * Group; t < (group + 1) * Group; ++t) {
      lo = fminf(lo, src[t * row_stride + c]);
      hi = fmaxf(hi, src[t * row_stride + c]);
    }
    const auto range = encode_detail::kivi_range<Bits>(lo, hi);
    const std::size_t meta = (static_cast<std::size_t>(group) * g.head_dim + c) * 2;
    encode_detail::store(plane + Codec::scales_offset(g) + meta, half(range.scale).bits);
    encode_detail::store(plane + Codec::mins_offset(g) + meta, half(range.min).bits);
    std::byte* row = plane + Codec::row_bytes(g) * c;
    constexpr int kPerByte = 8 / Bits;
    for (index_t t = group * Group; t < (group + 1) * Group; t += kPerByte) {
      unsigned byte = 0;
      for (int k = 0; k < kPerByte; ++k) byte |= encode_detail::kivi_code<Bits>(src[(t + k) * row_stride + c], range) << (Bits * k);
      row[static_cast<std::size_t>(t) * Bits / 8] = static_cast<std::byte>(byte);
    }
  }
};

template <int Bits, int Group, Plane P>
struct ElementEncoder<quant::KiviTokenCodec<Bits, Group, P>> {
  static constexpr bool kSupported = true;
  using Codec = quant::KiviTokenCodec<Bits, Group, P>;
  /// One unit per (token, channel group).
  KVPACK_HOST_DEVICE static index_t units(quant::PageGeometry g) noexcept { return g.page_size * (g.head_dim / Group); }
  KVPACK_HOST_DEVICE static void encode_unit(const float* src, std::ptrdiff_t row_stride, quant::NoParams,
                                             std::byte* plane, quant::PageGeometry g, index_t unit) noexcept {
    const index_t t = unit / (g.head_dim / Group);
    const index_t group = unit % (g.head_dim / Group);
    const float* x = src + t * row_stride;
    float lo = INFINITY, hi = -INFINITY;
    for (index_t c = group * Group; c < (group + 1) * Group; ++c) {
      lo = fminf(lo, x[c]);
      hi = fmaxf(hi, x[c]);
    }
    const auto range = encode_detail::kivi_range<Bits>(lo, hi);
    const std::size_t meta = (static_cast<std::size_t>(t) * (g.head_dim / Group) + group) * 2;
    encode_detail::store(plane + Codec::scales_offset(g) + meta, half(range.scale).bits);
    encode_detail::store(plane + Codec::mins_offset(g) + meta, half(range.min).bits);
    std::byte* row = plane + Codec::row_bytes(g) * t;
    constexpr int kPerByte = 8 / Bits;
    for (index_t c = group * Group; c < (group + 1) * Group; c += kPerByte) {
      unsigned byte = 0;
      for (int k = 0; k < kPerByte; ++k) byte |= encode_detail::kivi_code<Bits>(x[c + k], range) << (Bits * k);
      row[static_cast<std::size_t>(c) * Bits / 8] = static_cast<std::byte>(byte);
    }
  }
};

template <int Bits>
struct ElementEncoder<quant::KVQuantKeyCodec<Bits>> : KVQuantKeyPageEncoder<Bits> {
  static constexpr bool kSupported = true;
};

template <int Bits>
struct ElementEncoder<quant::KVQuantValueCodec<Bits>> : KVQuantValuePageEncoder<Bits> {
  static constexpr bool kSupported = true;
};

/// TurboQuant-MSE: one token per unit (turbo_encode.hpp), parameters in their device form. Prod's
/// sign sketch is not encoded on the device.
template <Plane P>
struct ElementEncoder<quant::TurboCodec<quant::TurboVariant::kMse, P>> : TurboMseEncoder<P> {
  static constexpr bool kSupported = true;
};

}  // namespace kvpack::inline v0::kernels::cuda
