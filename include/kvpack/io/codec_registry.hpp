#pragma once
/// \file codec_registry.hpp
/// \brief The codecs page files cover, by name: how their parameters are stored and checked, and
///        their plane sizes, so that a reader holding only bytes can tell a codec it knows from
///        one it does not, and check a file's payload sizes against its shape.
///
/// Covered: f32/f16/bf16, FP8 (e4m3fn, e5m2), int8, q8_0, q4_0, KIVI (2/4 bits, groups 32/64/128,
/// per-channel and per-token keys), KVQuant (2/3/4 bits), TurboQuant (MSE and Prod planes, any
/// rate), QJL keys, and any Mixed of them. A codec whose plane size depends on its options
/// (KVQuant's outlier fraction, TurboQuant's rate) reads them from the first PARM record.

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>

#include "kvpack/io/page_file_format.hpp"
#include "kvpack/io/params_format.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::io {

/// The group size a codec records beside its name (KIVI's names leave it out), 0 if none.
template <class Codec>
constexpr std::uint32_t codec_group() noexcept {
  if constexpr (requires { Codec::kGroup; }) {
    return static_cast<std::uint32_t>(Codec::kGroup);
  } else {
    return 0;
  }
}

/// One codec this build reads from page files. `record` is a PARM record of the codec (the
/// first stream's: plane sizes depend only on its codec prefix).
struct CodecEntry {
  std::string_view name;
  Plane plane;
  std::uint32_t group;
  ParamsKind params;
  std::size_t codec_prefix;  ///< leading bytes of a record that every stream's record shares
  std::size_t (*params_bytes)(quant::PageGeometry);
  /// Throws kInvalidArgument naming what is wrong with one record's values.
  void (*check_params)(std::span<const std::byte> record, quant::PageGeometry, std::string_view what);
  /// Throws kvpack::Error when the codec cannot store this geometry (e.g. q8_0 at head_dim 48).
  void (*validate)(quant::PageGeometry, std::span<const std::byte> record);
  std::size_t (*plane_bytes)(quant::PageGeometry, std::span<const std::byte> record);
};

namespace registry_detail {

template <class Codec>
constexpr CodecEntry entry() {
  using Format = ParamsFormat<Codec>;
  return {Codec::kName,        Codec::kPlane,     codec_group<Codec>(), Format::kKind, Format::kCodecPrefix,
          &Format::bytes,      &Format::check,    &Format::validate,    &Format::plane_bytes};
}

template <class Q>
constexpr std::array<CodecEntry, 2> both() {
  return {entry<typename Q::key_codec>(), entry<typename Q::value_codec>()};
}

template <int Bits, int Group>
constexpr std::array<CodecEntry, 3> kivi() {
  return {entry<quant::KiviKeyCodec<Bits, Group>>(), entry<quant::KiviValueCodec<Bits, Group>>(),
          entry<quant::KiviTokenCodec<Bits, Group, Plane::kKey>>()};
}

template <std::size_t... N>
constexpr auto join(const std::array<CodecEntry, N>&... parts) {
  std::array<CodecEntry, (N + ...)> all{};
  std::size_t at = 0;
  ((std::copy(parts.begin(), parts.end(), all.begin() + at), at += N), ...);
  return all;
}

}  // namespace registry_detail

/// Every codec page files cover.
inline const auto& known_codecs() {
  using namespace registry_detail;
  static const auto all = join(both<quant::Float<float>>(), both<quant::Float<half>>(), both<quant::Float<bfloat16>>(),
                               both<quant::FP8<quant::E4M3FN>>(), both<quant::FP8<quant::E5M2>>(), both<quant::Int8>(),
                               both<quant::Q8_0>(), both<quant::Q4_0>(), kivi<2, 32>(), kivi<2, 64>(), kivi<2, 128>(),
                               kivi<4, 32>(), kivi<4, 64>(), kivi<4, 128>(), both<quant::KVQuant<2>>(),
                               both<quant::KVQuant<3>>(), both<quant::KVQuant<4>>(), both<quant::TurboQuant<8>>(),
                               both<quant::TurboQuant<8, quant::TurboVariant::kProd, quant::TurboVariant::kProd>>(),
                               std::array{entry<quant::QjlKeyCodec>()});
  return all;
}

/// The entry for (name, plane, group), or nullptr when this build does not read that codec.
inline const CodecEntry* find_codec(std::string_view name, Plane plane, std::uint32_t group) {
  for (const CodecEntry& e : known_codecs()) {
    if (e.name == name && e.plane == plane && e.group == group) return &e;
  }
  return nullptr;
}

}  // namespace kvpack::inline v0::io
