#pragma once
/// \file lloyd_max.hpp
/// \brief Lloyd–Max scalar codebooks for TurboQuant (ALGORITHMS.md §4.1): the MSE-optimal
///        2^b-level quantizer of one coordinate of a uniform point on S^{d−1}, whose density is
///        f(x) ∝ (1 − x²)^{(d−3)/2} on [−1, 1], and of its large-d limit N(0, 1/d).
///
/// Everything is solved in the scaled variable t = √d·x (so the tables read like the spec's,
/// "in units of 1/√d"): density ∝ (1 − t²/d)^{(d−3)/2} on [−√d, √d], variance exactly 1.
/// Lloyd's iteration alternates boundaries = midpoints of neighbouring centroids and centroids
/// = conditional means E[t | cell]; both integrals use composite Gauss–Legendre quadrature. The
/// distortion of the fixed point is E t² − Σ_i p_i c_i² (the cross terms vanish there), which is
/// d·C(f, b) in the spec's notation.
///
/// `sphere_codebook(d, b)` memoises its result per (d, b) for the process: a solve takes a few
/// milliseconds and every TurboQuant codec of the same head_dim shares it.

#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::quant {

/// A solved codebook in units of 1/√d (multiply by 1/√d for sphere coordinates).
struct ScalarCodebook {
  int bits = 0;
  std::vector<double> centroids;   ///< [2^b], increasing
  std::vector<double> boundaries;  ///< [2^b − 1], the midpoints between neighbouring centroids
  double distortion = 0.0;         ///< E (t − Q(t))² = d·C(f, b); t has variance 1
  int iterations = 0;              ///< Lloyd iterations until the centroids moved < 1e-13
};

namespace lloyd_detail {

/// Gauss–Legendre nodes and weights on [−1, 1] (Newton on P_n from the Chebyshev guesses).
template <int N>
struct GaussLegendre {
  std::array<double, N> nodes{};
  std::array<double, N> weights{};
  GaussLegendre() {
    for (int i = 0; i < N; ++i) {
      double x = std::cos(3.14159265358979323846 * (i + 0.75) / (N + 0.5));
      double dp = 0.0;
      for (int it = 0; it < 100; ++it) {
        double p0 = 1.0, p1 = x;
        for (int k = 2; k <= N; ++k) {
          const double p2 = ((2.0 * k - 1.0) * x * p1 - (k - 1.0) * p0) / k;
          p0 = p1;
          p1 = p2;
        }
        dp = N * (x * p1 - p0) / (x * x - 1.0);
        const double step = p1 / dp;
        x -= step;
        if (std::fabs(step) < 1e-16) break;
      }
      nodes[i] = x;
      weights[i] = 2.0 / ((1.0 - x * x) * dp * dp);
    }
  }
};

/// (∫ g, ∫ t·g, ∫ t²·g) over [a, b], `panels` Gauss–Legendre panels of 20 nodes.
template <class Density>
std::array<double, 3> moments(const Density& g, double a, double b, int panels) {
  static const GaussLegendre<20> rule;
  std::array<double, 3> sum{0.0, 0.0, 0.0};
  const double width = (b - a) / panels;
  for (int p = 0; p < panels; ++p) {
    const double mid = a + (p + 0.5) * width;
    const double half = 0.5 * width;
    for (int i = 0; i < 20; ++i) {
      const double t = mid + half * rule.nodes[i];
      const double w = half * rule.weights[i] * g(t);
      sum[0] += w;
      sum[1] += w * t;
      sum[2] += w * t * t;
    }
  }
  return sum;
}

/// Lloyd's iteration for a symmetric density g on [−limit, limit] with unit variance.
template <class Density>
ScalarCodebook solve(const Density& g, double limit, int bits) {
  KVPACK_CHECK(bits >= 1 && bits <= 8, kInvalidArgument,
               ::kvpack::detail::message("Lloyd-Max codebooks have 1..8 bits, not ", bits));
  const int levels = 1 << bits;
  constexpr int kPanels = 8;
  const auto total = moments(g, -limit, limit, 64);
  const double mass = total[0];
  const double second = total[2] / mass;
  ScalarCodebook book;
  book.bits = bits;
  book.centroids.resize(static_cast<std::size_t>(levels));
  book.boundaries.resize(static_cast<std::size_t>(levels - 1));
  // Start from evenly spaced levels over ±2.5 standard deviations (inside the support).
  const double span = std::min(2.5, 0.9 * limit);
  for (int i = 0; i < levels; ++i) book.centroids[i] = span * (2.0 * (i + 0.5) / levels - 1.0);
  std::vector<double> probability(static_cast<std::size_t>(levels));
  for (int it = 1; it <= 100000; ++it) {
    for (int i = 0; i + 1 < levels; ++i) book.boundaries[i] = 0.5 * (book.centroids[i] + book.centroids[i + 1]);
    double moved = 0.0;
    // By symmetry only the upper half is integrated; the lower half mirrors it.
    for (int i = levels / 2; i < levels; ++i) {
      const double lo = i == 0 ? -limit : book.boundaries[i - 1];
      const double hi = i == levels - 1 ? limit : book.boundaries[i];
      const auto m = moments(g, lo, hi, kPanels);
      const double c = m[0] > 0.0 ? m[1] / m[0] : 0.5 * (lo + hi);
      moved = std::max(moved, std::fabs(c - book.centroids[i]));
      book.centroids[i] = c;
      book.centroids[levels - 1 - i] = -c;
      probability[i] = probability[levels - 1 - i] = m[0] / mass;
    }
    book.iterations = it;
    if (moved < 1e-13) break;
  }
  for (int i = 0; i + 1 < levels; ++i) book.boundaries[i] = 0.5 * (book.centroids[i] + book.centroids[i + 1]);
  double explained = 0.0;
  for (int i = 0; i < levels; ++i) explained += probability[i] * book.centroids[i] * book.centroids[i];
  book.distortion = second - explained;
  return book;
}

}  // namespace lloyd_detail

/// The Lloyd–Max codebook of one coordinate of a uniform point on S^{d−1}, scaled by √d.
/// \throws kvpack::Error (kInvalidArgument) for d < 3 (the density is not integrable there in
///         this form) or bits outside 1..8.
inline ScalarCodebook solve_sphere_codebook(index_t d, int bits) {
  KVPACK_CHECK(d >= 3, kInvalidArgument,
               ::kvpack::detail::message("sphere codebooks need head_dim >= 3, not ", d));
  const double dim = static_cast<double>(d);
  const double exponent = 0.5 * (dim - 3.0);
  auto density = [dim, exponent](double t) {
    const double u = 1.0 - t * t / dim;
    return u <= 0.0 ? 0.0 : std::exp(exponent * std::log(u));
  };
  return lloyd_detail::solve(density, std::sqrt(dim), bits);
}

/// The large-d limit: the Lloyd–Max codebook of N(0, 1) (Max, 1960).
inline ScalarCodebook solve_gaussian_codebook(int bits) {
  auto density = [](double t) { return std::exp(-0.5 * t * t); };
  return lloyd_detail::solve(density, 12.0, bits);
}

/// solve_sphere_codebook, memoised per (d, bits) for the process; the reference stays valid.
inline const ScalarCodebook& sphere_codebook(index_t d, int bits) {
  static std::mutex mutex;
  static std::map<std::pair<index_t, int>, std::unique_ptr<const ScalarCodebook>> solved;
  std::lock_guard lock(mutex);
  auto& slot = solved[{d, bits}];
  if (!slot) slot = std::make_unique<const ScalarCodebook>(solve_sphere_codebook(d, bits));
  return *slot;
}

}  // namespace kvpack::inline v0::quant
