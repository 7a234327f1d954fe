// eval/metrics.hpp: each metric against its definition, evaluated independently in the test.

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvpack/eval/metrics.hpp"

using namespace kvpack;
using namespace kvpack::eval;

TEST_CASE("relative_error is |out - ref| / |ref|", "[eval][metrics]") {
  const std::vector<float> out{3.0f, 4.0f + 1.0f};
  const std::vector<double> ref{3.0, 4.0};
  CHECK(relative_error(out, ref) == Approx(1.0 / 5.0));
  CHECK(relative_error(std::vector<float>{0, 0}, std::vector<double>{0, 0}) == 0.0);
  CHECK(std::isinf(relative_error(std::vector<float>{1, 0}, std::vector<double>{0, 0})));
  CHECK_THROWS_AS(relative_error(std::vector<float>{1}, ref), kvpack::Error);
}

TEST_CASE("summarize gives mean, nearest-rank p99 and max", "[eval][metrics]") {
  std::vector<double> sample;
  for (int i = 100; i >= 1; --i) sample.push_back(i);
  const Summary s = summarize(sample);
  CHECK(s.mean == Approx(50.5));
  CHECK(s.p99 == 99.0);
  CHECK(s.max == 100.0);
  CHECK(summarize({}).count == 0);
  // An error that could not be measured (NaN) ranks above everything: the maximum says so, the
  // mean is NaN, and the finite ones keep their order (a NaN in std::sort is undefined).
  std::vector<double> with_nan(sample);
  with_nan.insert(with_nan.begin() + 40, std::numeric_limits<double>::quiet_NaN());
  const Summary n = summarize(with_nan);
  CHECK(std::isnan(n.max));
  CHECK(std::isnan(n.mean));
  CHECK(n.p99 == 100.0);  // rank ceil(0.99 · 101) = 100 of 1..100 then NaN
  CHECK(n.count == 101);
}

TEST_CASE("kl_divergence matches its sum, is zero for equal inputs and infinite for a dropped token",
          "[eval][metrics]") {
  const std::vector<double> p{0.5, 0.25, 0.25};
  const std::vector<double> q{0.25, 0.25, 0.5};
  CHECK(kl_divergence(p, q) == Approx(0.5 * std::log(2.0) + 0.25 * std::log(0.5)));
  CHECK(kl_divergence(p, p) == 0.0);
  CHECK(std::isinf(kl_divergence(p, std::vector<double>{0.75, 0.25, 0.0})));
  // A token the reference ignores may be dropped at no cost.
  CHECK(kl_divergence(std::vector<double>{1.0, 0.0}, std::vector<double>{1.0, 0.0}) == 0.0);
}

TEST_CASE("top_k_recall is the kept share of the reference's top-k mass", "[eval][metrics]") {
  const std::vector<double> p{0.1, 0.4, 0.2, 0.3};
  const bool kept_arr[] = {true, false, true, true};
  const std::span<const bool> kept(kept_arr);
  CHECK(top_k_recall(p, kept, 2) == Approx(0.3 / 0.7));  // top 2: tokens 1 (dropped) and 3
  CHECK(top_k_recall(p, kept, 4) == Approx(0.6));
  CHECK(top_k_recall(p, kept, 10) == Approx(0.6));
  CHECK_THROWS_AS(top_k_recall(p, kept, 0), kvpack::Error);
}

TEST_CASE("InnerProductError's bias and variance equal a two-pass computation", "[eval][metrics]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  InnerProductError stats;
  std::vector<double> deltas;
  for (int n = 0; n < 500; ++n) {
    std::vector<float> q(16), k(16), k_hat(16);
    for (int c = 0; c < 16; ++c) {
      q[c] = normal(rng), k[c] = normal(rng);
      k_hat[c] = k[c] + 0.1f * normal(rng) + 0.01f;  // noise plus a deliberate bias
    }
    stats.add(q, k, k_hat);
    double d = 0, qq = 0, kk = 0;
    for (int c = 0; c < 16; ++c) {
      d += static_cast<double>(q[c]) * (static_cast<double>(k_hat[c]) - k[c]);
      qq += static_cast<double>(q[c]) * q[c];
      kk += static_cast<double>(k[c]) * k[c];
    }
    deltas.push_back(d / std::sqrt(qq * kk));  // EVAL.md §4: unit q and k
  }
  double mean = 0;
  for (double d : deltas) mean += d;
  mean /= deltas.size();
  double var = 0;
  for (double d : deltas) var += (d - mean) * (d - mean);
  var /= deltas.size() - 1;
  CHECK(stats.count() == 500);
  CHECK(stats.bias() == Approx(mean).margin(1e-9));
  CHECK(stats.variance() == Approx(var).epsilon(1e-9));
}

TEST_CASE("logit metrics: log_softmax, KL, argmax, first divergence, LogitComparison", "[eval][metrics]") {
  const std::vector<float> a{1.0f, 2.0f, 3.0f};
  const std::vector<float> b{1.0f, 3.0f, 2.0f};
  const auto lp = log_softmax(a);
  double total = 0;
  for (double x : lp) total += std::exp(x);
  CHECK(total == Approx(1.0));
  CHECK(lp[2] - lp[0] == Approx(2.0));
  const auto lb = log_softmax(b);
  double kl = 0;
  for (int i = 0; i < 3; ++i) kl += std::exp(lp[i]) * (lp[i] - lb[i]);
  CHECK(logit_kl(a, b) == Approx(kl));
  CHECK(logit_kl(a, a) == 0.0);
  CHECK(argmax(std::span<const float>(a)) == 2);

  const std::vector<int> ref{1, 5, 7, 9}, same{1, 5, 7, 9}, other{1, 5, 8, 9}, shorter{1, 5};
  CHECK(first_divergence<int>(ref, other) == 2);
  CHECK(first_divergence<int>(ref, same) == 4);
  CHECK(first_divergence<int>(ref, shorter) == 2);

  LogitComparison cmp;
  cmp.add(a, b, 2);
  CHECK(cmp.reference_loss() == Approx(-lp[2]));
  CHECK(cmp.loss() == Approx(-lb[2]));
  CHECK(cmp.loss_delta() == Approx(lp[2] - lb[2]));
  CHECK(cmp.top1_agreement() == 0.0);
  cmp.add(a, a, 0);
  CHECK(cmp.positions() == 2);
  CHECK(cmp.top1_agreement() == 0.5);
  CHECK(cmp.mean_kl() == Approx(kl / 2));
  // Logits of different vocabularies are refused before any total changes (the reference's
  // log-probability was read past its end, and the losses kept a term without its position).
  const std::vector<float> longer{1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
  CHECK_THROWS_AS(cmp.add(a, longer, 4), kvpack::Error);
  CHECK_THROWS_AS(cmp.add(longer, a, 1), kvpack::Error);
  CHECK(cmp.positions() == 2);
  CHECK(cmp.loss() == Approx(-(lb[2] + lp[0]) / 2));
  CHECK(cmp.reference_loss() == Approx(-(lp[2] + lp[0]) / 2));
}
