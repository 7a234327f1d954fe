#pragma once
/// \file kvquant_calibration.hpp
/// \brief KVQuantCalibrator: KVQuant's offline pass (ALGORITHMS.md §2.1–§2.2) from sample keys
///        and values to the per-channel key ranges and the per-layer codebooks quant::KVQuant
///        reads.
///
/// Feed it the K/V of a few calibration sequences (keys as the cache will store them: pre-RoPE
/// when CacheConfig::key_rope is set), layer by layer, then call finish(). Per (layer, KV head,
/// channel) the key range is [q(f/2), q(1 − f/2)] of the samples (linear interpolation between
/// order statistics, as torch.quantile), f the outlier fraction: with f = 1 % the 0.5th and
/// 99.5th percentiles. Codebooks are the normal-float levels, or weighted k-means over the
/// normalised samples that are not outliers (optional per-element weights, e.g. KVQuant's
/// Fisher information; at most 2^18 of them, evenly strided). The first `skip_first_tokens` tokens of each sample sequence (the
/// attention sink, kept exact by the cache) are left out, as KVQuant does.
///
/// Q-Norm (§2.5, an option: the paper uses it at 2 bits): after rounding, the decoded levels are
/// moved by one affine map per layer and plane, ℓ' = ℓ·σ1/σ2 + m1 − m2·σ1/σ2, so that the mean m
/// and standard deviation σ of the decoded normalised samples (2) equal those of the samples (1).
/// Elements are still rounded to the original levels (the tables' *_encode_codebook). Off by
/// default: at 2 bits it gained nothing measurable here (README, "KVQuant").

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <vector>

#include "kvpack/core/types.hpp"
#include "kvpack/error.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/nuq.hpp"

namespace kvpack::inline v0::quant {

class KVQuantCalibrator {
 public:
  struct Options {
    int bits = 3;
    double outlier_fraction = 0.01;  ///< must match the KVQuant the tables are used with (checked)
    bool kmeans = true;              ///< false: the normal-float codebook
    int max_iterations = 50;
    index_t skip_first_tokens = 1;
    /// Q-Norm: never, for 2 bits only (the paper's use), or always.
    enum class QNorm { kNever, kTwoBit, kAlways } q_norm = QNorm::kNever;
  };

  KVQuantCalibrator(const ModelShape& shape, Options options) : shape_(shape), options_(options) {
    shape_.validate();
    KVPACK_CHECK(options.bits >= 2 && options.bits <= 4, kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: bits must be 2, 3 or 4, got ", options.bits));
    KVPACK_CHECK(options.outlier_fraction >= 0.0 && options.outlier_fraction <= 0.05, kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: outlier_fraction must be in [0, 0.05], got ",
                                 options.outlier_fraction));
    // The codec packs 8 codes per Bits bytes, and the outlier candidates need two channels a side.
    KVPACK_CHECK(shape.head_dim % 8 == 0, kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: head_dim must be a multiple of 8, got ", shape.head_dim));
    KVPACK_CHECK(options.skip_first_tokens >= 0 && (!options.kmeans || options.max_iterations > 0), kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: skip_first_tokens must be >= 0 (got ",
                                           options.skip_first_tokens, ") and max_iterations > 0 with kmeans (got ",
                                           options.max_iterations, ")"));
    keys_.resize(static_cast<std::size_t>(shape.layers));
    values_.resize(keys_.size());
    key_weights_.resize(keys_.size());
    value_weights_.resize(keys_.size());
  }

  /// One sample sequence of one layer: keys and values [T][kv_heads][head_dim]; weights, when
  /// given, have the same shape (both or neither per plane).
  void add(index_t layer, std::span<const float> keys, std::span<const float> values,
           std::span<const float> key_weights = {}, std::span<const float> value_weights = {}) {
    KVPACK_CHECK(layer >= 0 && layer < shape_.layers, kInvalidArgument,
                 ::kvpack::detail::message("KVQuantCalibrator::add: layer ", layer, " out of range [0, ", shape_.layers, ")"));
    const std::size_t row = static_cast<std::size_t>(shape_.kv_heads) * shape_.head_dim;
    KVPACK_CHECK(!keys.empty() && keys.size() % row == 0 && values.size() == keys.size(), kInvalidArgument,
                 ::kvpack::detail::message("KVQuantCalibrator::add: keys and values must hold T > 0 rows of kv_heads * "
                                 "head_dim = ", row, " elements, got ", keys.size(), " and ", values.size()));
    KVPACK_CHECK((key_weights.empty() || key_weights.size() == keys.size()) &&
                     (value_weights.empty() || value_weights.size() == values.size()),
                 kInvalidArgument, "KVQuantCalibrator::add: weights must match the keys' and values' shapes");
    for (std::span<const float> data : {keys, values, key_weights, value_weights}) {
      for (float x : data) {
        KVPACK_CHECK(std::isfinite(x), kNonFinite, "KVQuantCalibrator::add: samples and weights must be finite");
      }
    }
    const std::size_t skip = std::min(keys.size() / row, static_cast<std::size_t>(options_.skip_first_tokens)) * row;
    auto append = [&](std::vector<float>& to, std::span<const float> from) {
      if (!from.empty()) to.insert(to.end(), from.begin() + static_cast<std::ptrdiff_t>(skip), from.end());
    };
    const bool first = keys_[layer].empty();
    KVPACK_CHECK(first || (key_weights_[layer].empty() == key_weights.empty() &&
                           value_weights_[layer].empty() == value_weights.empty()),
                 kInvalidArgument, "KVQuantCalibrator::add: give weights with every sample of a layer or with none");
    append(keys_[layer], keys);
    append(values_[layer], values);
    append(key_weights_[layer], key_weights);
    append(value_weights_[layer], value_weights);
  }

  /// The tables; every layer must have samples left after the skipped sink tokens.
  [[nodiscard]] std::shared_ptr<const KVQuantTables> finish() const {
    auto tables = std::make_shared<KVQuantTables>();
    const index_t heads = shape_.kv_heads, d = shape_.head_dim;
    tables->layers = shape_.layers;
    tables->kv_heads = heads;
    tables->head_dim = d;
    tables->bits = options_.bits;
    tables->outlier_fraction = options_.outlier_fraction;
    const std::size_t per_layer = static_cast<std::size_t>(heads) * d;
    tables->key_offset.resize(per_layer * shape_.layers);
    tables->key_half_range.resize(tables->key_offset.size());
    const double f = options_.outlier_fraction;
    for (index_t layer = 0; layer < shape_.layers; ++layer) {
      const std::vector<float>& keys = keys_[layer];
      KVPACK_CHECK(!keys.empty(), kInvalidArgument,
                   ::kvpack::detail::message("KVQuantCalibrator::finish: layer ", layer, " has no samples (after the first ",
                                   options_.skip_first_tokens, " tokens of each sequence)"));
      const std::size_t tokens = keys.size() / per_layer;
      std::vector<float> key_samples, key_sample_weights;
      std::vector<float> channel(tokens);
      for (std::size_t hc = 0; hc < per_layer; ++hc) {
        for (std::size_t t = 0; t < tokens; ++t) channel[t] = keys[t * per_layer + hc];
        const float lo = quantile(channel, f / 2.0), hi = quantile(channel, 1.0 - f / 2.0);
        const float offset = 0.5f * (hi + lo);
        // A constant channel still gets a usable (tiny) range: anything else is an outlier.
        const float half_range = std::max(0.5f * (hi - lo), 1e-6f * std::max(1.0f, std::fabs(offset)));
        tables->key_offset[layer * per_layer + hc] = offset;
        tables->key_half_range[layer * per_layer + hc] = half_range;
        for (std::size_t t = 0; t < tokens; ++t) {
          const float x = (keys[t * per_layer + hc] - offset) / half_range;
          if (std::fabs(x) > 1.0f) continue;  // stored exactly, no level needed
          key_samples.push_back(x);
          if (!key_weights_[layer].empty()) key_sample_weights.push_back(key_weights_[layer][t * per_layer + hc]);
        }
      }
      std::vector<float> value_samples, value_sample_weights;
      normalised_values(layer, value_samples, value_sample_weights);
      tables->key_codebook.push_back(codebook(key_samples, key_sample_weights));
      tables->value_codebook.push_back(codebook(value_samples, value_sample_weights));
      if (q_norm()) {
        tables->key_encode_codebook.push_back(tables->key_codebook.back());
        tables->value_encode_codebook.push_back(tables->value_codebook.back());
        tables->key_codebook.back() = q_normed(tables->key_codebook.back(), key_samples);
        tables->value_codebook.back() = q_normed(tables->value_codebook.back(), value_samples);
      }
    }
    return tables;
  }

 private:
  [[nodiscard]] bool q_norm() const noexcept {
    return options_.q_norm == Options::QNorm::kAlways || (options_.q_norm == Options::QNorm::kTwoBit && options_.bits == 2);
  }

  /// `book`'s levels mapped so that rounding `samples` to `book` and decoding with the result
  /// keeps their mean and standard deviation (unchanged when the rounded samples are constant).
  static nuq::Codebook q_normed(const nuq::Codebook& book, const std::vector<float>& samples) {
    double sum = 0.0, sum_sq = 0.0, rounded_sum = 0.0, rounded_sq = 0.0;
    for (float x : samples) {
      const double r = book.levels[nuq::nearest_level(book, x)];
      sum += x;
      sum_sq += static_cast<double>(x) * x;
      rounded_sum += r;
      rounded_sq += r * r;
    }
    const double n = static_cast<double>(samples.size());
    if (n == 0.0) return book;
    const double m1 = sum / n, m2 = rounded_sum / n;
    const double s1 = std::sqrt(std::max(0.0, sum_sq / n - m1 * m1)), s2 = std::sqrt(std::max(0.0, rounded_sq / n - m2 * m2));
    if (!(s2 > 0.0)) return book;
    nuq::Codebook normed = book;
    for (int i = 0; i < book.size; ++i) normed.levels[i] = static_cast<float>(book.levels[i] * (s1 / s2) + (m1 - m2 * s1 / s2));
    return normed;
  }

  /// Linear interpolation between order statistics (torch.quantile's default).
  static float quantile(std::vector<float> samples, double q) {
    const double at = q * static_cast<double>(samples.size() - 1);
    const auto below = static_cast<std::size_t>(std::floor(at));
    std::nth_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(below), samples.end());
    const float low = samples[below];
    if (below + 1 >= samples.size()) return low;
    const float high = *std::min_element(samples.begin() + static_cast<std::ptrdiff_t>(below) + 1, samples.end());
    return static_cast<float>(low + (at - static_cast<double>(below)) * (high - low));
  }

  /// Every value normalised by its token's range without its candidate outliers (the
  /// ⌈f/2·d⌉ largest and smallest, as the value codec removes them), candidates left out.
  void normalised_values(index_t layer, std::vector<float>& samples, std::vector<float>& weights) const {
    const index_t d = shape_.head_dim;
    const index_t side = kvquant_detail::candidates_per_side(options_.outlier_fraction, d);
    const std::vector<float>& values = values_[layer];
    std::vector<index_t> order(static_cast<std::size_t>(d));
    for (std::size_t v = 0; v + d <= values.size(); v += d) {
      const float* x = values.data() + v;
      for (index_t c = 0; c < d; ++c) order[c] = c;
      std::sort(order.begin(), order.end(), [&](index_t a, index_t b) { return x[a] != x[b] ? x[a] < x[b] : a < b; });
      const float lo = x[order[side]], hi = x[order[d - 1 - side]];
      const float offset = 0.5f * (hi + lo), half_range = 0.5f * (hi - lo);
      if (half_range <= 0.0f) continue;
      for (index_t i = side; i < d - side; ++i) {
        samples.push_back((x[order[i]] - offset) / half_range);
        if (!value_weights_[layer].empty()) weights.push_back(value_weights_[layer][v + order[i]]);
      }
    }
  }

  /// k-means on at most kMaxKmeansSamples of the samples (every k-th: the levels move by far less
  /// than their spacing, and the main job calibrates many times).
  nuq::Codebook codebook(const std::vector<float>& samples, const std::vector<float>& weights) const {
    if (!options_.kmeans) return nuq::normal_float_codebook(options_.bits);
    const std::size_t stride = samples.size() / kMaxKmeansSamples + 1;
    if (stride == 1) return nuq::kmeans_codebook(options_.bits, samples, weights, options_.max_iterations);
    std::vector<float> picked, picked_weights;
    for (std::size_t i = 0; i < samples.size(); i += stride) {
      picked.push_back(samples[i]);
      if (!weights.empty()) picked_weights.push_back(weights[i]);
    }
    return nuq::kmeans_codebook(options_.bits, picked, picked_weights, options_.max_iterations);
  }

  static constexpr std::size_t kMaxKmeansSamples = std::size_t{1} << 18;

  ModelShape shape_;
  Options options_;
  std::vector<std::vector<float>> keys_, values_, key_weights_, value_weights_;  ///< [layers][T·kv_heads·d]
};

}  // namespace kvpack::inline v0::quant
