#pragma once
// Seeded random K/V data for tests, including the adversarial shapes the kernels must survive.

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvpack::test {

/// Rows of `dim` normal values; `outlier_channels` channels (the first ones) scaled by
/// `outlier_scale`, as real key caches show a few large-magnitude channels.
inline std::vector<float> random_rows(std::size_t rows, int dim, std::uint32_t seed,
                                      int outlier_channels = 0, float outlier_scale = 10.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> out(rows * static_cast<std::size_t>(dim));
  for (std::size_t r = 0; r < rows; ++r) {
    for (int c = 0; c < dim; ++c) {
      out[r * dim + c] = normal(rng) * (c < outlier_channels ? outlier_scale : 1.0f);
    }
  }
  return out;
}

}  // namespace kvpack::test
