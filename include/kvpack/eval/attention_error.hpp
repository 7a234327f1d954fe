#pragma once
/// \file attention_error.hpp
/// \brief One policy's attention-output error on one layer of K/V: the number compare_policies
///        and the asymmetry experiment report.

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/metrics.hpp"
#include "kvpack/eval/policies.hpp"
#include "kvpack/eval/synthetic.hpp"

namespace kvpack::inline v0::eval {

/// Exact attention (double, on the fp32 inputs) of each query ([count][q_heads][d]) over `kv`:
/// [count][q_heads·d], the reference attention_error compares against.
inline std::vector<std::vector<double>> exact_outputs(const LayerKV& kv, std::span<const float> queries,
                                                      index_t q_heads) {
  const std::size_t row = static_cast<std::size_t>(q_heads) * kv.head_dim;
  KVPACK_CHECK(q_heads > 0 && queries.size() % row == 0, kInvalidArgument,
               detail::message("exact_outputs: ", queries.size(), " query floats are not rows of q_heads * head_dim = ",
                               row));
  std::vector<std::vector<double>> out;
  for (std::size_t n = 0; n < queries.size() / row; ++n) {
    out.push_back(exact_attention(kv.keys, kv.values, kv.kv_heads, kv.head_dim, queries.subspan(n * row, row),
                                  1.0 / std::sqrt(static_cast<double>(kv.head_dim))));
  }
  return out;
}

/// The relative error ‖o − o_exact‖ / ‖o_exact‖ of every query head of every query when `kv`
/// is held in `cache` as sequence `seq`, layer `layer` (already prefilled).
inline Summary attention_error(const AnyCache& cache, SeqId seq, index_t layer, std::span<const float> queries,
                               const std::vector<std::vector<double>>& exact) {
  const index_t q_heads = cache.shape().q_heads, d = cache.shape().head_dim;
  const std::size_t row = static_cast<std::size_t>(q_heads) * d;
  KVPACK_CHECK(queries.size() == exact.size() * row &&
                   std::all_of(exact.begin(), exact.end(), [&](const std::vector<double>& e) { return e.size() == row; }),
               kInvalidArgument,
               detail::message("attention_error: ", queries.size(), " query floats and ", exact.size(),
                               " reference outputs for rows of q_heads * head_dim = ", row));
  std::vector<float> out(row);
  std::vector<double> errors;
  for (std::size_t n = 0; n < exact.size(); ++n) {
    cache.attend(seq, layer, queries.subspan(n * row, row), std::span<float>(out), 1.0f / std::sqrt(static_cast<float>(d)));
    for (index_t h = 0; h < q_heads; ++h) {
      errors.push_back(relative_error(std::span<const float>(out).subspan(static_cast<std::size_t>(h) * d, d),
                                      std::span<const double>(exact[n]).subspan(static_cast<std::size_t>(h) * d, d)));
    }
  }
  return summarize(std::move(errors));
}

}  // namespace kvpack::inline v0::eval
