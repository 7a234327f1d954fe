// reconstruction_error: exact storage gives 0, fp16 storage at most fp16's relative rounding
// (2^-11 per element, so for the whole layer), pre-RoPE storage only the rotation's float rounding
// (so read_back's positions and rotation line up with the input tokens), and coarser codes more.

#include <catch2/catch.hpp>

#include <cmath>

#include "kvpack/eval.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

SyntheticSpec small_spec() {
  SyntheticSpec spec;
  spec.tokens = 300;  // pages, then a tail that does not fill one
  spec.kv_heads = 2;
  spec.q_heads = 4;
  spec.head_dim = 64;
  return spec;
}

ReconstructionError measure(const Policy& policy, const SyntheticSpec& spec, const LayerKV& layer,
                            const CacheConfig& config = {}) {
  const auto cache = policy.make({1, spec.q_heads, spec.kv_heads, spec.head_dim}, config);
  const SeqId seq = cache->add_sequence();
  cache->prefill(seq, 0, std::span<const float>(layer.keys), std::span<const float>(layer.values));
  return reconstruction_error(*cache, seq, 0, layer);
}

}  // namespace

TEST_CASE("reconstruction error is 0 for f32, within fp16 rounding for f16", "[eval][reconstruction]") {
  const SyntheticSpec spec = small_spec();
  const LayerKV layer = make_layer(spec);
  const ReconstructionError exact = measure(find_policy("f32"), spec, layer);
  CHECK(exact.keys == 0.0);
  CHECK(exact.values == 0.0);
  const ReconstructionError f16 = measure(find_policy("f16"), spec, layer);
  const double unit_roundoff = std::ldexp(1.0, -11);
  CHECK(f16.keys > 0.0);
  CHECK(f16.keys <= unit_roundoff);
  CHECK(f16.values > 0.0);
  CHECK(f16.values <= unit_roundoff);
}

TEST_CASE("keys stored before RoPE come back rotated to their own tokens", "[eval][reconstruction]") {
  const SyntheticSpec spec = small_spec();
  const LayerKV layer = make_layer(spec);
  CacheConfig config;
  config.key_rope = RopeSpec{spec.rope_theta};
  config.exact_prefix_tokens = 3;
  // Un-rotating on input and rotating on read cost a few float roundings per element.
  const ReconstructionError pre_rope = measure(find_policy("f32"), spec, layer, config);
  CHECK(pre_rope.keys < 1e-5);
  CHECK(pre_rope.values == 0.0);
}

TEST_CASE("coarser codes reconstruct worse, and a shape mismatch is an error", "[eval][reconstruction]") {
  const SyntheticSpec spec = small_spec();
  const LayerKV layer = make_layer(spec);
  const ReconstructionError kivi4 = measure(find_policy("kivi-4"), spec, layer);
  const ReconstructionError kivi2 = measure(find_policy("kivi-2"), spec, layer);
  CHECK(kivi4.keys < kivi2.keys);
  CHECK(kivi4.values < kivi2.values);

  SyntheticSpec other = spec;
  other.kv_heads = 1;
  other.q_heads = 2;
  const auto cache = find_policy("f32").make({1, other.q_heads, other.kv_heads, other.head_dim}, {});
  const SeqId seq = cache->add_sequence();
  const LayerKV one_head = make_layer(other);
  cache->prefill(seq, 0, std::span<const float>(one_head.keys), std::span<const float>(one_head.values));
  CHECK_THROWS_AS(reconstruction_error(*cache, seq, 0, layer), Error);
}
