#pragma once
/// \file synthetic_kv.hpp
/// \brief A seeded synthetic K/V workload shaped like a real model's (EVAL.md §1), for examples.
///
/// Keys: normal per channel, with a few channels scaled well above the median (real key caches
/// show this), then rotated by RoPE at their position. Values: isotropic normal. Queries: a
/// background plus peaks on a sink, the last token and a few content matches (see
/// make_synthetic_queries).
/// Output made from it must say "synthetic".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "kvpack/core/types.hpp"

namespace kvpack::inline v0::examples {

struct SyntheticOptions {
  index_t tokens = 32768;
  index_t kv_heads = 8;
  index_t q_heads = 32;
  index_t head_dim = 128;
  int outlier_channels = 4;      ///< key channels with a large magnitude
  float outlier_scale = 6.0f;    ///< their scale relative to the other channels (3–10 in models)
  float rope_theta = 500000.0f;  ///< Llama 3.1's RoPE base
  std::uint32_t seed = 1;
};

/// Rotates pairs (2j, 2j+1) of `row` by position · theta^(-2j/d) (RoPE, adjacent-pair form).
inline void apply_rope(float* row, index_t head_dim, std::int64_t position, float theta) {
  for (index_t j = 0; j < head_dim / 2; ++j) {
    const double angle = static_cast<double>(position) * std::pow(theta, -2.0 * j / head_dim);
    const double c = std::cos(angle), s = std::sin(angle);
    const double x = row[2 * j], y = row[2 * j + 1];
    row[2 * j] = static_cast<float>(x * c - y * s);
    row[2 * j + 1] = static_cast<float>(x * s + y * c);
  }
}

/// One layer of synthetic K and V ([tokens][kv_heads][head_dim], keys post-RoPE).
struct SyntheticLayer {
  std::vector<float> keys;
  std::vector<float> values;
};

inline SyntheticLayer make_synthetic_layer(const SyntheticOptions& o) {
  std::mt19937 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t row = static_cast<std::size_t>(o.kv_heads) * o.head_dim;
  SyntheticLayer layer;
  layer.keys.resize(static_cast<std::size_t>(o.tokens) * row);
  layer.values.resize(layer.keys.size());
  for (index_t t = 0; t < o.tokens; ++t) {
    for (index_t h = 0; h < o.kv_heads; ++h) {
      float* k = &layer.keys[t * row + h * o.head_dim];
      float* v = &layer.values[t * row + h * o.head_dim];
      for (index_t c = 0; c < o.head_dim; ++c) {
        k[c] = normal(rng) * (c < 2 * o.outlier_channels && c % 2 == 0 ? o.outlier_scale : 1.0f);
        v[c] = normal(rng);
      }
      apply_rope(k, o.head_dim, t, o.rope_theta);
    }
  }
  return layer;
}

/// `count` decode queries ([count][q_heads][head_dim]) at position `tokens`. Each head's scaled
/// scores (q·k/sqrt(d)) are a background of standard deviation ~1 plus peaks: the first token
/// (an attention sink, +9), the last token (recency, +7) and three random earlier tokens whose
/// content the query asks for (+8 each). So a few tokens carry much of the mass and the long
/// tail the rest, as in real decode steps.
inline std::vector<float> make_synthetic_queries(const SyntheticOptions& o, const SyntheticLayer& layer,
                                                 int count) {
  std::mt19937 rng(o.seed + 1000);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<index_t> any_token(1, o.tokens - 2);
  const std::size_t row = static_cast<std::size_t>(o.kv_heads) * o.head_dim;
  const index_t group = o.q_heads / o.kv_heads;
  const double sqrt_d = std::sqrt(static_cast<double>(o.head_dim));
  // Mean |k|^2: a background query of per-channel std sqrt_d / sqrt(mean |k|^2) gives scaled
  // scores of std ~1 against random keys.
  double mean_norm2 = 0.0;
  const index_t sample = std::min<index_t>(o.tokens, 256);
  for (index_t t = 0; t < sample; ++t) {
    for (index_t c = 0; c < o.head_dim; ++c) mean_norm2 += layer.keys[t * row + c] * layer.keys[t * row + c];
  }
  mean_norm2 /= sample;
  const double noise = sqrt_d / std::sqrt(mean_norm2 * o.head_dim);
  std::vector<float> queries(static_cast<std::size_t>(count) * o.q_heads * o.head_dim);
  for (int n = 0; n < count; ++n) {
    for (index_t h = 0; h < o.q_heads; ++h) {
      float* q = &queries[(static_cast<std::size_t>(n) * o.q_heads + h) * o.head_dim];
      const index_t kv = h / group;
      for (index_t c = 0; c < o.head_dim; ++c) q[c] = static_cast<float>(noise * normal(rng));
      const std::pair<index_t, double> peaks[] = {
          {0, 9.0}, {o.tokens - 1, 7.0}, {any_token(rng), 8.0}, {any_token(rng), 8.0}, {any_token(rng), 8.0}};
      for (const auto& [t, target] : peaks) {
        // Adding target·sqrt(d)·k/|k|^2 raises this token's scaled score by `target`.
        const float* k = &layer.keys[t * row + kv * o.head_dim];
        double norm2 = 0.0;
        for (index_t c = 0; c < o.head_dim; ++c) norm2 += static_cast<double>(k[c]) * k[c];
        for (index_t c = 0; c < o.head_dim; ++c) q[c] += static_cast<float>(target * sqrt_d * k[c] / norm2);
      }
    }
  }
  return queries;
}

}  // namespace kvpack::inline v0::examples
