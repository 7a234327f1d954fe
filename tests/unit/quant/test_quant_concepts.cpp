/// \file test_quant_concepts.cpp
/// \brief The Codec, CalibratedCodec and Quantizer concepts accept every shipped codec and
///        quantizer and reject types that break the contract; and the contract's numbers hold
///        for every shipped type: kPlane matches the slot, and nominal_bits_per_element is exactly
///        the rate plane_bytes implies.

#include <catch2/catch.hpp>
#include <concepts>
#include <cstddef>
#include <string>

#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/mixed.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "kvpack/quant/quant_concepts.hpp"
#include "quant_test_support.hpp"

namespace {

namespace q = kvpack::quant;
using kvpack::Plane;
using namespace kvpack_test::quant;

// --- every shipped quantizer and its codecs ----------------------------------------------------

template <class Q>
constexpr bool kShipped = q::Quantizer<Q> && q::Codec<typename Q::key_codec> &&
                          q::Codec<typename Q::value_codec> &&
                          Q::key_codec::kPlane == Plane::kKey && Q::value_codec::kPlane == Plane::kValue;

static_assert(kShipped<q::Float<float>>);
static_assert(kShipped<q::Float<kvpack::half>>);
static_assert(kShipped<q::Float<kvpack::bfloat16>>);
static_assert(kShipped<q::FP8<q::E4M3FN>>);
static_assert(kShipped<q::FP8<q::E5M2>>);
static_assert(kShipped<q::Int8>);
static_assert(kShipped<q::Q8_0>);
static_assert(kShipped<q::Q4_0>);
static_assert(kShipped<q::Mixed<q::Q8_0, q::Q4_0>>);
static_assert(kShipped<q::Mixed<q::FP8<q::E4M3FN>, q::Int8>>);
static_assert(kShipped<q::Mixed<q::Float<kvpack::half>, q::Q4_0>>);

static_assert(q::CalibratedCodec<q::FP8Codec<q::E4M3FN, Plane::kKey>>);
static_assert(q::CalibratedCodec<q::FP8Codec<q::E4M3FN, Plane::kValue>>);
static_assert(q::CalibratedCodec<q::FP8Codec<q::E5M2, Plane::kKey>>);
static_assert(q::CalibratedCodec<q::FP8Codec<q::E5M2, Plane::kValue>>);
static_assert(!q::CalibratedCodec<q::Q8_0Codec<Plane::kKey>>);
static_assert(!q::CalibratedCodec<q::FloatCodec<float, Plane::kValue>>);

// --- types the concepts must reject ------------------------------------------------------------

/// A well-formed codec, to derive broken variants from.
struct GoodCodec {
  using params_type = q::NoParams;
  static constexpr std::string_view kName = "good";
  static constexpr Plane kPlane = Plane::kKey;
  void validate(q::PageGeometry) const {}
  std::size_t plane_bytes(q::PageGeometry) const noexcept { return 0; }
  double nominal_bits_per_element(kvpack::index_t) const noexcept { return 0.0; }
  float max_abs_input() const noexcept { return 1.0f; }
  params_type initial_params(kvpack::index_t, kvpack::index_t) const noexcept { return {}; }
  void encode(q::PageGeometry, const float*, std::ptrdiff_t, params_type, std::byte*) const noexcept {}
  void decode(q::PageGeometry, const std::byte*, params_type, float*) const noexcept {}
};
static_assert(q::Codec<GoodCodec>);

struct ThrowingPlaneBytes : GoodCodec {
  std::size_t plane_bytes(q::PageGeometry) const { return 0; }  // must be noexcept
};
struct NoName {
  using params_type = q::NoParams;
  static constexpr Plane kPlane = Plane::kKey;
  void validate(q::PageGeometry) const {}
  std::size_t plane_bytes(q::PageGeometry) const noexcept { return 0; }
  double nominal_bits_per_element(kvpack::index_t) const noexcept { return 0.0; }
  float max_abs_input() const noexcept { return 1.0f; }
  params_type initial_params(kvpack::index_t, kvpack::index_t) const noexcept { return {}; }
  void encode(q::PageGeometry, const float*, std::ptrdiff_t, params_type, std::byte*) const noexcept {}
  void decode(q::PageGeometry, const std::byte*, params_type, float*) const noexcept {}
};
struct NonTrivialParams : GoodCodec {
  using params_type = std::string;
  params_type initial_params(kvpack::index_t, kvpack::index_t) const { return {}; }
  void encode(q::PageGeometry, const float*, std::ptrdiff_t, const params_type&, std::byte*) const noexcept {}
  void decode(q::PageGeometry, const std::byte*, const params_type&, float*) const noexcept {}
};
static_assert(!q::Codec<int>);
static_assert(!q::Codec<ThrowingPlaneBytes>);
static_assert(NoName::kPlane == Plane::kKey);  // complete but for kName
static_assert(!q::Codec<NoName>);
static_assert(!q::Codec<NonTrivialParams>);

struct NoValueCodec {
  using key_codec = GoodCodec;
  key_codec key{};
  static std::string name() { return "half"; }
};
static_assert(!q::Quantizer<NoValueCodec>);
static_assert(!q::Quantizer<int>);
static_assert(!q::Quantizer<q::Q8_0Codec<Plane::kKey>>);  // a codec is not a quantizer
static_assert(!q::Quantizer<q::FP8Codec<q::E5M2, Plane::kValue>>);

template <class Codec>
void check_rates(const Codec& codec) {
  for (kvpack::index_t p : {16, 32, 64}) {
    for (kvpack::index_t d : {32, 64, 128, 256}) {
      const q::PageGeometry g{p, d};
      INFO(std::string(Codec::kName) << " " << describe(g));
      REQUIRE_NOTHROW(codec.validate(g));
      CHECK(codec.nominal_bits_per_element(d) == implied_bits_per_element(codec, g));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("every quantizer's nominal rate is exactly the rate of its plane bytes", "[quant]",
                   q::Float<float>, q::Float<kvpack::half>, q::Float<kvpack::bfloat16>, q::FP8<q::E4M3FN>,
                   q::FP8<q::E5M2>, q::Int8, q::Q8_0, q::Q4_0, (q::Mixed<q::Q8_0, q::Q4_0>)) {
  const TestType quantizer{};
  check_rates(quantizer.key);
  check_rates(quantizer.value);
  CHECK_FALSE(TestType::name().empty());
}
