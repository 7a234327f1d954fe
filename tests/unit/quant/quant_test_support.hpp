#pragma once
/// \file quant_test_support.hpp
/// \brief Shared helpers of the quant tests: page data families, an independent binary16
///        encoder/decoder, failure counting, and the generic encode -> decode harness.
///
/// Nothing here calls the code under test except through the Codec interface, so expected values
/// derived with these helpers stay independent of the headers being tested.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "kvpack/quant/tile_layout.hpp"

namespace kvpack_test::quant {

using kvpack::index_t;
using kvpack::Plane;
using kvpack::quant::PageGeometry;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

/// The geometries every codec is run over: page_size {16, 32, 64} x head_dim {32, 64, 128}.
inline std::vector<PageGeometry> standard_geometries() {
  std::vector<PageGeometry> out;
  for (index_t p : {16, 32, 64}) {
    for (index_t d : {32, 64, 128}) out.push_back({p, d});
  }
  return out;
}

/// Byte of the 8-bit code of (t, c), from the documented pair tiles of the codec's plane.
template <class Codec>
std::size_t code_offset(PageGeometry g, index_t t, index_t c) {
  return Codec::kPlane == Plane::kKey ? kvpack::quant::tile::key_byte(g, t, c)
                                      : kvpack::quant::tile::value_byte(g, t, c);
}

inline std::string describe(PageGeometry g) {
  return "page_size=" + std::to_string(g.page_size) + " head_dim=" + std::to_string(g.head_dim);
}

inline std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%04X", v);
  return buf;
}

inline std::string fmt(double v) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

/// Counts failures inside big loops and keeps the first few messages: one CHECK per loop keeps
/// Catch2's per-assertion cost out of the inner loops.
struct Mismatches {
  std::size_t count = 0;
  std::vector<std::string> first;

  void add(std::string message) {
    if (first.size() < 8) first.push_back(std::move(message));
    ++count;
  }
};

inline void report(const Mismatches& m) {
  for (const std::string& s : m.first) UNSCOPED_INFO(s);
  CHECK(m.count == 0);
}

// ---------------------------------------------------------------------------------------------
// Independent IEEE binary16 (round to nearest even), written from the format definition with
// frexp/ldexp/nearbyint in double. Used as the oracle for every stored fp16 scale.
// ---------------------------------------------------------------------------------------------

/// float -> binary16 bits for finite x; overflow past the rounding midpoint gives inf.
inline std::uint16_t ref_fp16_bits(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return sign;
  int e = 0;
  (void)std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  int exponent = e - 1;
  if (exponent < -14) {
    // Subnormal range: a whole number of units 2^-24 (1024 units is the smallest normal).
    const double units = std::nearbyint(std::ldexp(a, 24));
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(units));
  }
  double mant = std::nearbyint(std::ldexp(a, 10 - exponent));  // in [1024, 2048]
  if (mant == 2048.0) {
    mant = 1024.0;
    ++exponent;
  }
  if (exponent > 15) return static_cast<std::uint16_t>(sign | 0x7C00u);
  return static_cast<std::uint16_t>(sign | ((exponent + 15) << 10) |
                                    (static_cast<int>(mant) - 1024));
}

/// binary16 bits -> value, for finite codes.
inline double ref_fp16_value(std::uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1F;
  const int mant = bits & 0x3FF;
  const double magnitude = exponent == 0 ? std::ldexp(mant, -24)
                                         : std::ldexp(1024 + mant, exponent - 25);
  return (bits & 0x8000u) != 0 ? -magnitude : magnitude;
}

// ---------------------------------------------------------------------------------------------
// Error budgets (STYLE.md §8), each from the definition of the format.
// ---------------------------------------------------------------------------------------------

inline constexpr double kFp16RelErr = 0x1p-11;            ///< half an ulp of an 11-bit significand
inline constexpr double kFp16HalfMinSubnormal = 0x1p-25;  ///< half of fp16's smallest subnormal 2^-24
/// fp32 rounding of x * (1/s) and of the scale itself, in units of the code step. The codes are
/// at most 127 in magnitude, so these roundings stay below 127 * 3 * 2^-24 < 3e-5 of a step.
inline constexpr double kCodeRoundingSlack = 1e-4;
inline constexpr double kInt8MaxCode = 127.0;  ///< int8 / q8_0: codes in [-127, 127]
inline constexpr double kQ4MaxOffset = 8.0;    ///< q4_0: |q - 8| <= 8

/// Largest error of storing a scale s as binary16: half an ulp (2^-11 relative) in the normal
/// range, half the smallest subnormal (2^-25) below it.
inline double fp16_store_error_bound(double s) {
  return std::max(std::fabs(s) * kFp16RelErr, kFp16HalfMinSubnormal);
}

/// 8-bit symmetric quantization (int8 per token, q8_0 per block) of values with largest
/// magnitude amax: s = amax/127, codes round(x/s), x̂ = q fp16(s), so
/// |x - x̂| <= s/2 + 127 |s - fp16(s)|.
inline double int8_error_bound(double amax) {
  const double s = amax / kInt8MaxCode;
  return (0.5 + kCodeRoundingSlack) * s + kInt8MaxCode * fp16_store_error_bound(s);
}

/// q4_0 (ggml truncation): d = m/-8 with m the signed value of largest |x|, q = min(15,
/// floor(x/d + 8.5)), so |x/d - (q-8)| <= 1/2 unless the code clamps (x/d in (7.5, 8]: error at
/// most |d|); storing d as fp16 adds |q-8| |d - fp16(d)| <= 8 |d - fp16(d)|.
inline double q4_0_error_bound(double amax, bool may_clamp) {
  const double d = amax / kQ4MaxOffset;
  return ((may_clamp ? 1.0 : 0.5) + kCodeRoundingSlack) * d + kQ4MaxOffset * fp16_store_error_bound(d);
}

// ---------------------------------------------------------------------------------------------
// Page data families. Rows are `stride` floats apart; the gap after head_dim is filled with a
// large poison value so an encoder that ignores row_stride, or reads past head_dim, is caught.
// ---------------------------------------------------------------------------------------------

enum class Data {
  kNormal,           ///< N(0, 1)
  kOutlierChannels,  ///< N(0, 1) with three channels x10
  kZeroRows,         ///< every third row all zero (one of them -0), every third row with
                     ///< its first 32 channels zero, the rest N(0, 1)
  kConstantRows,     ///< row t is the constant 0.37 (t - P/2): negative, zero and positive rows
  kOneHuge,          ///< N(0, 1) with one element per row = +-huge
  kTiny,             ///< N(0, 1) x 2^-12: scales fall in fp16's subnormal range
};

inline const char* name(Data kind) {
  switch (kind) {
    case Data::kNormal: return "normal";
    case Data::kOutlierChannels: return "outlier channels";
    case Data::kZeroRows: return "zero rows";
    case Data::kConstantRows: return "constant rows";
    case Data::kOneHuge: return "one huge value";
    case Data::kTiny: return "tiny";
  }
  return "?";
}

inline constexpr Data kAllData[] = {Data::kNormal,       Data::kOutlierChannels, Data::kZeroRows,
                                    Data::kConstantRows, Data::kOneHuge,         Data::kTiny};

inline constexpr float kPoison = 12345.0f;

/// `page_size` rows of `head_dim` values, `stride` (>= head_dim) floats apart.
inline std::vector<float> make_rows(Data kind, PageGeometry g, std::ptrdiff_t stride,
                                    std::uint32_t seed, float huge = 5000.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> src(static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(stride),
                         kPoison);
  const index_t d = g.head_dim;
  for (index_t t = 0; t < g.page_size; ++t) {
    float* row = src.data() + t * stride;
    for (index_t c = 0; c < d; ++c) row[c] = normal(rng);
    switch (kind) {
      case Data::kNormal:
        break;
      case Data::kOutlierChannels:
        for (index_t c : {index_t{3}, index_t(d / 2 + 1), index_t(d - 2)}) row[c] *= 10.0f;
        break;
      case Data::kZeroRows:
        if (t % 3 == 0) {
          for (index_t c = 0; c < d; ++c) row[c] = t == 3 ? -0.0f : 0.0f;
        } else if (t % 3 == 1) {
          for (index_t c = 0; c < std::min<index_t>(32, d); ++c) row[c] = 0.0f;
        }
        break;
      case Data::kConstantRows:
        for (index_t c = 0; c < d; ++c) row[c] = 0.37f * static_cast<float>(t - g.page_size / 2);
        break;
      case Data::kOneHuge:
        row[(t * 7) % d] = (t % 2 == 0) ? huge : -huge;
        break;
      case Data::kTiny:
        for (index_t c = 0; c < d; ++c) row[c] *= 0x1p-12f;
        break;
    }
  }
  return src;
}

/// Largest |x| of row t.
inline double row_absmax(const float* row, index_t n) {
  double m = 0.0;
  for (index_t c = 0; c < n; ++c) m = std::max(m, std::fabs(static_cast<double>(row[c])));
  return m;
}

// ---------------------------------------------------------------------------------------------
// Generic encode -> decode harness.
// ---------------------------------------------------------------------------------------------

inline constexpr std::size_t kGuardBytes = 64;

/// Encodes `src` into a plane and returns its `plane_bytes(g)` bytes. Checks that encode writes
/// every byte of the plane (two encodes into buffers pre-filled with different patterns agree)
/// and nothing past it (guard bytes intact).
template <class Codec>
std::vector<std::byte> encode_checked(const Codec& codec, PageGeometry g, const float* src,
                                      std::ptrdiff_t stride,
                                      const typename Codec::params_type& params) {
  const std::size_t bytes = codec.plane_bytes(g);
  std::vector<std::byte> a(bytes + kGuardBytes, std::byte{0xA5});
  std::vector<std::byte> b(bytes + kGuardBytes, std::byte{0x5A});
  codec.encode(g, src, stride, params, a.data());
  codec.encode(g, src, stride, params, b.data());
  bool guard_ok = true;
  for (std::size_t i = bytes; i < bytes + kGuardBytes; ++i) {
    guard_ok = guard_ok && a[i] == std::byte{0xA5} && b[i] == std::byte{0x5A};
  }
  CHECK(guard_ok);
  CHECK(std::memcmp(a.data(), b.data(), bytes) == 0);
  a.resize(bytes);
  return a;
}

/// Decodes a plane into [page_size][head_dim] floats, checking decode writes all of them (the
/// output starts as NaN) and nothing past them.
template <class Codec>
std::vector<float> decode_checked(const Codec& codec, PageGeometry g, const std::byte* plane,
                                  const typename Codec::params_type& params) {
  const std::size_t n = static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(g.head_dim);
  std::vector<float> out(n + 16, kNaN);
  codec.decode(g, plane, params, out.data());
  bool tail_untouched = true;
  for (std::size_t i = n; i < n + 16; ++i) tail_untouched = tail_untouched && std::isnan(out[i]);
  CHECK(tail_untouched);
  out.resize(n);
  return out;
}

/// Encodes and decodes one page and calls `check(t, c, x, x_hat, mismatches)` on every element.
/// A non-finite x_hat is always a failure.
template <class Codec, class Check>
void roundtrip(const Codec& codec, PageGeometry g, const std::vector<float>& src,
               std::ptrdiff_t stride, const typename Codec::params_type& params, Check check) {
  REQUIRE_NOTHROW(codec.validate(g));
  const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, params);
  const std::vector<float> out = decode_checked(codec, g, plane.data(), params);
  Mismatches m;
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const float x = src[static_cast<std::size_t>(t * stride + c)];
      const float y = out[static_cast<std::size_t>(t) * g.head_dim + c];
      if (!std::isfinite(y)) {
        m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) +
              " decoded to non-finite " + fmt(y));
        continue;
      }
      check(t, c, x, y, m);
    }
  }
  report(m);
}

/// Runs `body(g, stride, kind, seed)` over the standard geometries, every data family and the
/// strides head_dim and head_dim + 7.
template <class Body>
void for_each_case(Body body) {
  std::uint32_t seed = 1234;
  for (PageGeometry g : standard_geometries()) {
    for (Data kind : kAllData) {
      for (std::ptrdiff_t pad : {0, 7}) {
        const std::ptrdiff_t stride = g.head_dim + pad;
        INFO(describe(g) << " row_stride=" << stride << " data=" << name(kind));
        body(g, stride, kind, ++seed);
      }
    }
  }
}

/// The rate `plane_bytes` implies: 8 * plane_bytes / (page_size * head_dim).
template <class Codec>
double implied_bits_per_element(const Codec& codec, PageGeometry g) {
  return 8.0 * static_cast<double>(codec.plane_bytes(g)) /
         (static_cast<double>(g.page_size) * static_cast<double>(g.head_dim));
}

/// Runs `f()` and returns the kvpack::Error code it throws; fails the test when it throws nothing
/// or something else.
template <class F>
kvpack::ErrorCode error_code_of(F&& f) {
  try {
    f();
  } catch (const kvpack::Error& e) {
    return e.code();
  } catch (...) {
    FAIL("threw something other than kvpack::Error");
  }
  FAIL("did not throw");
  return kvpack::ErrorCode::kInvalidArgument;  // unreachable: FAIL throws
}

}  // namespace kvpack_test::quant
