// quant::TurboCodec (MSE, Prod) and quant::QjlKeyCodec: the statistics ALGORITHMS.md §3–§4 states,
// reproduced on random unit vectors at d = 128 with fixed seeds (distortion, unbiasedness, the
// variance of the inner-product estimate, the MSE variant's bias), the byte format as the header
// documents it, and the true bits per element.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvpack/core/half.hpp"
#include "kvpack/quant/turboquant.hpp"

namespace {

namespace q = kvpack::quant;
using kvpack::index_t;
using kvpack::Plane;
using q::PageGeometry;
using q::TurboVariant;

constexpr double kPi = 3.14159265358979323846;

/// `count` independent uniform unit vectors of R^d (normalised Gaussians), row-major.
std::vector<float> unit_vectors(std::size_t count, index_t d, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<float> out(count * d);
  std::vector<double> v(d);
  for (std::size_t i = 0; i < count; ++i) {
    double n2 = 0.0;
    for (double& x : v) {
      x = normal(rng);
      n2 += x * x;
    }
    for (index_t c = 0; c < d; ++c) out[i * d + c] = static_cast<float>(v[c] / std::sqrt(n2));
  }
  return out;
}

/// Encodes `rows` (a multiple of the page size) page by page and decodes them back.
template <class Codec>
std::vector<float> roundtrip(const Codec& codec, const std::vector<float>& rows, index_t d, index_t page = 32,
                             index_t layer = 0) {
  const PageGeometry g{page, d};
  codec.validate(g);
  const auto params = codec.initial_params(layer, 0);
  std::vector<std::byte> plane(codec.plane_bytes(g));
  std::vector<float> out(rows.size());
  REQUIRE(rows.size() % (static_cast<std::size_t>(page) * d) == 0);
  for (std::size_t first = 0; first < rows.size(); first += static_cast<std::size_t>(page) * d) {
    codec.encode(g, rows.data() + first, d, params, plane.data());
    codec.decode(g, plane.data(), params, out.data() + first);
  }
  return out;
}

struct Moments {
  double mean = 0.0, variance = 0.0, standard_error = 0.0;
};
Moments moments(const std::vector<double>& x) {
  Moments m;
  for (double v : x) m.mean += v;
  m.mean /= static_cast<double>(x.size());
  for (double v : x) m.variance += (v - m.mean) * (v - m.mean);
  m.variance /= static_cast<double>(x.size() - 1);
  m.standard_error = std::sqrt(m.variance / static_cast<double>(x.size()));
  return m;
}

/// ⟨y_i, x̃_i⟩ − ⟨y_i, x_i⟩ over pairs of independent unit vectors.
std::vector<double> inner_product_errors(const std::vector<float>& x, const std::vector<float>& decoded,
                                         const std::vector<float>& y, index_t d) {
  std::vector<double> err(x.size() / d);
  for (std::size_t i = 0; i < err.size(); ++i) {
    double exact = 0.0, estimate = 0.0;
    for (index_t c = 0; c < d; ++c) {
      exact += static_cast<double>(y[i * d + c]) * x[i * d + c];
      estimate += static_cast<double>(y[i * d + c]) * decoded[i * d + c];
    }
    err[i] = estimate - exact;
  }
  return err;
}

using MseCodec = q::TurboCodec<TurboVariant::kMse, Plane::kKey>;
using ProdCodec = q::TurboCodec<TurboVariant::kProd, Plane::kKey>;

// ALGORITHMS.md §4.1, d = 128: d·C(f, b) for b = 1..4.
constexpr double kMseDistortion128[] = {0.3609, 0.1160, 0.0340, 0.0093};

}  // namespace

TEST_CASE("TurboQuant-MSE distortion on random unit vectors matches ALGORITHMS.md §4.1 within 2 %",
          "[quant][turboquant]") {
  const index_t d = 128;
  const std::size_t n = 8192;  // relative standard error of the mean ≈ 0.15 % at b = 4
  const auto x = unit_vectors(n, d, 101);
  for (auto rotation : {q::RotationKind::kHadamard, q::RotationKind::kDense}) {
    for (int b = 1; b <= 4; ++b) {
      const MseCodec codec(q::TurboOptions{q::TurboRate::integer(b), rotation});
      const auto decoded = roundtrip(codec, x, d);
      double total = 0.0;
      for (std::size_t i = 0; i < x.size(); ++i) total += (x[i] - decoded[i]) * static_cast<double>(x[i] - decoded[i]);
      const double distortion = total / static_cast<double>(n);
      INFO("bits " << b << " rotation " << static_cast<int>(rotation) << " distortion " << distortion);
      CHECK(std::fabs(distortion / kMseDistortion128[b - 1] - 1.0) <= 0.02);
    }
  }
}

TEST_CASE("TurboQuant-Prod inner products are unbiased with the variance of ALGORITHMS.md §4.3",
          "[quant][turboquant]") {
  const index_t d = 128;
  const std::size_t n = 100000;
  const auto x = unit_vectors(n, d, 202);
  const auto y = unit_vectors(n, d, 303);
  // D_prod = (π / 2d) · D_mse(b − 1) (1.571, 0.56, 0.18, 0.054 over d; §4.3's consistency note).
  const double spec[] = {1.571, 0.56, 0.18, 0.054};
  {  // 10^5 pairs at b = 3; the other widths below with fewer (the tolerances scale with them)
    const int b = 3;
    const auto errors = inner_product_errors(x, roundtrip(ProdCodec(q::TurboOptions{q::TurboRate::integer(b)}), x, d), y, d);
    const Moments m = moments(errors);
    INFO("bits " << b << " mean " << m.mean << " se " << m.standard_error << " d·variance " << m.variance * d);
    CHECK(std::fabs(m.mean) <= 3.0 * m.standard_error);
    CHECK(std::fabs(m.variance * d / spec[b - 1] - 1.0) <= 0.10);
  }
  const std::size_t fewer = 32000;
  const std::vector<float> xs(x.begin(), x.begin() + fewer * d), ys(y.begin(), y.begin() + fewer * d);
  for (int b : {1, 2, 4}) {
    const auto errors = inner_product_errors(xs, roundtrip(ProdCodec(q::TurboOptions{q::TurboRate::integer(b)}), xs, d), ys, d);
    const Moments m = moments(errors);
    INFO("bits " << b << " mean " << m.mean << " se " << m.standard_error << " d·variance " << m.variance * d);
    CHECK(std::fabs(m.mean) <= 3.0 * m.standard_error);
    CHECK(std::fabs(m.variance * d / spec[b - 1] - 1.0) <= 0.10);
  }
}

TEST_CASE("TurboQuant-MSE shrinks inner products by 1 − D(b); Prod does not", "[quant][turboquant]") {
  // At the Lloyd-Max fixed point E⟨y, c(y)⟩ = E‖c(y)‖² = 1 − D, so for y = x the MSE variant's
  // ⟨x, x̃⟩ is biased by −D(b) (2/π at b = 1 in the large-d limit), Prod's is not.
  const index_t d = 128;
  const std::size_t n = 8192;
  const auto x = unit_vectors(n, d, 404);
  for (int b = 1; b <= 4; ++b) {
    const auto mse = inner_product_errors(x, roundtrip(MseCodec(q::TurboOptions{q::TurboRate::integer(b)}), x, d), x, d);
    const Moments m = moments(mse);
    INFO("bits " << b << " MSE bias " << m.mean << " se " << m.standard_error);
    CHECK(std::fabs(m.mean + kMseDistortion128[b - 1]) <= 0.02 * kMseDistortion128[b - 1] + 3.0 * m.standard_error);
    CHECK(std::fabs(m.mean) > 10.0 * m.standard_error);  // a bias, not noise
    const auto prod = inner_product_errors(x, roundtrip(ProdCodec(q::TurboOptions{q::TurboRate::integer(b)}), x, d), x, d);
    const Moments p = moments(prod);
    INFO("Prod bias " << p.mean << " se " << p.standard_error);
    CHECK(std::fabs(p.mean) <= 3.0 * p.standard_error);
  }
  // b = 1, large d: 1 − D = c₁² → 2/π.
  CHECK(1.0 - q::sphere_codebook(128, 1).distortion == Approx(2.0 / kPi).epsilon(0.01));
}

TEST_CASE("QJL's estimator is unbiased with variance (π/2 − ⟨x,y⟩²)/m", "[quant][turboquant][qjl]") {
  const index_t d = 128;
  const std::size_t n = 100000;
  const auto x = unit_vectors(n, d, 505);
  const auto y = unit_vectors(n, d, 606);
  const q::QjlKeyCodec codec(128);
  const auto errors = inner_product_errors(x, roundtrip(codec, x, d), y, d);
  const Moments m = moments(errors);
  // E⟨x, y⟩² = 1/d for independent unit vectors.
  const double expected = (kPi / 2.0 - 1.0 / d) / 128.0;
  INFO("mean " << m.mean << " se " << m.standard_error << " variance " << m.variance << " expected " << expected);
  CHECK(std::fabs(m.mean) <= 3.0 * m.standard_error);
  CHECK(std::fabs(m.variance / expected - 1.0) <= 0.10);
  CHECK(m.variance <= kPi / (2.0 * 128) * 1.03);  // Lemma 4's bound, up to sampling error

  // m = 256 halves the variance.
  const std::size_t fewer = 32000;
  const std::vector<float> xs(x.begin(), x.begin() + fewer * d), ys(y.begin(), y.begin() + fewer * d);
  const auto wide = moments(inner_product_errors(xs, roundtrip(q::QjlKeyCodec(256), xs, d), ys, d));
  CHECK(std::fabs(wide.mean) <= 3.0 * wide.standard_error);
  CHECK(std::fabs(wide.variance / ((kPi / 2.0 - 1.0 / d) / 256.0) - 1.0) <= 0.10);
}

TEST_CASE("TurboQuant's and QJL's planes follow the documented byte format", "[quant][turboquant]") {
  const index_t d = 64, P = 16;
  const PageGeometry g{P, d};
  auto rows = unit_vectors(P, d, 707);
  for (index_t t = 0; t < P; ++t) {
    for (index_t c = 0; c < d; ++c) rows[t * d + c] *= 0.5f + t;  // norms 0.5 .. 15.5
  }
  for (int low_bits : {1, 2, 3}) {
    // 2.5-, 1.5-, 3.5-bit splits: the first high_channels rotated channels get one bit more.
    const MseCodec codec(q::TurboOptions{q::TurboRate::half_step(low_bits), q::RotationKind::kDense, 99});
    codec.validate(g);
    const auto params = codec.initial_params(3, 1);
    CHECK(params.layer == 3);
    CHECK(params.seed == q::derive_seed(99, 3));
    std::vector<std::byte> plane(codec.plane_bytes(g));
    codec.encode(g, rows.data(), d, params, plane.data());
    std::vector<float> decoded(rows.size());
    codec.decode(g, plane.data(), params, decoded.data());
    const index_t high = d / 2;
    const std::size_t row_bits = static_cast<std::size_t>(high) * (low_bits + 1) + static_cast<std::size_t>(d - high) * low_bits;
    const std::size_t row_bytes = (row_bits + 7) / 8;
    REQUIRE(codec.plane_bytes(g) == row_bytes * P + 2 * P);
    // Independent decode: the rotation rebuilt from the documented seed, codebooks from the solver.
    const q::Rotation rotation(q::RotationKind::kDense, d, q::derive_seed(99, 3));
    const auto& hi_book = q::sphere_codebook(d, low_bits + 1);
    const auto& lo_book = q::sphere_codebook(d, low_bits);
    for (index_t t = 0; t < P; ++t) {
      std::vector<float> y(d), x(d);
      std::size_t bit = t * row_bytes * 8;
      for (index_t c = 0; c < d; ++c) {
        const int bits = c < high ? low_bits + 1 : low_bits;
        unsigned code = 0;
        for (int k = 0; k < bits; ++k, ++bit) code |= ((static_cast<unsigned>(plane[bit / 8]) >> (bit % 8)) & 1u) << k;
        y[c] = static_cast<float>((c < high ? hi_book : lo_book).centroids[code] / std::sqrt(static_cast<double>(d)));
      }
      rotation.apply_transpose(y.data(), x.data());
      std::uint16_t norm_bits;
      std::memcpy(&norm_bits, plane.data() + row_bytes * P + 2 * t, 2);
      const float norm = kvpack::half::from_bits(norm_bits);
      CHECK(norm == Approx(0.5 + t).epsilon(1e-3));
      for (index_t c = 0; c < d; ++c) CHECK(decoded[t * d + c] == Approx(x[c] * norm).margin(1e-5));
    }
    // True bits per element, from the plane's bytes.
    CHECK(codec.nominal_bits_per_element(d) == Approx(8.0 * codec.plane_bytes(g) / (P * d)));
    CHECK(codec.nominal_bits_per_element(d) == Approx(low_bits + 0.5 + 16.0 / d));
  }
  // Prod: codes, then d sign bits per token, then norm and gamma.
  const ProdCodec prod(q::TurboOptions{q::TurboRate::integer(3)});
  CHECK(prod.plane_bytes(g) == (2 * d / 8 + d / 8 + 4) * static_cast<std::size_t>(P));
  CHECK(prod.nominal_bits_per_element(128) == Approx(3.25));
  const q::QjlKeyCodec qjl(128);
  CHECK(qjl.plane_bytes(g) == (128 / 8 + 2) * static_cast<std::size_t>(P));
  CHECK(qjl.nominal_bits_per_element(128) == Approx(1.125));
  CHECK(q::QjlKeyCodec{}.nominal_bits_per_element(128) == Approx(2.125));  // m = 2d by default
  CHECK_THROWS_AS(q::QjlKeyCodec(256).validate(PageGeometry{32, 64}), kvpack::Error);  // m > 2d
  CHECK_THROWS_AS(q::QjlKeyCodec(100).validate(PageGeometry{32, 64}), kvpack::Error);  // not whole bytes
  CHECK_THROWS_AS(q::QjlKeyCodec(-8).validate(PageGeometry{32, 64}), kvpack::Error);   // not the default
  CHECK_THROWS_AS(q::Rotation(q::RotationKind::kDense, 2048, 1), kvpack::Error);      // beyond the buffers
  CHECK_THROWS_AS(q::Rotation(q::RotationKind::kDense, -1, 1), kvpack::Error);
  CHECK_THROWS_AS(q::Rotation(q::RotationKind::kHadamard, 12, 1), kvpack::Error);     // not a power of two
}

TEST_CASE("TurboQuant validates its options and keeps zero vectors zero", "[quant][turboquant]") {
  CHECK_THROWS_AS(MseCodec(q::TurboOptions{q::TurboRate::integer(5)}).validate({32, 64}), kvpack::Error);
  CHECK_THROWS_AS(MseCodec(q::TurboOptions{q::TurboRate::integer(3), q::RotationKind::kHadamard}).validate({32, 96}),
                  kvpack::Error);
  CHECK_NOTHROW(MseCodec(q::TurboOptions{q::TurboRate::integer(3)}).validate({32, 96}));  // kAuto: dense
  const std::vector<float> zeros(32 * 96, 0.0f);
  const auto decoded = roundtrip(ProdCodec(q::TurboOptions{q::TurboRate::integer(2)}), zeros, 96, 32);
  for (float v : decoded) CHECK(v == 0.0f);
  // Layers get different rotations: the same rows encode differently.
  const MseCodec codec;
  const auto x = unit_vectors(64, 64, 808);
  CHECK(roundtrip(codec, x, 64, 64, 0) != roundtrip(codec, x, 64, 64, 1));
  CHECK(roundtrip(codec, x, 64, 64, 1) == roundtrip(codec, x, 64, 64, 1));
}
