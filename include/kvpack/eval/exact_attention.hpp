#pragma once
/// \file exact_attention.hpp
/// \brief Attention computed naively in double: the yardstick policies are measured against.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::eval {

/// Rows of `dim` floats, `stride` floats apart: one head's keys or values in whatever layout
/// holds them ([tokens][kv_heads][d] input, or a read_back stream).
struct StridedRows {
  const float* data = nullptr;
  std::ptrdiff_t stride = 0;
  index_t count = 0;
  index_t dim = 0;
  [[nodiscard]] const float* row(index_t i) const noexcept { return data + i * stride; }
};

/// One query head: out = softmax(scale · q · Kᵀ) V, in double. When `probabilities` is given it
/// receives the attention distribution over the rows.
inline void exact_attention_head(StridedRows keys, StridedRows values, const float* query, double scale,
                                 double* out, std::vector<double>* probabilities = nullptr) {
  std::vector<double> local;
  std::vector<double>& p = probabilities != nullptr ? *probabilities : local;
  p.resize(static_cast<std::size_t>(keys.count));
  double top = -INFINITY;
  for (index_t t = 0; t < keys.count; ++t) {
    const float* k = keys.row(t);
    double dot = 0.0;
    for (index_t c = 0; c < keys.dim; ++c) dot += static_cast<double>(query[c]) * k[c];
    p[t] = dot * scale;
    top = std::max(top, p[t]);
  }
  double sum = 0.0;
  for (double& x : p) sum += (x = std::exp(x - top));
  std::fill(out, out + values.dim, 0.0);
  for (index_t t = 0; t < keys.count; ++t) {
    p[t] /= sum;
    const float* v = values.row(t);
    for (index_t c = 0; c < values.dim; ++c) out[c] += p[t] * v[c];
  }
}

/// Every query head of a decode step over K/V in KVCache's input layout ([tokens][kv_heads][d]):
/// returns [q_heads][d]. Query head h reads KV head h / (q_heads / kv_heads).
inline std::vector<double> exact_attention(std::span<const float> keys, std::span<const float> values,
                                           index_t kv_heads, index_t head_dim, std::span<const float> query,
                                           double scale) {
  const std::size_t row = static_cast<std::size_t>(kv_heads) * static_cast<std::size_t>(head_dim);
  KVPACK_CHECK(kv_heads > 0 && head_dim > 0 && query.size() % static_cast<std::size_t>(head_dim) == 0 &&
                   keys.size() % row == 0 && values.size() == keys.size(),
               kInvalidArgument,
               detail::message("exact_attention: ", keys.size(), " key and ", values.size(), " value floats and ",
                               query.size(), " query floats are not whole rows of ", kv_heads, " KV heads x ",
                               head_dim));
  const index_t q_heads = static_cast<index_t>(query.size() / head_dim);
  KVPACK_CHECK(q_heads >= kv_heads && q_heads % kv_heads == 0, kInvalidArgument,
               detail::message("exact_attention: ", q_heads, " query heads do not share ", kv_heads, " KV heads"));
  const index_t group = q_heads / kv_heads;
  const auto tokens = static_cast<index_t>(keys.size() / row);
  const std::ptrdiff_t stride = static_cast<std::ptrdiff_t>(kv_heads) * head_dim;
  std::vector<double> out(query.size());
  for (index_t h = 0; h < q_heads; ++h) {
    const index_t kv = h / group;
    exact_attention_head({keys.data() + kv * head_dim, stride, tokens, head_dim},
                         {values.data() + kv * head_dim, stride, tokens, head_dim},
                         query.data() + static_cast<std::size_t>(h) * head_dim, scale,
                         out.data() + static_cast<std::size_t>(h) * head_dim);
  }
  return out;
}

}  // namespace kvpack::inline v0::eval
