// quant::KIVI: byte format as documented in kivi.hpp, round-trip error within the bound of
// asymmetric b-bit quantization with fp16 scale and minimum, the s == 0 guard, rates, limits.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvpack/quant/kivi.hpp"
#include "quant_test_support.hpp"

namespace {

using namespace kvpack_test::quant;
namespace q = kvpack::quant;

/// KIVI's groups are whole pages' worth of 32..128 tokens (keys) or channels (values).
std::vector<PageGeometry> kivi_geometries(int group) {
  std::vector<PageGeometry> out;
  for (index_t p : {32, 64, 128}) {
    for (index_t d : {32, 64, 128}) {
      if (p % group == 0 && d % group == 0) out.push_back({p, d});
    }
  }
  return out;
}

/// Code j of a packed row, read from the bits as kivi.hpp documents them.
std::uint32_t doc_code(const std::byte* row, index_t j, int bits) {
  const std::size_t bit = static_cast<std::size_t>(j) * bits;
  return (static_cast<unsigned>(row[bit / 8]) >> (bit % 8)) & ((1u << bits) - 1);
}

double doc_half(const std::byte* at) {
  std::uint16_t v;
  std::memcpy(&v, at, 2);
  return ref_fp16_value(v);
}

/// |x − x̂| for a group [lo, hi]: half a step of the stored scale s', plus, where the code clamps,
/// what rounding s and lo to fp16 moved the ends: (2^b − 1)|s − s'| + |lo − fp16(lo)|.
double kivi_error_bound(double lo, double hi, int bits, double stored_scale) {
  const double levels = (1 << bits) - 1;
  const double s = (hi - lo) / levels;
  return (0.5 + kCodeRoundingSlack) * stored_scale + levels * fp16_store_error_bound(s) + fp16_store_error_bound(lo);
}

/// Encodes one page of every data family and checks each element against the bound of its
/// group, with the group's stored scale read at its documented offset.
template <class Codec, int Bits, int Group>
void check_roundtrip(bool keys) {
  const Codec codec{};
  std::uint32_t seed = 77;
  for (PageGeometry g : kivi_geometries(Group)) {
    for (Data kind : kAllData) {
      for (std::ptrdiff_t pad : {0, 5}) {
        const std::ptrdiff_t stride = g.head_dim + pad;
        INFO(describe(g) << " stride " << stride << " data " << name(kind));
        const std::vector<float> src = make_rows(kind, g, stride, ++seed);
        const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, q::NoParams{});
        const std::vector<float> out = decode_checked(codec, g, plane.data(), q::NoParams{});
        Mismatches m;
        for (index_t t = 0; t < g.page_size; ++t) {
          for (index_t c = 0; c < g.head_dim; ++c) {
            // The group of (t, c): tokens [t0, t0 + G) of channel c for keys, channels
            // [c0, c0 + G) of token t for values.
            const index_t t0 = keys ? t / Group * Group : t, c0 = keys ? c : c / Group * Group;
            double lo = INFINITY, hi = -INFINITY;
            for (index_t i = 0; i < Group; ++i) {
              const float x = keys ? src[(t0 + i) * stride + c] : src[t * stride + c0 + i];
              lo = std::min(lo, static_cast<double>(x));
              hi = std::max(hi, static_cast<double>(x));
            }
            const std::size_t meta = keys ? (static_cast<std::size_t>(t / Group) * g.head_dim + c) * 2
                                          : (static_cast<std::size_t>(t) * (g.head_dim / Group) + c / Group) * 2;
            const double stored_scale = doc_half(plane.data() + Codec::scales_offset(g) + meta);
            const double x = src[t * stride + c], y = out[static_cast<std::size_t>(t) * g.head_dim + c];
            const double bound = kivi_error_bound(lo, hi, Bits, stored_scale);
            if (!(std::fabs(x - y) <= bound)) {
              m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " x=" + fmt(x) + " x_hat=" + fmt(y) +
                    " bound " + fmt(bound));
            }
            // Decode is code · s' + min' with the documented bytes.
            const std::byte* row = plane.data() + Codec::row_bytes(g) * static_cast<std::size_t>(keys ? c : t);
            const double code = doc_code(row, keys ? t : c, Bits);
            const double expected = static_cast<float>(code * stored_scale) +
                                    static_cast<float>(doc_half(plane.data() + Codec::mins_offset(g) + meta));
            if (static_cast<float>(expected) != static_cast<float>(y)) {
              m.add("documented bytes give " + fmt(expected) + ", decode " + fmt(y));
            }
          }
        }
        report(m);
      }
    }
  }
}

/// Every code is the spec's: clamp(round((x − mn') / s', 0, 2^b − 1)) with the stored (fp16)
/// s' and mn', rounded to nearest with ties to even; 0 where s' == 0. `src` may add groups whose
/// quotients are exact ties.
template <class Codec, int Bits, int Group>
void check_codes(bool keys, PageGeometry g, const std::vector<float>& src, std::ptrdiff_t stride) {
  const Codec codec{};
  const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), stride, q::NoParams{});
  Mismatches m;
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const std::size_t meta = keys ? (static_cast<std::size_t>(t / Group) * g.head_dim + c) * 2
                                    : (static_cast<std::size_t>(t) * (g.head_dim / Group) + c / Group) * 2;
      const auto scale = static_cast<float>(doc_half(plane.data() + Codec::scales_offset(g) + meta));
      const auto min = static_cast<float>(doc_half(plane.data() + Codec::mins_offset(g) + meta));
      const float top = static_cast<float>((1 << Bits) - 1);
      const float quotient = (src[t * stride + c] - min) / scale;
      const double expected = scale == 0.0f ? 0.0 : std::nearbyint(std::clamp(quotient, 0.0f, top));
      const std::byte* row = plane.data() + Codec::row_bytes(g) * static_cast<std::size_t>(keys ? c : t);
      const double code = doc_code(row, keys ? t : c, Bits);
      if (code != expected) {
        m.add("t=" + std::to_string(t) + " c=" + std::to_string(c) + " (x - min) / s = " + fmt(quotient) + ": code " +
              fmt(code) + ", expected " + fmt(expected));
      }
    }
  }
  report(m);
}

/// Rows whose every group of `Group` elements (along tokens for keys, channels for values) runs
/// from 0 to 2^b − 1 with the other elements at k + 0.5: scale 1 and min 0 exactly in fp16, so
/// each quotient is a tie.
template <int Bits, int Group>
std::vector<float> tie_rows(bool keys, PageGeometry g, std::ptrdiff_t stride) {
  std::vector<float> src(static_cast<std::size_t>(g.page_size) * static_cast<std::size_t>(stride), kPoison);
  const float top = static_cast<float>((1 << Bits) - 1);
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const index_t i = keys ? t % Group : c % Group;  // position in the group
      src[t * stride + c] = i == 0 ? 0.0f : i == 1 ? top : static_cast<float>((i + t + c) % (1 << Bits)) - 0.5f;
      if (src[t * stride + c] < 0.0f) src[t * stride + c] = 0.5f;
    }
  }
  return src;
}

template <class Codec, int Bits, int Group>
void check_codes_everywhere(bool keys) {
  std::uint32_t seed = 901;
  for (PageGeometry g : kivi_geometries(Group)) {
    const std::ptrdiff_t stride = g.head_dim + 3;
    for (Data kind : kAllData) {
      INFO(describe(g) << " data " << name(kind));
      check_codes<Codec, Bits, Group>(keys, g, make_rows(kind, g, stride, ++seed), stride);
    }
    INFO(describe(g) << " ties");
    check_codes<Codec, Bits, Group>(keys, g, tie_rows<Bits, Group>(keys, g, stride), stride);
  }
}

}  // namespace

TEST_CASE("KIVI keys: per channel over token groups, within the asymmetric quantization bound", "[quant][kivi]") {
  check_roundtrip<q::KiviKeyCodec<2, 32>, 2, 32>(true);
  check_roundtrip<q::KiviKeyCodec<4, 32>, 4, 32>(true);
  check_roundtrip<q::KiviKeyCodec<4, 64>, 4, 64>(true);
  check_roundtrip<q::KiviKeyCodec<2, 128>, 2, 128>(true);
}

TEST_CASE("KIVI values: per token over channel groups, within the asymmetric quantization bound", "[quant][kivi]") {
  check_roundtrip<q::KiviValueCodec<2, 32>, 2, 32>(false);
  check_roundtrip<q::KiviValueCodec<4, 32>, 4, 32>(false);
  check_roundtrip<q::KiviValueCodec<2, 64>, 2, 64>(false);
  check_roundtrip<q::KiviValueCodec<4, 128>, 4, 128>(false);
  // The ablation's per-token keys share the value plane's format.
  check_roundtrip<q::KiviTokenCodec<2, 32, kvpack::Plane::kKey>, 2, 32>(false);
}

TEST_CASE("KIVI stores a constant group as scale 0 and code 0 and gives back its fp16 value", "[quant][kivi]") {
  const PageGeometry g{32, 32};
  std::vector<float> src(32 * 32, 1.2345f);
  const q::KiviValueCodec<2, 32> codec{};
  const std::vector<std::byte> plane = encode_checked(codec, g, src.data(), 32, q::NoParams{});
  for (std::size_t i = 0; i < codec.scales_offset(g); ++i) REQUIRE(plane[i] == std::byte{0});
  CHECK(doc_half(plane.data() + codec.scales_offset(g)) == 0.0);
  for (float y : decode_checked(codec, g, plane.data(), q::NoParams{})) CHECK(y == static_cast<float>(kvpack::half(1.2345f)));
}

TEST_CASE("KIVI's bytes give exactly b + 32/G bits per element; bad geometries are rejected", "[quant][kivi]") {
  const q::KIVI<2> kivi2;
  const q::KIVI<4, 128> kivi4;
  for (PageGeometry g : kivi_geometries(32)) {
    CHECK(implied_bits_per_element(kivi2.key, g) == 3.0);
    CHECK(implied_bits_per_element(kivi2.value, g) == 3.0);
    CHECK(kivi2.key.nominal_bits_per_element(g.head_dim) == 3.0);
  }
  CHECK(implied_bits_per_element(kivi4.key, {128, 128}) == 4.25);
  CHECK(implied_bits_per_element(kivi4.value, {128, 128}) == 4.25);
  CHECK(error_code_of([&] { kivi2.key.validate({16, 128}); }) == kvpack::ErrorCode::kUnsupported);
  CHECK_THROWS_WITH(kivi2.key.validate({16, 128}), Catch::Contains("groups of 32 tokens"));
  CHECK_THROWS_WITH(kivi2.value.validate({32, 8}), Catch::Contains("head_dim 8"));
  CHECK(q::KIVI<2>::name() == "kivi2_g32");
}

TEST_CASE("KIVI codes are the spec's rounding of (x - min') / s', ties to even", "[quant][kivi]") {
  check_codes_everywhere<q::KiviKeyCodec<2, 32>, 2, 32>(true);
  check_codes_everywhere<q::KiviKeyCodec<4, 64>, 4, 64>(true);
  check_codes_everywhere<q::KiviValueCodec<4, 32>, 4, 32>(false);
  check_codes_everywhere<q::KiviValueCodec<2, 128>, 2, 128>(false);
}
