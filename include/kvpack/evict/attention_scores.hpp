#pragma once
/// \file attention_scores.hpp
/// \brief Per-token attention scores for evictors: from the observation window at prefill, and
///        from the scores `attend` recorded, reduced over a GQA group.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvpack/evict/evict_concepts.hpp"

namespace kvpack::inline v0::evict {

/// Folds one head's probabilities into a token's group score: sums for kMean and kSum (kMean
/// divides once at the end, see finish_group), the largest for kMax.
inline void fold_head(GroupReduce reduce, float probability, float& group_score) noexcept {
  group_score = reduce == GroupReduce::kMax ? std::max(group_score, probability) : group_score + probability;
}
inline float finish_group(GroupReduce reduce, float group_score, index_t group) noexcept {
  return reduce == GroupReduce::kMean ? group_score / static_cast<float>(group) : group_score;
}

/// q·k with eight partial sums, so the compiler can keep them in one vector register (a single
/// chain would wait on each add: this loop runs once per key and observation query).
inline float dot(const float* q, const float* k, index_t n) noexcept {
  float partial[8] = {};
  index_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (index_t i = 0; i < 8; ++i) partial[i] += q[c + i] * k[c + i];
  }
  float sum = 0.0f;
  for (; c < n; ++c) sum += q[c] * k[c];
  for (float p : partial) sum += p;
  return sum;
}

/// SnapKV's and H2O's prefill scores for one KV stream: out[j] = reduce over the group's heads h
/// of Σ_w softmax_j(scale · q_{w,h} · k_j), where query w sits at position
/// `last_position − (W − 1 − w)` and sees only keys at positions up to its own (causal).
/// \param keys      [n][head_dim], as the kernels read them (decoded, rotated)
/// \param positions [n], increasing
/// \param queries   [W][q_heads][head_dim]; this stream's heads are [first_head, first_head + group)
/// \param out       [n], overwritten
inline void observation_scores(std::span<const float> keys, std::span<const std::int32_t> positions,
                               index_t head_dim, std::span<const float> queries, index_t q_heads,
                               index_t first_head, index_t group, std::int64_t last_position, float scale,
                               GroupReduce reduce, std::span<float> out) {
  const index_t n = static_cast<index_t>(positions.size());
  const index_t window = static_cast<index_t>(queries.size() / (static_cast<std::size_t>(q_heads) * head_dim));
  std::vector<float> weights(static_cast<std::size_t>(n));
  std::vector<float> per_head(static_cast<std::size_t>(n));
  std::fill(out.begin(), out.end(), 0.0f);  // probabilities are >= 0: a fine start for kMax too
  for (index_t h = 0; h < group; ++h) {
    std::fill(per_head.begin(), per_head.end(), 0.0f);
    for (index_t w = 0; w < window; ++w) {
      const float* q = queries.data() + (static_cast<std::size_t>(w) * q_heads + first_head + h) * head_dim;
      const std::int64_t query_position = last_position - (window - 1 - w);
      // Positions increase: the keys this query sees are a prefix.
      const index_t visible = static_cast<index_t>(
          std::upper_bound(positions.begin(), positions.end(), query_position,
                           [](std::int64_t p, std::int32_t position) { return p < position; }) -
          positions.begin());
      if (visible == 0) continue;
      float max_logit = -std::numeric_limits<float>::infinity();
      for (index_t j = 0; j < visible; ++j) {
        weights[j] = scale * dot(q, keys.data() + static_cast<std::size_t>(j) * head_dim, head_dim);
        max_logit = std::max(max_logit, weights[j]);
      }
      double sum = 0.0;
      for (index_t j = 0; j < visible; ++j) sum += (weights[j] = std::exp(weights[j] - max_logit));
      const float inverse = static_cast<float>(1.0 / sum);
      for (index_t j = 0; j < visible; ++j) per_head[j] += weights[j] * inverse;
    }
    for (index_t j = 0; j < n; ++j) fold_head(reduce, per_head[j], out[j]);
  }
  for (index_t j = 0; j < n; ++j) out[j] = finish_group(reduce, out[j], group);
}

}  // namespace kvpack::inline v0::evict
