/// \file test_fp8.cpp
/// \brief quant::FP8<E4M3FN | E5M2> (key and value planes): byte format (one code per element,
///        key plane channel-major, value plane token-major), decode error within the format's
///        bound (relative 2^-4 / 2^-3 in the normal range, half the smallest subnormal below it,
///        saturation at +-448 / +-57344 times the scale), FP8Options validation and vLLM's
///        calibration constants.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvpack/quant/fp8.hpp"
#include "quant_test_support.hpp"

namespace {

using kvpack::ErrorCode;
using kvpack::quant::E4M3FN;
using kvpack::quant::E5M2;
using kvpack::quant::FP8;
using kvpack::quant::FP8Codec;
using kvpack::quant::FP8Options;
using kvpack::quant::FP8Params;
using kvpack::quant::ScaleGranularity;
using namespace kvpack_test::quant;

using E4M3Key = FP8Codec<E4M3FN, Plane::kKey>;
using E4M3Value = FP8Codec<E4M3FN, Plane::kValue>;
using E5M2Key = FP8Codec<E5M2, Plane::kKey>;
using E5M2Value = FP8Codec<E5M2, Plane::kValue>;

/// The formats' numbers from their definitions (ALGORITHMS.md §5.1).
template <class Format>
struct Fp8Math;
template <>
struct Fp8Math<E4M3FN> {
  static constexpr double kMax = 448.0;          // 2^8 x 1.75
  static constexpr double kRel = 0x1p-4;         // half an ulp of a 3-bit mantissa
  static constexpr double kMinNormal = 0x1p-6;
  static constexpr double kHalfMinSub = 0x1p-10;  // min subnormal 2^-9
  static constexpr const char* kName = "fp8_e4m3fn";
};
template <>
struct Fp8Math<E5M2> {
  static constexpr double kMax = 57344.0;        // 2^15 x 1.75
  static constexpr double kRel = 0x1p-3;
  static constexpr double kMinNormal = 0x1p-14;
  static constexpr double kHalfMinSub = 0x1p-17;  // min subnormal 2^-16
  static constexpr const char* kName = "fp8_e5m2";
};

template <class Codec>
using MathOf = Fp8Math<typename Codec::storage_type>;

/// Checks x̂ against x for scale s; returns an empty string when within the bound.
template <class Codec>
std::string fp8_violation(float x, float y, float s) {
  using M = MathOf<Codec>;
  const double xd = x;
  const double yd = y;
  const double sd = s;
  const double scaled = std::fabs(xd / sd);
  if (yd != 0.0 && std::signbit(yd) != std::signbit(xd)) return "sign flipped";
  if (x == 0.0f) return yd == 0.0 ? "" : "zero not kept";
  double bound = 0.0;
  if (scaled > M::kMax) {
    // Saturation (satfinite): x̂ = sign(x) * max * s.
    const double want = std::copysign(M::kMax * sd, xd);
    return std::fabs(yd - want) <= std::fabs(want) * 0x1p-23 ? "" : "not saturated to " + fmt(want);
  }
  if (scaled >= M::kMinNormal) {
    bound = (M::kRel + 0x1p-20) * std::fabs(xd);  // the slack covers fp32 rounding of x/s and code*s
  } else {
    bound = M::kHalfMinSub * sd * (1 + 0x1p-20) + 0x1p-20 * std::fabs(xd);
  }
  return std::fabs(xd - yd) <= bound ? "" : "error above " + fmt(bound);
}

template <class Codec>
std::size_t doc_index(PageGeometry g, index_t t, index_t c) {
  // key plane uint8 k[d][P] (channel-major), value plane uint8 v[P][d] (token-major)
  return Codec::kPlane == Plane::kKey
             ? static_cast<std::size_t>(c) * g.page_size + static_cast<std::size_t>(t)
             : static_cast<std::size_t>(t) * g.head_dim + static_cast<std::size_t>(c);
}

}  // namespace

TEMPLATE_TEST_CASE("FP8 plane size, rate and name", "[quant]", E4M3Key, E4M3Value, E5M2Key, E5M2Value) {
  const TestType codec{};
  CHECK(TestType::kName == MathOf<TestType>::kName);
  CHECK(FP8<typename TestType::storage_type>::name() == MathOf<TestType>::kName);
  for (PageGeometry g : standard_geometries()) {
    for (PageGeometry gg : {g, PageGeometry{g.page_size + 1, g.head_dim + 3}}) {
      INFO(describe(gg));
      CHECK(codec.plane_bytes(gg) == static_cast<std::size_t>(gg.page_size) * gg.head_dim);
      CHECK(codec.nominal_bits_per_element(gg.head_dim) == 8.0);
      CHECK(codec.nominal_bits_per_element(gg.head_dim) == implied_bits_per_element(codec, gg));
    }
  }
  // Saturation stores anything up to half fp32's max (see the test of finite decoding below).
  CHECK(codec.max_abs_input() == std::numeric_limits<float>::max() / 2);
}

TEMPLATE_TEST_CASE("FP8 page bytes are the fp8 codes of x / scale at the documented positions", "[quant]",
                   E4M3Key, E4M3Value, E5M2Key, E5M2Value) {
  using Format = typename TestType::storage_type;
  const TestType codec{};
  for (float scale : {1.0f, 0.0371f}) {
    INFO("scale " << scale);
    for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
      const std::vector<float> src = make_rows(kind, g, stride, seed);
      const FP8Params params{scale};
      const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, params);
      const std::vector<float> out = decode_checked(codec, g, plane.data(), params);
      Mismatches m;
      for (index_t t = 0; t < g.page_size; ++t) {
        for (index_t c = 0; c < g.head_dim; ++c) {
          const float x = src[static_cast<std::size_t>(t * stride + c)];
          const auto code = static_cast<std::uint8_t>(plane[doc_index<TestType>(g, t, c)]);
          if (code != Format(x / scale).bits) {
            m.add("code t=" + std::to_string(t) + " c=" + std::to_string(c) + " " + hex(code) + " vs " +
                  hex(Format(x / scale).bits));
          }
          // x̂ = float(code) * scale
          const float want = static_cast<float>(Format::from_bits(code)) * scale;
          if (out[static_cast<std::size_t>(t) * g.head_dim + c] != want) {
            m.add("decode t=" + std::to_string(t) + " c=" + std::to_string(c));
          }
        }
      }
      report(m);
    });
  }
}

TEMPLATE_TEST_CASE("FP8 decode error is within the format's bound", "[quant]", E4M3Key, E4M3Value, E5M2Key,
                   E5M2Value) {
  const TestType codec{};
  for (int variant = 0; variant < 3; ++variant) {
    INFO((variant == 0 ? "scale 1" : variant == 1 ? "scale 0.0371" : "calibrated scale"));
    for_each_case([&](PageGeometry g, std::ptrdiff_t stride, Data kind, std::uint32_t seed) {
      const std::vector<float> src = make_rows(kind, g, stride, seed);
      float absmax = 0.0f;
      for (index_t t = 0; t < g.page_size; ++t) {
        absmax = std::max(absmax, static_cast<float>(row_absmax(src.data() + t * stride, g.head_dim)));
      }
      const FP8Params params = variant == 0   ? FP8Params{1.0f}
                               : variant == 1 ? FP8Params{0.0371f}
                                              : codec.params_from_absmax(absmax);
      roundtrip(codec, g, src, stride, params, [&](index_t t, index_t c, float x, float y, Mismatches& m) {
        const std::string why = fp8_violation<TestType>(x, y, params.scale);
        if (!why.empty()) {
          m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " y=" + fmt(y) +
                " scale=" + fmt(params.scale) + ": " + why);
        }
      });
    });
  }
}

TEMPLATE_TEST_CASE("FP8 saturates at +-max times the scale", "[quant]", E4M3Key, E4M3Value, E5M2Key,
                   E5M2Value) {
  using M = MathOf<TestType>;
  const TestType codec{};
  const PageGeometry g{2, 8};
  for (float scale : {1.0f, 0.5f, 3.0f}) {
    INFO("scale " << scale);
    const float mx = static_cast<float>(M::kMax);
    // Just above max, the rounding tie to the next (non-existent) binade step, far above, FLT_MAX.
    const float next_step = mx + (M::kMax == 448.0 ? 32.0f : 8192.0f);  // the tie point max + ulp/2
    const std::vector<float> src = {mx * scale,        -mx * scale,          (mx + 1.0f) * scale,
                                    next_step * scale, -next_step * scale,   1e30f,
                                    -1e30f,            std::numeric_limits<float>::max(),
                                    -std::numeric_limits<float>::max(),      1e7f * scale,
                                    -1e7f * scale,     2.0f * mx * scale,    -2.0f * mx * scale,
                                    0.5f * scale,      -0.25f * scale,       0.0f};
    const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), g.head_dim, FP8Params{scale});
    const std::vector<float> out = decode_checked(codec, g, plane.data(), FP8Params{scale});
    for (std::size_t i = 0; i < 13; ++i) {
      INFO("x = " << src[i]);
      CHECK(out[i] == std::copysign(mx * scale, src[i]));
    }
    CHECK(out[13] == 0.5f * scale);
    CHECK(out[14] == -0.25f * scale);
    CHECK(out[15] == 0.0f);
  }
}

TEMPLATE_TEST_CASE("FP8 subnormal range: absolute error at most half the smallest subnormal", "[quant]",
                   E4M3Key, E4M3Value, E5M2Key, E5M2Value) {
  using M = MathOf<TestType>;
  const TestType codec{};
  const PageGeometry g{16, 32};
  for (float scale : {1.0f, 0.25f, 7.0f}) {
    std::vector<float> src(static_cast<std::size_t>(g.page_size) * g.head_dim);
    for (std::size_t i = 0; i < src.size(); ++i) {
      // Sweep (-min normal, min normal) * scale in uneven steps, including exact subnormals.
      const double u = (static_cast<double>(i) / static_cast<double>(src.size()) * 2.0 - 1.0) * 0.9999;
      src[i] = static_cast<float>(u * M::kMinNormal * scale);
    }
    roundtrip(codec, g, src, g.head_dim, FP8Params{scale}, [&](index_t t, index_t c, float x, float y, Mismatches& m) {
      if (std::fabs(static_cast<double>(x) - y) > M::kHalfMinSub * scale * (1 + 0x1p-20)) {
        m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " y=" + fmt(y));
      }
    });
  }
}

TEMPLATE_TEST_CASE("FP8Options validation", "[quant]", E4M3Key, E5M2Value) {
  const PageGeometry g{32, 128};
  auto codec_with = [](FP8Options o) {
    TestType c{};
    c.options = std::move(o);
    return c;
  };
  CHECK_NOTHROW(TestType{}.validate(g));

  SECTION("static_scale must be finite and > 0") {
    for (float bad : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
      INFO("static_scale " << bad);
      FP8Options o;
      o.calibrate = false;
      o.static_scale = bad;
      CHECK(error_code_of([&] { codec_with(o).validate(g); }) == ErrorCode::kInvalidConfig);
    }
    FP8Options ok;
    ok.calibrate = false;
    ok.static_scale = 0.02f;
    CHECK_NOTHROW(codec_with(ok).validate(g));
    CHECK(codec_with(ok).initial_params(0, 0).scale == 0.02f);
    CHECK(codec_with(ok).initial_params(5, 3).scale == 0.02f);
  }

  SECTION("per-head static scales need kv_heads > 0 and layers * kv_heads entries") {
    FP8Options o;
    o.calibrate = false;
    o.granularity = ScaleGranularity::kPerHead;
    o.kv_heads = 2;
    o.static_head_scales = {0.5f, 0.25f, 2.0f, 4.0f, 1.5f, 0.125f};  // 3 layers x 2 heads
    CHECK_NOTHROW(codec_with(o).validate(g));
    const TestType c = codec_with(o);
    CHECK(c.initial_params(0, 0).scale == 0.5f);
    CHECK(c.initial_params(0, 1).scale == 0.25f);
    CHECK(c.initial_params(1, 0).scale == 2.0f);
    CHECK(c.initial_params(2, 1).scale == 0.125f);
    CHECK(error_code_of([&] { (void)c.initial_params(3, 0); }) == ErrorCode::kInvalidConfig);

    FP8Options wrong_size = o;
    wrong_size.static_head_scales.pop_back();  // 5 entries for 2 heads
    CHECK(error_code_of([&] { codec_with(wrong_size).validate(g); }) == ErrorCode::kInvalidConfig);
    FP8Options empty = o;
    empty.static_head_scales.clear();
    CHECK(error_code_of([&] { codec_with(empty).validate(g); }) == ErrorCode::kInvalidConfig);
    FP8Options no_heads = o;
    no_heads.kv_heads = 0;
    CHECK(error_code_of([&] { codec_with(no_heads).validate(g); }) == ErrorCode::kInvalidConfig);
    for (float bad : {0.0f, -0.5f, std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity()}) {
      INFO("head scale " << bad);
      FP8Options bad_scale = o;
      bad_scale.static_head_scales[3] = bad;
      CHECK(error_code_of([&] { codec_with(bad_scale).validate(g); }) == ErrorCode::kInvalidConfig);
    }
  }
}

TEMPLATE_TEST_CASE("FP8 calibration follows vLLM: absmax/200 for keys, absmax/100 for values", "[quant]",
                   E4M3Key, E4M3Value, E5M2Key, E5M2Value) {
  const TestType codec{};
  const float divisor = TestType::kPlane == Plane::kKey ? 200.0f : 100.0f;
  for (float absmax : {50.0f, 123.0f, 0.003f, 7.5e4f}) {
    INFO("absmax " << absmax);
    CHECK(codec.params_from_absmax(absmax).scale == absmax / divisor);
  }
  CHECK(codec.params_from_absmax(0.0f).scale == 1.0f);  // nothing to calibrate from
  CHECK(TestType::kCalibrationTarget == divisor);

  // The defaults: per-tensor, calibrated, static scale 1.
  CHECK(codec.granularity() == ScaleGranularity::kPerTensor);
  CHECK(codec.calibrates());
  CHECK(codec.initial_params(0, 0).scale == 1.0f);
  TestType per_head{};
  per_head.options.granularity = ScaleGranularity::kPerHead;
  per_head.options.calibrate = false;
  CHECK(per_head.granularity() == ScaleGranularity::kPerHead);
  CHECK_FALSE(per_head.calibrates());
}

TEST_CASE("FP8 quantizer passes its options to both planes", "[quant]") {
  FP8Options k;
  k.calibrate = false;
  k.static_scale = 0.5f;
  FP8Options v;
  v.calibrate = false;
  v.static_scale = 0.125f;
  const FP8<E4M3FN> both(k);
  CHECK(both.key.options == k);
  CHECK(both.value.options == k);
  const FP8<E5M2> split(k, v);
  CHECK(split.key.options == k);
  CHECK(split.value.options == v);
  CHECK(split.key.initial_params(0, 0).scale == 0.5f);
  CHECK(split.value.initial_params(0, 0).scale == 0.125f);
  CHECK(FP8<E4M3FN>{} == FP8<E4M3FN>{});
  CHECK_FALSE(FP8<E4M3FN>(k) == FP8<E4M3FN>(v));
}

// A calibrated scale must be one validate() accepts for a static scale: finite and > 0. A
// subnormal absmax (e.g. 1e-44) divided by 200 would underflow to 0, and a zero input would then
// encode 0/0 = NaN.
TEMPLATE_TEST_CASE("FP8 params_from_absmax gives a finite positive scale for any finite absmax",
                   "[quant]", E4M3Key, E4M3Value, E5M2Key, E5M2Value) {
  const TestType codec{};
  for (float absmax : {std::numeric_limits<float>::max(), 1.0f, std::numeric_limits<float>::min(), 1e-40f,
                       1e-44f, std::numeric_limits<float>::denorm_min()}) {
    INFO("absmax " << absmax);
    const FP8Params p = codec.params_from_absmax(absmax);
    CHECK(p.scale > 0.0f);
    CHECK(std::isfinite(p.scale));
    const PageGeometry g{2, 2};
    const std::vector<float> src = {0.0f, absmax, -absmax, 0.0f};
    const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), 2, p);
    const std::vector<float> out = decode_checked(codec, g, plane.data(), p);
    CHECK(out[0] == 0.0f);
    CHECK(out[3] == 0.0f);
  }
}

// Found by tests/fuzz/fuzz_codec_spans.cpp (a page holding FLT_MAX decoded to Inf): with
// max_abs_input at fp32's max, a page whose largest value was e.g. 0.98 · FLT_MAX calibrated to
// scale absmax / 200, that value over the scale came to just above 200 and rounded up to the
// code 208, and 208 · scale is Inf; a static scale of FLT_MAX / 1.97 took FLT_MAX to 2.0 · scale.
TEMPLATE_TEST_CASE("FP8 decodes every input up to max_abs_input to a finite value", "[quant]", E4M3Key, E4M3Value,
                   E5M2Key, E5M2Value) {
  const TestType codec{};
  const float top = codec.max_abs_input();
  const PageGeometry g{2, 4};
  const std::vector<float> src = {top, -top, std::nextafter(top, 0.0f), top * 0.98f,
                                  top * 0.51f, -top * 0.9f, top / 3, 1.0f};
  for (const FP8Params params : {codec.params_from_absmax(top), codec.params_from_absmax(top * 0.98f),
                                 FP8Params{top / 1.97f}, FP8Params{top / 200},
                                 FP8Params{1.0f}, FP8Params{std::numeric_limits<float>::max()}}) {
    INFO("scale " << params.scale);
    const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), g.head_dim, params);
    const std::vector<float> out = decode_checked(codec, g, plane.data(), params);
    for (std::size_t i = 0; i < src.size(); ++i) {
      INFO("x = " << src[i]);
      CHECK(std::isfinite(out[i]));
    }
  }
  CHECK(top >= 1e38f);  // still far beyond any real K or V: FP8 saturates rather than rejects
}
