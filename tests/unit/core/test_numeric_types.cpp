/// \file test_numeric_types.cpp
/// \brief Exhaustive and sampled checks of half, bfloat16, fp8_e4m3fn and fp8_e5m2 conversions.
///
/// Every oracle here is independent of the headers under test: the compiler's own `_Float16`
/// conversions where available, and decoders / nearest-value searches written from the format
/// definitions in double arithmetic with std::ldexp.

#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvpack/core/fp8.hpp"
#include "kvpack/core/half.hpp"

// GCC 12 and clang >= 15 provide _Float16 on x86-64; __FLT16_MAX__ is defined exactly then.
#if defined(__FLT16_MAX__)
#define KVPACK_TEST_HAS_FLOAT16 1
#else
#define KVPACK_TEST_HAS_FLOAT16 0
#endif

namespace {

using kvpack::bfloat16;
using kvpack::fp8_e4m3fn;
using kvpack::fp8_e5m2;
using kvpack::half;
namespace detail = kvpack::detail;

constexpr float kInf = std::numeric_limits<float>::infinity();

// The headers must be usable in constant expressions.
static_assert(detail::float_to_half_bits(1.0f) == 0x3C00);
static_assert(detail::half_bits_to_float(0x0001) == 0x1p-24f);
static_assert(detail::float_to_bfloat16_bits(1.0f) == 0x3F80);
static_assert(detail::bfloat16_bits_to_float(0xC000) == -2.0f);
static_assert(detail::float_to_e4m3fn_bits(448.0f) == 0x7E);
static_assert(detail::e4m3fn_bits_to_float(0x01) == 0x1p-9f);
static_assert(detail::float_to_e5m2_bits(57344.0f) == 0x7B);
static_assert(detail::e5m2_bits_to_float(0x01) == 0x1p-16f);
static_assert(static_cast<float>(half(0.5f)) == 0.5f);
static_assert(static_cast<float>(fp8_e4m3fn(-3.0f)) == -3.0f);

std::string describe(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", x);
  return buf;
}

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%X", v);
  return buf;
}

/// Counts failures in the big loops and keeps a few messages; one CHECK per loop keeps Catch2's
/// per-assertion cost out of the millions of comparisons.
struct Mismatches {
  std::size_t count = 0;
  std::vector<std::string> first;

  void add(std::string message) {
    if (first.size() < 8) first.push_back(std::move(message));
    ++count;
  }
};

void report(const Mismatches& m) {
  for (const std::string& s : m.first) UNSCOPED_INFO(s);
  CHECK(m.count == 0);
}

/// Appends x, -x to `out`.
void push_both_signs(std::vector<float>& out, float x) {
  out.push_back(x);
  out.push_back(-x);
}

/// For ascending code values `vals[0..n)`, appends every value, every midpoint between neighbours
/// and the floats one ulp either side of each midpoint, with both signs.
void push_grid(std::vector<float>& out, const std::vector<double>& vals) {
  for (std::size_t i = 0; i < vals.size(); ++i) {
    push_both_signs(out, static_cast<float>(vals[i]));
    if (i + 1 == vals.size()) break;
    const double mid = 0.5 * (vals[i] + vals[i + 1]);
    const auto fmid = static_cast<float>(mid);
    REQUIRE(static_cast<double>(fmid) == mid);  // the generator relies on exact midpoints
    push_both_signs(out, fmid);
    push_both_signs(out, std::nextafter(fmid, 0.0f));
    push_both_signs(out, std::nextafter(fmid, kInf));
  }
}

/// Nearest entry of ascending `vals` to `ax` >= 0, ties to the even index. Values at or above the
/// last entry map to the last index. For IEEE-style encodings the index is the magnitude code and
/// an even code is an even mantissa, so this is round-to-nearest-even.
std::size_t ref_nearest_index(double ax, const std::vector<double>& vals) {
  if (ax >= vals.back()) return vals.size() - 1;
  std::size_t lo = 0;
  std::size_t hi = vals.size() - 1;  // invariant: vals[lo] <= ax < vals[hi]
  while (hi - lo > 1) {
    const std::size_t mid = (lo + hi) / 2;
    (vals[mid] <= ax ? lo : hi) = mid;
  }
  const double d_lo = ax - vals[lo];
  const double d_hi = vals[hi] - ax;
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo % 2 == 0) ? lo : hi;
}

std::vector<float> random_floats(std::uint32_t seed, std::size_t n, int min_exp, int max_exp) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::uint32_t> bits_dist;
  std::uniform_int_distribution<int> exp_dist(min_exp, max_exp);
  std::vector<float> out;
  out.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back(std::bit_cast<float>(bits_dist(rng)));  // any pattern, NaN and inf included
    const std::uint32_t r = bits_dist(rng);
    const auto biased = static_cast<std::uint32_t>(exp_dist(rng) + 127);
    out.push_back(std::bit_cast<float>((r & 0x807FFFFFu) | (biased << 23)));  // in the range
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// binary16
// ------------------------------------------------------------------------------------------------

/// binary16 decoded from its definition: (-1)^s * 2^(e-15) * 1.m, subnormal 2^-14 * 0.m.
double ref_half_decode(std::uint16_t h) {
  const int sign = h >> 15;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  double v = 0.0;
  if (e == 0x1F) {
    v = (m == 0) ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else {
    v = std::ldexp(static_cast<double>(1024 + m), e - 25);
  }
  return sign ? -v : v;
}

bool half_is_nan(std::uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0; }

/// Positive binary16 magnitudes by code 0..0x7C00, with 2^16 standing in for inf: IEEE rounds to
/// inf exactly when the nearest-even choice between 65504 and 2^16 is 2^16.
const std::vector<double>& half_table() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t c = 0; c < 0x7C00; ++c)
      t.push_back(ref_half_decode(static_cast<std::uint16_t>(c)));
    t.push_back(65536.0);
    return t;
  }();
  return table;
}

/// Independent float -> binary16 by nearest search; NaN returns 0x7E00 (compare as "is NaN").
std::uint16_t ref_half_encode(float x) {
  if (std::isnan(x)) return 0x7E00;
  const auto sign = static_cast<std::uint16_t>(std::signbit(x) ? 0x8000 : 0);
  const std::size_t code = ref_nearest_index(std::fabs(static_cast<double>(x)), half_table());
  return static_cast<std::uint16_t>(sign | code);
}

#if KVPACK_TEST_HAS_FLOAT16
std::uint16_t compiler_half_encode(float x) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
}
float compiler_half_decode(std::uint16_t h) {
  return static_cast<float>(std::bit_cast<_Float16>(h));
}
#endif

/// Compares an encoding against an oracle: bitwise, except NaN where only "NaN with the same
/// sign" is required.
void expect_half_code(Mismatches& m, float x, std::uint16_t got, std::uint16_t want,
                      const char* oracle) {
  const bool ok = half_is_nan(want) ? (half_is_nan(got) && std::signbit(x) == ((got & 0x8000) != 0))
                                    : got == want;
  if (!ok)
    m.add(std::string(oracle) + ": x=" + describe(x) + " got " + hex(got) + " want " + hex(want));
}

TEST_CASE("half: all 65536 codes decode exactly", "[core][half]") {
  Mismatches m;
  for (std::uint32_t c = 0; c <= 0xFFFF; ++c) {
    const auto h = static_cast<std::uint16_t>(c);
    const float got = detail::half_bits_to_float(h);
    const double want = ref_half_decode(h);
    if (std::isnan(want)) {
      if (!std::isnan(got) || std::signbit(got) != ((c & 0x8000) != 0)) m.add("ldexp: " + hex(c));
    } else if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
      m.add("ldexp: " + hex(c) + " got " + describe(got) + " want " + describe(want));
    }
#if KVPACK_TEST_HAS_FLOAT16
    const float cf = compiler_half_decode(h);
    const bool same = std::isnan(cf)
                          ? std::isnan(got)
                          : std::bit_cast<std::uint32_t>(cf) == std::bit_cast<std::uint32_t>(got);
    if (!same) m.add("_Float16: " + hex(c) + " got " + describe(got) + " want " + describe(cf));
#endif
    if (std::bit_cast<std::uint32_t>(static_cast<float>(half::from_bits(h))) !=
        std::bit_cast<std::uint32_t>(got)) {
      m.add("half::operator float disagrees with detail at " + hex(c));
    }
  }
  report(m);
}

TEST_CASE("half: float -> half rounds to nearest even", "[core][half]") {
  std::vector<float> xs;
  push_grid(xs, half_table());  // exact values, midpoints (incl. 65520), +-1 ulp around them
  for (float x : {0.0f, 65504.0f, std::nextafter(65520.0f, 0.0f), 65520.0f,
                  std::nextafter(65520.0f, kInf), 65536.0f, 1e6f, std::numeric_limits<float>::max(),
                  kInf, std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  0x1p-25f, std::nextafter(0x1p-25f, kInf), std::nextafter(0x1p-25f, 0.0f),
                  0x1p-24f, 0x1.8p-24f, 0x1p-14f, std::nextafter(0x1p-14f, 0.0f)}) {
    push_both_signs(xs, x);
  }
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0x7FA00000u, 0x7F802000u, 0x7FFFFFFFu}) {
    push_both_signs(xs, std::bit_cast<float>(nan));
  }
  const std::vector<float> random = random_floats(0x5EED16u, 1u << 19, -27, 16);
  xs.insert(xs.end(), random.begin(), random.end());

  Mismatches m;
  for (float x : xs) {
    const std::uint16_t got = detail::float_to_half_bits(x);
    expect_half_code(m, x, got, ref_half_encode(x), "nearest-search");
#if KVPACK_TEST_HAS_FLOAT16
    expect_half_code(m, x, got, compiler_half_encode(x), "_Float16");
#endif
    if (half(x).bits != got) m.add("half(float) disagrees with detail at " + describe(x));
  }
  INFO("checked " << xs.size() << " floats, _Float16 oracle: " << KVPACK_TEST_HAS_FLOAT16);
  report(m);
}

TEST_CASE("half: spot values", "[core][half]") {
  CHECK(half(1.0f).bits == 0x3C00);
  CHECK(half(-2.0f).bits == 0xC000);
  CHECK(half(65504.0f).bits == 0x7BFF);
  CHECK(half(65519.99f).bits == 0x7BFF);
  CHECK(half(65520.0f).bits == 0x7C00);
  CHECK(half(-65520.0f).bits == 0xFC00);
  CHECK(half(-kInf).bits == 0xFC00);
  CHECK(half(0.0f).bits == 0x0000);
  CHECK(half(-0.0f).bits == 0x8000);
  CHECK(half(0x1p-24f).bits == 0x0001);
  CHECK(half(0x1p-25f).bits == 0x0000);                              // tie -> even zero
  CHECK(half(0x1.8p-24f).bits == 0x0002);                            // tie -> even subnormal
  CHECK(half(1.0f + 0x1p-11f).bits == 0x3C00);                       // tie -> even
  CHECK(half(1.0f + 0x3p-11f).bits == 0x3C02);                       // tie -> even
  CHECK(half_is_nan(half(std::bit_cast<float>(0x7F800001u)).bits));  // payload lost, still NaN
  CHECK(std::isnan(static_cast<float>(half::from_bits(0x7E00))));
  CHECK(static_cast<float>(half::from_bits(0x7BFF)) == 65504.0f);
  CHECK(static_cast<float>(half::from_bits(0x0400)) == 0x1p-14f);
}

// ------------------------------------------------------------------------------------------------
// bfloat16
// ------------------------------------------------------------------------------------------------

/// bfloat16 decoded from its definition: (-1)^s * 2^(e-127) * 1.m (7 bits), subnormal 2^-126 * 0.m.
double ref_bf16_decode(std::uint16_t b) {
  const int sign = b >> 15;
  const int e = (b >> 7) & 0xFF;
  const int m = b & 0x7F;
  double v = 0.0;
  if (e == 0xFF) {
    v = (m == 0) ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -133);
  } else {
    v = std::ldexp(static_cast<double>(128 + m), e - 134);
  }
  return sign ? -v : v;
}

/// Positive bfloat16 magnitudes by code 0..0x7F80, with 2^128 standing in for inf.
const std::vector<double>& bf16_table() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t c = 0; c < 0x7F80; ++c)
      t.push_back(ref_bf16_decode(static_cast<std::uint16_t>(c)));
    t.push_back(std::ldexp(1.0, 128));
    return t;
  }();
  return table;
}

bool bf16_is_nan(std::uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0; }

TEST_CASE("bfloat16: all 65536 codes decode exactly", "[core][bfloat16]") {
  Mismatches m;
  for (std::uint32_t c = 0; c <= 0xFFFF; ++c) {
    const auto b = static_cast<std::uint16_t>(c);
    const float got = detail::bfloat16_bits_to_float(b);
    // Oracle 1: bfloat16 is the top half of a float.
    if (std::bit_cast<std::uint32_t>(got) != (c << 16)) m.add("shift: " + hex(c));
    // Oracle 2, checking oracle 1 independently: the value from sign, exponent and mantissa.
    const double want = ref_bf16_decode(b);
    if (std::isnan(want)) {
      if (!std::isnan(got)) m.add("ldexp NaN: " + hex(c));
    } else if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
      m.add("ldexp: " + hex(c) + " got " + describe(got) + " want " + describe(want));
    }
    if (std::bit_cast<std::uint32_t>(static_cast<float>(bfloat16::from_bits(b))) != (c << 16)) {
      m.add("bfloat16::operator float disagrees at " + hex(c));
    }
  }
  report(m);
}

TEST_CASE("bfloat16: float -> bfloat16 rounds to nearest even", "[core][bfloat16]") {
  std::vector<float> xs;
  push_grid(xs, bf16_table());
  for (float x :
       {0.0f, std::numeric_limits<float>::max(), kInf, std::numeric_limits<float>::min(),
        std::numeric_limits<float>::denorm_min(), 0x1p-134f, 0x1.01p0f, 0x1.03p0f, 0x1.0101p0f}) {
    push_both_signs(xs, x);
  }
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0x7F80FFFFu, 0x7FFFFFFFu}) {
    push_both_signs(xs, std::bit_cast<float>(nan));
  }
  const std::vector<float> random = random_floats(0xBF16u, 1u << 19, -135, 127);
  xs.insert(xs.end(), random.begin(), random.end());

  Mismatches m;
  for (float x : xs) {
    const std::uint16_t got = detail::float_to_bfloat16_bits(x);
    if (std::isnan(x)) {
      if (!bf16_is_nan(got) || ((got & 0x8000) != 0) != std::signbit(x)) {
        m.add("NaN: x=" + hex(std::bit_cast<std::uint32_t>(x)) + " got " + hex(got));
      }
    } else {
      const std::size_t code = ref_nearest_index(std::fabs(static_cast<double>(x)), bf16_table());
      const auto want = static_cast<std::uint16_t>((std::signbit(x) ? 0x8000 : 0) | code);
      if (got != want) m.add("x=" + describe(x) + " got " + hex(got) + " want " + hex(want));
    }
    if (bfloat16(x).bits != got) m.add("bfloat16(float) disagrees with detail at " + describe(x));
  }
  report(m);
}

TEST_CASE("bfloat16: spot values", "[core][bfloat16]") {
  CHECK(bfloat16(1.0f).bits == 0x3F80);
  CHECK(bfloat16(-0.0f).bits == 0x8000);
  CHECK(bfloat16(0x1.01p0f).bits == 0x3F80);                          // tie -> even
  CHECK(bfloat16(0x1.03p0f).bits == 0x3F82);                          // tie -> even
  CHECK(bfloat16(std::numeric_limits<float>::max()).bits == 0x7F80);  // rounds past the midpoint
  CHECK(bfloat16(-kInf).bits == 0xFF80);
  CHECK(bf16_is_nan(bfloat16(std::bit_cast<float>(0x7F800001u)).bits));  // payload lost, NaN
}

// ------------------------------------------------------------------------------------------------
// FP8
// ------------------------------------------------------------------------------------------------

/// An OCP FP8 format, described from its definition only.
struct Fp8Format {
  int mant_bits;
  int bias;
  bool fn;  ///< E4M3FN: no inf, NaN only at S.1111.111; otherwise IEEE-style specials
};
constexpr Fp8Format kE4M3FN{3, 7, true};
constexpr Fp8Format kE5M2{2, 15, false};

double ref_fp8_decode(std::uint8_t code, Fp8Format f) {
  const int exp_bits = 7 - f.mant_bits;
  const int max_exp = (1 << exp_bits) - 1;
  const int sign = code >> 7;
  const int e = (code >> f.mant_bits) & max_exp;
  const int m = code & ((1 << f.mant_bits) - 1);
  double v = 0.0;
  if (f.fn && e == max_exp && m == (1 << f.mant_bits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (!f.fn && e == max_exp) {
    v = (m == 0) ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - f.bias - f.mant_bits);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.mant_bits), e - f.bias);
  }
  return sign ? -v : v;
}

/// Positive finite magnitudes, ascending, indexed by code.
std::vector<double> fp8_finite_values(Fp8Format f) {
  std::vector<double> vals;
  for (int c = 0; c < 0x80; ++c) {
    const double v = ref_fp8_decode(static_cast<std::uint8_t>(c), f);
    if (!std::isfinite(v)) break;
    vals.push_back(v);
  }
  return vals;
}

/// Satfinite RNE reference: linear search over all finite codes for the nearest value (so
/// anything beyond max, inf included, lands on max), ties to the even code. NaN returns -1.
int ref_fp8_encode(float x, Fp8Format f) {
  if (std::isnan(x)) return -1;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double ax = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x80; ++c) {
    const double v = ref_fp8_decode(static_cast<std::uint8_t>(c), f);
    if (!std::isfinite(v)) continue;
    if (ax >= v) {
      // Values ascend with the code. At or above a code, every smaller code is farther away;
      // deciding this by comparison rather than distance keeps huge inputs (whose double
      // distances to the two largest codes round to the same value) and inf exact.
      best = c;
      best_d = ax - v;
      continue;
    }
    const double d = std::fabs(ax - v);
    if (d < best_d || (d == best_d && c % 2 == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

template <typename T>
void check_fp8_decode_all(Fp8Format f, float (*decode)(std::uint8_t)) {
  Mismatches m;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float got = decode(code);
    const double want = ref_fp8_decode(code, f);
    if (std::isnan(want)) {
      if (!std::isnan(got) || std::signbit(got) != (c >= 0x80)) m.add("NaN code " + hex(c));
      if (!T::from_bits(code).is_nan()) m.add("is_nan false at " + hex(c));
    } else {
      if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
        m.add(hex(c) + " got " + describe(got) + " want " + describe(want));
      }
      if (T::from_bits(code).is_nan()) m.add("is_nan true at " + hex(c));
    }
    if (std::bit_cast<std::uint32_t>(static_cast<float>(T::from_bits(code))) !=
        std::bit_cast<std::uint32_t>(got)) {
      m.add("operator float disagrees with detail at " + hex(c));
    }
  }
  report(m);
}

template <typename T>
void check_fp8_encode(Fp8Format f, std::uint8_t (*encode)(float), std::uint8_t nan_code,
                      std::uint32_t seed) {
  const std::vector<double> vals = fp8_finite_values(f);
  const double max = vals.back();
  REQUIRE(max == static_cast<double>(T::kMax));
  const double max_ulp = max - vals[vals.size() - 2];
  const double half_min_sub = 0.5 * vals[1];

  std::vector<float> xs;
  push_grid(xs, vals);  // every code, every midpoint, +-1 ulp around each midpoint
  const auto fmax = static_cast<float>(max);
  const auto beyond = static_cast<float>(max + max_ulp / 2);  // would round up past max
  const auto fhalf = static_cast<float>(half_min_sub);
  for (float x :
       {std::nextafter(fmax, kInf), beyond, std::nextafter(beyond, 0.0f),
        std::nextafter(beyond, kInf), static_cast<float>(max + max_ulp), 2.0f * fmax, 1e30f,
        std::numeric_limits<float>::max(), kInf, fhalf, std::nextafter(fhalf, 0.0f),
        std::nextafter(fhalf, kInf), 0.5f * fhalf, std::numeric_limits<float>::min(),
        std::numeric_limits<float>::denorm_min(), 1e-30f, 0.0f}) {
    push_both_signs(xs, x);
  }
  const int min_exp = 1 - f.bias - f.mant_bits - 3;
  const int max_exp = static_cast<int>(std::log2(max)) + 3;
  const std::vector<float> random = random_floats(seed, 1u << 15, min_exp, max_exp);
  xs.insert(xs.end(), random.begin(), random.end());
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu}) {
    push_both_signs(xs, std::bit_cast<float>(nan));
  }

  Mismatches m;
  for (float x : xs) {
    const std::uint8_t got = encode(x);
    const int ref = ref_fp8_encode(x, f);
    const int want = ref >= 0 ? ref : ((std::signbit(x) ? 0x80 : 0) | nan_code);
    if (got != want) m.add("x=" + describe(x) + " got " + hex(got) + " want " + hex(want));
    if (T(x).bits != got) m.add("constructor disagrees with detail at " + describe(x));
  }
  INFO("checked " << xs.size() << " floats");
  report(m);
}

TEST_CASE("fp8_e4m3fn: all 256 codes decode exactly", "[core][fp8]") {
  check_fp8_decode_all<fp8_e4m3fn>(kE4M3FN, detail::e4m3fn_bits_to_float);
}

TEST_CASE("fp8_e5m2: all 256 codes decode exactly", "[core][fp8]") {
  check_fp8_decode_all<fp8_e5m2>(kE5M2, detail::e5m2_bits_to_float);
  int infs = 0;
  for (int c = 0; c < 256; ++c) {
    const auto v = fp8_e5m2::from_bits(static_cast<std::uint8_t>(c));
    if (v.is_inf()) {
      ++infs;
      CHECK(std::isinf(static_cast<float>(v)));
    }
  }
  CHECK(infs == 2);
}

TEST_CASE("fp8_e4m3fn: float -> fp8 is satfinite round-to-nearest-even", "[core][fp8]") {
  check_fp8_encode<fp8_e4m3fn>(kE4M3FN, detail::float_to_e4m3fn_bits, 0x7F, 0xE4u);
}

TEST_CASE("fp8_e5m2: float -> fp8 is satfinite round-to-nearest-even", "[core][fp8]") {
  check_fp8_encode<fp8_e5m2>(kE5M2, detail::float_to_e5m2_bits, 0x7E, 0xE5u);
}

TEST_CASE("fp8: spot values", "[core][fp8]") {
  // E4M3FN
  CHECK(fp8_e4m3fn(1.0f).bits == 0x38);
  CHECK(fp8_e4m3fn(-1.0f).bits == 0xB8);
  CHECK(fp8_e4m3fn(448.0f).bits == 0x7E);
  CHECK(fp8_e4m3fn::kMaxBits == 0x7E);
  CHECK(static_cast<float>(fp8_e4m3fn::from_bits(0x7E)) == 448.0f);
  CHECK(fp8_e4m3fn(464.0f).bits == 0x7E);  // the midpoint to the NaN slot saturates
  CHECK(fp8_e4m3fn(1e9f).bits == 0x7E);
  CHECK(fp8_e4m3fn(kInf).bits == 0x7E);
  CHECK(fp8_e4m3fn(-kInf).bits == 0xFE);
  CHECK(fp8_e4m3fn(std::numeric_limits<float>::quiet_NaN()).bits == 0x7F);
  CHECK(fp8_e4m3fn(-std::numeric_limits<float>::quiet_NaN()).bits == 0xFF);
  CHECK(fp8_e4m3fn(0x1p-9f).bits == 0x01);
  CHECK(fp8_e4m3fn(0x1p-10f).bits == 0x00);   // tie -> even zero
  CHECK(fp8_e4m3fn(-0x1p-10f).bits == 0x80);  // keeps the sign
  CHECK(fp8_e4m3fn(0x1.8p-9f).bits == 0x02);  // tie -> even subnormal
  CHECK(std::isnan(static_cast<float>(fp8_e4m3fn::from_bits(0x7F))));
  CHECK(std::isnan(static_cast<float>(fp8_e4m3fn::from_bits(0xFF))));
  for (int c = 0; c < 256; ++c) {
    CHECK_FALSE(
        std::isinf(static_cast<float>(fp8_e4m3fn::from_bits(static_cast<std::uint8_t>(c)))));
  }
  // E5M2
  CHECK(fp8_e5m2(1.0f).bits == 0x3C);
  CHECK(fp8_e5m2(57344.0f).bits == 0x7B);
  CHECK(fp8_e5m2::kMaxBits == 0x7B);
  CHECK(static_cast<float>(fp8_e5m2::from_bits(0x7B)) == 57344.0f);
  CHECK(fp8_e5m2(61440.0f).bits == 0x7B);  // the midpoint to inf saturates
  CHECK(fp8_e5m2(kInf).bits == 0x7B);
  CHECK(fp8_e5m2(-kInf).bits == 0xFB);
  CHECK(fp8_e5m2(std::numeric_limits<float>::quiet_NaN()).is_nan());
  CHECK(fp8_e5m2(0x1p-16f).bits == 0x01);
  CHECK(fp8_e5m2(-0x1p-17f).bits == 0x80);
  CHECK(static_cast<float>(fp8_e5m2::from_bits(0x7C)) == kInf);
  CHECK(static_cast<float>(fp8_e5m2::from_bits(0xFC)) == -kInf);
  for (std::uint8_t c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) {
    CHECK(std::isnan(static_cast<float>(fp8_e5m2::from_bits(c))));
  }
}

}  // namespace
