#pragma once
/// \file params_format.hpp
/// \brief How each codec's per-(layer, stream) parameters are stored in a page file's PARM
///        section: the record's bytes, how they are checked, and what they say about the planes.
///
/// Two families. *Value* parameters (none, FP8's scale) are the whole story: read() turns a
/// record back into params_type. *Table* parameters (KVQuant's calibration, TurboQuant's and
/// QJL's seeded rotations and sketches) are pointers into tables the codec object owns; their
/// records hold the values those pointers reach (ranges and codebooks; options and seeds), so a
/// file can rebuild the codec (page_file_quantizer.hpp) and a loader can check that a cache's
/// codec is the file's by comparing records byte for byte.
///
/// Every record starts with `kCodecPrefix` bytes that describe the codec rather than the stream
/// (KVQuant's outlier fraction, TurboQuant's rate and rotation): equal in every record, and the
/// only part the plane sizes depend on.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

#include "kvpack/error.hpp"
#include "kvpack/io/page_file_format.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace kvpack::inline v0::io {

namespace params_detail {

template <class T>
T load(std::span<const std::byte> record, std::size_t at) noexcept {
  T value;
  std::memcpy(&value, record.data() + at, sizeof(T));
  return value;
}
template <class T>
void store(std::byte* out, std::size_t at, T value) noexcept {
  std::memcpy(out + at, &value, sizeof(T));
}

inline void require(bool ok, std::string_view what, std::string_view codec, const char* problem) {
  KVPACK_CHECK(ok, kInvalidArgument, detail::message(what, ": PARM holds ", codec, " parameters with ", problem));
}

/// A nuq codebook's record: u32 levels used, then 16 f32 levels (unused ones zero).
inline constexpr std::size_t kCodebookBytes = 4 + 4 * 16;

inline void write_codebook(std::byte* out, const quant::nuq::Codebook* book) noexcept {
  std::fill(out, out + kCodebookBytes, std::byte{0});
  if (book == nullptr) return;
  store<std::uint32_t>(out, 0, static_cast<std::uint32_t>(book->size));
  for (int i = 0; i < book->size; ++i) store<float>(out, 4 + 4 * static_cast<std::size_t>(i), book->levels[i]);
}
inline quant::nuq::Codebook read_codebook(std::span<const std::byte> record, std::size_t at) noexcept {
  quant::nuq::Codebook book;
  book.size = static_cast<int>(load<std::uint32_t>(record, at));
  for (int i = 0; i < 16; ++i) book.levels[i] = load<float>(record, at + 4 + 4 * static_cast<std::size_t>(i));
  return book;
}
/// Bounds on what KVQuant tables may decode to: far beyond any calibration (the codec's inputs
/// are limited to ±32752, and normalised levels lie near [−1, 1]), tight enough that decoded
/// keys stay below ~4·10^6 and attention scores over them finite.
inline constexpr float kMaxLevel = 64.0f;
inline constexpr float kMaxRange = 65504.0f;

/// `levels` finite levels within ±kMaxLevel, unused ones zero; `sorted` for a codebook elements
/// are rounded to (nearest-level rounding assumes it).
inline void check_codebook(std::span<const std::byte> record, std::size_t at, int levels, bool sorted,
                           std::string_view what, std::string_view codec) {
  const quant::nuq::Codebook book = read_codebook(record, at);
  require(book.size == levels, what, codec, "a codebook of another size than 2^bits");
  for (int i = 0; i < 16; ++i) {
    const bool ok = i < levels ? std::fabs(book.levels[i]) <= kMaxLevel
                               : book.levels[i] == 0.0f && !std::signbit(book.levels[i]);
    require(ok, what, codec, "a codebook level that is not finite within ±64, or a non-zero unused one");
    if (sorted && i > 0 && i < levels) require(book.levels[i - 1] <= book.levels[i], what, codec, "unsorted levels");
  }
}

}  // namespace params_detail

/// Unspecialised: parameters page files cannot hold.
template <class Codec, class Params = typename Codec::params_type>
struct ParamsFormat {
  static constexpr bool kSupported = false;
};

/// Shared by codecs without parameters and by value parameters: the plane sizes come from the
/// codec type alone.
template <class Codec>
struct ValueParamsFormat {
  static constexpr bool kSupported = true;
  static constexpr bool kReadable = true;
  static constexpr std::size_t kCodecPrefix = 0;
  static void validate(quant::PageGeometry g, std::span<const std::byte>) { Codec{}.validate(g); }
  static std::size_t plane_bytes(quant::PageGeometry g, std::span<const std::byte>) { return Codec{}.plane_bytes(g); }
};

template <class Codec>
struct ParamsFormat<Codec, quant::NoParams> : ValueParamsFormat<Codec> {
  static constexpr ParamsKind kKind = ParamsKind::kNone;
  static std::size_t bytes(quant::PageGeometry) noexcept { return 0; }
  static void write(const Codec&, const quant::NoParams&, quant::PageGeometry, std::byte*) noexcept {}
  static quant::NoParams read(std::span<const std::byte>) noexcept { return {}; }
  static void check(std::span<const std::byte>, quant::PageGeometry, std::string_view) noexcept {}
};

template <class Codec>
struct ParamsFormat<Codec, quant::FP8Params> : ValueParamsFormat<Codec> {
  static constexpr ParamsKind kKind = ParamsKind::kFP8Scale;
  static std::size_t bytes(quant::PageGeometry) noexcept { return sizeof(float); }
  static void write(const Codec&, const quant::FP8Params& p, quant::PageGeometry, std::byte* out) noexcept {
    params_detail::store<float>(out, 0, p.scale);
  }
  static quant::FP8Params read(std::span<const std::byte> record) noexcept {
    quant::FP8Params p;
    p.scale = params_detail::load<float>(record, 0);
    return p;
  }
  /// A scale the codec divides by: zero or non-finite would turn every decoded value into Inf/NaN.
  static void check(std::span<const std::byte> record, quant::PageGeometry, std::string_view what) {
    const float scale = params_detail::load<float>(record, 0);
    KVPACK_CHECK(std::isfinite(scale) && scale > 0.0f, kInvalidArgument,
                 detail::message(what, ": PARM holds an FP8 scale of ", scale, "; scales are finite and > 0"));
  }
};

/// KVQuant's planes: f64 outlier fraction (the codec prefix), the rounding codebook's Q-Norm
/// flag (u32 0/1), u32 zero, the decoded codebook, the rounding codebook (zeros without Q-Norm);
/// keys add f32 offset[d] and f32 half_range[d] of their (layer, KV head).
template <class Codec>
struct KVQuantParamsFormat {
  static constexpr bool kSupported = true;
  static constexpr bool kReadable = false;
  static constexpr bool kKeys = Codec::kPlane == Plane::kKey;
  static constexpr ParamsKind kKind = kKeys ? ParamsKind::kKVQuantKey : ParamsKind::kKVQuantValue;
  static constexpr std::size_t kCodecPrefix = 8;
  static constexpr std::size_t kCodebooks = 16;
  static constexpr std::size_t kRanges = kCodebooks + 2 * params_detail::kCodebookBytes;

  static std::size_t bytes(quant::PageGeometry g) noexcept {
    return kRanges + (kKeys ? 8 * static_cast<std::size_t>(g.head_dim) : 0);
  }
  static double outlier_fraction(std::span<const std::byte> record) noexcept {
    return params_detail::load<double>(record, 0);
  }
  static Codec codec_of(std::span<const std::byte> record) {
    Codec codec;
    codec.outlier_fraction = outlier_fraction(record);
    return codec;
  }
  static void validate(quant::PageGeometry g, std::span<const std::byte> record) {
    Codec::validate_geometry(g, outlier_fraction(record));
  }
  static std::size_t plane_bytes(quant::PageGeometry g, std::span<const std::byte> record) {
    return codec_of(record).plane_bytes(g);
  }
  static void write(const Codec&, const typename Codec::params_type& p, quant::PageGeometry g, std::byte* out) {
    using namespace params_detail;
    std::fill(out, out + bytes(g), std::byte{0});
    store<double>(out, 0, p.outlier_fraction);
    store<std::uint32_t>(out, 8, p.encode_codebook != nullptr ? 1u : 0u);
    write_codebook(out + kCodebooks, p.codebook);
    write_codebook(out + kCodebooks + kCodebookBytes, p.encode_codebook);
    if constexpr (kKeys) {
      const std::size_t d = static_cast<std::size_t>(g.head_dim);
      std::memcpy(out + kRanges, p.offset, d * sizeof(float));
      std::memcpy(out + kRanges + 4 * d, p.half_range, d * sizeof(float));
    }
  }
  static void check(std::span<const std::byte> record, quant::PageGeometry g, std::string_view what) {
    using namespace params_detail;
    const std::string_view name = Codec::kName;
    const double fraction = outlier_fraction(record);
    require(fraction >= 0.0 && fraction <= 0.05, what, name, "an outlier fraction outside [0, 0.05]");
    const auto q_norm = load<std::uint32_t>(record, 8);
    require(q_norm <= 1 && load<std::uint32_t>(record, 12) == 0, what, name, "a Q-Norm flag other than 0 or 1");
    const int levels = 1 << Codec::kBits;
    check_codebook(record, kCodebooks, levels, q_norm == 0, what, name);
    check_codebook(record, kCodebooks + kCodebookBytes, q_norm == 1 ? levels : 0, true, what, name);
    if constexpr (kKeys) {
      const std::size_t d = static_cast<std::size_t>(g.head_dim);
      for (std::size_t c = 0; c < d; ++c) {
        const float offset = load<float>(record, kRanges + 4 * c);
        const float half_range = load<float>(record, kRanges + 4 * (d + c));
        require(std::fabs(offset) <= kMaxRange && half_range > 0.0f && half_range <= kMaxRange, what, name,
                "a key range outside fp16's (offsets within ±65504, half-ranges in (0, 65504])");
      }
    }
  }
};

template <class Codec>
struct ParamsFormat<Codec, quant::KVQuantKeyParams> : KVQuantParamsFormat<Codec> {};
template <class Codec>
struct ParamsFormat<Codec, quant::KVQuantValueParams> : KVQuantParamsFormat<Codec> {};

/// TurboQuant's planes: the codec prefix (u32 rotation kind, i32 high bits, i32 low bits, u32
/// zero, f64 share of high-bit channels, u64 base seed), then the stream's u32 model layer, u32
/// zero and u64 seed (derive_seed(base seed, layer): the rotation and sketch are rebuilt from it).
/// QJL's key plane: prefix u32 requested sketch rows (0: 2·head_dim), u32 zero, u64 base seed;
/// then the same layer and seed.
template <class Codec>
struct ParamsFormat<Codec, quant::turbo_detail::Params> {
  static constexpr bool kSupported = true;
  static constexpr bool kReadable = false;
  static constexpr bool kQjl = std::is_same_v<Codec, quant::QjlKeyCodec>;
  static constexpr ParamsKind kKind = kQjl ? ParamsKind::kQjl : ParamsKind::kTurbo;
  static constexpr std::size_t kCodecPrefix = kQjl ? 16 : 32;

  static std::size_t bytes(quant::PageGeometry) noexcept { return kCodecPrefix + 16; }
  static std::uint64_t base_seed(std::span<const std::byte> record) noexcept {
    return params_detail::load<std::uint64_t>(record, kCodecPrefix - 8);
  }
  static Codec codec_of(std::span<const std::byte> record) {
    using params_detail::load;
    if constexpr (kQjl) {
      return Codec(static_cast<index_t>(load<std::uint32_t>(record, 0)), base_seed(record));
    } else {
      quant::TurboOptions options;
      options.rotation = static_cast<quant::RotationKind>(load<std::uint32_t>(record, 0));
      options.rate = {load<std::int32_t>(record, 4), load<std::int32_t>(record, 8), load<double>(record, 16)};
      options.seed = base_seed(record);
      return Codec(options);
    }
  }
  static void validate(quant::PageGeometry g, std::span<const std::byte> record) { codec_of(record).validate(g); }
  static std::size_t plane_bytes(quant::PageGeometry g, std::span<const std::byte> record) {
    return codec_of(record).plane_bytes(g);
  }
  static void write(const Codec& codec, const quant::turbo_detail::Params& p, quant::PageGeometry g, std::byte* out) {
    using params_detail::store;
    std::fill(out, out + bytes(g), std::byte{0});
    if constexpr (kQjl) {
      store<std::uint32_t>(out, 0, static_cast<std::uint32_t>(codec.requested_rows()));
      store<std::uint64_t>(out, 8, codec.seed());
    } else {
      const quant::TurboOptions& options = codec.options();
      store<std::uint32_t>(out, 0, static_cast<std::uint32_t>(options.rotation));
      store<std::int32_t>(out, 4, options.rate.high_bits);
      store<std::int32_t>(out, 8, options.rate.low_bits);
      store<double>(out, 16, options.rate.high_fraction);
      store<std::uint64_t>(out, 24, options.seed);
    }
    store<std::uint32_t>(out, kCodecPrefix, p.layer);
    store<std::uint64_t>(out, kCodecPrefix + 8, p.seed);
  }
  /// What validate() leaves: a known rotation kind, zero padding, and a seed that is the layer's.
  static void check(std::span<const std::byte> record, quant::PageGeometry g, std::string_view what) {
    using namespace params_detail;
    const std::string_view name = Codec::kName;
    if constexpr (kQjl) {
      require(load<std::uint32_t>(record, 4) == 0, what, name, "non-zero padding");
      require(load<std::uint32_t>(record, 0) <= 2 * static_cast<std::uint32_t>(g.head_dim), what, name,
              "more sketch rows than 2 x head_dim");
    } else {
      require(load<std::uint32_t>(record, 0) <= static_cast<std::uint32_t>(quant::RotationKind::kDense) &&
                load<std::uint32_t>(record, 12) == 0,
            what, name, "an unknown rotation kind or non-zero padding");
      require(std::isfinite(load<double>(record, 16)), what, name, "a non-finite share of high-bit channels");
    }
    const auto layer = load<std::uint32_t>(record, kCodecPrefix);
    require(load<std::uint32_t>(record, kCodecPrefix + 4) == 0 &&
              load<std::uint64_t>(record, kCodecPrefix + 8) == quant::derive_seed(base_seed(record), layer),
          what, name, "a seed that is not the layer's");
  }
};

/// Whether page files can carry a codec type (its parameters serialise).
template <class Codec>
inline constexpr bool kPageFileCodec = ParamsFormat<Codec>::kSupported;

}  // namespace kvpack::inline v0::io
