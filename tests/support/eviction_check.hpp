#pragma once
// What an evicting cache's attend must equal: exact attention (double precision) over the live
// tokens of each KV stream that it read — read_back's tokens, less those on pages select::Quest
// skipped (AttendReport::read_pages). Shared by the eviction property test and the eviction fuzzer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/eval/exact_attention.hpp"

namespace kvpack::test {

/// The largest relative L2 error over query heads of `out` (attend's output for `q` on `layer`),
/// after the part that fp32 scores may cause: each score within ε = (d + 6)·2⁻²⁴·max_t Σ_c
/// |q_c·k_tc|·scale of the exact one moves the output by at most 2(e^{2ε} − 1)·max_t ‖v_t‖ (as in
/// support/error_bound.hpp). Scores near 350 make that larger than a relative error where two
/// nearly tied tokens' values cancel; for scores of order 1 it is negligible.
template <class Cache>
double error_against_read_back(const Cache& cache, SeqId seq, index_t layer, const std::vector<float>& q,
                               const std::vector<float>& out, float scale, const AttendReport& report) {
  double worst = 0.0;
  const ModelShape& shape = cache.shape();
  const index_t d = shape.head_dim, group = shape.group_size();
  for (index_t s = 0; s < shape.kv_heads; ++s) {
    const StoredTokens kept = cache.read_back(seq, layer, s);
    // The tokens of pages Quest skipped, by the positions in their metadata.
    std::set<std::int32_t> skipped;
    const auto pages = cache.pages(seq, layer, s);
    const auto& read = report.read_pages[static_cast<std::size_t>(s)];
    for (index_t i = 0; i < static_cast<index_t>(pages.size()); ++i) {
      if (std::find(read.begin(), read.end(), i) != read.end()) continue;
      const std::byte* metadata = cache.pool().metadata(pages[static_cast<std::size_t>(i)]);
      for (index_t t = 0; t < cache.config().page_size; ++t) {
        std::int32_t position = 0;
        std::memcpy(&position, metadata + t * sizeof(position), sizeof(position));
        skipped.insert(position);
      }
    }
    std::vector<float> k, v;
    for (index_t i = 0; i < kept.size(); ++i) {
      if (skipped.count(kept.positions[i]) != 0) continue;
      k.insert(k.end(), kept.keys.begin() + i * d, kept.keys.begin() + (i + 1) * d);
      v.insert(v.end(), kept.values.begin() + i * d, kept.values.begin() + (i + 1) * d);
    }
    const index_t n = static_cast<index_t>(k.size() / d);
    for (index_t h = s * group; h < (s + 1) * group; ++h) {
      std::vector<double> want(d);
      eval::exact_attention_head({k.data(), d, n, d}, {v.data(), d, n, d}, q.data() + h * d, scale, want.data());
      double magnitude = 0.0, largest_value = 0.0;
      for (index_t t = 0; t < n; ++t) {
        double a = 0.0, norm = 0.0;
        for (index_t c = 0; c < d; ++c) {
          a += std::fabs(static_cast<double>(q[h * d + c]) * k[t * d + c]);
          norm += static_cast<double>(v[t * d + c]) * v[t * d + c];
        }
        magnitude = std::max(magnitude, a * std::fabs(scale));
        largest_value = std::max(largest_value, std::sqrt(norm));
      }
      const double float_scores = 2.0 * std::expm1(2.0 * (d + 6) * 0x1p-24 * magnitude) * largest_value;
      double diff = 0.0, norm = 0.0;
      for (index_t c = 0; c < d; ++c) {
        diff += std::pow(out[h * d + c] - want[c], 2);
        norm += want[c] * want[c];
      }
      worst = std::max(worst, std::max(0.0, std::sqrt(diff) - float_scores) / std::sqrt(std::max(norm, 1e-30)));
    }
  }
  return worst;
}

/// AttendReport::read_pages as a cache that reads every page would fill it.
template <class Cache>
void every_page_read(const Cache& cache, SeqId seq, index_t layer, AttendReport& report) {
  report.read_pages.assign(static_cast<std::size_t>(cache.shape().kv_heads), {});
  for (index_t s = 0; s < cache.shape().kv_heads; ++s) {
    for (index_t i = 0; i < static_cast<index_t>(cache.pages(seq, layer, s).size()); ++i) {
      report.read_pages[static_cast<std::size_t>(s)].push_back(i);
    }
  }
}

}  // namespace kvpack::test
