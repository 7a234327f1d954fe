#pragma once
/// \file metrics.hpp
/// \brief The quality metrics of EVAL.md §4, as plain functions over spans: attention-output
///        error, attention KL, top-k recall, inner-product bias and variance, and the logit
///        metrics of a real model (loss, logit KL, top-1 agreement, first divergence).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "kvpack/cache_config.hpp"
#include "kvpack/error.hpp"

namespace kvpack::inline v0::eval {

/// ‖out − ref‖ / ‖ref‖ (0 when both are zero, +inf when only ref is).
inline double relative_error(std::span<const float> out, std::span<const double> ref) {
  KVPACK_CHECK(out.size() == ref.size(), kInvalidArgument,
               detail::message("relative_error: sizes differ (", out.size(), " vs ", ref.size(), ")"));
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

/// Mean, 99th percentile (nearest rank) and maximum of a sample. A NaN in the sample (an error
/// that could not be measured) ranks above everything, as +inf: the maximum says so and the
/// mean is NaN.
struct Summary {
  double mean = 0.0;
  double p99 = 0.0;
  double max = 0.0;
  std::size_t count = 0;
};

inline Summary summarize(std::vector<double> sample) {
  Summary s;
  s.count = sample.size();
  if (sample.empty()) return s;
  // NaN compares false with everything, which std::sort may not be given.
  std::sort(sample.begin(), sample.end(),
            [](double a, double b) { return std::isnan(b) ? !std::isnan(a) : a < b; });
  s.mean = std::accumulate(sample.begin(), sample.end(), 0.0) / static_cast<double>(sample.size());
  const auto rank = static_cast<std::size_t>(std::ceil(0.99 * static_cast<double>(sample.size())));
  s.p99 = sample[std::clamp<std::size_t>(rank, 1, sample.size()) - 1];
  s.max = sample.back();
  return s;
}

/// KL(p_ref ‖ p) over the reference's tokens, in nats. `p[i]` is the policy's probability of the
/// reference's token i (0 for a token the policy dropped): +inf when the policy drops a token the
/// reference attends to — eviction's failure shows as it is, not clipped.
inline double kl_divergence(std::span<const double> p_ref, std::span<const double> p) {
  KVPACK_CHECK(p_ref.size() == p.size(), kInvalidArgument,
               detail::message("kl_divergence: sizes differ (", p_ref.size(), " vs ", p.size(), ")"));
  double kl = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p_ref[i] <= 0.0) continue;
    if (p[i] <= 0.0) return std::numeric_limits<double>::infinity();
    kl += p_ref[i] * std::log(p_ref[i] / p[i]);
  }
  return std::max(kl, 0.0);  // rounding can make an exact match slightly negative
}

/// Of the reference's k most attended tokens, the share of their mass whose tokens the policy
/// kept (`kept[i]`: the policy still holds and reads the reference's token i).
inline double top_k_recall(std::span<const double> p_ref, std::span<const bool> kept, std::size_t k) {
  KVPACK_CHECK(p_ref.size() == kept.size(), kInvalidArgument, "top_k_recall: p_ref and kept sizes differ");
  KVPACK_CHECK(k > 0, kInvalidArgument, "top_k_recall: k must be at least 1");
  std::vector<std::size_t> order(p_ref.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  k = std::min(k, order.size());
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](std::size_t a, std::size_t b) { return p_ref[a] > p_ref[b]; });
  double total = 0.0, kept_mass = 0.0;
  for (std::size_t i = 0; i < k; ++i) {
    total += p_ref[order[i]];
    if (kept[order[i]]) kept_mass += p_ref[order[i]];
  }
  return total > 0.0 ? kept_mass / total : 1.0;
}

/// Bias and variance of ⟨q, k̂⟩ − ⟨q, k⟩ for unit q and k (EVAL.md §4) accumulated over pairs
/// (Welford's update, so long runs stay accurate). Unbiased estimators (QJL) show bias ≈ 0; MSE
/// quantizers a shrinking bias.
class InnerProductError {
 public:
  /// q, k and k̂ (k's reconstruction) as given; the difference is divided by ‖q‖·‖k‖, which is
  /// the difference for q/‖q‖, k/‖k‖ and k̂/‖k‖.
  void add(std::span<const float> q, std::span<const float> k, std::span<const float> k_hat) {
    KVPACK_CHECK(q.size() == k.size() && k.size() == k_hat.size(), kInvalidArgument,
                 "InnerProductError::add: q, k and k_hat sizes differ");
    double exact = 0.0, approx = 0.0, q_norm = 0.0, k_norm = 0.0;
    for (std::size_t c = 0; c < q.size(); ++c) {
      exact += static_cast<double>(q[c]) * k[c];
      approx += static_cast<double>(q[c]) * k_hat[c];
      q_norm += static_cast<double>(q[c]) * q[c];
      k_norm += static_cast<double>(k[c]) * k[c];
    }
    const double norms = std::sqrt(q_norm * k_norm);
    KVPACK_CHECK(norms > 0.0 && std::isfinite(norms), kInvalidArgument,
                 "InnerProductError::add: q and k must be non-zero and finite");
    add_difference((approx - exact) / norms);
  }
  void add_difference(double delta) {
    ++count_;
    const double step = delta - mean_;
    mean_ += step / static_cast<double>(count_);
    m2_ += step * (delta - mean_);
  }
  [[nodiscard]] double bias() const noexcept { return mean_; }
  [[nodiscard]] double variance() const noexcept { return count_ > 1 ? m2_ / static_cast<double>(count_ - 1) : 0.0; }
  [[nodiscard]] std::size_t count() const noexcept { return count_; }

 private:
  std::size_t count_ = 0;
  double mean_ = 0.0;
  double m2_ = 0.0;
};

/// Bits per stored element measured from a cache's bytes.
struct MeasuredBits {
  double all_in = 0.0;   ///< every byte memory() reports: pages, metadata, tails, tables, params
  double payload = 0.0;  ///< encoded page payload only (the codec's own rate, page padding included)
};

/// `page_elements`: K and V elements one page holds (page_size · (key_dim + value_dim)).
inline MeasuredBits measured_bits(const MemoryUsage& memory, std::size_t page_elements) {
  MeasuredBits bits;
  bits.all_in = memory.bits_per_element();
  if (memory.pages_in_use > 0 && page_elements > 0) {
    bits.payload = 8.0 * static_cast<double>(memory.page_payload) /
                   (static_cast<double>(memory.pages_in_use) * static_cast<double>(page_elements));
  }
  return bits;
}

// --- Logit metrics of a real model (one position at a time) -------------------------------------

/// log softmax(logits), in double.
inline std::vector<double> log_softmax(std::span<const float> logits) {
  KVPACK_CHECK(!logits.empty(), kInvalidArgument, "log_softmax: no logits");
  const double top = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - top);
  const double log_sum = top + std::log(sum);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - log_sum;
  return out;
}

/// KL(softmax(ref) ‖ softmax(logits)) in nats.
inline double logit_kl(std::span<const float> ref, std::span<const float> logits) {
  KVPACK_CHECK(ref.size() == logits.size(), kInvalidArgument, "logit_kl: vocabulary sizes differ");
  const std::vector<double> lp_ref = log_softmax(ref);
  const std::vector<double> lp = log_softmax(logits);
  double kl = 0.0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp_ref[i]) * (lp_ref[i] - lp[i]);
  return std::max(kl, 0.0);
}

/// Index of the largest logit (the first on ties).
inline std::size_t argmax(std::span<const float> logits) {
  return static_cast<std::size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// First index where two token sequences differ, or the shorter length when one is a prefix.
template <class Token>
std::size_t first_divergence(std::span<const Token> ref, std::span<const Token> tokens) {
  const std::size_t n = std::min(ref.size(), tokens.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (ref[i] != tokens[i]) return i;
  }
  return n;
}

/// Teacher-forced quality of a policy against the full-precision reference, accumulated one
/// predicted position at a time.
class LogitComparison {
 public:
  /// `ref` and `logits`: both runs' logits predicting `target`.
  void add(std::span<const float> ref, std::span<const float> logits, std::size_t target) {
    KVPACK_CHECK(ref.size() == logits.size(), kInvalidArgument,
                 detail::message("LogitComparison::add: ", ref.size(), " reference and ", logits.size(), " logits"));
    KVPACK_CHECK(target < logits.size(), kInvalidArgument, "LogitComparison::add: target outside the vocabulary");
    const double kl = logit_kl(ref, logits);  // everything computed before any total changes
    loss_ref_ += -log_softmax(ref)[target];
    loss_ += -log_softmax(logits)[target];
    kl_ += kl;
    agree_ += argmax(ref) == argmax(logits) ? 1 : 0;
    ++count_;
  }
  [[nodiscard]] std::size_t positions() const noexcept { return count_; }
  /// Mean negative log-likelihood of the targets, nats/token.
  [[nodiscard]] double loss() const noexcept { return mean(loss_); }
  [[nodiscard]] double reference_loss() const noexcept { return mean(loss_ref_); }
  [[nodiscard]] double loss_delta() const noexcept { return loss() - reference_loss(); }
  [[nodiscard]] double mean_kl() const noexcept { return mean(kl_); }
  [[nodiscard]] double top1_agreement() const noexcept { return mean(agree_); }

 private:
  [[nodiscard]] double mean(double total) const noexcept {
    return count_ == 0 ? 0.0 : total / static_cast<double>(count_);
  }
  double loss_ = 0.0, loss_ref_ = 0.0, kl_ = 0.0, agree_ = 0.0;
  std::size_t count_ = 0;
};

}  // namespace kvpack::inline v0::eval
