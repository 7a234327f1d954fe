/// \file test_int8.cpp
/// \brief quant::Int8 (per-token symmetric, ALGORITHMS.md §5.2): byte format (codes in the pair
///        tiles, then fp16 scale[P]), rate 8 + 16/d, validation (d % 8 == 0, even P), and the decode bound
///        |x - x̂| <= s/2 + 127 |s - fp16(s)| with s = max|x|/127 per token.

#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvpack/quant/int8.hpp"
#include "quant_test_support.hpp"

namespace {

namespace tile = kvpack::quant::tile;
using kvpack::quant::Int8;
using kvpack::quant::Int8Codec;
using kvpack::quant::NoParams;
using namespace kvpack_test::quant;

using KeyCodec = Int8Codec<Plane::kKey>;
using ValueCodec = Int8Codec<Plane::kValue>;

/// Byte of token t's fp16 scale: after the P*d codes, `fp16 scale[P]`.
std::size_t doc_scale_offset(PageGeometry g, index_t t) {
  return static_cast<std::size_t>(g.page_size) * g.head_dim + 2 * static_cast<std::size_t>(t);
}

}  // namespace

TEMPLATE_TEST_CASE("Int8 plane size, rate, name and validation", "[quant]", KeyCodec, ValueCodec) {
  const TestType codec{};
  CHECK(TestType::kName == "int8");
  CHECK(Int8::name() == "int8");
  for (index_t p : {2, 16, 32, 64, 128}) {
    for (index_t d : {8, 16, 32, 64, 72, 80, 96, 128, 256}) {
      const PageGeometry g{p, d};
      INFO(describe(g));
      CHECK(codec.plane_bytes(g) == static_cast<std::size_t>(p) * d + 2u * static_cast<std::size_t>(p));
      CHECK(codec.nominal_bits_per_element(d) == 8.0 + 16.0 / d);
      CHECK(codec.nominal_bits_per_element(d) == implied_bits_per_element(codec, g));
      CHECK_NOTHROW(codec.validate(g));
    }
  }
  CHECK(codec.nominal_bits_per_element(128) == 8.125);  // ALGORITHMS.md §0
  // Odd head_dim can not be paired; the header also documents d % 8 == 0 (SIMD value kernels).
  for (index_t d : {1, 2, 3, 6, 12, 63, 127, 130}) {
    INFO("head_dim " << d);
    CHECK(error_code_of([&] { codec.validate({32, d}); }) == kvpack::ErrorCode::kUnsupported);
  }
  CHECK(error_code_of([&] { codec.validate({15, 64}); }) == kvpack::ErrorCode::kUnsupported);
  CHECK(codec.max_abs_input() == 65504.0f * 127.0f);
  CHECK(codec.initial_params(3, 1) == NoParams{});
}

TEMPLATE_TEST_CASE("Int8 page bytes follow the documented format", "[quant]", KeyCodec, ValueCodec) {
  const TestType codec{};
  for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
    const std::vector<float> src = make_rows(kind, g, stride, seed);
    const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, NoParams{});
    Mismatches m;
    for (index_t t = 0; t < g.page_size; ++t) {
      const float* row = src.data() + t * stride;
      // §5.2 with the header's stated arithmetic: s = amax/127 in fp32, codes round(x * (1/s))
      // (half away from zero), s stored as fp16.
      float amax = 0.0f;
      for (index_t c = 0; c < g.head_dim; ++c) amax = std::fabs(row[c]) > amax ? std::fabs(row[c]) : amax;
      const float s = amax / 127.0f;
      const float inv = s != 0.0f ? 1.0f / s : 0.0f;
      std::uint16_t scale_bits;
      std::memcpy(&scale_bits, plane.data() + doc_scale_offset(g, t), 2);
      if (scale_bits != ref_fp16_bits(s)) {
        m.add("scale t=" + std::to_string(t) + " " + hex(scale_bits) + " vs " + hex(ref_fp16_bits(s)));
      }
      for (index_t c = 0; c < g.head_dim; ++c) {
        const int want = static_cast<int>(std::round(row[c] * inv));
        const int got = static_cast<std::int8_t>(plane[code_offset<TestType>(g, t, c)]);
        if (want < -127 || want > 127 || got != want) {
          m.add("code t=" + std::to_string(t) + " c=" + std::to_string(c) + " " + std::to_string(got) +
                " vs " + std::to_string(want));
        }
      }
    }
    report(m);
  });
}

TEMPLATE_TEST_CASE("Int8 decode error is within s/2 + 127 |s - fp16(s)| per token", "[quant]", KeyCodec,
                   ValueCodec) {
  const TestType codec{};
  for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
    const std::vector<float> src = make_rows(kind, g, stride, seed);
    roundtrip(codec, g, src, stride, NoParams{}, [&](index_t t, index_t c, float x, float y, Mismatches& m) {
      const double bound = int8_error_bound(row_absmax(src.data() + t * stride, g.head_dim));
      if (std::fabs(static_cast<double>(x) - y) > bound || (x == 0.0f && y != 0.0f)) {
        m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " y=" + fmt(y) +
              " bound=" + fmt(bound));
      }
    });
  });
}

TEMPLATE_TEST_CASE("Int8 special rows: zero rows decode to 0, constant rows to +-127 codes", "[quant]",
                   KeyCodec, ValueCodec) {
  const TestType codec{};
  const PageGeometry g{16, 64};
  std::vector<float> src(static_cast<std::size_t>(g.page_size) * g.head_dim, 0.0f);
  for (index_t c = 0; c < g.head_dim; ++c) {
    src[static_cast<std::size_t>(1 * g.head_dim + c)] = 2.5f;   // constant positive
    src[static_cast<std::size_t>(2 * g.head_dim + c)] = -0.75f; // constant negative
    src[static_cast<std::size_t>(3 * g.head_dim + c)] = -0.0f;  // negative zeros
  }
  const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), g.head_dim, NoParams{});
  const std::vector<float> out = decode_checked(codec, g, plane.data(), NoParams{});
  for (index_t t : {0, 3, 4, 15}) {
    INFO("zero row " << t);
    std::uint16_t bits;
    std::memcpy(&bits, plane.data() + doc_scale_offset(g, t), 2);
    CHECK(ref_fp16_value(bits) == 0.0);
    bool all_zero = true;
    for (index_t c = 0; c < g.head_dim; ++c) {
      all_zero = all_zero && out[static_cast<std::size_t>(t * g.head_dim + c)] == 0.0f &&
                 static_cast<std::int8_t>(plane[code_offset<TestType>(g, t, c)]) == 0;
    }
    CHECK(all_zero);
  }
  for (index_t t : {1, 2}) {
    INFO("constant row " << t);
    const float v = src[static_cast<std::size_t>(t * g.head_dim)];
    bool codes_ok = true;
    bool values_ok = true;
    for (index_t c = 0; c < g.head_dim; ++c) {
      codes_ok = codes_ok && static_cast<std::int8_t>(plane[code_offset<TestType>(g, t, c)]) == (v > 0 ? 127 : -127);
      const double y = out[static_cast<std::size_t>(t * g.head_dim + c)];
      values_ok = values_ok && std::fabs(y - v) <= std::fabs(v) * (0x1p-11 + 0x1p-20);
    }
    CHECK(codes_ok);
    CHECK(values_ok);
  }
}

TEMPLATE_TEST_CASE("Int8 stores inputs up to max_abs_input", "[quant]", KeyCodec, ValueCodec) {
  const TestType codec{};
  const PageGeometry g{16, 64};
  std::vector<float> src = make_rows(Data::kNormal, g, g.head_dim, 5);
  src[7] = codec.max_abs_input();
  src[64 * 9 + 1] = -codec.max_abs_input();
  roundtrip(codec, g, src, g.head_dim, NoParams{}, [&](index_t t, index_t c, float x, float y, Mismatches& m) {
    if (std::fabs(static_cast<double>(x) - y) > int8_error_bound(row_absmax(src.data() + t * g.head_dim, g.head_dim))) {
      m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " y=" + fmt(y));
    }
  });
}

// Rows whose largest |x| is so small that 1/s overflows to inf: the fp16 scale is 0, so every
// element must decode to 0.
TEMPLATE_TEST_CASE("Int8 rows of tiny values decode to zero", "[quant]", KeyCodec, ValueCodec) {
  const TestType codec{};
  const PageGeometry g{16, 32};
  std::vector<float> src(static_cast<std::size_t>(g.page_size) * g.head_dim, 0.0f);
  src[3] = 1e-39f;
  src[32 + 7] = -2e-39f;
  src[64 + 1] = 1e-45f;
  roundtrip(codec, g, src, g.head_dim, NoParams{}, [](index_t t, index_t c, float, float y, Mismatches& m) {
    if (y != 0.0f) m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " y=" + fmt(y));
  });
}
