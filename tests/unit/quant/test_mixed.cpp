/// \file test_mixed.cpp
/// \brief quant::Mixed<K, V>: keys use K's key codec, values V's value codec, and the name joins
///        the two names with '/'.

#include <catch2/catch.hpp>
#include <concepts>
#include <cstddef>
#include <vector>

#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/mixed.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "quant_test_support.hpp"

namespace {

namespace q = kvpack::quant;
using namespace kvpack_test::quant;

using Q8Q4 = q::Mixed<q::Q8_0, q::Q4_0>;

static_assert(std::same_as<Q8Q4::key_codec, q::Q8_0::key_codec>);
static_assert(std::same_as<Q8Q4::value_codec, q::Q4_0::value_codec>);
static_assert(std::same_as<Q8Q4::key_codec, q::Q8_0Codec<kvpack::Plane::kKey>>);
static_assert(std::same_as<Q8Q4::value_codec, q::Q4_0Codec<kvpack::Plane::kValue>>);
static_assert(std::same_as<decltype(Q8Q4{}.key), q::Q8_0Codec<kvpack::Plane::kKey>>);
static_assert(std::same_as<decltype(Q8Q4{}.value), q::Q4_0Codec<kvpack::Plane::kValue>>);
static_assert(q::Quantizer<Q8Q4>);

}  // namespace

TEST_CASE("Mixed<Q8_0, Q4_0> keys are Q8_0 keys and values are Q4_0 values", "[quant]") {
  CHECK(Q8Q4::name() == "q8_0/q4_0");
  CHECK(q::Mixed<q::Q4_0, q::Q8_0>::name() == "q4_0/q8_0");
  CHECK(q::Mixed<q::FP8<q::E4M3FN>, q::Int8>::name() == "fp8_e4m3fn/int8");
  CHECK(Q8Q4{} == Q8Q4{});

  const Q8Q4 mixed{};
  const PageGeometry g{32, 64};
  CHECK(mixed.key.plane_bytes(g) == q::Q8_0{}.key.plane_bytes(g));
  CHECK(mixed.value.plane_bytes(g) == q::Q4_0{}.value.plane_bytes(g));
  CHECK(mixed.key.nominal_bits_per_element(g.head_dim) == 8.5);
  CHECK(mixed.value.nominal_bits_per_element(g.head_dim) == 4.5);

  const std::vector<float> src = make_rows(Data::kOutlierChannels, g, g.head_dim, 11);
  const std::vector<std::byte> k_mixed = encode_checked(mixed.key, g, src.data(), g.head_dim, q::NoParams{});
  const std::vector<std::byte> k_q8 = encode_checked(q::Q8_0{}.key, g, src.data(), g.head_dim, q::NoParams{});
  CHECK(k_mixed == k_q8);
  const std::vector<std::byte> v_mixed = encode_checked(mixed.value, g, src.data(), g.head_dim, q::NoParams{});
  const std::vector<std::byte> v_q4 = encode_checked(q::Q4_0{}.value, g, src.data(), g.head_dim, q::NoParams{});
  CHECK(v_mixed == v_q4);
}

TEST_CASE("Mixed keeps each side's codec options", "[quant]") {
  using M = q::Mixed<q::FP8<q::E5M2>, q::Int8>;
  static_assert(std::same_as<M::key_codec, q::FP8Codec<q::E5M2, kvpack::Plane::kKey>>);
  static_assert(std::same_as<M::value_codec, q::Int8Codec<kvpack::Plane::kValue>>);
  M m{};
  m.key.options.calibrate = false;
  m.key.options.static_scale = 0.25f;
  CHECK(m.key.initial_params(0, 0).scale == 0.25f);
  CHECK_FALSE(m == M{});
  M copy = m;
  CHECK(copy == m);
}
