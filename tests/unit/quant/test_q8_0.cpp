/// \file test_q8_0.cpp
/// \brief quant::Q8_0 page codec (key and value planes): pages hold exactly llama.cpp's q8_0
///        blocks, in the documented byte format (codes in the pair tiles, then fp16 d[d/32][P]),
///        to_ggml/from_ggml convert losslessly, and the decode error is within q8_0's bound.

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvpack/quant/q8_0.hpp"
#include "quant_test_support.hpp"

namespace {

namespace ggml = kvpack::quant::ggml;
namespace tile = kvpack::quant::tile;
using kvpack::quant::NoParams;
using kvpack::quant::Q8_0;
using kvpack::quant::Q8_0Codec;
using namespace kvpack_test::quant;

using KeyCodec = Q8_0Codec<Plane::kKey>;
using ValueCodec = Q8_0Codec<Plane::kValue>;

/// Byte of the fp16 scale of (t, block b): after the P*d code bytes, `fp16 d[d/32][P]`.
std::size_t doc_scale_offset(PageGeometry g, index_t t, index_t b) {
  return static_cast<std::size_t>(g.page_size) * g.head_dim +
         2 * (static_cast<std::size_t>(b) * g.page_size + static_cast<std::size_t>(t));
}

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

bool same_block(const ggml::BlockQ8_0& a, const ggml::BlockQ8_0& b) {
  return a.d == b.d && std::memcmp(a.qs, b.qs, sizeof(a.qs)) == 0;
}

}  // namespace

TEMPLATE_TEST_CASE("Q8_0 plane size, rate, name and validation", "[quant]", KeyCodec, ValueCodec) {
  const TestType codec{};
  CHECK(TestType::kName == "q8_0");
  CHECK(Q8_0::name() == "q8_0");
  for (index_t p : {16, 32, 48, 64, 128, 256}) {
    for (index_t d : {32, 64, 96, 128, 256}) {
      const PageGeometry g{p, d};
      INFO(describe(g));
      // P*d int8 codes + P*(d/32) fp16 scales = 34 bytes per 32 elements.
      CHECK(codec.plane_bytes(g) == static_cast<std::size_t>(p) * d + 2u * static_cast<std::size_t>(p) * (d / 32));
      CHECK(codec.nominal_bits_per_element(d) == 8.5);
      CHECK(codec.nominal_bits_per_element(d) == implied_bits_per_element(codec, g));
      CHECK_NOTHROW(codec.validate(g));
    }
  }
  for (index_t d : {1, 8, 16, 31, 33, 48, 100, 130}) {
    INFO("head_dim " << d);
    CHECK(error_code_of([&] { codec.validate({32, d}); }) == kvpack::ErrorCode::kUnsupported);
  }
  CHECK(codec.max_abs_input() == 65504.0f * 127.0f);  // d = amax / 127 must stay a finite fp16
  CHECK(codec.initial_params(0, 0) == NoParams{});
  CHECK(TestType::scale_byte({32, 64}, 5, 1) == doc_scale_offset({32, 64}, 5, 1));
}

TEMPLATE_TEST_CASE("Q8_0 pages hold llama.cpp's q8_0 blocks in the documented byte format", "[quant]",
                   KeyCodec, ValueCodec) {
  const TestType codec{};
  for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
    const std::vector<float> src = make_rows(kind, g, stride, seed);
    const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, NoParams{});
    const index_t blocks = g.head_dim / 32;

    Mismatches m;
    std::vector<ggml::BlockQ8_0> expected(static_cast<std::size_t>(g.page_size) * blocks);
    std::vector<ggml::BlockQ8_0> row(static_cast<std::size_t>(blocks));
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t b = 0; b < blocks; ++b) {
        expected[static_cast<std::size_t>(t * blocks + b)] = ggml::quantize_q8_0(src.data() + t * stride + 32 * b);
      }
      // to_ggml gives llama.cpp's row of blocks for token t.
      TestType::to_ggml(g, plane.data(), t, row.data());
      for (index_t b = 0; b < blocks; ++b) {
        const ggml::BlockQ8_0& want = expected[static_cast<std::size_t>(t * blocks + b)];
        if (!same_block(row[static_cast<std::size_t>(b)], want)) {
          m.add("to_ggml t=" + std::to_string(t) + " b=" + std::to_string(b) + " d " +
                hex(row[static_cast<std::size_t>(b)].d) + " vs " + hex(want.d));
        }
        // The raw bytes: scale at the documented offset, codes at their tile bytes.
        if (load_u16(plane.data() + doc_scale_offset(g, t, b)) != want.d) {
          m.add("scale bytes t=" + std::to_string(t) + " b=" + std::to_string(b));
        }
        for (index_t j = 0; j < 32; ++j) {
          const auto code = static_cast<std::int8_t>(plane[code_offset<TestType>(g, t, 32 * b + j)]);
          if (code != want.qs[j]) m.add("code byte t=" + std::to_string(t) + " c=" + std::to_string(32 * b + j));
        }
      }
    }
    report(m);

    // from_ggml of the quantized blocks rebuilds the encoded plane byte for byte, whatever the
    // buffer held before.
    for (std::uint8_t fill : {std::uint8_t{0x00}, std::uint8_t{0xC3}}) {
      std::vector<std::byte> rebuilt(plane.size(), std::byte{fill});
      for (index_t t = 0; t < g.page_size; ++t) {
        TestType::from_ggml(g, expected.data() + static_cast<std::size_t>(t) * blocks, t, rebuilt.data());
      }
      CHECK(rebuilt == plane);
    }

    // decode is ggml's dequantization of the same blocks, bit for bit.
    const std::vector<float> out = decode_checked(codec, g, plane.data(), NoParams{});
    Mismatches md;
    float y[32];
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t b = 0; b < blocks; ++b) {
        ggml::dequantize_q8_0(expected[static_cast<std::size_t>(t * blocks + b)], y);
        if (std::memcmp(y, out.data() + static_cast<std::size_t>(t) * g.head_dim + 32 * b, sizeof(y)) != 0) {
          md.add("decode t=" + std::to_string(t) + " b=" + std::to_string(b));
        }
      }
    }
    report(md);
  });
}

TEMPLATE_TEST_CASE("Q8_0 decode error is within s/2 + 127 |s - fp16(s)| per block", "[quant]", KeyCodec,
                   ValueCodec) {
  const TestType codec{};
  for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
    const std::vector<float> src = make_rows(kind, g, stride, seed);
    roundtrip(codec, g, src, stride, NoParams{},
              [&](index_t t, index_t c, float x, float y, Mismatches& m) {
                const double bound = int8_error_bound(row_absmax(src.data() + t * stride + (c / 32) * 32, 32));
                const double err = std::fabs(static_cast<double>(x) - y);
                if (err > bound || (x == 0.0f && y != 0.0f)) {
                  m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) +
                        " y=" + fmt(y) + " bound=" + fmt(bound));
                }
              });
  });
}

TEMPLATE_TEST_CASE("Q8_0 stores inputs up to max_abs_input", "[quant]", KeyCodec, ValueCodec) {
  const TestType codec{};
  const PageGeometry g{16, 64};
  std::vector<float> src = make_rows(Data::kNormal, g, g.head_dim, 99);
  src[5] = codec.max_abs_input();
  src[64 * 3 + 40] = -codec.max_abs_input();
  roundtrip(codec, g, src, g.head_dim, NoParams{}, [&](index_t t, index_t c, float x, float y, Mismatches& m) {
    if (std::fabs(static_cast<double>(x) - y) > int8_error_bound(row_absmax(src.data() + t * g.head_dim + (c / 32) * 32, 32))) {
      m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " y=" + fmt(y));
    }
  });
}

TEMPLATE_TEST_CASE("Q8_0 from_ggml writes exactly one token's bytes and to_ggml reads them back",
                   "[quant]", KeyCodec, ValueCodec) {
  std::mt19937 rng(77);
  std::uniform_int_distribution<int> byte(0, 255);
  for (PageGeometry g : standard_geometries()) {
    INFO(describe(g));
    const index_t blocks = g.head_dim / 32;
    const std::size_t bytes = TestType{}.plane_bytes(g);
    std::vector<std::byte> plane(bytes);
    for (std::byte& b : plane) b = static_cast<std::byte>(byte(rng));
    for (index_t t : {index_t{0}, index_t{1}, index_t(g.page_size / 2 + 1), index_t(g.page_size - 1)}) {
      // Arbitrary blocks: any scale bits, any int8 code (-128 included).
      std::vector<ggml::BlockQ8_0> in(static_cast<std::size_t>(blocks));
      for (ggml::BlockQ8_0& blk : in) {
        blk.d = static_cast<std::uint16_t>(byte(rng) | (byte(rng) << 8));
        for (std::int8_t& q : blk.qs) q = static_cast<std::int8_t>(byte(rng) - 128);
      }
      const std::vector<std::byte> before = plane;
      TestType::from_ggml(g, in.data(), t, plane.data());

      // The documented positions of token t's bytes; nothing else may change.
      std::set<std::size_t> mine;
      for (index_t b = 0; b < blocks; ++b) {
        mine.insert(doc_scale_offset(g, t, b));
        mine.insert(doc_scale_offset(g, t, b) + 1);
      }
      for (index_t c = 0; c < g.head_dim; ++c) mine.insert(code_offset<TestType>(g, t, c));
      std::size_t foreign_changes = 0;
      for (std::size_t i = 0; i < bytes; ++i) {
        if (mine.count(i) == 0 && plane[i] != before[i]) ++foreign_changes;
      }
      CHECK(foreign_changes == 0);

      std::vector<ggml::BlockQ8_0> out(static_cast<std::size_t>(blocks));
      TestType::to_ggml(g, plane.data(), t, out.data());
      for (index_t b = 0; b < blocks; ++b) CHECK(same_block(out[static_cast<std::size_t>(b)], in[static_cast<std::size_t>(b)]));
    }
  }
}

// validate() must throw for a geometry the codec cannot store (quant_concepts.hpp). The value
// plane pairs tokens (tile::value_byte), so an odd page_size would put codes past P*d (a heap
// overflow in encode).
TEMPLATE_TEST_CASE("Q8_0 validate accepts only geometries whose codes fit in the plane", "[quant]",
                   KeyCodec, ValueCodec) {
  const TestType codec{};
  for (index_t p : {1, 15, 17, 33, 16}) {
    for (index_t d : {32, 64}) {
      const PageGeometry g{p, d};
      INFO(describe(g));
      bool accepted = true;
      try {
        codec.validate(g);
      } catch (const kvpack::Error&) {
        accepted = false;
      }
      if (!accepted) continue;
      std::size_t past_codes = 0;
      for (index_t t = 0; t < p; ++t) {
        for (index_t c = 0; c < d; ++c) past_codes += code_offset<TestType>(g, t, c) >= static_cast<std::size_t>(p) * d;
      }
      CHECK(past_codes == 0);
    }
  }
}

// Blocks whose largest |x| is so small that 1/d overflows to inf (amax < ~3.7e-37): the fp16
// scale is 0, so every element must decode to 0.
TEMPLATE_TEST_CASE("Q8_0 blocks of tiny values decode to zero", "[quant]", KeyCodec, ValueCodec) {
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
