// eval/synthetic.hpp: the workload has the properties EVAL.md §1 asks for, measured on its output.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvpack/eval/attention_error.hpp"
#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/synthetic.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

SyntheticSpec small_spec() {
  SyntheticSpec spec;
  spec.tokens = 4096;
  spec.kv_heads = 2;
  spec.q_heads = 8;
  return spec;
}

/// Per-channel RMS of one head's rows.
std::vector<double> channel_rms(const LayerKV& kv, bool keys) {
  std::vector<double> rms(static_cast<std::size_t>(kv.head_dim), 0.0);
  for (index_t t = 0; t < kv.tokens; ++t) {
    const float* row = keys ? kv.key(t, 0) : kv.value(t, 0);
    for (index_t c = 0; c < kv.head_dim; ++c) rms[c] += static_cast<double>(row[c]) * row[c];
  }
  for (double& r : rms) r = std::sqrt(r / kv.tokens);
  return rms;
}

double max_over_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.back() / v[v.size() / 2];
}

}  // namespace

TEST_CASE("the synthetic workload is reproducible from its seed", "[eval][synthetic]") {
  SyntheticSpec spec = small_spec();
  spec.tokens = 64;
  const LayerKV a = make_layer(spec), b = make_layer(spec), other_layer = make_layer(spec, 1);
  CHECK(a.keys == b.keys);
  CHECK(a.values == b.values);
  CHECK(a.keys != other_layer.keys);
  spec.seed = 2;
  CHECK(make_layer(spec).keys != a.keys);
  CHECK(make_decode_queries(spec, a, 2, 5) == make_decode_queries(spec, a, 2, 5));
}

TEST_CASE("synthetic keys have outlier channels, values are flat", "[eval][synthetic]") {
  const LayerKV kv = make_layer(small_spec());
  // RoPE mixes each outlier channel with its pair partner, so both carry the outlier's energy:
  // RMS ≈ sqrt((6² + 1) / 2) ≈ 4.3 × the others. EVAL.md asks for 3–10× the median.
  const double key_ratio = max_over_median(channel_rms(kv, true));
  CHECK(key_ratio > 3.0);
  CHECK(key_ratio < 10.0);
  CHECK(max_over_median(channel_rms(kv, false)) < 1.2);
}

TEST_CASE("synthetic queries show attention sinks and recency", "[eval][synthetic]") {
  const SyntheticSpec spec = small_spec();
  const LayerKV kv = make_layer(spec);
  const auto queries = make_decode_queries(spec, kv, 4, 11);
  const std::ptrdiff_t stride = static_cast<std::ptrdiff_t>(spec.kv_heads) * spec.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(spec.head_dim));
  std::vector<double> out(static_cast<std::size_t>(spec.head_dim)), p;
  double sink_mass = 0, recent_mass = 0, middle_mass = 0;
  int heads = 0;
  for (std::size_t row = 0; row < queries.size() / spec.head_dim; ++row) {
    const index_t head = static_cast<index_t>(row % spec.q_heads) / (spec.q_heads / spec.kv_heads);
    exact_attention_head({kv.keys.data() + head * spec.head_dim, stride, kv.tokens, spec.head_dim},
                         {kv.values.data() + head * spec.head_dim, stride, kv.tokens, spec.head_dim},
                         &queries[row * spec.head_dim], scale, out.data(), &p);
    for (index_t t = 0; t < spec.sink_tokens; ++t) sink_mass += p[t];
    for (index_t t = kv.tokens - 256; t < kv.tokens; ++t) recent_mass += p[t];
    for (index_t t = kv.tokens / 2 - 128; t < kv.tokens / 2 + 128; ++t) middle_mass += p[t];
    ++heads;
  }
  sink_mass /= heads, recent_mass /= heads, middle_mass /= heads;
  // Four of 4096 tokens take a large share; the last 256 tokens take several times what 256
  // tokens from the middle do (content matches there may add a little).
  CHECK(sink_mass > 0.2);
  CHECK(recent_mass > 3 * middle_mass);
}

TEST_CASE("background query scores have std ~1 against each KV head's own keys", "[eval][synthetic]") {
  // K/V as a dump gives them (no recency mean), with head 1's keys 10x head 0's: a background
  // scaled by head 0's norm would give head 1 scores of std ~10.
  SyntheticSpec spec = small_spec();
  spec.tokens = 1024;
  spec.sink_tokens = 0;
  spec.content_matches = 0;
  LayerKV kv = make_layer(spec);
  kv.recency_means.clear();
  for (index_t t = 0; t < kv.tokens; ++t) {
    for (index_t c = 0; c < kv.head_dim; ++c) kv.key(t, 1)[c] *= 10.0f;
  }
  const int count = 8;
  const auto queries = make_decode_queries(spec, kv, count, 3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(spec.head_dim));
  const index_t group = spec.q_heads / spec.kv_heads;
  for (index_t head = 0; head < spec.kv_heads; ++head) {
    double sum2 = 0.0;
    std::size_t n = 0;
    for (int query = 0; query < count; ++query) {
      for (index_t h = head * group; h < (head + 1) * group; ++h) {
        const float* q = &queries[(static_cast<std::size_t>(query) * spec.q_heads + h) * spec.head_dim];
        for (index_t t = 0; t < kv.tokens; ++t) {
          double s = 0.0;
          for (index_t c = 0; c < spec.head_dim; ++c) s += static_cast<double>(q[c]) * kv.key(t, head)[c];
          sum2 += (s * scale) * (s * scale);
          ++n;
        }
      }
    }
    // 32 query rows: the std of their scores is within ~25 % of 1 (the spread of the query
    // norms over 32 draws of d = 128 channels is ~2 %; the keys' outlier channels add more).
    const double score_std = std::sqrt(sum2 / static_cast<double>(n));
    INFO("KV head " << head);
    CHECK(score_std > 0.75);
    CHECK(score_std < 1.33);
  }
  LayerKV other_heads = kv;
  other_heads.kv_heads = 1;
  CHECK_THROWS_AS(make_decode_queries(spec, other_heads, 1, 3), Error);

  // A zero key (a dump's padding) where a sink or a content match falls scores 0 against any
  // query and is not raised: raising it divided by its zero norm and made every query NaN.
  SyntheticSpec with_peaks = small_spec();
  LayerKV padded = make_layer(with_peaks);
  padded.recency_means.clear();
  for (index_t head = 0; head < padded.kv_heads; ++head) {
    for (index_t t = 0; t < padded.tokens; t += 2) std::fill_n(padded.key(t, head), padded.head_dim, 0.0f);
  }
  const auto finite = make_decode_queries(with_peaks, padded, 4, 5);
  CHECK(std::all_of(finite.begin(), finite.end(), [](float x) { return std::isfinite(x); }));
  // A trailing part of a query row is refused, not dropped.
  CHECK(exact_outputs(padded, finite, with_peaks.q_heads).size() == 4);
  CHECK_THROWS_AS(exact_outputs(padded, std::span(finite).first(finite.size() - 1), with_peaks.q_heads), Error);
  SyntheticSpec negative = small_spec();
  negative.sink_tokens = -1;
  CHECK_THROWS_AS(make_layer(negative), Error);
}
