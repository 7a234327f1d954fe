// The cache's write-path kernels (kernels/cpu/convert.hpp) on every instruction set this CPU
// runs: widening fp16/bf16 input must give exactly half.hpp's conversion for every one of the
// 65536 patterns (but that F16C sets a signaling NaN's quiet bit), and encoding a Float page plane must write exactly the bytes of the codec's
// scalar `encode`, over random 32-bit patterns (every NaN payload, Inf, fp32 subnormals), ties,
// the fp16 overflow edge, head_dim and page sizes that are not multiples of a vector, and rows
// further apart than head_dim. Nothing outside the plane may be written. The same holds for the
// Int8, Q8_0, Q4_0 and KIVI encoders (encode_*.hpp), whose rows add exact rounding ties or code
// boundaries and their neighbours, signed zeros, constant groups and scales that overflow.

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string_view>
#include <vector>

#include "kvpack/kvpack.hpp"

namespace {

using namespace kvpack;

template <class T>
void check_widening() {
  using Kernel = kernels::cpu::WidenToFloat<T>;
  std::vector<T> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = T::from_bits(static_cast<std::uint16_t>(i));
  int isas = 0;
  dispatch::for_each_runnable_isa<Kernel>([&](std::string_view isa, dispatch::CpuFunction<Kernel> widen) {
    ++isas;
    // The whole table, then short runs at odd offsets for the scalar remainder.
    for (const std::size_t count : {std::size_t{65536}, std::size_t{1}, std::size_t{7}, std::size_t{17},
                                    std::size_t{31}, std::size_t{0}}) {
      const std::size_t offset = count == 65536 ? 0 : 40961;
      std::vector<float> out(count + 1, -7.0f);
      widen({all.data() + offset, out.data(), count});
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < count; ++i) {
        const auto expected = std::bit_cast<std::uint32_t>(static_cast<float>(all[offset + i]));
        const auto got = std::bit_cast<std::uint32_t>(out[i]);
        // F16C quiets a signaling NaN (sign and payload kept); half.hpp keeps the bits as they are.
        const bool quieted = std::isnan(out[i]) && got == (expected | 0x00400000u);
        wrong += got != expected && !quieted;
      }
      INFO(isa << ": " << wrong << " of " << count << " conversions differ");
      CHECK(wrong == 0);
      CHECK(out[count] == -7.0f);  // nothing past the end
    }
  });
  CHECK(isas >= 1);
}

/// Rows of `row_stride` floats: random bit patterns, then edge cases in the first rows.
std::vector<float> adversarial_rows(index_t page_size, std::ptrdiff_t row_stride, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> rows(static_cast<std::size_t>(page_size) * row_stride);
  for (float& x : rows) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
  const float edges[] = {0.0f, -0.0f, 65504.0f, 65519.996f, 65520.0f, -65520.0f, 1.0f + 0x1p-11f, 1.0f + 0x1p-10f + 0x1p-11f,
                         0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1p-14f, 0x1.ffcp-15f, 1e-40f, -1e-45f,
                         std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                         std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0xFFC00000u),
                         std::bit_cast<float>(0x7FBFE000u), 1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-7f, 3.4e38f};
  for (std::size_t i = 0; i < std::size(edges) && i < rows.size(); ++i) rows[i * 3 % rows.size()] = edges[i];
  return rows;
}

/// The kernel's plane must be the codec's scalar `encode`, byte for byte, on every ISA that does
/// not decline the page. AVX-512 must encode it unless `may_decline` (KIVI's pages with NaN);
/// a declining kernel must not write.
template <class Codec>
void check_plane_encoding(quant::PageGeometry g, std::ptrdiff_t row_stride, const std::vector<float>& rows,
                          bool may_decline = false) {
  using Kernel = kernels::cpu::EncodePlane<Codec>;
  const Codec codec{};
  const std::size_t bytes = codec.plane_bytes(g);
  std::vector<std::byte> expected(bytes);
  codec.encode(g, rows.data(), row_stride, {}, expected.data());
  int isas = 0;
  dispatch::for_each_runnable_isa<Kernel>([&](std::string_view isa, dispatch::CpuFunction<Kernel> encode) {
    ++isas;
    std::vector<std::byte> got(bytes + 64, std::byte{0xAB});  // garbage, and a guard after the plane
    bool declined = false;
    encode({rows.data(), row_stride, g.page_size, g.head_dim, got.data(), &declined});
    INFO(isa << " " << Codec::kName << (declined ? " declined" : " encoded") << " the page");
    if (isa == "avx512" && !may_decline) CHECK_FALSE(declined);
    if (declined) {
      CHECK(std::count(got.begin(), got.end(), std::byte{0xAB}) == static_cast<std::ptrdiff_t>(got.size()));
      return;
    }
    std::size_t wrong = 0, guard = 0;
    for (std::size_t i = 0; i < bytes; ++i) wrong += got[i] != expected[i];
    for (std::size_t i = bytes; i < got.size(); ++i) guard += got[i] != std::byte{0xAB};
    INFO(isa << " " << Codec::kName << (Codec::kPlane == Plane::kKey ? " keys" : " values") << " page_size "
             << g.page_size << " head_dim " << g.head_dim << " row_stride " << row_stride << ": " << wrong << " of "
             << bytes << " bytes differ");
    CHECK(wrong == 0);
    CHECK(guard == 0);
  });
  CHECK(isas >= 1);
}

template <class T>
void check_encodings() {
  for (const quant::PageGeometry g : {quant::PageGeometry{32, 128}, quant::PageGeometry{16, 12},
                                      quant::PageGeometry{7, 20}, quant::PageGeometry{64, 8}}) {
    for (const std::ptrdiff_t stride : {std::ptrdiff_t{g.head_dim}, std::ptrdiff_t{g.head_dim} * 3 + 5}) {
      const std::vector<float> rows = adversarial_rows(g.page_size, stride, 1000 + g.head_dim);
      check_plane_encoding<quant::FloatCodec<T, Plane::kKey>>(g, stride, rows);
      check_plane_encoding<quant::FloatCodec<T, Plane::kValue>>(g, stride, rows);
    }
  }
}

/// page_size rows `row_stride` floats apart (NaN past head_dim), row t filled by fill(t, row, rng).
template <class Fill>
std::vector<float> rows_of_families(index_t page_size, std::ptrdiff_t row_stride, std::uint32_t seed, Fill fill) {
  std::mt19937 rng(seed);
  std::vector<float> rows(static_cast<std::size_t>(page_size) * row_stride, std::nanf(""));
  for (index_t t = 0; t < page_size; ++t) fill(t, rows.data() + static_cast<std::ptrdiff_t>(t) * row_stride, rng);
  return rows;
}

/// Rows for the 8-bit integer encoders, one data family per token: Gaussian with an outlier
/// channel (and NaN in some); exact ties of the rounding (d = 2^s, so x·(1/d) = k + 1/2
/// exactly); the floats either side of those ties; zeros next to scales so small that 1/d
/// overflows to infinity; and random 32-bit patterns (NaN, Inf, huge and subnormal values).
std::vector<float> int8_rows(index_t page_size, index_t head_dim, std::ptrdiff_t row_stride, std::uint32_t seed) {
  return rows_of_families(page_size, row_stride, seed, [&](index_t t, float* row, std::mt19937& rng) {
    std::normal_distribution<float> gaussian;
    const float power = std::ldexp(1.0f, t % 7 - 3);
    for (index_t c = 0; c < head_dim; ++c) {
      const float tie = (static_cast<float>(rng() % 254) - 127.0f + 0.5f) * power;  // |tie| ≤ 126.5·2^s
      const float peak = (c % 2 ? 127.0f : -127.0f) * power;                        // d = 2^s per 32 channels
      switch (t % 5) {
        case 0:  // NaN at the end of a scale group in every other such row: a maximum must skip it
          row[c] = gaussian(rng) * (c == 3 ? 40.0f : 1.0f);
          if (t % 10 == 5 && (c % 32 == 31 || c == head_dim - 1)) row[c] = std::nanf("");
          break;
        case 1: row[c] = c % 32 == 5 ? peak : tie; break;
        case 2: row[c] = c % 32 == 5 ? peak : std::nextafter(tie, rng() % 2 ? 0.0f : 1000.0f); break;
        case 3: row[c] = c < 32 ? 0.0f : (c % 3 == 0 ? 1e-38f : -0.0f); break;
        default: row[c] = std::bit_cast<float>(static_cast<std::uint32_t>(rng())); break;
      }
    }
  });
}

/// Rows for the q4_0 encoder, one data family per token: Gaussian with an outlier channel (NaN in
/// some); values on the code boundaries x = (n - 8.5)·d for an inexact 1/d, and the floats either
/// side; the largest magnitude twice with both signs, so the first one must set the sign of d;
/// zeros and -0 next to scales whose inverse overflows; random 32-bit patterns.
std::vector<float> q4_0_rows(index_t page_size, index_t head_dim, std::ptrdiff_t row_stride, std::uint32_t seed) {
  return rows_of_families(page_size, row_stride, seed, [&](index_t t, float* row, std::mt19937& rng) {
    std::normal_distribution<float> gaussian;
    const float peak = static_cast<float>(1 + rng() % 997) / 7.0f;  // d = peak / -8, 1/d inexact
    const float d = peak / -8.0f;
    for (index_t c = 0; c < head_dim; ++c) {
      const float boundary = (static_cast<float>(1 + rng() % 15) - 8.5f) * d;
      switch (t % 5) {
        case 0:
          row[c] = gaussian(rng) * (c == 3 ? 40.0f : 1.0f);
          if (t % 10 == 5 && c % 32 == 31) row[c] = std::nanf("");
          break;
        case 1: {
          const float toward = rng() % 3 == 0 ? 0.0f : rng() % 2 ? 1e3f : -1e3f;
          row[c] = c % 32 == 7 ? peak : std::nextafter(boundary, toward);
          break;
        }
        case 2: row[c] = c % 32 == 9 ? -peak : c % 32 == 20 ? peak : boundary; break;
        case 3: row[c] = c < 32 ? (c % 2 ? -0.0f : 0.0f) : (c % 3 == 0 ? 1e-38f : -0.0f); break;
        default: row[c] = std::bit_cast<float>(static_cast<std::uint32_t>(rng())); break;
      }
    }
  });
}

template <template <Plane> class Codec>
void check_int8_encodings(std::initializer_list<quant::PageGeometry> geometries) {
  for (const quant::PageGeometry g : geometries) {
    for (const std::ptrdiff_t stride : {std::ptrdiff_t{g.head_dim}, std::ptrdiff_t{g.head_dim} * 2 + 3}) {
      const std::vector<float> rows = int8_rows(g.page_size, g.head_dim, stride, 2000 + g.head_dim);
      check_plane_encoding<Codec<Plane::kKey>>(g, stride, rows);
      check_plane_encoding<Codec<Plane::kValue>>(g, stride, rows);
    }
  }
}

/// Rows for the KIVI encoders, one data family per token (so every key group mixes them): Gaussian
/// with an outlier channel; exact rounding ties (a group spans [0, 2^b − 1], so s = 1 and
/// (x − min') / s = k + 1/2); +0 and −0 as the smallest and largest values; constant rows (s = 0);
/// ±Inf; huge values whose range overflows; and, in `with_nan` rows, NaN. `only_family` ≥ 0
/// gives every token that family, so key groups (along tokens) see ties and signed zeros too.
std::vector<float> kivi_rows(index_t page_size, index_t head_dim, std::ptrdiff_t row_stride, int bits, bool with_nan,
                             int only_family, std::uint32_t seed) {
  const float top = static_cast<float>((1 << bits) - 1);
  return rows_of_families(page_size, row_stride, seed, [&](index_t t, float* row, std::mt19937& rng) {
    std::normal_distribution<float> gaussian;
    for (index_t c = 0; c < head_dim; ++c) {
      const float tie = static_cast<float>(rng() % (1 << bits)) + (rng() % 2 ? 0.5f : 0.0f);
      switch (only_family >= 0 ? only_family : t % 7) {
        case 0: row[c] = gaussian(rng) * (c == 3 ? 40.0f : 1.0f); break;
        case 1: row[c] = c % 8 == 0 ? 0.0f : c % 8 == 1 ? top : (tie > top ? top : tie); break;
        case 2: row[c] = 0.1f; break;  // not an fp16 value: x − min' ≠ 0 where s = 0
        case 3: row[c] = c % 3 == 0 ? -0.0f : c % 3 == 1 ? 0.0f : gaussian(rng) > 0 ? -0.0f : 0.0f; break;
        case 4: row[c] = c % 5 == 0 ? INFINITY : c % 5 == 1 ? -INFINITY : gaussian(rng); break;
        case 5: row[c] = (rng() % 2 ? 3e38f : -3e38f) * (c % 4 == 0 ? 1.0f : 0.5f); break;
        default: row[c] = with_nan && c % 6 == 5 ? std::nanf("") : static_cast<float>(c % 7); break;
      }
    }
  });
}

template <int Bits, int Group>
void check_kivi_encodings() {
  using Keys = quant::KiviKeyCodec<Bits, Group>;
  using Values = quant::KiviValueCodec<Bits, Group>;
  using TokenKeys = quant::KiviTokenCodec<Bits, Group, Plane::kKey>;
  // head_dim 12 and 40 leave part of a vector of channels (keys); two groups per page.
  for (const quant::PageGeometry g : {quant::PageGeometry{Group, 128}, quant::PageGeometry{2 * Group, 12},
                                      quant::PageGeometry{Group, 40}, quant::PageGeometry{2 * Group, 256}}) {
    for (const std::ptrdiff_t stride : {std::ptrdiff_t{g.head_dim}, std::ptrdiff_t{g.head_dim} * 2 + 3}) {
      for (const bool with_nan : {false, true}) {
        for (const int family : {-1, 1, 2, 3, 6}) {
          const std::vector<float> rows =
              kivi_rows(g.page_size, g.head_dim, stride, Bits, with_nan, family, 4000 + g.head_dim);
          check_plane_encoding<Keys>(g, stride, rows, with_nan);
          if (g.head_dim % Group != 0) continue;
          check_plane_encoding<Values>(g, stride, rows, with_nan);
          check_plane_encoding<TokenKeys>(g, stride, rows, with_nan);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("every ISA widens all 65536 fp16 and bf16 patterns exactly as half.hpp does", "[kernels][cpu][write]") {
  check_widening<half>();
  check_widening<bfloat16>();
}

TEST_CASE("every ISA encodes Float pages with exactly the codec's scalar bytes", "[kernels][cpu][write]") {
  check_encodings<half>();
  check_encodings<bfloat16>();
  check_encodings<float>();
}

TEST_CASE("every ISA encodes Int8 and Q8_0 pages with exactly the codec's scalar bytes", "[kernels][cpu][write]") {
  // head_dim 8, 24 and 40 leave a half vector; 2048 is Q8_0's largest (64 scale blocks).
  check_int8_encodings<quant::Int8Codec>({quant::PageGeometry{2, 8}, quant::PageGeometry{16, 24},
                                          quant::PageGeometry{32, 128}, quant::PageGeometry{10, 40},
                                          quant::PageGeometry{4, 1096}});
  check_int8_encodings<quant::Q8_0Codec>({quant::PageGeometry{2, 32}, quant::PageGeometry{16, 96},
                                          quant::PageGeometry{32, 128}, quant::PageGeometry{6, 2048}});
}

TEST_CASE("every ISA encodes Q4_0 pages with exactly the codec's scalar bytes", "[kernels][cpu][write]") {
  using Keys = quant::Q4_0Codec<Plane::kKey>;
  using Values = quant::Q4_0Codec<Plane::kValue>;
  for (const quant::PageGeometry g : {quant::PageGeometry{4, 32}, quant::PageGeometry{16, 96},
                                      quant::PageGeometry{32, 128}, quant::PageGeometry{12, 2048}}) {
    for (const std::ptrdiff_t stride : {std::ptrdiff_t{g.head_dim}, std::ptrdiff_t{g.head_dim} * 2 + 3}) {
      const std::vector<float> rows = q4_0_rows(g.page_size, g.head_dim, stride, 3000 + g.head_dim);
      check_plane_encoding<Keys>(g, stride, rows);
      check_plane_encoding<Values>(g, stride, rows);
    }
  }
}

TEST_CASE("every ISA encodes Q4_0 pages as the scalar encoder does under any rounding mode", "[kernels][cpu][write]") {
  // The scalar encoder rounds its products by the current mode; the AVX-512 one rounded to
  // nearest whatever it was until 2026-12-07, so codes near a boundary differed.
  for (const int mode : {FE_TOWARDZERO, FE_UPWARD, FE_DOWNWARD}) {
    const quant::PageGeometry g{32, 128};
    const std::vector<float> rows = q4_0_rows(g.page_size, g.head_dim, g.head_dim, 3100 + mode);
    REQUIRE(std::fesetround(mode) == 0);
    check_plane_encoding<quant::Q4_0Codec<Plane::kKey>>(g, g.head_dim, rows);
    check_plane_encoding<quant::Q4_0Codec<Plane::kValue>>(g, g.head_dim, rows);
    REQUIRE(std::fesetround(FE_TONEAREST) == 0);
  }
}

TEST_CASE("every ISA encodes KIVI pages with exactly the codec's scalar bytes", "[kernels][cpu][write]") {
  check_kivi_encodings<2, 32>();
  check_kivi_encodings<4, 32>();
  check_kivi_encodings<2, 64>();
  check_kivi_encodings<4, 128>();
  check_kivi_encodings<2, 128>();
  check_kivi_encodings<4, 64>();
}
