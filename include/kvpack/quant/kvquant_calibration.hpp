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
/// 99.5th percentiles. The first `skip_first_tokens` tokens of each sample sequence (the
/// attention sink, kept exact by the cache) are left out, as KVQuant does.
///
/// Codebooks are the normal-float levels, or k-means over the samples normalised as the codecs
/// normalise them: each sequence is cut into pages of `page_size` tokens per KV head, and a page
/// keeps only the round(f · page_size · head_dim) outliers it has room for (the codecs' choice,
/// kvquant_detail), so a value token's range may keep one of its extremes, and a key outside its
/// channel's range that the page cannot keep is clamped to ±1; the elements a page keeps exactly
/// need no level and are left out. The k-means objective is ALGORITHMS.md §2.2's, Σ F·r²·(x − ℓ)²
/// over normalised elements x of half-range r (the squared error in the units decode gives),
/// with the optional per-element weights F (e.g. KVQuant's Fisher information; 1 when not given);
/// `range_weighted = false` drops r² as the reference implementation does. At most 2^18 samples,
/// evenly strided, enter the k-means.
///
/// Q-Norm (§2.5, an option: the paper uses it at 2 bits): after rounding, the decoded levels are
/// moved by one affine map per layer and plane, ℓ' = ℓ·σ1/σ2 + m1 − m2·σ1/σ2, so that the mean m
/// and standard deviation σ of the decoded normalised samples (2) equal those of the samples (1).
/// Elements are still rounded to the original levels (the tables' *_encode_codebook). Off by
/// default: at 2 bits it gained nothing measurable here (README, "KVQuant").

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "kvpack/core/half.hpp"
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
    /// The cache's page size (CacheConfig::page_size), which sets how many outliers a page keeps.
    index_t page_size = 32;
    /// Weigh each normalised sample by its half-range squared (§2.2's objective), or not.
    bool range_weighted = true;
  };

  KVQuantCalibrator(const ModelShape& shape, Options options) : shape_(shape), options_(options) {
    shape_.validate();
    KVPACK_CHECK(options.bits >= 2 && options.bits <= 4, kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: bits must be 2, 3 or 4, got ", options.bits));
    KVPACK_CHECK(options.outlier_fraction >= 0.0 && options.outlier_fraction <= 0.05, kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: outlier_fraction must be in [0, 0.05], got ",
                                 options.outlier_fraction));
    // The codecs' own limits on the page the tables will be used with (head_dim a multiple of 8,
    // page_size · head_dim ≤ 65536, ...): the page simulation below relies on them too.
    const PageGeometry page{options.page_size, shape.head_dim};
    switch (options.bits) {
      case 2: KVQuantTraits<2>::validate_geometry(page, options.outlier_fraction); break;
      case 3: KVQuantTraits<3>::validate_geometry(page, options.outlier_fraction); break;
      default: KVQuantTraits<4>::validate_geometry(page, options.outlier_fraction); break;
    }
    KVPACK_CHECK(options.skip_first_tokens >= 0 && (!options.kmeans || options.max_iterations > 0), kInvalidConfig,
                 ::kvpack::detail::message("KVQuantCalibrator: skip_first_tokens must be >= 0 (got ",
                                           options.skip_first_tokens, ") and max_iterations > 0 with kmeans (got ",
                                           options.max_iterations, ")"));
    keys_.resize(static_cast<std::size_t>(shape.layers));
    key_weights_.resize(keys_.size());
    sequence_tokens_.resize(keys_.size());
    value_samples_.resize(keys_.size());
    value_sample_weights_.resize(keys_.size());
    value_weighted_.resize(keys_.size());
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
    const std::size_t skipped = std::min(keys.size() / row, static_cast<std::size_t>(options_.skip_first_tokens));
    const std::size_t skip = skipped * row;
    auto after_skip = [&](std::span<const float> from) { return from.empty() ? from : from.subspan(skip); };
    const bool first = sequence_tokens_[layer].empty();
    KVPACK_CHECK(first || (key_weights_[layer].empty() == key_weights.empty() &&
                           value_weighted_[layer] == !value_weights.empty()),
                 kInvalidArgument, "KVQuantCalibrator::add: give weights with every sample of a layer or with none");
    if (first) value_weighted_[layer] = !value_weights.empty();
    if (skip == keys.size()) return;
    keys_[layer].insert(keys_[layer].end(), keys.begin() + static_cast<std::ptrdiff_t>(skip), keys.end());
    std::span<const float> kw = after_skip(key_weights);
    key_weights_[layer].insert(key_weights_[layer].end(), kw.begin(), kw.end());
    sequence_tokens_[layer].push_back(keys.size() / row - skipped);
    add_value_samples(layer, after_skip(values), after_skip(value_weights));
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
      std::vector<float> channel(tokens);
      for (std::size_t hc = 0; hc < per_layer; ++hc) {
        for (std::size_t t = 0; t < tokens; ++t) channel[t] = keys[t * per_layer + hc];
        const float lo = quantile(channel, f / 2.0), hi = quantile(channel, 1.0 - f / 2.0);
        const float offset = 0.5f * (hi + lo);
        // A constant channel still gets a usable (tiny) range: anything else is an outlier.
        const float half_range = std::max(0.5f * (hi - lo), 1e-6f * std::max(1.0f, std::fabs(offset)));
        tables->key_offset[layer * per_layer + hc] = offset;
        tables->key_half_range[layer * per_layer + hc] = half_range;
      }
      std::vector<float> key_samples, key_sample_weights;
      normalised_keys(layer, *tables, key_samples, key_sample_weights);
      const std::vector<float>& value_samples = value_samples_[layer];
      const std::vector<float>& value_sample_weights = value_sample_weights_[layer];
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

  /// The k-means weight of a normalised element of half-range r with given weight F (1 when the
  /// layer has none): F·r², or F without range weighting; capped to stay finite.
  [[nodiscard]] float sample_weight(const float* given, double half_range) const noexcept {
    const double range_weight = options_.range_weighted ? half_range * half_range : 1.0;
    const double w = (given ? static_cast<double>(*given) : 1.0) * range_weight;
    return static_cast<float>(std::min(w, static_cast<double>(std::numeric_limits<float>::max())));
  }
  [[nodiscard]] bool weighs_samples(bool given) const noexcept { return given || options_.range_weighted; }

  /// The keys normalised by their channel's calibrated range, page by page as the key codec does:
  /// a page keeps its C elements furthest outside their range exactly (left out here) and clamps
  /// the other ones outside to ±1. A last partial page counts as a page of its own length.
  void normalised_keys(index_t layer, const KVQuantTables& tables, std::vector<float>& samples,
                       std::vector<float>& weights) const {
    const std::vector<float>& keys = keys_[layer];
    const std::vector<float>& given = key_weights_[layer];
    const index_t d = shape_.head_dim;
    const std::size_t row = static_cast<std::size_t>(shape_.kv_heads) * d;
    const float* offset = tables.key_offset.data() + layer * row;
    const float* half_range = tables.key_half_range.data() + layer * row;
    std::size_t sequence_start = 0;
    for (std::size_t sequence : sequence_tokens_[layer]) {
      for (std::size_t first = 0; first < sequence; first += static_cast<std::size_t>(options_.page_size)) {
        const std::size_t page = std::min(static_cast<std::size_t>(options_.page_size), sequence - first);
        for (std::size_t h = 0; h < static_cast<std::size_t>(shape_.kv_heads); ++h) {
          const std::size_t at = (sequence_start + first) * row + h * d;  // element (0, 0) of the page
          auto normalised = [&](std::size_t t, index_t c) {
            return (keys[at + t * row + c] - offset[h * d + c]) / half_range[h * d + c];
          };
          kvquant_detail::FurthestCandidates kept(
              kvquant_detail::outlier_capacity(options_.outlier_fraction, {static_cast<index_t>(page), d}));
          kvquant_detail::offer_key_candidates(keys.data() + at, static_cast<std::ptrdiff_t>(row),
                                               static_cast<index_t>(page), d, offset + h * d, half_range + h * d, kept);
          const std::span<const kvquant_detail::Candidate> exact = kept.sorted();
          std::size_t next = 0;
          for (std::size_t t = 0; t < page; ++t) {
            for (index_t c = 0; c < d; ++c) {
              if (next < exact.size() && exact[next].index == t * d + c) {
                ++next;
                continue;
              }
              samples.push_back(std::clamp(normalised(t, c), -1.0f, 1.0f));
              if (weighs_samples(!given.empty())) {
                const float* weight = given.empty() ? nullptr : &given[at + t * row + c];
                weights.push_back(sample_weight(weight, half_range[h * d + c]));
              }
            }
          }
        }
      }
      sequence_start += sequence;
    }
  }

  /// One sequence's values normalised page by page as the value codec does: each token by the
  /// range of its elements that its page does not keep exactly (those are left out). A last
  /// partial page counts as a page of its own length.
  void add_value_samples(index_t layer, std::span<const float> values, std::span<const float> given) {
    std::vector<float>& samples = value_samples_[layer];
    std::vector<float>& weights = value_sample_weights_[layer];
    const index_t d = shape_.head_dim;
    const std::size_t row = static_cast<std::size_t>(shape_.kv_heads) * d;
    const std::size_t tokens = values.size() / row;
    const index_t side = kvquant_detail::candidates_per_side(options_.outlier_fraction, d);
    for (std::size_t first = 0; first < tokens; first += static_cast<std::size_t>(options_.page_size)) {
      const std::size_t page = std::min(static_cast<std::size_t>(options_.page_size), tokens - first);
      for (std::size_t h = 0; h < static_cast<std::size_t>(shape_.kv_heads); ++h) {
        const std::size_t at = first * row + h * d;  // element (0, 0) of the page
        kvquant_detail::FurthestCandidates kept(
            kvquant_detail::outlier_capacity(options_.outlier_fraction, {static_cast<index_t>(page), d}));
        kvquant_detail::offer_value_candidates(values.data() + at, static_cast<std::ptrdiff_t>(row),
                                               static_cast<index_t>(page), d, side, kept);
        const std::span<const kvquant_detail::Candidate> exact = kept.sorted();
        std::size_t next = 0;
        for (std::size_t t = 0; t < page; ++t) {
          const float* x = values.data() + at + t * row;
          std::size_t e = next;  // row t's first exact entry, for the second pass
          const auto [lo, hi] = kvquant_detail::range_without_exact(x, static_cast<index_t>(t), d, exact, next);
          // fp16, as the page stores them: the samples are the codec's normalised elements.
          const float offset = half(0.5f * (hi + lo)), half_range = half(0.5f * (hi - lo));
          for (index_t c = 0; c < d; ++c) {
            if (e < exact.size() && exact[e].index == t * d + c) {
              ++e;
              continue;
            }
            if (!(half_range > 0.0f)) continue;  // a constant token: every level decodes it exactly
            samples.push_back(std::clamp((x[c] - offset) / half_range, -1.0f, 1.0f));
            if (weighs_samples(!given.empty())) {
              weights.push_back(sample_weight(given.empty() ? nullptr : &given[at + t * row + c], half_range));
            }
          }
        }
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
  std::vector<std::vector<float>> keys_, key_weights_;                    ///< [layers][T·kv_heads·d], all sequences
  std::vector<std::vector<std::size_t>> sequence_tokens_;                 ///< [layers][sequence]: T of each
  std::vector<std::vector<float>> value_samples_, value_sample_weights_;  ///< [layers][...]: normalised at add()
  std::vector<bool> value_weighted_;                                      ///< [layers]: add() had value weights
};

}  // namespace kvpack::inline v0::quant
