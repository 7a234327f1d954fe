#pragma once
/// \file nuq.hpp
/// \brief Non-uniform quantization levels on [−1, 1] (KVQuant's nuqX, ALGORITHMS.md §2.2): the
///        fixed normal-float codebook, a weighted 1-D k-means that calibrates one from samples,
///        and nearest-level rounding.
///
/// A codebook is 2^b sorted levels. Values are normalised per vector to [−1, 1] before they are
/// rounded to the nearest level, so the levels only have to follow the *shape* of the data.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "kvpack/config.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::quant::nuq {

/// Up to 16 levels (4 bits), sorted; `size` of them are used.
struct Codebook {
  std::array<float, 16> levels{};
  int size = 0;
  friend bool operator==(const Codebook&, const Codebook&) = default;
};

/// Φ⁻¹(p) for p in (0, 1), by bisection on Φ(x) = erfc(−x/√2)/2: slow, exact to double
/// rounding, and only used to build codebooks.
inline double inverse_normal_cdf(double p) {
  double lo = -40.0, hi = 40.0;
  for (int i = 0; i < 200 && hi - lo > 0.0; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (mid == lo || mid == hi) break;
    (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

/// The normal-float codebook (SqueezeLLM / QLoRA construction, KVQuant's "nf" option): 2^(b−1)
/// positive levels from Φ⁻¹ at evenly spaced quantiles from 0.5 to δ = ½(1/32 + 1/30) from the
/// top, 2^(b−1) − 1 negative ones likewise, and 0; each half scaled to reach ±1.
inline Codebook normal_float_codebook(int bits) {
  KVPACK_CHECK(bits >= 1 && bits <= 4, kInvalidArgument,
               ::kvpack::detail::message("nuq codebooks have 1 to 4 bits, got ", bits));
  const int n = 1 << bits;
  const double top = 1.0 - 0.5 * (1.0 / 32.0 + 1.0 / 30.0);
  std::vector<double> levels{0.0};
  auto half = [&](int count, double sign) {
    // `count` quantiles evenly spaced in [0.5, top], 0.5 excluded.
    std::vector<double> side;
    for (int i = 1; i <= count; ++i) side.push_back(inverse_normal_cdf(0.5 + (top - 0.5) * i / count));
    const double scale = side.empty() ? 1.0 : side.back();
    for (double x : side) levels.push_back(sign * x / scale);
  };
  half(n / 2, 1.0);
  half(n / 2 - 1, -1.0);
  std::sort(levels.begin(), levels.end());
  Codebook book;
  book.size = n;
  for (int i = 0; i < n; ++i) book.levels[i] = static_cast<float>(levels[i]);
  return book;
}

/// The index of a codebook's level nearest to x (ties to the lower level; NaN gives 0), with the
/// midpoints between levels computed once for the many elements a page codes with one codebook.
/// Plain data, so the device's KVQuant encoder takes it by value and rounds exactly as the host.
class NearestLevel {
 public:
  NearestLevel() = default;  ///< every element to code 0
  explicit NearestLevel(const Codebook& book) noexcept : size_(book.size) {
    for (int i = 1; i < book.size; ++i) midpoint_[i - 1] = 0.5f * (book.levels[i - 1] + book.levels[i]);
  }
  [[nodiscard]] KVPACK_HOST_DEVICE int operator()(float x) const noexcept {
    int code = 0;
    for (int i = 1; i < size_; ++i) {
      if (x > midpoint_[i - 1]) code = i;
    }
    return code;
  }

 private:
  float midpoint_[15] = {};
  int size_ = 0;
};

/// NearestLevel for one element.
[[nodiscard]] inline int nearest_level(const Codebook& book, float x) noexcept { return NearestLevel(book)(x); }

/// Weighted 1-D k-means (Lloyd's algorithm) of `samples` in [−1, 1] into 2^b levels, minimising
/// Σ w_i (x_i − level(x_i))², from the normal-float codebook, at most `max_iterations` rounds
/// (KVQuant: sklearn's k-means with Fisher weights, 50 iterations). An empty cluster keeps its
/// level. `weights` empty means all 1.
inline Codebook kmeans_codebook(int bits, std::span<const float> samples, std::span<const float> weights = {},
                                int max_iterations = 50) {
  KVPACK_CHECK(weights.empty() || weights.size() == samples.size(), kInvalidArgument,
               ::kvpack::detail::message("kmeans_codebook: ", weights.size(), " weights for ", samples.size(), " samples"));
  Codebook book = normal_float_codebook(bits);
  if (samples.empty()) return book;
  // Sorted samples make each round one pass: clusters are contiguous runs between midpoints.
  std::vector<std::pair<float, float>> sorted(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const float w = weights.empty() ? 1.0f : weights[i];
    KVPACK_CHECK(std::isfinite(samples[i]) && std::isfinite(w) && w >= 0.0f, kInvalidArgument,
                 "kmeans_codebook: samples must be finite and weights finite and non-negative");
    sorted[i] = {samples[i], w};
  }
  std::sort(sorted.begin(), sorted.end());
  for (int round = 0; round < max_iterations; ++round) {
    std::array<double, 16> sum{}, mass{};
    int cluster = 0;
    for (const auto& [x, w] : sorted) {
      while (cluster + 1 < book.size && x > 0.5f * (book.levels[cluster] + book.levels[cluster + 1])) ++cluster;
      sum[cluster] += static_cast<double>(w) * x;
      mass[cluster] += w;
    }
    bool moved = false;
    for (int i = 0; i < book.size; ++i) {
      if (mass[i] <= 0.0) continue;
      const float level = static_cast<float>(sum[i] / mass[i]);
      moved = moved || level != book.levels[i];
      book.levels[i] = level;
    }
    std::sort(book.levels.begin(), book.levels.begin() + book.size);
    if (!moved) break;
  }
  return book;
}

}  // namespace kvpack::inline v0::quant::nuq
