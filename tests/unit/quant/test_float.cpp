/// \file test_float.cpp
/// \brief quant::Float<float | half | bfloat16> (key and value planes): byte format (key plane
///        T k[d][P] channel-major, value plane T v[P][d] token-major), rates 32/16/16, exact
///        round trip for float, and for half / bfloat16 the round-to-nearest-even value of an
///        independent encoder written here (and the numeric type's own conversion).

#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kvpack/quant/float.hpp"
#include "quant_test_support.hpp"

namespace {

using kvpack::bfloat16;
using kvpack::half;
using kvpack::quant::Float;
using kvpack::quant::FloatCodec;
using kvpack::quant::NoParams;
using namespace kvpack_test::quant;

using F32Key = FloatCodec<float, Plane::kKey>;
using F32Value = FloatCodec<float, Plane::kValue>;
using F16Key = FloatCodec<half, Plane::kKey>;
using F16Value = FloatCodec<half, Plane::kValue>;
using BF16Key = FloatCodec<bfloat16, Plane::kKey>;
using BF16Value = FloatCodec<bfloat16, Plane::kValue>;

/// Independent bfloat16 encoder (finite inputs, normal range): keep 8 significant bits with
/// round to nearest even.
std::uint16_t ref_bf16_bits(float x) {
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return std::signbit(x) ? 0x8000u : 0u;
  int e = 0;
  (void)std::frexp(a, &e);
  const double rounded = std::ldexp(std::nearbyint(std::ldexp(a, 8 - e)), e - 8);
  const auto f = static_cast<float>(std::copysign(rounded, static_cast<double>(x)));
  return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16);
}

/// What each storage type must hold, from its definition (not from the code under test).
template <class T>
struct Expect;
template <>
struct Expect<float> {
  static constexpr const char* kName = "f32";
  static constexpr std::size_t kBytes = 4;
  static constexpr double kBits = 32.0;
  static std::uint32_t bits(float x) { return std::bit_cast<std::uint32_t>(x); }
  static std::uint32_t stored(const std::byte* p) {
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static double value(float x) { return x; }
  static float max_abs() { return std::numeric_limits<float>::max(); }
};
template <>
struct Expect<half> {
  static constexpr const char* kName = "f16";
  static constexpr std::size_t kBytes = 2;
  static constexpr double kBits = 16.0;
  static std::uint32_t bits(float x) { return ref_fp16_bits(x); }
  static std::uint32_t stored(const std::byte* p) {
    std::uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  static double value(float x) { return ref_fp16_value(ref_fp16_bits(x)); }
  static float max_abs() { return 65504.0f; }
};
template <>
struct Expect<bfloat16> {
  static constexpr const char* kName = "bf16";
  static constexpr std::size_t kBytes = 2;
  static constexpr double kBits = 16.0;
  static std::uint32_t bits(float x) { return ref_bf16_bits(x); }
  static std::uint32_t stored(const std::byte* p) {
    std::uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  static double value(float x) { return std::bit_cast<float>(std::uint32_t{ref_bf16_bits(x)} << 16); }
  static float max_abs() { return std::bit_cast<float>(std::uint32_t{0x7F7F} << 16); }  // largest finite
};

template <class Codec>
std::size_t doc_element(PageGeometry g, index_t t, index_t c) {
  return Codec::kPlane == Plane::kKey
             ? static_cast<std::size_t>(c) * g.page_size + static_cast<std::size_t>(t)
             : static_cast<std::size_t>(t) * g.head_dim + static_cast<std::size_t>(c);
}

}  // namespace

TEMPLATE_TEST_CASE("Float plane size, rate, name and limits", "[quant]", F32Key, F32Value, F16Key, F16Value,
                   BF16Key, BF16Value) {
  using T = typename TestType::storage_type;
  using E = Expect<T>;
  const TestType codec{};
  CHECK(TestType::kName == E::kName);
  CHECK(Float<T>::name() == E::kName);
  for (PageGeometry g : standard_geometries()) {
    for (PageGeometry gg : {g, PageGeometry{g.page_size + 3, g.head_dim + 1}}) {
      INFO(describe(gg));
      CHECK_NOTHROW(codec.validate(gg));
      CHECK(codec.plane_bytes(gg) == static_cast<std::size_t>(gg.page_size) * gg.head_dim * E::kBytes);
      CHECK(codec.nominal_bits_per_element(gg.head_dim) == E::kBits);
      CHECK(codec.nominal_bits_per_element(gg.head_dim) == implied_bits_per_element(codec, gg));
    }
  }
  CHECK(codec.max_abs_input() == E::max_abs());
}

TEMPLATE_TEST_CASE("Float pages hold T(x) at the documented positions and decode to it", "[quant]", F32Key,
                   F32Value, F16Key, F16Value, BF16Key, BF16Value) {
  using T = typename TestType::storage_type;
  using E = Expect<T>;
  const TestType codec{};
  for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
    const std::vector<float> src = make_rows(kind, g, stride, seed);
    const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, NoParams{});
    const std::vector<float> out = decode_checked(codec, g, plane.data(), NoParams{});
    Mismatches m;
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        const float x = src[static_cast<std::size_t>(t * stride + c)];
        const float y = out[static_cast<std::size_t>(t) * g.head_dim + c];
        const std::uint32_t stored = E::stored(plane.data() + doc_element<TestType>(g, t, c) * E::kBytes);
        const std::string where = "t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x);
        if (stored != E::bits(x)) m.add(where + " stored " + hex(stored) + " expected " + hex(E::bits(x)));
        // Decoded value: the independent rounding, the numeric type's own conversion, and for
        // float the input itself, bit for bit (-0 included).
        if (std::bit_cast<std::uint32_t>(y) != std::bit_cast<std::uint32_t>(static_cast<float>(E::value(x)))) {
          m.add(where + " decoded " + fmt(y));
        }
        if (std::bit_cast<std::uint32_t>(y) != std::bit_cast<std::uint32_t>(static_cast<float>(static_cast<T>(x)))) {
          m.add(where + " differs from the type's own conversion");
        }
      }
    }
    report(m);
  });
}

TEMPLATE_TEST_CASE("Float decode error is within half an ulp of T", "[quant]", F32Key, F32Value, F16Key,
                   F16Value, BF16Key, BF16Value) {
  using T = typename TestType::storage_type;
  // Relative rounding error of round-to-nearest with p significant bits is 2^-p (float: exact).
  const double rel = std::is_same_v<T, float> ? 0.0 : std::is_same_v<T, half> ? 0x1p-11 : 0x1p-8;
  const double abs_floor = std::is_same_v<T, half> ? 0x1p-25 : 0.0;  // fp16 subnormals (tiny data)
  const TestType codec{};
  for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
    const std::vector<float> src = make_rows(kind, g, stride, seed);
    roundtrip(codec, g, src, stride, NoParams{}, [&](index_t t, index_t c, float x, float y, Mismatches& m) {
      const double err = std::fabs(static_cast<double>(x) - y);
      if (err > std::max(rel * std::fabs(x), abs_floor)) {
        m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " y=" + fmt(y));
      }
    });
  });
}

TEMPLATE_TEST_CASE("Float stores +-max_abs_input without overflowing", "[quant]", F32Key, F32Value, F16Key,
                   F16Value, BF16Key, BF16Value) {
  const TestType codec{};
  const PageGeometry g{2, 4};
  const float mx = codec.max_abs_input();
  const std::vector<float> src = {mx, -mx, 1.0f, -2.5f, 0.0f, -0.0f, 3.0f, mx / 2.0f};
  const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), g.head_dim, NoParams{});
  const std::vector<float> out = decode_checked(codec, g, plane.data(), NoParams{});
  CHECK(out[0] == mx);
  CHECK(out[1] == -mx);
  CHECK(out[2] == 1.0f);
  CHECK(out[3] == -2.5f);
  CHECK(out[4] == 0.0f);
  CHECK(std::signbit(out[5]));
  CHECK(out[6] == 3.0f);
  CHECK(out[7] == mx / 2.0f);
}
