// The CUDA kernels' per-element and per-pair decoders (kernels/cuda/element_decode.hpp),
// compiled for the host, against every supported codec's scalar decode on the same page bytes: bit for bit
// (TurboQuant-MSE: its rotated rows, and through the device's transforms within float rounding), on
// random pages with outlier channels, zero rows, extreme magnitudes and (where the format can
// hold them) NaN and Inf. Runs without a GPU, so a layout mismatch is caught in every CI run.

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvpack/kernels/cuda/element_decode.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "support/stream_fixture.hpp"

namespace {

using namespace kvpack;

/// Page rows for (page_size, head_dim): outlier channels, a zero row, one row at the format's
/// largest storable magnitude and, when `non_finite`, a NaN and an Inf.
std::vector<float> adversarial_rows(index_t page_size, index_t head_dim, float max_abs, bool non_finite,
                                    std::uint32_t seed) {
  std::vector<float> rows = test::random_rows(static_cast<std::size_t>(page_size), head_dim, seed, 3, 40.0f);
  std::fill_n(rows.begin() + head_dim, head_dim, 0.0f);  // token 1: a zero vector
  const float big = std::min(max_abs, 1e30f);
  for (index_t c = 0; c < head_dim; ++c) rows[2 * head_dim + c] = c % 2 == 0 ? big : -big / 3;
  if (non_finite) {
    rows[3 * head_dim + 5] = std::numeric_limits<float>::quiet_NaN();
    rows[4 * head_dim + 7] = -std::numeric_limits<float>::infinity();
  }
  return rows;
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

/// The parameters the device decoder takes, on the host: KVQuant's with its host tables in place
/// of the device copies.
template <class Codec>
kernels::cuda::device_params_t<Codec> decoder_params(const typename Codec::params_type& params, quant::PageGeometry g) {
  if constexpr (std::is_same_v<kernels::cuda::device_params_t<Codec>, kernels::cuda::KVQuantDeviceKeyParams>) {
    return kernels::cuda::to_device_params(params, g, params.offset, params.half_range);
  } else if constexpr (std::is_same_v<kernels::cuda::device_params_t<Codec>, kernels::cuda::KVQuantDeviceValueParams>) {
    return kernels::cuda::to_device_params(params, g);
  } else {
    return params;
  }
}

template <class Codec>
void check_codec(const Codec& codec, typename Codec::params_type host_params, quant::PageGeometry g, bool non_finite) {
  using Decoder = kernels::cuda::ElementDecoder<Codec>;
  try {
    codec.validate(g);
  } catch (const Error&) {
    return;  // a geometry this codec cannot store (KIVI keys need page_size a multiple of the group)
  }
  const std::vector<float> rows = adversarial_rows(g.page_size, g.head_dim, codec.max_abs_input(), non_finite, 17);
  std::vector<std::byte> plane(codec.plane_bytes(g) + 64);
  codec.encode(g, rows.data(), g.head_dim, host_params, plane.data());
  std::vector<float> expected(static_cast<std::size_t>(g.page_size) * g.head_dim);
  codec.decode(g, plane.data(), host_params, expected.data());
  const auto params = decoder_params<Codec>(host_params, g);
  int mismatches = 0;
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const float got = Decoder::at(plane.data(), g, params, t, c);
      if (!same_float(got, expected[static_cast<std::size_t>(t) * g.head_dim + c])) ++mismatches;
    }
  }
  // The pairs the kernels read: tokens (t, t + 1) of a channel, channels (c, c + 1) of a token.
  for (index_t t = 0; t + 1 < g.page_size; t += 2) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const auto pair = kernels::cuda::token_pair<Decoder>(plane.data(), g, params, t, c);
      if (!same_float(pair.first, expected[static_cast<std::size_t>(t) * g.head_dim + c])) ++mismatches;
      if (!same_float(pair.second, expected[static_cast<std::size_t>(t + 1) * g.head_dim + c])) ++mismatches;
    }
  }
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c + 1 < g.head_dim; c += 2) {
      const auto pair = kernels::cuda::channel_pair<Decoder>(plane.data(), g, params, t, c);
      if (!same_float(pair.first, expected[static_cast<std::size_t>(t) * g.head_dim + c])) ++mismatches;
      if (!same_float(pair.second, expected[static_cast<std::size_t>(t) * g.head_dim + c + 1])) ++mismatches;
    }
  }
  INFO(Codec::kName << " page_size " << g.page_size << " head_dim " << g.head_dim);
  CHECK(mismatches == 0);
}

template <class Quantizer>
void check_quantizer(bool non_finite, std::vector<quant::PageGeometry> geometries) {
  const Quantizer q = test::make_quantizer<Quantizer>(geometries.front().head_dim);
  for (const quant::PageGeometry g : geometries) {
    check_codec(q.key, q.key.initial_params(0, 0), g, non_finite);
    check_codec(q.value, q.value.initial_params(0, 0), g, non_finite);
  }
}

}  // namespace

TEST_CASE("CUDA element decoders equal the scalar decode of every device codec", "[cuda][decode]") {
  const std::vector<quant::PageGeometry> shapes{{32, 128}, {16, 64}, {64, 96}, {256, 32}};
  check_quantizer<quant::Float<float>>(true, shapes);
  check_quantizer<quant::Float<half>>(true, shapes);
  check_quantizer<quant::Float<bfloat16>>(true, shapes);
  check_quantizer<quant::Int8>(false, shapes);
  check_quantizer<quant::Q8_0>(false, shapes);
  check_quantizer<quant::Q4_0>(false, shapes);
  check_quantizer<quant::KIVI<2, 32>>(false, shapes);
  check_quantizer<quant::KIVI<4, 32>>(false, shapes);
  check_quantizer<quant::KIVI<4, 64>>(false, {{64, 128}, {128, 64}});
}

TEST_CASE("CUDA element decoders read KVQuant's codebook, ranges and exact outliers like the scalar decode",
          "[cuda][decode]") {
  // One calibration per head_dim; the adversarial rows put a row at ±32752 and outlier
  // channels far outside the calibrated key ranges, so every page stores outliers (and more
  // candidates than it has room for: those left are rounded like the rest).
  for (const index_t head_dim : {128, 64}) {
    const std::vector<quant::PageGeometry> shapes{{32, head_dim}, {16, head_dim}, {128, head_dim}};
    check_quantizer<quant::KVQuant<4>>(false, shapes);
    check_quantizer<quant::KVQuant<3>>(false, shapes);
    check_quantizer<quant::KVQuant<2>>(false, shapes);
  }
}

TEST_CASE("CUDA FP8 element decoders apply the plane's scale like the scalar decode", "[cuda][decode]") {
  for (const float scale : {1.0f, 0.37f, 1e-3f}) {
    const quant::FP8Params params{scale};
    for (const quant::PageGeometry g : {quant::PageGeometry{32, 128}, quant::PageGeometry{16, 48}}) {
      check_codec(quant::FP8Codec<quant::E4M3FN, Plane::kKey>{}, params, g, true);
      check_codec(quant::FP8Codec<quant::E4M3FN, Plane::kValue>{}, params, g, true);
      check_codec(quant::FP8Codec<quant::E5M2, Plane::kKey>{}, params, g, true);
      check_codec(quant::FP8Codec<quant::E5M2, Plane::kValue>{}, params, g, true);
    }
  }
}

TEST_CASE("KIVI's per-token key ablation decodes element-wise too", "[cuda][decode]") {
  check_codec(quant::KiviTokenCodec<2, 32, Plane::kKey>{}, {}, {32, 128}, false);
  check_codec(quant::KiviTokenCodec<4, 32, Plane::kKey>{}, {}, {64, 64}, false);
}

namespace {

/// TurboQuant-MSE's decoder gives rotated rows (element_decode.hpp). Checked against the codec:
/// - bit for bit against n_t·C(code) from the codec's own decode_rotated;
/// - through the matrix the device kernels apply (turbo_transform, y = Mᵀx): a value row turned
///   back, Rᵀ(n·C), equals the scalar decode, and a query turned in, R q, scores every key as
///   q·(decoded key) does, within the float rounding of M's entries, of n·C and of the decode.
template <class Codec>
void check_turbo_codec(const Codec& codec, quant::PageGeometry g) {
  using Decoder = kernels::cuda::ElementDecoder<Codec>;
  static_assert(kernels::cuda::rotated_space<Decoder>);
  const index_t d = g.head_dim;
  const auto host = codec.initial_params(0, 0);
  const std::vector<float> rows = adversarial_rows(g.page_size, d, codec.max_abs_input(), false, 19);
  std::vector<std::byte> plane(codec.plane_bytes(g) + 64);
  codec.encode(g, rows.data(), d, host, plane.data());
  std::vector<float> decoded(static_cast<std::size_t>(g.page_size) * d);
  codec.decode(g, plane.data(), host, decoded.data());
  const quant::turbo_detail::LayerView& view = quant::turbo_detail::layer_view(host, d);
  const auto params = kernels::cuda::to_device_params(host, g, nullptr);
  const std::vector<float> M = kernels::cuda::turbo_transform(view.rotation, d, Codec::kPlane);
  const std::vector<float> query = test::random_rows(1, d, 23, 2, 8.0f);
  std::vector<double> turned_query(static_cast<std::size_t>(d), 0.0), query_mass(static_cast<std::size_t>(d), 0.0);
  for (index_t j = 0; j < d; ++j) {
    for (index_t c = 0; c < d; ++c) {
      turned_query[c] += static_cast<double>(M[static_cast<std::size_t>(j) * d + c]) * query[j];
      query_mass[c] += std::fabs(static_cast<double>(M[static_cast<std::size_t>(j) * d + c]) * query[j]);
    }
  }
  constexpr double kUlp = 0x1p-24;
  int mismatches = 0, beyond_bound = 0;
  std::vector<float> centroids(static_cast<std::size_t>(d)), rotated(static_cast<std::size_t>(d));
  for (index_t t = 0; t < g.page_size; ++t) {
    codec.decode_rotated(g, plane.data(), view, t, centroids.data());
    const float norm = quant::turbo_detail::load_half(plane.data() + view.norms_offset(g.page_size) + 2 * t);
    for (index_t c = 0; c < d; ++c) {
      rotated[c] = Decoder::at(plane.data(), g, params, t, c);
      if (!same_float(rotated[c], centroids[c] * norm)) ++mismatches;
    }
    const float* x = decoded.data() + static_cast<std::size_t>(t) * d;
    if constexpr (Codec::kPlane == Plane::kValue) {
      for (index_t c = 0; c < d; ++c) {
        double back = 0.0, mass = 0.0;
        for (index_t j = 0; j < d; ++j) {
          back += static_cast<double>(M[static_cast<std::size_t>(j) * d + c]) * rotated[j];
          mass += std::fabs(static_cast<double>(M[static_cast<std::size_t>(j) * d + c]) * rotated[j]);
        }
        if (std::fabs(back - x[c]) > 4 * kUlp * (mass + std::fabs(x[c])) + 1e-30) ++beyond_bound;
      }
    } else {
      double device_score = 0.0, host_score = 0.0, mass = 0.0;
      for (index_t c = 0; c < d; ++c) {
        device_score += turned_query[c] * rotated[c];
        host_score += static_cast<double>(query[c]) * x[c];
        mass += query_mass[c] * std::fabs(rotated[c]) + std::fabs(static_cast<double>(query[c]) * x[c]);
      }
      if (std::fabs(device_score - host_score) > 4 * kUlp * mass + 1e-30) ++beyond_bound;
    }
  }
  INFO(Codec::kName << " page_size " << g.page_size << " head_dim " << d);
  CHECK(mismatches == 0);
  CHECK(beyond_bound == 0);
}

template <class Quantizer>
void check_turbo(std::vector<quant::PageGeometry> geometries) {
  const Quantizer q = test::make_quantizer<Quantizer>(geometries.front().head_dim);
  for (const quant::PageGeometry g : geometries) {
    check_turbo_codec(q.key, g);
    check_turbo_codec(q.value, g);
  }
}

}  // namespace

TEST_CASE("CUDA element decoders read TurboQuant-MSE's rotated rows, which its transforms turn like the host",
          "[cuda][decode][turboquant]") {
  // Hadamard rotations (64, 128) and a dense one (96); 4-, 3- (codes across bytes) and 2-bit
  // codes, and the half rates' two widths.
  for (const index_t d : {128, 96, 64}) {
    const std::vector<quant::PageGeometry> shapes{{32, d}, {16, d}};
    check_turbo<quant::TurboQuant<8>>(shapes);
    check_turbo<quant::TurboQuant<7>>(shapes);
    check_turbo<quant::TurboQuant<6>>(shapes);
    check_turbo<quant::TurboQuant<5>>(shapes);
    check_turbo<quant::TurboQuant<4>>(shapes);
  }
}

static_assert(kernels::cuda::DeviceDecodable<quant::Q4_0Codec<Plane::kKey>>);
static_assert(kernels::cuda::DeviceDecodable<quant::KVQuantKeyCodec<3>>);
static_assert(kernels::cuda::DeviceDecodable<quant::TurboQuant<8>::key_codec>);
static_assert(!kernels::cuda::DeviceDecodable<quant::TurboQuant<6, quant::TurboVariant::kProd>::key_codec> &&
                  !kernels::cuda::DeviceDecodable<quant::QJL<>::key_codec>,
              "Prod's and QJL's sketch is not on the device yet: its entry points must reject them at compile time");
