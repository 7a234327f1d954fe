// Lloyd-Max codebooks against the tables of ALGORITHMS.md §4.1 (N(0,1) limit, d = 128, d = 64),
// and the two random rotations of rotation.hpp: orthogonal, reproducible from their seed,
// Hadamard equal to an explicitly built H·D/√d.

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "kvpack/quant/lloyd_max.hpp"
#include "kvpack/quant/rotation.hpp"

namespace {

namespace q = kvpack::quant;
using kvpack::index_t;

/// ALGORITHMS.md §4.1: distortion d·C and positive centroids (units of 1/√d), as printed.
struct Table {
  int bits;
  double distortion;
  std::vector<double> positive;
};

// Printed centroids have 4 decimals: half a unit in the last place plus solver slack.
constexpr double kCentroidTolerance = 0.6e-4;

void check_against(const q::ScalarCodebook& book, const Table& table, double distortion_tolerance) {
  INFO("bits " << table.bits);
  CHECK(std::fabs(book.distortion - table.distortion) <= distortion_tolerance);
  const std::size_t levels = std::size_t{1} << table.bits;
  REQUIRE(book.centroids.size() == levels);
  REQUIRE(table.positive.size() == levels / 2);
  for (std::size_t i = 0; i < levels / 2; ++i) {
    INFO("centroid " << i);
    CHECK(std::fabs(book.centroids[levels / 2 + i] - table.positive[i]) <= kCentroidTolerance);
    CHECK(book.centroids[levels / 2 - 1 - i] == -book.centroids[levels / 2 + i]);  // symmetric
  }
  for (std::size_t i = 0; i + 1 < levels; ++i) {
    CHECK(book.centroids[i] < book.centroids[i + 1]);
    CHECK(book.boundaries[i] == Approx(0.5 * (book.centroids[i] + book.centroids[i + 1])));
  }
}

}  // namespace

TEST_CASE("Lloyd-Max codebooks of N(0,1) match Max's tables (ALGORITHMS.md §4.1)", "[quant][turboquant]") {
  const Table tables[] = {
      {1, 0.36338, {0.7979}},
      {2, 0.11748, {0.4528, 1.5104}},
      {3, 0.034548, {0.2451, 0.7560, 1.3439, 2.1519}},
      {4, 0.009501, {0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326}},
  };
  for (const Table& t : tables) {
    const auto book = q::solve_gaussian_codebook(t.bits);
    check_against(book, t, t.bits < 3 ? 0.6e-5 : 0.6e-6);  // half a unit of the last printed digit
  }
  // The paper's b = 1 centroid is exactly √(2/π).
  CHECK(q::solve_gaussian_codebook(1).centroids[1] == Approx(std::sqrt(2.0 / 3.14159265358979323846)).epsilon(1e-10));
}

TEST_CASE("Lloyd-Max codebooks of the sphere's coordinate match the d = 128 and d = 64 tables", "[quant][turboquant]") {
  const Table d128[] = {
      {1, 0.36089, {0.7994}},
      {2, 0.11600, {0.4525, 1.5052}},
      {3, 0.03397, {0.2444, 0.7533, 1.3366, 2.1315}},
      {4, 0.00931, {0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6889}},
  };
  for (const Table& t : d128) check_against(q::sphere_codebook(128, t.bits), t, 0.6e-5);
  // d = 64: distortions only.
  const double d64[] = {0.35839, 0.11453, 0.03339, 0.00913};
  for (int b = 1; b <= 4; ++b) {
    INFO("d = 64, bits " << b);
    CHECK(std::fabs(q::sphere_codebook(64, b).distortion - d64[b - 1]) <= 0.6e-5);
  }
  // b = 1 has a closed form: E|t| = √d · Γ(d/2) / (√π · Γ((d+1)/2)).
  for (index_t d : {8, 64, 128, 200}) {
    const double expected = std::sqrt(static_cast<double>(d)) *
                            std::exp(std::lgamma(d / 2.0) - std::lgamma((d + 1) / 2.0)) / std::sqrt(3.14159265358979323846);
    CHECK(q::sphere_codebook(d, 1).centroids[1] == Approx(expected).epsilon(1e-9));
  }
  // The sphere's codebooks approach the Gaussian ones as d grows.
  for (int b = 1; b <= 4; ++b) {
    const double gap_small = std::fabs(q::sphere_codebook(64, b).distortion - q::solve_gaussian_codebook(b).distortion);
    const double gap_large = std::fabs(q::sphere_codebook(1024, b).distortion - q::solve_gaussian_codebook(b).distortion);
    CHECK(gap_large < gap_small / 8);
  }
}

TEST_CASE("sphere codebooks reject head_dim < 3 and bit widths outside 1..8", "[quant][turboquant]") {
  CHECK_THROWS_AS(q::solve_sphere_codebook(2, 2), kvpack::Error);
  CHECK_THROWS_AS(q::solve_sphere_codebook(128, 0), kvpack::Error);
  CHECK_THROWS_AS(q::solve_sphere_codebook(128, 9), kvpack::Error);
}

namespace {

/// The columns R e_i through apply(): checks RᵀR = I and returns R as [row][col].
std::vector<double> matrix_of(const q::Rotation& r) {
  const index_t d = r.dim();
  std::vector<double> m(static_cast<std::size_t>(d) * d);
  std::vector<float> e(d), y(d);
  for (index_t i = 0; i < d; ++i) {
    std::fill(e.begin(), e.end(), 0.0f);
    e[i] = 1.0f;
    r.apply(e.data(), y.data());
    for (index_t row = 0; row < d; ++row) m[static_cast<std::size_t>(row) * d + i] = y[row];
  }
  return m;
}

void check_orthogonal(const q::Rotation& r) {
  const index_t d = r.dim();
  const auto m = matrix_of(r);
  double worst = 0.0;
  for (index_t i = 0; i < d; ++i) {
    for (index_t j = 0; j < d; ++j) {
      double dot = 0.0;
      for (index_t k = 0; k < d; ++k) dot += m[k * d + i] * m[k * d + j];
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  CHECK(worst < 1e-5);  // float storage of the matrix
  // apply_transpose inverts apply.
  std::vector<float> x(d), y(d), back(d);
  for (index_t i = 0; i < d; ++i) x[i] = std::sin(0.37f * i) + 0.1f * i;
  r.apply(x.data(), y.data());
  r.apply_transpose(y.data(), back.data());
  for (index_t i = 0; i < d; ++i) CHECK(back[i] == Approx(x[i]).margin(1e-5));
}

}  // namespace

TEST_CASE("rotations are orthogonal and invertible", "[quant][turboquant]") {
  for (index_t d : {8, 64, 128}) {
    INFO("d " << d);
    check_orthogonal(q::Rotation(q::RotationKind::kHadamard, d, 11));
    check_orthogonal(q::Rotation(q::RotationKind::kDense, d, 11));
  }
  const q::Rotation odd(q::RotationKind::kAuto, 96, 3);
  CHECK(odd.kind() == q::RotationKind::kDense);
  check_orthogonal(odd);
  CHECK(q::Rotation(q::RotationKind::kAuto, 128, 3).kind() == q::RotationKind::kHadamard);
}

TEST_CASE("the randomized Hadamard transform is H·D/√d with H Sylvester's matrix", "[quant][turboquant]") {
  const index_t d = 32;
  const q::Rotation r(q::RotationKind::kHadamard, d, 5);
  const auto m = matrix_of(r);
  // Recover D from the first row (H's first row is all ones), then compare every entry.
  std::vector<double> signs(d);
  for (index_t c = 0; c < d; ++c) signs[c] = m[c] > 0 ? 1.0 : -1.0;
  int flips = 0;
  for (index_t c = 0; c < d; ++c) flips += signs[c] < 0;
  CHECK(flips > 0);
  CHECK(flips < d);
  for (index_t i = 0; i < d; ++i) {
    for (index_t c = 0; c < d; ++c) {
      const double h = (__builtin_popcount(static_cast<unsigned>(i & c)) % 2) ? -1.0 : 1.0;
      CHECK(m[i * d + c] == Approx(h * signs[c] / std::sqrt(static_cast<double>(d))).margin(1e-6));
    }
  }
}

TEST_CASE("rotations are reproducible from their seed and differ between seeds", "[quant][turboquant]") {
  for (auto kind : {q::RotationKind::kHadamard, q::RotationKind::kDense}) {
    const auto a = matrix_of(q::Rotation(kind, 64, q::derive_seed(42, 0)));
    const auto b = matrix_of(q::Rotation(kind, 64, q::derive_seed(42, 0)));
    const auto c = matrix_of(q::Rotation(kind, 64, q::derive_seed(42, 1)));
    CHECK(a == b);
    CHECK(a != c);
  }
  // The normal generator is our own Box–Muller: mean 0, variance 1.
  q::SeededNormal normal(9);
  double sum = 0.0, sum2 = 0.0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = normal();
    sum += x;
    sum2 += x * x;
  }
  CHECK(std::fabs(sum / n) < 4.0 / std::sqrt(n));
  CHECK(std::fabs(sum2 / n - 1.0) < 4.0 * std::sqrt(2.0 / n));
}
