#pragma once
/// \file element_decode.hpp
/// \brief One element of a page plane, decoded where it lies: what the CUDA kernels read.
///
/// The CPU kernels decode whole vectors; a CUDA thread decodes the element (token t, channel c)
/// it needs, straight from the page bytes staged in shared memory. `ElementDecoder<Codec>::at`
/// is that function for each codec the device backend supports. It is host-clean (no CUDA
/// header) so the host test suite checks it, bit for bit, against every codec's scalar `decode`
/// on machines without a GPU; the device kernels then only add arithmetic that is checked
/// against the scalar reference when a GPU is present.
///
/// A codec without a specialisation is not supported on the device: `DeviceDecodable<Codec>` is
/// false and the CUDA entry points reject it at compile time.
///
/// Kernels read two elements at a time: two consecutive tokens of a key channel (`token_pair`)
/// and two consecutive channels of a value token (`channel_pair`). A decoder whose layout keeps
/// such a pair side by side (fp16 and FP8 planes) reads it with one load; for the others the
/// pair is two `at` calls.
///
/// A codec whose parameters point into host tables (KVQuant, TurboQuant) has a device form of
/// them, `device_params_t<Codec>`, with the tables copied to the device; every other codec's
/// parameters are plain values and cross unchanged.
///
/// TurboQuant-MSE's decoder gives the element of the *rotated* row, n_t·C(code): the inverse
/// rotation mixes every channel, so no single element of the stored vector can be read on its
/// own. Its decoder says so (`rotated_space`), and the kernels then turn the query into that space
/// once per block and the pages' value sums back out of it (paged_attention.cuh); q·k and the
/// softmax weights are the same in either space, R being orthogonal.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvpack/config.hpp"
#include "kvpack/core/fp8.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "kvpack/quant/tile_layout.hpp"
#include "kvpack/quant/turboquant.hpp"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace kvpack::inline v0::kernels::cuda {

namespace decode_detail {

/// A little-endian scalar at `at` (aligned to its size: every layout above keeps it so).
template <class T>
KVPACK_HOST_DEVICE T load(const std::byte* at) noexcept {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(at);
#else
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
#endif
}

/// fp16 bits to float: the hardware conversion on the device, the portable one on the host
/// (both exact, NaN payloads aside).
KVPACK_HOST_DEVICE float half_to_float(std::uint16_t bits) noexcept {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(bits));
#else
  return detail::half_bits_to_float(bits);
#endif
}

template <class Format>
KVPACK_HOST_DEVICE float fp8_to_float(std::uint8_t bits) noexcept {
#if defined(__CUDA_ARCH__)
  // Every E4M3 and E5M2 value is exactly representable in fp16.
  constexpr __nv_fp8_interpretation_t kind = std::is_same_v<Format, fp8_e4m3fn> ? __NV_E4M3 : __NV_E5M2;
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, kind)));
#else
  return static_cast<float>(Format::from_bits(bits));
#endif
}

template <class T>
KVPACK_HOST_DEVICE float storage_to_float(const std::byte* at) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return load<float>(at);
  } else if constexpr (std::is_same_v<T, half>) {
    return half_to_float(load<std::uint16_t>(at));
  } else {
    return detail::bfloat16_bits_to_float(load<std::uint16_t>(at));
  }
}

}  // namespace decode_detail

/// Two decoded elements.
struct ElementPair {
  float first = 0.0f;
  float second = 0.0f;
};

template <class Codec>
struct ElementDecoder;

/// Codecs the CUDA backend can read.
template <class Codec>
concept DeviceDecodable = requires { ElementDecoder<Codec>::kSupported; };

namespace decode_detail {

/// Two consecutive 16-bit floats at `at` (4-byte aligned), decoded.
template <class T>
KVPACK_HOST_DEVICE ElementPair storage_pair(const std::byte* at) noexcept {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, half>) {
    const float2 both = __half22float2(*reinterpret_cast<const __half2*>(at));
    return {both.x, both.y};
  }
#endif
  return {storage_to_float<T>(at), storage_to_float<T>(at + sizeof(T))};
}

}  // namespace decode_detail

template <class T, Plane P>
struct ElementDecoder<quant::FloatCodec<T, P>> {
  static constexpr bool kSupported = true;
  using Codec = quant::FloatCodec<T, P>;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::NoParams, index_t t,
                                     index_t c) noexcept {
    return decode_detail::storage_to_float<T>(plane + quant::tile::element(g, P, t, c) * sizeof(T));
  }
  /// Keys are channel-major: tokens t and t + 1 (t even) of a channel are adjacent.
  KVPACK_HOST_DEVICE static ElementPair token_pair(const std::byte* plane, quant::PageGeometry g, quant::NoParams,
                                                   index_t t, index_t c) noexcept
    requires(P == Plane::kKey)
  {
    return decode_detail::storage_pair<T>(plane + quant::tile::element(g, P, t, c) * sizeof(T));
  }
  /// Values are token-major: channels c and c + 1 (c even) of a token are adjacent.
  KVPACK_HOST_DEVICE static ElementPair channel_pair(const std::byte* plane, quant::PageGeometry g, quant::NoParams,
                                                     index_t t, index_t c) noexcept
    requires(P == Plane::kValue)
  {
    return decode_detail::storage_pair<T>(plane + quant::tile::element(g, P, t, c) * sizeof(T));
  }
};

template <class Format, Plane P>
struct ElementDecoder<quant::FP8Codec<Format, P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::FP8Params params,
                                     index_t t, index_t c) noexcept {
    const auto code = static_cast<std::uint8_t>(plane[quant::tile::element(g, P, t, c)]);
    return decode_detail::fp8_to_float<Format>(code) * params.scale;
  }
  /// Keys channel-major, values token-major: the pair is two adjacent bytes either way.
  KVPACK_HOST_DEVICE static ElementPair pair(const std::byte* plane, quant::PageGeometry g, quant::FP8Params params,
                                             index_t t, index_t c) noexcept {
    const std::uint16_t codes = decode_detail::load<std::uint16_t>(plane + quant::tile::element(g, P, t, c));
    return {decode_detail::fp8_to_float<Format>(static_cast<std::uint8_t>(codes & 0xFFu)) * params.scale,
            decode_detail::fp8_to_float<Format>(static_cast<std::uint8_t>(codes >> 8)) * params.scale};
  }
  KVPACK_HOST_DEVICE static ElementPair token_pair(const std::byte* plane, quant::PageGeometry g, quant::FP8Params params,
                                                   index_t t, index_t c) noexcept
    requires(P == Plane::kKey)
  {
    return pair(plane, g, params, t, c);
  }
  KVPACK_HOST_DEVICE static ElementPair channel_pair(const std::byte* plane, quant::PageGeometry g,
                                                     quant::FP8Params params, index_t t, index_t c) noexcept
    requires(P == Plane::kValue)
  {
    return pair(plane, g, params, t, c);
  }
};

/// Int8 and Q8_0 share the 8-bit pair tiles; they differ in where a code's fp16 scale sits.
template <Plane P>
KVPACK_HOST_DEVICE float pair_tile_code(const std::byte* plane, quant::PageGeometry g, index_t t, index_t c) noexcept {
  const std::size_t byte = P == Plane::kKey ? quant::tile::key_byte(g, t, c) : quant::tile::value_byte(g, t, c);
  return static_cast<float>(static_cast<std::int8_t>(plane[byte]));
}

template <Plane P>
struct ElementDecoder<quant::Int8Codec<P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::NoParams, index_t t,
                                     index_t c) noexcept {
    const std::size_t scales = quant::Int8Codec<P>::codes_bytes(g);
    const float scale = decode_detail::half_to_float(
        decode_detail::load<std::uint16_t>(plane + scales + static_cast<std::size_t>(t) * 2));
    return pair_tile_code<P>(plane, g, t, c) * scale;
  }
};

template <Plane P>
struct ElementDecoder<quant::Q8_0Codec<P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::NoParams, index_t t,
                                     index_t c) noexcept {
    const float scale = decode_detail::half_to_float(
        decode_detail::load<std::uint16_t>(plane + quant::Q8_0Codec<P>::scale_byte(g, t, c / 32)));
    return pair_tile_code<P>(plane, g, t, c) * scale;
  }
};

template <Plane P>
struct ElementDecoder<quant::Q4_0Codec<P>> {
  static constexpr bool kSupported = true;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::NoParams, index_t t,
                                     index_t c) noexcept {
    const quant::tile::NibbleAddress address =
        P == Plane::kKey ? quant::tile::key_nibble(g, t, c) : quant::tile::value_nibble(g, t, c);
    const unsigned code = (static_cast<unsigned>(plane[address.byte]) >> (4 * address.nibble)) & 0xFu;
    const float scale = decode_detail::half_to_float(
        decode_detail::load<std::uint16_t>(plane + quant::Q4_0Codec<P>::scale_byte(g, t, c / 32)));
    return static_cast<float>(static_cast<int>(code) - 8) * scale;
  }
};

/// KIVI: code · scale + min, with the group's fp16 scale and minimum.
template <int Bits>
KVPACK_HOST_DEVICE float kivi_element(const std::byte* row, index_t j, const std::byte* scale_at,
                                      const std::byte* min_at) noexcept {
  const std::size_t bit = static_cast<std::size_t>(j) * Bits;
  const unsigned code = (static_cast<unsigned>(row[bit / 8]) >> (bit % 8)) & ((1u << Bits) - 1u);
  const float scale = decode_detail::half_to_float(decode_detail::load<std::uint16_t>(scale_at));
  const float min = decode_detail::half_to_float(decode_detail::load<std::uint16_t>(min_at));
  return static_cast<float>(code) * scale + min;
}

template <int Bits, int Group>
struct ElementDecoder<quant::KiviKeyCodec<Bits, Group>> {
  static constexpr bool kSupported = true;
  using Codec = quant::KiviKeyCodec<Bits, Group>;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::NoParams, index_t t,
                                     index_t c) noexcept {
    const std::size_t meta = (static_cast<std::size_t>(t / Group) * g.head_dim + c) * 2;
    return kivi_element<Bits>(plane + Codec::row_bytes(g) * c, t, plane + Codec::scales_offset(g) + meta,
                              plane + Codec::mins_offset(g) + meta);
  }
};

template <int Bits, int Group, Plane P>
struct ElementDecoder<quant::KiviTokenCodec<Bits, Group, P>> {
  static constexpr bool kSupported = true;
  using Codec = quant::KiviTokenCodec<Bits, Group, P>;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, quant::NoParams, index_t t,
                                     index_t c) noexcept {
    const std::size_t meta = (static_cast<std::size_t>(t) * (g.head_dim / Group) + c / Group) * 2;
    return kivi_element<Bits>(plane + Codec::row_bytes(g) * t, c, plane + Codec::scales_offset(g) + meta,
                              plane + Codec::mins_offset(g) + meta);
  }
};

/// KVQuant's parameters as the device reads them. The host's point into KVQuantTables on the
/// host; these hold the codebook's levels themselves, the outlier section's capacity, what the
/// encoder rounds to (the rounding codebook's midpoints), and (keys) device addresses of the
/// stream's per-channel offsets and half-ranges.
struct KVQuantDeviceKeyParams {
  const float* offset = nullptr;      ///< [head_dim], device memory
  const float* half_range = nullptr;  ///< [head_dim], device memory
  float levels[16] = {};
  std::uint32_t outlier_capacity = 0;
  quant::nuq::NearestLevel rounding;
};
struct KVQuantDeviceValueParams {
  float levels[16] = {};
  std::uint32_t outlier_capacity = 0;
  quant::nuq::NearestLevel rounding;
  index_t candidates_per_side = 0;  ///< each token's largest and smallest elements that may be exact
};

/// The parameters the device kernels take for a codec: its own, unless they point into host memory.
template <class Codec>
struct DeviceParams {
  using type = typename Codec::params_type;
};
template <int Bits>
struct DeviceParams<quant::KVQuantKeyCodec<Bits>> {
  using type = KVQuantDeviceKeyParams;
};
template <int Bits>
struct DeviceParams<quant::KVQuantValueCodec<Bits>> {
  using type = KVQuantDeviceValueParams;
};
template <class Codec>
using device_params_t = typename DeviceParams<Codec>::type;

/// The device form of a KVQuant key page's parameters, with `offset` and `half_range` where the
/// caller put copies of the host's per-channel arrays (the host arrays themselves on the host).
inline KVQuantDeviceKeyParams to_device_params(const quant::KVQuantKeyParams& host, quant::PageGeometry g,
                                               const float* offset, const float* half_range) noexcept {
  KVQuantDeviceKeyParams out;
  out.offset = offset;
  out.half_range = half_range;
  std::copy(host.codebook->levels.begin(), host.codebook->levels.end(), out.levels);
  out.outlier_capacity = static_cast<std::uint32_t>(quant::kvquant_detail::outlier_capacity(host.outlier_fraction, g));
  out.rounding = quant::nuq::NearestLevel(host.rounding());
  return out;
}
inline KVQuantDeviceValueParams to_device_params(const quant::KVQuantValueParams& host, quant::PageGeometry g) noexcept {
  KVQuantDeviceValueParams out;
  std::copy(host.codebook->levels.begin(), host.codebook->levels.end(), out.levels);
  out.outlier_capacity = static_cast<std::uint32_t>(quant::kvquant_detail::outlier_capacity(host.outlier_fraction, g));
  out.rounding = quant::nuq::NearestLevel(host.rounding());
  out.candidates_per_side = quant::kvquant_detail::candidates_per_side(host.outlier_fraction, g.head_dim);
  return out;
}

namespace decode_detail {

/// Element `index` (t·head_dim + c) of a page from its KVQuant outlier section, if stored there:
/// a binary search of the ascending indices (`count`, then `u16 index[capacity]`, then `fp16
/// value[capacity]`). With the same index twice (only a corrupt page), the last one wins, as
/// in the scalar decode, which writes them in order.
KVPACK_HOST_DEVICE bool nuq_outlier(const std::byte* section, std::uint32_t capacity, std::uint32_t index,
                                    float& exact) noexcept {
  const std::uint32_t stored = load<std::uint16_t>(section);
  const std::uint32_t count = stored < capacity ? stored : capacity;
  // The first entry above `index`: the one before it, if equal, is the last equal.
  std::uint32_t lo = 0, hi = count;
  while (lo < hi) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (load<std::uint16_t>(section + 2 + 2 * mid) <= index) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0 || load<std::uint16_t>(section + 2 + 2 * (lo - 1)) != index) return false;
  exact = half_to_float(load<std::uint16_t>(section + 2 + 2 * static_cast<std::size_t>(capacity) + 2 * (lo - 1)));
  return true;
}

}  // namespace decode_detail

/// KVQuant keys: channel c's codes are row c, decoded with the channel's calibrated range.
template <int Bits>
struct ElementDecoder<quant::KVQuantKeyCodec<Bits>> {
  static constexpr bool kSupported = true;
  using Codec = quant::KVQuantKeyCodec<Bits>;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, const KVQuantDeviceKeyParams& p,
                                     index_t t, index_t c) noexcept {
    float exact;
    const auto index = static_cast<std::uint32_t>(t * g.head_dim + c);
    if (decode_detail::nuq_outlier(plane + Codec::outliers_offset(g), p.outlier_capacity, index, exact)) return exact;
    const float level = p.levels[quant::kvquant_detail::get_code<Bits>(plane + Codec::row_bytes(g) * c, t)];
    return level * p.half_range[c] + p.offset[c];
  }
};

/// KVQuant values: token t's codes are row t, decoded with the token's fp16 range.
template <int Bits>
struct ElementDecoder<quant::KVQuantValueCodec<Bits>> {
  static constexpr bool kSupported = true;
  using Codec = quant::KVQuantValueCodec<Bits>;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry g, const KVQuantDeviceValueParams& p,
                                     index_t t, index_t c) noexcept {
    float exact;
    const auto index = static_cast<std::uint32_t>(t * g.head_dim + c);
    if (decode_detail::nuq_outlier(plane + Codec::outliers_offset(g), p.outlier_capacity, index, exact)) return exact;
    const float offset = decode_detail::half_to_float(
        decode_detail::load<std::uint16_t>(plane + Codec::offsets_offset(g) + 2 * static_cast<std::size_t>(t)));
    const float half_range = decode_detail::half_to_float(
        decode_detail::load<std::uint16_t>(plane + Codec::ranges_offset(g) + 2 * static_cast<std::size_t>(t)));
    const float level = p.levels[quant::kvquant_detail::get_code<Bits>(plane + Codec::row_bytes(g) * t, c)];
    return level * half_range + offset;
  }
};

/// TurboQuant-MSE's parameters as the device reads them: the layer's two codebooks and code
/// widths by value, where the norms lie, and the device address of a d×d matrix M (row-major)
/// that the kernels apply as y = Mᵀx: Rᵀ on a key plane (the query into the rotated space), R on
/// a value plane (the sums back out of it).
struct TurboDeviceParams {
  const float* transform = nullptr;  ///< M, [head_dim][head_dim], device memory
  float centroids[2][16] = {};       ///< the high and low channels' levels
  // What the encoder (turbo_encode.hpp) needs besides: R as the host applies it, and the codes'
  // boundaries.
  const float* rotation = nullptr;  ///< R's signs [head_dim] (Hadamard) or Q [head_dim][head_dim], device memory
  std::uint32_t hadamard = 0;       ///< whether `rotation` holds signs
  float boundaries[2][16] = {};     ///< the high and low channels' midpoints
  std::uint32_t high_channels = 0;
  std::uint32_t high_bits = 0;
  std::uint32_t low_bits = 0;
  std::uint32_t row_bytes = 0;
  std::uint32_t norms_offset = 0;
};
template <Plane P>
struct DeviceParams<quant::TurboCodec<quant::TurboVariant::kMse, P>> {
  using type = TurboDeviceParams;
};

/// The device form of a TurboQuant-MSE plane's parameters, with M at `transform` and R's signs
/// or matrix (turbo_rotation_table) at `rotation`. The layer's tables must exist (a page encoded,
/// or the codec's `prepare` called, as KVCache does).
inline TurboDeviceParams to_device_params(const quant::turbo_detail::Params& host, quant::PageGeometry g,
                                          const float* transform, const float* rotation = nullptr) {
  const quant::turbo_detail::LayerTables* tables =
      host.store != nullptr ? host.store->find(g.head_dim, host.layer) : nullptr;
  KVPACK_CHECK(tables != nullptr, kInvalidArgument,
               ::kvpack::detail::message("TurboQuant's tables for head_dim ", g.head_dim, ", layer ", host.layer,
                                         " are not built: encode a page or call the codec's prepare first"));
  const quant::turbo_detail::LayerView& v = tables->view;
  TurboDeviceParams out;
  out.transform = transform;
  std::copy(v.high_centroids, v.high_centroids + 16, out.centroids[0]);
  std::copy(v.low_centroids, v.low_centroids + 16, out.centroids[1]);
  out.rotation = rotation;
  out.hadamard = v.rotation.kind == quant::RotationKind::kHadamard ? 1u : 0u;
  std::copy(v.high_boundaries, v.high_boundaries + 16, out.boundaries[0]);
  std::copy(v.low_boundaries, v.low_boundaries + 16, out.boundaries[1]);
  out.high_channels = static_cast<std::uint32_t>(v.high_channels);
  out.high_bits = static_cast<std::uint32_t>(v.high_bits);
  out.low_bits = static_cast<std::uint32_t>(v.low_bits);
  out.row_bytes = static_cast<std::uint32_t>(v.row_bytes());
  out.norms_offset = static_cast<std::uint32_t>(v.norms_offset(g.page_size));
  return out;
}

/// The matrix M of TurboDeviceParams for a plane, row-major: the kernels form y = Mᵀx, so M's
/// row j is R e_j on a key plane (M = Rᵀ: y = R q) and Rᵀ e_j on a value plane (M = R: y = Rᵀ s).
/// Built with the host's rotation (double inside, each entry rounded to float once).
inline std::vector<float> turbo_transform(const quant::RotationView& rotation, index_t d, Plane plane) {
  std::vector<float> matrix(static_cast<std::size_t>(d) * d);
  std::vector<float> unit(static_cast<std::size_t>(d), 0.0f);
  for (index_t j = 0; j < d; ++j) {
    unit[static_cast<std::size_t>(j)] = 1.0f;
    float* row = matrix.data() + static_cast<std::size_t>(j) * d;
    if (plane == Plane::kKey) {
      quant::rotate(rotation, unit.data(), row);
    } else {
      quant::unrotate(rotation, unit.data(), row);
    }
    unit[static_cast<std::size_t>(j)] = 0.0f;
  }
  return matrix;
}

/// What TurboDeviceParams::rotation holds: R's signs (Hadamard) or its matrix Q (dense), as the
/// host's rotation stores them.
inline std::vector<float> turbo_rotation_table(const quant::RotationView& rotation) {
  const std::size_t d = static_cast<std::size_t>(rotation.dim);
  return rotation.kind == quant::RotationKind::kHadamard ? std::vector<float>(rotation.signs, rotation.signs + d)
                                                         : std::vector<float>(rotation.matrix, rotation.matrix + d * d);
}

/// TurboQuant-MSE: channel c of token t's rotated row, n_t·C(code_tc), high channels first in
/// the row's bits (least significant first; a 3-bit code may span two bytes).
template <Plane P>
struct ElementDecoder<quant::TurboCodec<quant::TurboVariant::kMse, P>> {
  static constexpr bool kSupported = true;
  static constexpr bool kRotatedSpace = true;
  KVPACK_HOST_DEVICE static float at(const std::byte* plane, quant::PageGeometry, const TurboDeviceParams& p,
                                     index_t t, index_t c) noexcept {
    const auto channel = static_cast<std::uint32_t>(c);
    const bool high = channel < p.high_channels;
    const std::uint32_t bits = high ? p.high_bits : p.low_bits;
    const std::uint32_t bit =
        high ? channel * p.high_bits : p.high_channels * p.high_bits + (channel - p.high_channels) * p.low_bits;
    const std::byte* row = plane + static_cast<std::size_t>(p.row_bytes) * t;
    unsigned word = static_cast<unsigned>(row[bit / 8]);
    if (bit % 8 + bits > 8) word |= static_cast<unsigned>(row[bit / 8 + 1]) << 8;
    const unsigned code = (word >> (bit % 8)) & ((1u << bits) - 1u);
    const float norm = decode_detail::half_to_float(
        decode_detail::load<std::uint16_t>(plane + p.norms_offset + 2 * static_cast<std::size_t>(t)));
    return p.centroids[high ? 0 : 1][code] * norm;
  }
};

/// Whether a decoder's elements are those of a rotated row (see the file comment).
template <class Decoder>
inline constexpr bool rotated_space = requires { Decoder::kRotatedSpace; };

/// Tokens t and t + 1 (t even) of key channel c.
template <class Decoder, class Params>
KVPACK_HOST_DEVICE ElementPair token_pair(const std::byte* plane, quant::PageGeometry g, const Params& params, index_t t,
                                          index_t c) noexcept {
  if constexpr (requires { Decoder::token_pair(plane, g, params, t, c); }) {
    return Decoder::token_pair(plane, g, params, t, c);
  } else {
    return {Decoder::at(plane, g, params, t, c), Decoder::at(plane, g, params, t + 1, c)};
  }
}

/// Channels c and c + 1 (c even) of value token t.
template <class Decoder, class Params>
KVPACK_HOST_DEVICE ElementPair channel_pair(const std::byte* plane, quant::PageGeometry g, const Params& params,
                                            index_t t, index_t c) noexcept {
  if constexpr (requires { Decoder::channel_pair(plane, g, params, t, c); }) {
    return Decoder::channel_pair(plane, g, params, t, c);
  } else {
    return {Decoder::at(plane, g, params, t, c), Decoder::at(plane, g, params, t, c + 1)};
  }
}

}  // namespace kvpack::inline v0::kernels::cuda
