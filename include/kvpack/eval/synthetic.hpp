#pragma once
/// \file synthetic.hpp
/// \brief A seeded synthetic K/V workload shaped like a real model's (EVAL.md §1). Anything
///        printed from it must say "synthetic".
///
/// Keys: normal per channel with a few outlier channels (`outlier_scale` × the others, as real
/// key caches show), plus a fixed per-head mean in mid-frequency RoPE pairs, then rotated by RoPE
/// at their position. The mean is what makes recency: a query carrying the same mean rotated to
/// its own position scores nearby tokens higher, decaying with distance the way RoPE models do.
/// Values: isotropic normal. Queries: a background with scaled scores of std ~1, plus attention
/// sinks on the first tokens, the recency bias, and a few content matches on random earlier tokens.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::eval {

/// The shape and character of a synthetic workload. Defaults: one Llama-3.1-8B layer.
struct SyntheticSpec {
  index_t tokens = 32768;
  index_t kv_heads = 8;
  index_t q_heads = 32;
  index_t head_dim = 128;
  int outlier_channels = 4;      ///< key channels with a large magnitude (0 for none)
  float outlier_scale = 6.0f;    ///< their scale relative to the other channels (3–10 in models)
  float rope_theta = 500000.0f;  ///< Llama 3.1's RoPE base
  index_t sink_tokens = 4;       ///< first tokens every query attends to regardless of content
  float sink_boost = 9.0f;       ///< scaled-score boost of the first sink (each next one 1 less)
  float recency_boost = 4.0f;    ///< scaled-score boost at distance 0, decaying over ~100s of tokens
  int content_matches = 3;       ///< random earlier tokens each query asks for
  float content_boost = 8.0f;    ///< their scaled-score boost
  std::uint32_t seed = 1;  ///< the "model": each head's recency mean, and the tokens unless token_seed
  /// Set: the tokens' random draws come from this seed while the model stays seed's — another
  /// text of the same model (calibration data for offline-calibrated policies).
  std::optional<std::uint32_t> token_seed{};

  void validate() const {
    KVPACK_CHECK(tokens > 0 && kv_heads > 0 && q_heads > 0 && head_dim > 0 && head_dim % 2 == 0 &&
                     q_heads % kv_heads == 0,
                 kInvalidConfig,
                 detail::message("SyntheticSpec: need tokens, heads > 0, an even head_dim and q_heads a "
                                 "multiple of kv_heads; got tokens ", tokens, ", q_heads ", q_heads,
                                 ", kv_heads ", kv_heads, ", head_dim ", head_dim));
    KVPACK_CHECK(outlier_channels >= 0 && 2 * outlier_channels <= head_dim, kInvalidConfig,
                 detail::message("SyntheticSpec: outlier_channels ", outlier_channels,
                                 " must be in [0, head_dim / 2]"));
    KVPACK_CHECK(sink_tokens >= 0 && content_matches >= 0 && rope_theta > 1.0f && outlier_scale > 0.0f, kInvalidConfig,
                 detail::message("SyntheticSpec: sink_tokens (", sink_tokens, ") and content_matches (",
                                 content_matches, ") must be >= 0, rope_theta (", rope_theta, ") > 1 and outlier_scale (",
                                 outlier_scale, ") > 0"));
  }
};

/// RoPE's rotation frequencies theta^(-2j/d), j < d/2.
inline std::vector<double> rope_frequencies(index_t head_dim, double theta) {
  std::vector<double> frequencies(static_cast<std::size_t>(head_dim / 2));
  for (index_t j = 0; j < head_dim / 2; ++j) frequencies[j] = std::pow(theta, -2.0 * j / head_dim);
  return frequencies;
}

/// Rotates pairs (2j, 2j+1) of `row` by position · frequencies[j] (RoPE, adjacent-pair form).
inline void apply_rope(float* row, std::span<const double> frequencies, std::int64_t position) {
  for (std::size_t j = 0; j < frequencies.size(); ++j) {
    const double angle = static_cast<double>(position) * frequencies[j];
    const double c = std::cos(angle), s = std::sin(angle);
    const double x = row[2 * j], y = row[2 * j + 1];
    row[2 * j] = static_cast<float>(x * c - y * s);
    row[2 * j + 1] = static_cast<float>(x * s + y * c);
  }
}

/// One layer of K and V, [tokens][kv_heads][head_dim] (the layout KVCache::prefill takes).
struct LayerKV {
  index_t tokens = 0;
  index_t kv_heads = 0;
  index_t head_dim = 0;
  std::vector<float> keys;    ///< post-RoPE
  std::vector<float> values;
  /// Per head, the pre-RoPE key mean that carries recency ([kv_heads][head_dim]).
  std::vector<float> recency_means;

  [[nodiscard]] float* key(index_t t, index_t h) noexcept { return &keys[offset(t, h)]; }
  [[nodiscard]] const float* key(index_t t, index_t h) const noexcept { return &keys[offset(t, h)]; }
  [[nodiscard]] float* value(index_t t, index_t h) noexcept { return &values[offset(t, h)]; }
  [[nodiscard]] const float* value(index_t t, index_t h) const noexcept { return &values[offset(t, h)]; }
  [[nodiscard]] std::size_t offset(index_t t, index_t h) const noexcept {
    return (static_cast<std::size_t>(t) * kv_heads + h) * head_dim;
  }
};

namespace synthetic_detail {

/// RoPE pairs whose period spans tens to a thousand tokens carry the recency mean: slower ones
/// would not decay within a context, faster ones would decay within a few tokens.
inline std::vector<index_t> recency_pairs(index_t head_dim, double theta) {
  std::vector<index_t> pairs;
  index_t closest = 0;
  double closest_gap = INFINITY;
  for (index_t j = 0; j < head_dim / 2; ++j) {
    const double omega = std::pow(theta, -2.0 * j / head_dim);
    if (omega >= 1.0 / 1024 && omega <= 1.0 / 16) pairs.push_back(j);
    const double gap = std::fabs(std::log(omega * 128));
    if (gap < closest_gap) closest_gap = gap, closest = j;
  }
  if (pairs.empty()) pairs.push_back(closest);
  return pairs;
}

inline std::uint32_t layer_seed(std::uint32_t seed, index_t layer) noexcept {
  return seed * 0x9E3779B9u + static_cast<std::uint32_t>(layer) * 0x85EBCA6Bu + 1u;
}

}  // namespace synthetic_detail

/// Layer `layer` of the workload (each layer has its own seed derived from spec.seed).
inline LayerKV make_layer(const SyntheticSpec& spec, index_t layer = 0) {
  spec.validate();
  std::mt19937 rng(synthetic_detail::layer_seed(spec.seed, layer));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> phase(0.0, 2 * std::numbers::pi);
  const index_t d = spec.head_dim;
  LayerKV kv{spec.tokens, spec.kv_heads, d, {}, {}, {}};
  kv.keys.resize(static_cast<std::size_t>(spec.tokens) * spec.kv_heads * d);
  kv.values.resize(kv.keys.size());
  kv.recency_means.assign(static_cast<std::size_t>(spec.kv_heads) * d, 0.0f);
  for (index_t h = 0; h < spec.kv_heads; ++h) {
    for (index_t j : synthetic_detail::recency_pairs(d, spec.rope_theta)) {
      // Magnitude 2 per pair against unit noise: the recency score stands well above its noise.
      const double angle = phase(rng);
      kv.recency_means[h * d + 2 * j] = static_cast<float>(2.0 * std::cos(angle));
      kv.recency_means[h * d + 2 * j + 1] = static_cast<float>(2.0 * std::sin(angle));
    }
  }
  if (spec.token_seed) rng.seed(synthetic_detail::layer_seed(*spec.token_seed, layer));
  const std::vector<double> frequencies = rope_frequencies(d, spec.rope_theta);
  for (index_t t = 0; t < spec.tokens; ++t) {
    for (index_t h = 0; h < spec.kv_heads; ++h) {
      float* k = kv.key(t, h);
      float* v = kv.value(t, h);
      for (index_t c = 0; c < d; ++c) {
        const bool outlier = c < 2 * spec.outlier_channels && c % 2 == 0;
        k[c] = normal(rng) * (outlier ? spec.outlier_scale : 1.0f) + kv.recency_means[h * d + c];
        v[c] = normal(rng);
      }
      apply_rope(k, frequencies, t);
    }
  }
  return kv;
}

/// One decode query per entry of `positions` ([count][q_heads][head_dim]), each asked at that
/// position (it attends to tokens before it): background + sinks + recency + content matches.
/// `kv` may be synthetic or loaded from a dump (then without recency); spec gives the shape.
/// `exclude`, when in range, is a token no content match may pick (a planted needle).
inline std::vector<float> make_queries(const SyntheticSpec& spec, const LayerKV& kv,
                                       std::span<const std::int64_t> positions, std::uint32_t query_seed,
                                       index_t exclude = -1) {
  spec.validate();
  KVPACK_CHECK(kv.kv_heads == spec.kv_heads && kv.head_dim == spec.head_dim &&
                   kv.keys.size() == static_cast<std::size_t>(kv.tokens) * kv.kv_heads * kv.head_dim,
               kInvalidArgument,
               detail::message("make_queries: K/V of ", kv.kv_heads, " heads x ", kv.head_dim, " channels (",
                               kv.keys.size(), " key floats for ", kv.tokens, " tokens) for a spec of ",
                               spec.kv_heads, " x ", spec.head_dim));
  std::mt19937 rng(query_seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const index_t d = spec.head_dim;
  const index_t group = spec.q_heads / spec.kv_heads;
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  // A background query of per-channel std sqrt(d) / sqrt(mean |k|^2) gives scaled scores
  // q·k / sqrt(d) of std ~1 against random keys (until 2026-12-07 it had 1/sqrt(mean |k|^2):
  // std 1/sqrt(d)). Per KV head: the heads of a real model differ in key norm.
  std::vector<double> noise(static_cast<std::size_t>(spec.kv_heads), 0.0);
  const index_t sample = std::min<index_t>(kv.tokens, 256);
  for (index_t head = 0; head < spec.kv_heads; ++head) {
    double mean_norm2 = 0.0;
    for (index_t t = 0; t < sample; ++t) {
      for (index_t c = 0; c < d; ++c) mean_norm2 += static_cast<double>(kv.key(t, head)[c]) * kv.key(t, head)[c];
    }
    mean_norm2 /= std::max<index_t>(sample, 1);
    // A head of zero keys scores 0 against any query: no background then.
    if (mean_norm2 > 0.0) noise[static_cast<std::size_t>(head)] = sqrt_d / std::sqrt(mean_norm2);
  }

  const std::vector<double> frequencies = rope_frequencies(d, spec.rope_theta);
  std::vector<float> queries(positions.size() * spec.q_heads * d);
  std::vector<float> rotated_mean(static_cast<std::size_t>(d));
  for (std::size_t n = 0; n < positions.size(); ++n) {
    const std::int64_t position = positions[n];
    const index_t visible = static_cast<index_t>(std::min<std::int64_t>(position, kv.tokens));
    KVPACK_CHECK(visible > 0, kInvalidArgument, "make_queries: a query must follow at least one token");
    for (index_t h = 0; h < spec.q_heads; ++h) {
      float* q = &queries[(n * spec.q_heads + h) * d];
      const index_t head = h / group;
      for (index_t c = 0; c < d; ++c) q[c] = static_cast<float>(noise[static_cast<std::size_t>(head)] * normal(rng));
      // Recency: the head's key mean rotated to the query's position; its score against token t
      // is recency_boost · Σ_j |m_j|² cos((position − t) ω_j) / |m|². K/V from a dump have no
      // recency mean: their queries get sinks and content matches only.
      if (!kv.recency_means.empty()) {
        const float* mean = &kv.recency_means[static_cast<std::size_t>(head) * d];
        double mean_norm2_h = 0.0;
        for (index_t c = 0; c < d; ++c) mean_norm2_h += static_cast<double>(mean[c]) * mean[c];
        std::copy(mean, mean + d, rotated_mean.begin());
        apply_rope(rotated_mean.data(), frequencies, position);
        for (index_t c = 0; c < d; ++c) {
          q[c] += static_cast<float>(spec.recency_boost * sqrt_d * rotated_mean[c] / mean_norm2_h);
        }
      }
      // Peaks: adding boost·sqrt(d)·k/|k|² raises that token's scaled score by `boost`.
      auto raise = [&](index_t t, double boost) {
        const float* k = kv.key(t, head);
        double norm2 = 0.0;
        for (index_t c = 0; c < d; ++c) norm2 += static_cast<double>(k[c]) * k[c];
        if (norm2 == 0.0) return;  // a zero key (a dump's padding) scores 0 whatever the query
        for (index_t c = 0; c < d; ++c) q[c] += static_cast<float>(boost * sqrt_d * k[c] / norm2);
      };
      for (index_t t = 0; t < std::min(spec.sink_tokens, visible); ++t) raise(t, spec.sink_boost - t);
      if (visible > spec.sink_tokens + 1) {
        std::uniform_int_distribution<index_t> earlier(spec.sink_tokens, visible - 1);
        for (int m = 0; m < spec.content_matches; ++m) {
          const index_t t = earlier(rng);
          if (t != exclude) raise(t, spec.content_boost);
        }
      }
    }
  }
  return queries;
}

/// `count` decode queries all asked right after the context (position = spec.tokens).
inline std::vector<float> make_decode_queries(const SyntheticSpec& spec, const LayerKV& kv, int count,
                                              std::uint32_t query_seed) {
  const std::vector<std::int64_t> positions(static_cast<std::size_t>(count), spec.tokens);
  return make_queries(spec, kv, positions, query_seed);
}

}  // namespace kvpack::inline v0::eval
