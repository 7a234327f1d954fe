// The K-versus-V asymmetry (KIVI's ablation) on the synthetic workload with outlier key
// channels: keys are the more sensitive plane, and per-channel keys beat per-token keys. The
// example kv_asymmetry prints the full table; this holds the two directions to the measurement.

#include <catch2/catch.hpp>

#include "kvpack/eval.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

/// Mean attention-output error of `policy` on one synthetic layer, no residual window.
template <class Quantizer>
double mean_error(const SyntheticSpec& spec, const LayerKV& layer, const std::vector<float>& queries,
                  const std::vector<std::vector<double>>& exact) {
  const auto cache = make_policy<Quantizer>("", "").make({1, spec.q_heads, spec.kv_heads, spec.head_dim}, {});
  const SeqId seq = cache->add_sequence();
  cache->prefill(seq, 0, std::span<const float>(layer.keys), std::span<const float>(layer.values));
  return attention_error(*cache, seq, 0, queries, exact).mean;
}

}  // namespace

TEST_CASE("keys are more sensitive than values, and per-channel keys beat per-token keys", "[eval][asymmetry]") {
  using quant::Float;
  using quant::KIVI;
  using quant::KiviPerTokenKeys;
  using quant::Mixed;
  SyntheticSpec spec;
  spec.tokens = 2048;
  spec.kv_heads = 4;
  spec.q_heads = 16;
  spec.outlier_scale = 10.0f;  // the top of EVAL.md's 3–10x: the regime per-channel keys are for
  const LayerKV layer = make_layer(spec);
  const std::vector<float> queries = make_decode_queries(spec, layer, 4, 99);
  const auto exact = exact_outputs(layer, queries, spec.q_heads);

  // Measured here: K4 0.138, V4 0.076, K4 per-token 0.185; K2 0.618, V2 0.391, K2 per-token
  // 0.787. The margins (27–80 %) come from the grouping, not from noise: in a per-token group one
  // outlier channel sets the step of all 32 channels; a per-channel group only its own. (At the
  // default 6x outliers and 2K tokens the per-token penalty shrinks to 5–8 %.)
  for (int bits : {4, 2}) {
    INFO(bits << " bits");
    const double k = bits == 4 ? mean_error<Mixed<KIVI<4>, Float<float>>>(spec, layer, queries, exact)
                               : mean_error<Mixed<KIVI<2>, Float<float>>>(spec, layer, queries, exact);
    const double k_token = bits == 4 ? mean_error<Mixed<KiviPerTokenKeys<4>, Float<float>>>(spec, layer, queries, exact)
                                     : mean_error<Mixed<KiviPerTokenKeys<2>, Float<float>>>(spec, layer, queries, exact);
    const double v = bits == 4 ? mean_error<Mixed<Float<float>, KIVI<4>>>(spec, layer, queries, exact)
                               : mean_error<Mixed<Float<float>, KIVI<2>>>(spec, layer, queries, exact);
    INFO("K per-channel " << k << ", K per-token " << k_token << ", V " << v);
    CHECK(k > 1.2 * v);
    CHECK(k_token > 1.1 * k);
  }
}
