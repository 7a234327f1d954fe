// The CUDA append path's unit encoders (kernels/cuda/element_encode.hpp), compiled for the host:
// encoding every unit of a plane must give exactly the bytes of the codec's scalar `encode`, and
// must write every byte of the plane (the target starts as garbage). Random rows with outlier
// channels, zero rows, ties for ggml's rounding and the largest storable magnitudes. KVQuant's
// staged encoders run stage by stage, the units of each stage in a shuffled order.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "kvpack/kernels/cuda/element_encode.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "support/stream_fixture.hpp"

namespace {

using namespace kvpack;

std::vector<float> rows_for(index_t page_size, index_t head_dim, float max_abs, std::uint32_t seed) {
  std::vector<float> rows = test::random_rows(static_cast<std::size_t>(page_size), head_dim, seed, 3, 40.0f);
  std::fill_n(rows.begin() + head_dim, head_dim, 0.0f);  // a zero row
  const float big = std::min(max_abs, 1e30f);
  for (index_t c = 0; c < head_dim; ++c) rows[2 * head_dim + c] = c % 3 == 0 ? big : -big / 2;
  for (index_t c = 0; c < head_dim; ++c) rows[3 * head_dim + c] = 0.5f * static_cast<float>(c % 7) - 1.5f;  // ties
  return rows;
}

template <class Codec>
void check_codec(const Codec& codec, typename Codec::params_type params, quant::PageGeometry g) {
  using Encoder = kernels::cuda::ElementEncoder<Codec>;
  try {
    codec.validate(g);
  } catch (const Error&) {
    return;  // a geometry this codec cannot store
  }
  const std::vector<float> rows = rows_for(g.page_size, g.head_dim, codec.max_abs_input(), 23);
  const std::size_t bytes = codec.plane_bytes(g);
  std::vector<std::byte> expected(bytes, std::byte{0}), got(bytes, std::byte{0xAB});
  codec.encode(g, rows.data(), g.head_dim, params, expected.data());
  for (index_t u = 0; u < Encoder::units(g); ++u) Encoder::encode_unit(rows.data(), g.head_dim, params, got.data(), g, u);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < bytes; ++i) mismatches += expected[i] != got[i];
  INFO(Codec::kName << " page_size " << g.page_size << " head_dim " << g.head_dim << ": " << mismatches << " of "
                    << bytes << " bytes differ");
  CHECK(mismatches == 0);
}

template <class Quantizer>
void check_quantizer(std::vector<quant::PageGeometry> geometries) {
  const Quantizer q{};
  for (const quant::PageGeometry g : geometries) {
    check_codec(q.key, q.key.initial_params(0, 0), g);
    check_codec(q.value, q.value.initial_params(0, 0), g);
  }
}

/// Runs a staged encoder over one plane as the device would, except that the units of each stage
/// go in a shuffled order (no unit may read what another of its stage writes), the plane and the
/// scratch memory starting as garbage; returns how many bytes differ from the scalar encoder's.
template <class Codec>
std::size_t staged_mismatches(const Codec& codec, const typename Codec::params_type& params, quant::PageGeometry g,
                              const std::vector<float>& rows, std::uint32_t seed) {
  using Encoder = kernels::cuda::ElementEncoder<Codec>;
  static_assert(kernels::cuda::StagedEncoder<Encoder>);
  kernels::cuda::device_params_t<Codec> device;
  if constexpr (Codec::kPlane == Plane::kKey) {
    device = kernels::cuda::to_device_params(params, g, params.offset, params.half_range);
  } else {
    device = kernels::cuda::to_device_params(params, g);
  }
  const std::size_t bytes = codec.plane_bytes(g);
  REQUIRE(Encoder::plane_bytes(g, device) == bytes);
  std::vector<std::byte> expected(bytes, std::byte{0}), got(bytes, std::byte{0xAB});
  std::vector<std::uint32_t> scratch((Encoder::scratch_bytes(g) + 3) / 4, 0xDEADBEEFu);
  codec.encode(g, rows.data(), g.head_dim, params, expected.data());
  std::mt19937 rng(seed);
  for (int stage = 0; stage < Encoder::kStages; ++stage) {
    std::vector<index_t> order(static_cast<std::size_t>(Encoder::units(stage, g, device)));
    std::iota(order.begin(), order.end(), index_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    for (index_t u : order) {
      Encoder::encode_unit(stage, rows.data(), g.head_dim, device, got.data(), g, u, scratch.data());
    }
  }
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < bytes; ++i) mismatches += expected[i] != got[i];
  return mismatches;
}

/// The outliers a KVQuant plane keeps (its section's count), to show which cases the data reach.
std::size_t outlier_count(const std::byte* section) {
  std::uint16_t count;
  std::memcpy(&count, section, sizeof(count));
  return count;
}

/// Both of KVQuant<Bits>'s planes on pages that keep fewer candidates than the section holds,
/// more than it holds (keys far outside the calibration: every element a candidate), ties in
/// how far outside (equal elements, ±0), the extremes of rows_for, and unchecked input (NaN,
/// ±Inf, which the scalar encoder orders on purpose).
template <int Bits>
void check_kvquant(quant::PageGeometry g, double fraction, bool q_norm, std::uint32_t seed) {
  using Q = quant::KVQuant<Bits>;
  const std::shared_ptr<const quant::KVQuantTables> tables = test::kvquant_tables<Bits>(g.head_dim, q_norm, seed);
  REQUIRE(tables->key_encode_codebook.empty() != q_norm);
  const Q q(tables, fraction);
  const auto key_params = q.key.initial_params(0, 0);
  const auto value_params = q.value.initial_params(0, 0);
  const std::size_t elements = static_cast<std::size_t>(g.page_size) * g.head_dim;
  std::vector<std::vector<float>> cases{test::random_rows(g.page_size, g.head_dim, seed + 2, 4, 10.0f),
                                        rows_for(g.page_size, g.head_dim, q.key.max_abs_input(), seed + 3),
                                        test::random_rows(g.page_size, g.head_dim, seed + 4, g.head_dim, 300.0f),
                                        std::vector<float>(elements, 7.0f)};
  for (std::size_t i = 0; i < elements; i += 5) cases.back()[i] = -7.0f;  // equal excesses, equal values
  cases.push_back(cases.front());
  for (std::size_t i = 0; i < elements; i += 7) {
    const float odd[] = {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY, -0.0f, 0.0f};
    cases.back()[i] = odd[(i / 7) % 5];
  }
  // Zero rows with one −0 each: every value candidate is −0 or +0 outside its token's range
  // (a −0 lowest, a +0 highest), and those compare equal.
  cases.emplace_back(elements, 0.0f);
  for (index_t t = 0; t < g.page_size; ++t) cases.back()[static_cast<std::size_t>(t) * g.head_dim + 1] = -0.0f;
  std::size_t most_key_outliers = 0;
  for (std::size_t k = 0; k < cases.size(); ++k) {
    INFO(Q::name() << " page_size " << g.page_size << " head_dim " << g.head_dim << " fraction " << fraction
                   << (q_norm ? " Q-Norm" : "") << " case " << k);
    CHECK(staged_mismatches(q.key, key_params, g, cases[k], seed + 10 * k) == 0);
    CHECK(staged_mismatches(q.value, value_params, g, cases[k], seed + 10 * k + 5) == 0);
    std::vector<std::byte> plane(q.key.plane_bytes(g));
    q.key.encode(g, cases[k].data(), g.head_dim, key_params, plane.data());
    most_key_outliers = std::max(most_key_outliers, outlier_count(plane.data() + q.key.outliers_offset(g)));
  }
  // The keys far outside fill the section: the capped selection ran.
  if (fraction > 0.0) CHECK(most_key_outliers == quant::kvquant_detail::outlier_capacity(fraction, g));
}

/// TurboQuant-MSE's token encoder on both planes of TurboQuant<HalfBits>, with the rotation read
/// from the host's own tables as the device reads its copy of them.
template <int HalfBits>
void check_turbo(quant::PageGeometry g, std::uint32_t seed) {
  using Q = quant::TurboQuant<HalfBits>;
  const Q q{};
  std::vector<std::vector<float>> cases{test::random_rows(g.page_size, g.head_dim, seed, 4, 10.0f),
                                        rows_for(g.page_size, g.head_dim, q.key.max_abs_input(), seed + 1)};
  auto check_plane = [&](const auto& codec, auto params) {
    using Codec = std::remove_cvref_t<decltype(codec)>;
    using Encoder = kernels::cuda::ElementEncoder<Codec>;
    codec.prepare(g, params);
    const std::vector<float> rotation =
        kernels::cuda::turbo_rotation_table(quant::turbo_detail::layer_view(params, g.head_dim).rotation);
    const auto device = kernels::cuda::to_device_params(params, g, nullptr, rotation.data());
    for (std::size_t k = 0; k < cases.size(); ++k) {
      std::vector<std::byte> expected(codec.plane_bytes(g)), got(expected.size(), std::byte{0xAB});
      codec.encode(g, cases[k].data(), g.head_dim, params, expected.data());
      for (index_t u = 0; u < Encoder::units(g); ++u) {
        Encoder::encode_unit(cases[k].data(), g.head_dim, device, got.data(), g, u);
      }
      INFO(Q::name() << (Codec::kPlane == Plane::kKey ? " keys" : " values") << " page_size " << g.page_size
                     << " head_dim " << g.head_dim << " case " << k);
      CHECK(got == expected);
    }
  };
  check_plane(q.key, q.key.initial_params(0, 0));
  check_plane(q.value, q.value.initial_params(0, 0));
}

}  // namespace

TEST_CASE("CUDA token encoder writes exactly TurboQuant-MSE's scalar bytes", "[cuda][encode][turbo]") {
  // Hadamard rotations at head_dim 64 and 128, the dense one at 96; every rate's code layout.
  for (const quant::PageGeometry g : {quant::PageGeometry{32, 128}, quant::PageGeometry{16, 64},
                                      quant::PageGeometry{16, 96}}) {
    check_turbo<8>(g, 101);
    check_turbo<7>(g, 111);
    check_turbo<6>(g, 121);
    check_turbo<5>(g, 131);
    check_turbo<4>(g, 141);
  }
}

TEST_CASE("CUDA staged encoders write exactly KVQuant's scalar bytes", "[cuda][encode][kvquant]") {
  for (const quant::PageGeometry g : {quant::PageGeometry{32, 128}, quant::PageGeometry{16, 64},
                                      quant::PageGeometry{64, 96}}) {
    for (const double fraction : {0.0, 0.01, 0.05}) {
      check_kvquant<4>(g, fraction, false, 31);
      check_kvquant<3>(g, fraction, false, 41);
      check_kvquant<2>(g, fraction, false, 51);
    }
  }
  check_kvquant<2>({32, 128}, 0.01, true, 61);
  check_kvquant<4>({64, 64}, 0.02, true, 71);
  check_kvquant<3>({256, 256}, 0.01, false, 81);
  // 2 candidates per token and room for 2 per token: every value candidate kept, none capped.
  check_kvquant<4>({16, 64}, 0.03125, false, 91);
}

TEST_CASE("CUDA unit encoders write exactly the scalar encoders' bytes", "[cuda][encode]") {
  const std::vector<quant::PageGeometry> shapes{{32, 128}, {16, 64}, {64, 96}, {256, 32}};
  check_quantizer<quant::Float<float>>(shapes);
  check_quantizer<quant::Float<half>>(shapes);
  check_quantizer<quant::Float<bfloat16>>(shapes);
  check_quantizer<quant::Int8>(shapes);
  check_quantizer<quant::Q8_0>(shapes);
  check_quantizer<quant::Q4_0>(shapes);
  check_quantizer<quant::KIVI<2, 32>>(shapes);
  check_quantizer<quant::KIVI<4, 32>>(shapes);
  check_quantizer<quant::KIVI<4, 128>>({{128, 128}, {256, 256}});
  for (const float scale : {1.0f, 0.37f, 1e-3f}) {
    check_codec(quant::FP8Codec<quant::E4M3FN, Plane::kKey>{}, {scale}, {32, 128});
    check_codec(quant::FP8Codec<quant::E4M3FN, Plane::kValue>{}, {scale}, {32, 128});
    check_codec(quant::FP8Codec<quant::E5M2, Plane::kKey>{}, {scale}, {16, 48});
    check_codec(quant::FP8Codec<quant::E5M2, Plane::kValue>{}, {scale}, {16, 48});
  }
  check_codec(quant::KiviTokenCodec<2, 32, Plane::kKey>{}, {}, {32, 128});
}

static_assert(kernels::cuda::DeviceEncodable<quant::KVQuantKeyCodec<3>> &&
              kernels::cuda::DeviceEncodable<quant::KVQuantValueCodec<3>>);
static_assert(kernels::cuda::DeviceEncodable<quant::TurboQuant<7>::key_codec>);
static_assert(!kernels::cuda::DeviceEncodable<
                  quant::TurboQuant<8, quant::TurboVariant::kProd, quant::TurboVariant::kProd>::value_codec>,
              "Prod's sign sketch is not encoded on the device: the append path must reject it at compile time");
