#pragma once
/// \file codec_registry.hpp
/// \brief The codecs page files cover, by name: how their parameters are stored, and their plane
///        sizes, so that a reader holding only bytes can tell a codec it knows from one it does
///        not, and check a file's payload sizes against its shape.
///
/// Covered: f32/f16/bf16, FP8 (e4m3fn, e5m2), int8, q8_0, q4_0, KIVI (2/4 bits, groups 32/64/128,
/// per-channel and per-token keys) and any Mixed of them. Not covered: KVQuant (its parameters
/// point into calibration tables: offsets, ranges, codebooks) and TurboQuant/QJL (rotations and
/// sketches rebuilt from a seed by a table store); the writer rejects them with kUnsupported.

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>

#include "kvpack/io/page_file_format.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"

namespace kvpack::inline v0::io {

/// How a codec's params_type goes to and from PARM; unspecialised: not serialisable.
template <class Params>
struct ParamsFormat {
  static constexpr bool kSupported = false;
};
template <>
struct ParamsFormat<quant::NoParams> {
  static constexpr bool kSupported = true;
  static constexpr ParamsKind kKind = ParamsKind::kNone;
  static constexpr std::size_t kBytes = 0;
  static void write(const quant::NoParams&, std::byte*) noexcept {}
  static quant::NoParams read(const std::byte*) noexcept { return {}; }
};
template <>
struct ParamsFormat<quant::FP8Params> {
  static constexpr bool kSupported = true;
  static constexpr ParamsKind kKind = ParamsKind::kFP8Scale;
  static constexpr std::size_t kBytes = sizeof(float);
  static void write(const quant::FP8Params& p, std::byte* out) noexcept { std::memcpy(out, &p.scale, sizeof(float)); }
  static quant::FP8Params read(const std::byte* in) noexcept {
    quant::FP8Params p;
    std::memcpy(&p.scale, in, sizeof(float));
    return p;
  }
};

/// The group size a codec records beside its name (KIVI's names leave it out), 0 if none.
template <class Codec>
constexpr std::uint32_t codec_group() noexcept {
  if constexpr (requires { Codec::kGroup; }) {
    return static_cast<std::uint32_t>(Codec::kGroup);
  } else {
    return 0;
  }
}

/// One codec this build reads from page files.
struct CodecEntry {
  std::string_view name;
  Plane plane;
  std::uint32_t group;
  ParamsKind params;
  std::size_t params_bytes;
  /// Throws kvpack::Error when the codec cannot store this geometry (e.g. q8_0 at head_dim 48).
  void (*validate)(quant::PageGeometry);
  std::size_t (*plane_bytes)(quant::PageGeometry);
};

namespace registry_detail {

template <class Codec>
constexpr CodecEntry entry() {
  return {Codec::kName, Codec::kPlane, codec_group<Codec>(), ParamsFormat<typename Codec::params_type>::kKind,
          ParamsFormat<typename Codec::params_type>::kBytes,
          [](quant::PageGeometry g) { Codec{}.validate(g); },
          [](quant::PageGeometry g) { return Codec{}.plane_bytes(g); }};
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
                               kivi<4, 32>(), kivi<4, 64>(), kivi<4, 128>());
  return all;
}

/// The entry for (name, plane, group), or nullptr when this build does not read that codec.
inline const CodecEntry* find_codec(std::string_view name, Plane plane, std::uint32_t group) {
  for (const CodecEntry& e : known_codecs()) {
    if (e.name == name && e.plane == plane && e.group == group) return &e;
  }
  return nullptr;
}

/// Whether page files can carry a codec type (its parameters serialise).
template <class Codec>
inline constexpr bool kPageFileCodec = ParamsFormat<typename Codec::params_type>::kSupported;

}  // namespace kvpack::inline v0::io
