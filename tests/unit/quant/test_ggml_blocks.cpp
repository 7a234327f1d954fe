/// \file test_ggml_blocks.cpp
/// \brief ggml q8_0 / q4_0 blocks: the ALGORITHMS.md §5.3 test vectors byte for byte, ggml's
///        rounding (q8_0: roundf) and truncation (q4_0) semantics, the block byte image, and
///        agreement with an independent reference quantizer written here from §5.3.

#include <array>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "kvpack/quant/ggml_blocks.hpp"
#include "quant_test_support.hpp"

namespace {

namespace ggml = kvpack::quant::ggml;
using namespace kvpack_test::quant;

// ---------------------------------------------------------------------------------------------
// Independent reference quantizers, from ALGORITHMS.md §5.3 and ggml's `_ref` functions: the
// scale is computed in fp32 and stored as fp16; codes use id = 1/d in fp32.
// ---------------------------------------------------------------------------------------------

struct RefQ8 {
  std::uint16_t d;
  std::array<int, 32> q;
};

RefQ8 ref_q8_0(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::fabs(x[j]) > amax ? std::fabs(x[j]) : amax;
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  RefQ8 r{ref_fp16_bits(d), {}};
  for (int j = 0; j < 32; ++j) r.q[j] = static_cast<int>(std::round(x[j] * id));  // half away from 0
  return r;
}

struct RefQ4 {
  std::uint16_t d;
  std::array<int, 32> q;  ///< codes 0..15 in element order
};

RefQ4 ref_q4_0(const float* x) {
  // m = the signed value of the first element with the largest |x|.
  float amax = 0.0f;
  float m = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      m = x[j];
    }
  }
  const float d = m / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  RefQ4 r{ref_fp16_bits(d), {}};
  for (int j = 0; j < 32; ++j) {
    const int truncated = static_cast<int>(std::trunc(x[j] * id + 8.5f));
    r.q[j] = truncated < 15 ? truncated : 15;
  }
  return r;
}

/// The §5.3 input x_j = 3 sin(0.7 j + 0.3), j = 0..31, in fp32: 3.0f * sinf(0.7f * j + 0.3f) with
/// glibc, which reproduces the stated RMSE digits (the formula in double gives 0.0162918, and
/// clang -O3 evaluates the fp32 expression to different last bits). Held as literals so every
/// compiler sees the same input; a test below checks them against the formula.
constexpr float kSection53Input[32] = {
    0x1.c5eb48p-1f, 0x1.431ff6p+1f, 0x1.7ccc9ep+1f, 0x1.0360bep+1f,
    0x1.fef1c2p-4f, -0x1.d5e824p+0f, -0x1.775f2p+1f, -0x1.533f1cp+1f,
    -0x1.1f232p+0f, 0x1.de8702p-1f, 0x1.469156p+1f, 0x1.7be9ep+1f,
    0x1.fd2914p+0f, 0x1.3071f4p-4f, -0x1.e00df2p+0f, -0x1.78adf6p+1f,
    -0x1.502c74p+1f, -0x1.131ec8p+0f, 0x1.f7000cp-1f, 0x1.49eb1p+1f,
    0x1.7aebap+1f, 0x1.f36bccp+0f, 0x1.876a7p-6f, -0x1.ea10d4p+0f,
    -0x1.79e18p+1f, -0x1.4d017cp+1f, -0x1.0706c8p+0f, 0x1.07aa4p+0f,
    0x1.4d2cdep+1f, 0x1.79d1fep+1f, 0x1.e98a7ep+0f, -0x1.b2f74p-6f,
};

std::array<float, 32> section_5_3_input() {
  std::array<float, 32> x{};
  for (int j = 0; j < 32; ++j) x[j] = kSection53Input[j];
  x[5] = -7.5f;
  return x;
}

double rmse(const float* x, const float* y) {
  double sum = 0.0;
  for (int j = 0; j < 32; ++j) {
    const double e = static_cast<double>(x[j]) - static_cast<double>(y[j]);
    sum += e * e;
  }
  return std::sqrt(sum / 32.0);
}

/// `v` printed with 6 significant digits, the precision of the §5.3 table.
std::string six_digits(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::array<std::byte, sizeof(ggml::BlockQ8_0)> bytes_of(const ggml::BlockQ8_0& b) {
  std::array<std::byte, sizeof(ggml::BlockQ8_0)> out{};
  std::memcpy(out.data(), &b, sizeof(b));
  return out;
}

std::array<std::byte, sizeof(ggml::BlockQ4_0)> bytes_of(const ggml::BlockQ4_0& b) {
  std::array<std::byte, sizeof(ggml::BlockQ4_0)> out{};
  std::memcpy(out.data(), &b, sizeof(b));
  return out;
}

}  // namespace

TEST_CASE("ggml blocks have llama.cpp's size and field offsets", "[quant]") {
  STATIC_REQUIRE(ggml::kBlockSize == 32);
  STATIC_REQUIRE(sizeof(ggml::BlockQ8_0) == 34);  // 2 + 32: 8.5 bits per element
  STATIC_REQUIRE(sizeof(ggml::BlockQ4_0) == 18);  // 2 + 16: 4.5 bits per element
  STATIC_REQUIRE(offsetof(ggml::BlockQ8_0, d) == 0);
  STATIC_REQUIRE(offsetof(ggml::BlockQ8_0, qs) == 2);
  STATIC_REQUIRE(offsetof(ggml::BlockQ4_0, d) == 0);
  STATIC_REQUIRE(offsetof(ggml::BlockQ4_0, qs) == 2);
}

TEST_CASE("the 5.3 test input is 3 sin(0.7 j + 0.3)", "[quant]") {
  for (int j = 0; j < 32; ++j) {
    INFO("j = " << j);
    // fp32 rounding of the argument (<= 2^-19 near 22) moves 3 sin by at most ~6e-6.
    CHECK(std::fabs(kSection53Input[j] - 3.0 * std::sin(0.7 * j + 0.3)) <= 1e-5);
  }
}

TEST_CASE("q8_0 reproduces the ALGORITHMS.md 5.3 test vector", "[quant]") {
  const std::array<float, 32> x = section_5_3_input();
  const ggml::BlockQ8_0 block = ggml::quantize_q8_0(x.data());

  CHECK(hex(block.d) == hex(0x2b8f));
  CHECK(ref_fp16_value(0x2b8f) == Approx(0.059051514).epsilon(1e-8));

  const int expected[32] = {15,  43,  50,  34,  2,  -127, -50, -45, -19, 16, 43,
                            50,  34,  1,   -32, -50, -44, -18, 17,  44,  50, 33,
                            0,   -32, -50, -44, -17, 17,  44,  50,  32,  0};
  for (int j = 0; j < 32; ++j) {
    INFO("j = " << j);
    CHECK(static_cast<int>(block.qs[j]) == expected[j]);
  }

  // The byte image llama.cpp writes: fp16 d little-endian, then the 32 codes.
  if constexpr (std::endian::native == std::endian::little) {
    const auto raw = bytes_of(block);
    CHECK(raw[0] == std::byte{0x8f});
    CHECK(raw[1] == std::byte{0x2b});
    for (int j = 0; j < 32; ++j) {
      CHECK(raw[2 + j] == static_cast<std::byte>(static_cast<std::uint8_t>(expected[j])));
    }
  }

  // Dequantize: y_j = qs_j * fp16(d), exact in float.
  float y[32];
  ggml::dequantize_q8_0(block, y);
  const double d = ref_fp16_value(0x2b8f);
  for (int j = 0; j < 32; ++j) {
    INFO("j = " << j);
    CHECK(static_cast<double>(y[j]) == expected[j] * d);
  }
  CHECK(six_digits(rmse(x.data(), y)) == "0.0162917");
}

TEST_CASE("q4_0 reproduces the ALGORITHMS.md 5.3 test vector", "[quant]") {
  const std::array<float, 32> x = section_5_3_input();
  const ggml::BlockQ4_0 block = ggml::quantize_q4_0(x.data());

  // m = -7.5 (x_5), d = m / -8 = 0.9375, exactly representable.
  CHECK(hex(block.d) == hex(0x3b80));
  CHECK(ref_fp16_value(0x3b80) == 0.9375);

  const unsigned expected[16] = {0x59, 0x7b, 0x9b, 0xba, 0xb8, 0xa0, 0x85, 0x65,
                                 0x57, 0x59, 0x7b, 0x9b, 0xba, 0xb8, 0xa6, 0x85};
  for (int j = 0; j < 16; ++j) {
    INFO("byte " << j);
    CHECK(hex(block.qs[j]) == hex(expected[j]));
  }
  if constexpr (std::endian::native == std::endian::little) {
    const auto raw = bytes_of(block);
    CHECK(raw[0] == std::byte{0x80});
    CHECK(raw[1] == std::byte{0x3b});
    for (int j = 0; j < 16; ++j) CHECK(raw[2 + j] == static_cast<std::byte>(expected[j]));
  }

  // Dequantize: element j from the low nibble of byte j, element j + 16 from the high nibble.
  float y[32];
  ggml::dequantize_q4_0(block, y);
  for (int j = 0; j < 16; ++j) {
    INFO("j = " << j);
    CHECK(static_cast<double>(y[j]) == (static_cast<int>(expected[j] & 0xF) - 8) * 0.9375);
    CHECK(static_cast<double>(y[j + 16]) == (static_cast<int>(expected[j] >> 4) - 8) * 0.9375);
  }
  CHECK(six_digits(rmse(x.data(), y)) == "0.141362");
}

TEST_CASE("q8_0 rounds half away from zero like roundf", "[quant]") {
  // amax = 127 makes d = 1 and id = 1 exactly, so the codes are round(x) of the inputs.
  float x[32] = {};
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 0.5f;
  x[4] = -0.5f;
  x[5] = 1.5f;
  x[6] = 0.49f;
  x[7] = -127.0f;
  x[8] = -126.5f;
  const ggml::BlockQ8_0 block = ggml::quantize_q8_0(x);
  CHECK(hex(block.d) == hex(0x3C00));  // 1.0
  const int expected[9] = {127, 3, -3, 1, -1, 2, 0, -127, -127};
  for (int j = 0; j < 9; ++j) {
    INFO("x = " << x[j]);
    CHECK(static_cast<int>(block.qs[j]) == expected[j]);
  }
  for (int j = 9; j < 32; ++j) CHECK(block.qs[j] == 0);
}

TEST_CASE("q4_0 truncates x/d + 8.5 and clamps at 15, as ggml does", "[quant]") {
  SECTION("largest magnitude negative: d > 0") {
    float x[32] = {};
    x[0] = -8.0f;  // m = -8, d = 1, id = 1
    x[1] = 8.0f;   // 16.5 -> 16 -> clamped to 15, decodes to 7
    x[2] = -0.5f;  // 8.0 -> 8: truncation, where round-half-away would give 7
    x[3] = 0.5f;   // 9.0 -> 9
    x[4] = -1.5f;  // 7.0 -> 7 (rounding away from zero would give 6)
    x[5] = 1.5f;   // 10.0 -> 10
    x[6] = 7.4f;   // 15.9 -> 15
    x[7] = 6.4f;   // 14.9 -> 14
    x[8] = -7.6f;  // 0.9 -> 0
    x[9] = -7.4f;  // 1.1 -> 1
    x[16] = 3.0f;  // 11.5 -> 11
    x[17] = -3.0f; // 5.5 -> 5
    const ggml::BlockQ4_0 block = ggml::quantize_q4_0(x);
    CHECK(hex(block.d) == hex(0x3C00));
    const unsigned lo[10] = {0, 15, 8, 9, 7, 10, 15, 14, 0, 1};
    for (int j = 0; j < 16; ++j) {
      INFO("byte " << j);
      const unsigned low = j < 10 ? lo[j] : 8u;  // zeros encode as 8
      const unsigned high = j == 0 ? 11u : j == 1 ? 5u : 8u;
      CHECK(hex(block.qs[j]) == hex(low | (high << 4)));
    }
    float y[32];
    ggml::dequantize_q4_0(block, y);
    CHECK(y[0] == -8.0f);
    CHECK(y[1] == 7.0f);
    CHECK(y[2] == 0.0f);
    CHECK(y[16] == 3.0f);
    CHECK(y[17] == -3.0f);
  }
  SECTION("largest magnitude positive: d < 0") {
    float x[32] = {};
    x[0] = 8.0f;   // m = 8, d = -1
    x[1] = -8.0f;  // x*id = 8 -> 16.5 -> clamped to 15, decodes to -7
    x[2] = 2.0f;   // -2 + 8.5 = 6.5 -> 6
    const ggml::BlockQ4_0 block = ggml::quantize_q4_0(x);
    CHECK(hex(block.d) == hex(0xBC00));  // -1.0
    CHECK(hex(block.qs[0]) == hex(0x80));
    CHECK(hex(block.qs[1]) == hex(0x8F));
    CHECK(hex(block.qs[2]) == hex(0x86));
    float y[32];
    ggml::dequantize_q4_0(block, y);
    CHECK(y[0] == 8.0f);
    CHECK(y[1] == -7.0f);
    CHECK(y[2] == 2.0f);
  }
  SECTION("ties on |x| keep the first element's sign") {
    float a[32] = {};
    a[3] = -4.0f;
    a[9] = 4.0f;
    CHECK(hex(ggml::quantize_q4_0(a).d) == hex(0x3800));  // m = -4: d = 0.5
    float b[32] = {};
    b[3] = 4.0f;
    b[9] = -4.0f;
    CHECK(hex(ggml::quantize_q4_0(b).d) == hex(0xB800));  // m = 4: d = -0.5
  }
}

TEST_CASE("all-zero ggml blocks have scale 0 and decode to zeros", "[quant]") {
  const float x[32] = {};
  const ggml::BlockQ8_0 b8 = ggml::quantize_q8_0(x);
  CHECK(ref_fp16_value(b8.d) == 0.0);
  for (int j = 0; j < 32; ++j) CHECK(b8.qs[j] == 0);
  const ggml::BlockQ4_0 b4 = ggml::quantize_q4_0(x);
  CHECK(ref_fp16_value(b4.d) == 0.0);  // ggml stores 0 / -8 = -0
  for (int j = 0; j < 16; ++j) CHECK(hex(b4.qs[j]) == hex(0x88));  // code 8 stands for 0
  float y[32];
  ggml::dequantize_q8_0(b8, y);
  for (float v : y) CHECK(v == 0.0f);
  ggml::dequantize_q4_0(b4, y);
  for (float v : y) CHECK(v == 0.0f);
}

TEST_CASE("ggml quantizers match the independent reference on random blocks", "[quant]") {
  std::mt19937 rng(20240611);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> decade(-7, 3);  // x30 outliers stay below q4_0's 8 * 65504
  Mismatches m8;
  Mismatches m4;
  float x[32];
  for (int trial = 0; trial < 3000; ++trial) {
    const float scale = std::pow(10.0f, static_cast<float>(decade(rng)));
    for (float& v : x) v = normal(rng) * scale;
    if (trial % 5 == 1) x[trial % 32] *= 30.0f;  // an outlier
    if (trial % 7 == 2) x[(trial + 3) % 32] = -x[trial % 32];  // a |x| tie of opposite sign

    const ggml::BlockQ8_0 b8 = ggml::quantize_q8_0(x);
    const RefQ8 r8 = ref_q8_0(x);
    bool same8 = b8.d == r8.d;
    for (int j = 0; j < 32; ++j) same8 = same8 && b8.qs[j] == r8.q[j];
    if (!same8) m8.add("q8_0 trial " + std::to_string(trial) + ": d " + hex(b8.d) + " vs " + hex(r8.d));

    const ggml::BlockQ4_0 b4 = ggml::quantize_q4_0(x);
    const RefQ4 r4 = ref_q4_0(x);
    bool same4 = b4.d == r4.d;
    for (int j = 0; j < 16; ++j) {
      same4 = same4 && b4.qs[j] == static_cast<std::uint8_t>(r4.q[j] | (r4.q[j + 16] << 4));
    }
    if (!same4) m4.add("q4_0 trial " + std::to_string(trial) + ": d " + hex(b4.d) + " vs " + hex(r4.d));

    // Dequantization error from the math of the formats (quant_test_support.hpp).
    float y[32];
    ggml::dequantize_q8_0(b8, y);
    const double amax = row_absmax(x, 32);
    for (int j = 0; j < 32; ++j) {
      const double bound = int8_error_bound(amax);
      if (std::fabs(static_cast<double>(x[j]) - y[j]) > bound) {
        m8.add("q8_0 trial " + std::to_string(trial) + " j=" + std::to_string(j) + " x=" +
               fmt(x[j]) + " y=" + fmt(y[j]) + " bound=" + fmt(bound));
      }
    }
    ggml::dequantize_q4_0(b4, y);
    for (int j = 0; j < 32; ++j) {
      const double bound = q4_0_error_bound(amax, /*may_clamp=*/r4.q[j] == 15);
      if (std::fabs(static_cast<double>(x[j]) - y[j]) > bound) {
        m4.add("q4_0 trial " + std::to_string(trial) + " j=" + std::to_string(j) + " x=" +
               fmt(x[j]) + " y=" + fmt(y[j]) + " bound=" + fmt(bound));
      }
    }
  }
  report(m8);
  report(m4);
}

TEST_CASE("ggml dequantizers decode every code", "[quant]") {
  const std::uint16_t scales[] = {0x2b8f, 0x3C00, 0xB800, 0x0001, 0x7BFF};
  for (std::uint16_t dbits : scales) {
    INFO("d = " << hex(dbits));
    const double d = ref_fp16_value(dbits);
    Mismatches m;
    for (int base = -128; base < 128; base += 32) {
      ggml::BlockQ8_0 b8{};
      b8.d = dbits;
      for (int j = 0; j < 32; ++j) b8.qs[j] = static_cast<std::int8_t>(base + j);
      float y[32];
      ggml::dequantize_q8_0(b8, y);
      for (int j = 0; j < 32; ++j) {
        const double expected = static_cast<double>(static_cast<float>((base + j) * d));
        if (static_cast<double>(y[j]) != expected) m.add("q8_0 code " + std::to_string(base + j));
      }
    }
    for (int base = 0; base < 256; base += 16) {
      ggml::BlockQ4_0 b4{};
      b4.d = dbits;
      for (int j = 0; j < 16; ++j) b4.qs[j] = static_cast<std::uint8_t>(base + j);
      float y[32];
      ggml::dequantize_q4_0(b4, y);
      for (int j = 0; j < 16; ++j) {
        const int byte = base + j;
        const double lo = static_cast<double>(static_cast<float>(((byte & 0xF) - 8) * d));
        const double hi = static_cast<double>(static_cast<float>(((byte >> 4) - 8) * d));
        if (static_cast<double>(y[j]) != lo || static_cast<double>(y[j + 16]) != hi) {
          m.add("q4_0 byte " + hex(static_cast<unsigned>(byte)));
        }
      }
    }
    report(m);
  }
}
