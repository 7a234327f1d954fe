// eval/policies.hpp: the registry builds every policy, errors pass through, and read_back
// returns what the kernels read.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/metrics.hpp"
#include "kvpack/eval/policies.hpp"
#include "support/random_kv.hpp"

using namespace kvpack;
using namespace kvpack::eval;

TEST_CASE("every built-in policy builds, stores and attends through AnyCache", "[eval][policies]") {
  const ModelShape shape{1, 8, 2, 64};
  const auto keys = test::random_rows(100 * 2, 64, 1, 2, 5.0f);
  const auto values = test::random_rows(100 * 2, 64, 2);
  const auto query = test::random_rows(8, 64, 3);
  const auto exact = exact_attention(keys, values, 2, 64, query, 0.125);
  // KVQuant calibrates on other data of the same kind (rotated by the same RoPE).
  RopeSpec rope;
  LayerKV sample{300, 2, 64, test::random_rows(300 * 2, 64, 4, 2, 5.0f), test::random_rows(300 * 2, 64, 5), {}};
  const PolicyInputs inputs{rope, std::make_shared<const std::vector<LayerKV>>(std::vector<LayerKV>{sample})};
  for (const Policy& policy : builtin_policies()) {
    INFO(policy.name);
    const auto cache = policy.make(shape, {}, inputs);
    const SeqId seq = cache->add_sequence();
    cache->prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
    CHECK(cache->length(seq, 0) == 100);
    std::vector<float> out(query.size());
    cache->attend(seq, 0, std::span<const float>(query), std::span<float>(out), 0.125f);
    // Loose tiers, to catch a policy wired to the wrong codec or kernel rather than to grade it
    // (the kernel and codec tests hold each format to its own bound): with two outlier channels
    // (5x) in a 32-channel block, q4_0's step is ~1.5, which moves scores by ~0.3 and the output
    // by about as much (measured 0.29); KIVI-2's four levels per group measure 0.69; 8-bit
    // formats stay near 0.01–0.07, 16-bit ones below 0.004. QJL's keys are one sign bit per sketch
    // row and nothing else: its unbiased scores carry noise √(π/2m)·‖q‖‖k‖ (m = 2d = 128), about
    // as large as the scores' own spread on these unstructured keys (measured 1.38), so it only
    // gets the bound of an output that is not garbage (NaN, a wrong scale).
    const double bits = cache->nominal_bits_per_element();
    const double tier = policy.name == "qjl" ? 2.0 : bits >= 16 ? 0.01 : bits >= 8 ? 0.1 : bits >= 4 ? 0.5 : 1.0;
    CHECK(relative_error(out, exact) < tier);
    CHECK(cache->memory().stored_elements == 100 * 2 * 64 * 2);
    CHECK(cache->nominal_bits_per_element() > 0);
  }
}

TEST_CASE("a policy calibrated offline says what it needs when it gets nothing", "[eval][policies]") {
  const Policy kvquant = find_policy("kvquant-3");
  CHECK(kvquant.needs_inputs);
  CHECK_FALSE(find_policy("kivi-2").needs_inputs);
  CHECK_THROWS_WITH(kvquant.make({1, 8, 2, 64}, {}), Catch::Contains("needs PolicyInputs"));
  // Calibration for 1 layer, a model of 2.
  const PolicyInputs one_layer = synthetic_policy_inputs(SyntheticSpec{}, 64);
  CHECK_THROWS_WITH(kvquant.make({2, 32, 8, 128}, {}, one_layer), Catch::Contains("calibration has 1 layers"));
  // As published: pre-RoPE keys with the model's RoPE, the first token exact.
  const auto cache = kvquant.make({1, 32, 8, 128}, {}, one_layer);
  REQUIRE(cache->config().key_rope.has_value());
  CHECK(cache->config().key_rope->theta == SyntheticSpec{}.rope_theta);
  CHECK(cache->config().exact_prefix_tokens == 1);
}

TEST_CASE("find_policy names the known policies when asked for an unknown one", "[eval][policies]") {
  CHECK(find_policy("q4_0").name == "q4_0");
  CHECK_THROWS_WITH(find_policy("q3_k"), Catch::Contains("unknown policy 'q3_k'") && Catch::Contains("f32, f16"));
}

TEST_CASE("AnyCache passes KVCache's errors through", "[eval][policies]") {
  const auto cache = find_policy("q4_0").make({1, 2, 1, 32}, {});
  CHECK_THROWS_AS(cache->attend(99, 0, std::span<const float>(), std::span<float>(), 1.0f), kvpack::Error);
  CHECK_THROWS_WITH(find_policy("q4_0").make({1, 2, 1, 8}, {}), Catch::Contains("32"));
}

TEST_CASE("read_back returns paged tokens through the codec and the tail exactly", "[eval][policies]") {
  const ModelShape shape{1, 4, 2, 32};
  CacheConfig config;
  config.page_size = 16;
  const auto keys = test::random_rows(40 * 2, 32, 4);
  const auto values = test::random_rows(40 * 2, 32, 5);
  for (const char* name : {"f32", "q8_0"}) {
    INFO(name);
    const auto cache = find_policy(name).make(shape, config);
    const SeqId seq = cache->add_sequence();
    cache->prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
    const StoredTokens stored = cache->read_back(seq, 0, 1);
    REQUIRE(stored.size() == 40);
    for (index_t t = 0; t < 40; ++t) {
      CHECK(stored.positions[t] == t);
      for (index_t c = 0; c < 32; ++c) {
        const float k = keys[(t * 2 + 1) * 32 + c], v = values[(t * 2 + 1) * 32 + c];
        const float got_k = stored.keys[t * 32 + c], got_v = stored.values[t * 32 + c];
        if (t >= 32 || std::string(name) == "f32") {  // the tail (and f32 pages) hold the input exactly
          CHECK(got_k == k);
          CHECK(got_v == v);
        } else {  // q8_0: half a step of absmax/127, plus the fp16 rounding of the scale (2^-11 relative)
          float absmax = 0;
          for (index_t i = 0; i < 32; ++i) absmax = std::max(absmax, std::fabs(keys[(t * 2 + 1) * 32 + i]));
          CHECK(std::fabs(got_k - k) <= absmax / 127 * (0.5f + 127.0f / 2048) * 1.001f);
        }
      }
    }
  }
}

TEST_CASE("KIVI policies keep their published residual of 128 full-precision tokens", "[eval][policies]") {
  const ModelShape shape{1, 4, 2, 64};
  CHECK(find_policy("kivi-2").make(shape, {})->config().tail_tokens == 128);
  CacheConfig longer;
  longer.tail_tokens = 256;
  CHECK(find_policy("kivi-4").make(shape, longer)->config().tail_tokens == 256);  // never lowered
  CacheConfig pages_of_96;
  pages_of_96.page_size = 96;
  CHECK(find_policy("kivi-4").make(shape, pages_of_96)->config().tail_tokens == 192);  // whole pages
  CHECK(find_policy("q4_0").make(shape, {})->config().tail_tokens == 0);
}

TEST_CASE("the evictor policies are built in and evict each KV stream to their budget", "[eval][policies][evict]") {
  const ModelShape shape{1, 8, 2, 64};
  constexpr index_t kTokens = 2048, kWindow = 8;
  const auto keys = test::random_rows(kTokens * 2, 64, 6);
  const auto values = test::random_rows(kTokens * 2, 64, 7);
  const auto window = test::random_rows(kWindow * 8, 64, 8);  // SnapKV and H2O score with it
  const auto full = find_policy("f16").make(shape, {});
  const SeqId full_seq = full->add_sequence();
  full->prefill(full_seq, 0, std::span<const float>(keys), std::span<const float>(values));
  for (const char* name : {"streaming-llm", "h2o", "snapkv", "pyramidkv", "snapkv+q4_0"}) {
    INFO(name);
    const Policy policy = find_policy(name);
    CHECK(policy.budget_tokens == kEvictionBudgetTokens);
    CHECK_THAT(policy.description, Catch::Contains(std::to_string(kEvictionBudgetTokens) + " tokens"));
    const auto cache = policy.make(shape, {});
    const SeqId seq = cache->add_sequence();
    cache->prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values), std::span<const float>(window));
    CHECK(cache->length(seq, 0) == kTokens);
    for (index_t stream = 0; stream < 2; ++stream) CHECK(cache->live_tokens(seq, 0, stream) == policy.budget_tokens);
    CHECK(cache->memory().stored_elements == static_cast<std::size_t>(policy.budget_tokens) * 2 * 64 * 2);
    CHECK(cache->memory().total() < full->memory().total() / 2);  // a quarter of the tokens kept
  }
  // Policies that keep every token say so, and accept pins.
  CHECK(find_policy("q4_0").budget_tokens == 0);
  full->pin(full_seq, 0, 10);
  CHECK(full->live_tokens(full_seq, 0, 1) == kTokens);
}

TEST_CASE("a pinned span survives an evictor policy", "[eval][policies][evict]") {
  const ModelShape shape{1, 4, 1, 32};
  const auto keys = test::random_rows(1024, 32, 9);
  const auto values = test::random_rows(1024, 32, 10);
  const auto cache = find_policy("streaming-llm").make(shape, {});
  const SeqId seq = cache->add_sequence();
  cache->pin(seq, 300, 309);  // far from the sinks and the recent window
  cache->prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  const StoredTokens stored = cache->read_back(seq, 0, 0);
  // The budget, give or take the pins (which count towards it or come on top, per evictor).
  CHECK(stored.size() >= kEvictionBudgetTokens);
  CHECK(stored.size() <= kEvictionBudgetTokens + 10);
  for (std::int32_t position = 300; position <= 309; ++position) {
    CHECK(std::count(stored.positions.begin(), stored.positions.end(), position) == 1);
  }
}

TEST_CASE("the eviction matrix: every evictor over every codec evicts to its budget and says whether it certifies",
          "[eval][policies][evict]") {
  const ModelShape shape{1, 8, 2, 64};
  const index_t tokens = 200, budget = 64, window = 8;
  const auto keys = test::random_rows(tokens * 2, 64, 11, 2, 5.0f);
  const auto values = test::random_rows(tokens * 2, 64, 12);
  const auto observation = test::random_rows(window * 8, 64, 13);
  const auto query = test::random_rows(8, 64, 14);
  std::vector<std::string> names;
  for (std::string_view evictor : kMatrixEvictors) {
    for (std::string_view codec : kMatrixCodecs) {
      const Policy policy = evictor_policy(evictor, codec, budget);
      INFO(policy.name);
      names.push_back(policy.name);
      CHECK(policy.budget_tokens == budget);
      CHECK(find_policy(policy.name).description == evictor_policy(evictor, codec).description);
      REQUIRE(policy.with_budget);
      CHECK(policy.with_budget(32).budget_tokens == 32);
      const auto cache = policy.make(shape, {});
      const SeqId seq = cache->add_sequence();
      cache->prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values),
                     std::span<const float>(observation));
      for (index_t stream = 0; stream < 2; ++stream) CHECK(cache->live_tokens(seq, 0, stream) <= budget);
      REQUIRE(cache->certifies_unread());  // every evictor keeps page summaries
      std::vector<float> out(query.size());
      AttendReport report;
      cache->attend_reported(seq, 0, std::span<const float>(query), std::span<float>(out), 0.125f, report);
      REQUIRE(report.heads.size() == 8);
      // Most of the context is gone: a random query gave it mass the bound must admit.
      CHECK(report.max_mass() > 0.0);
    }
  }
  std::sort(names.begin(), names.end());
  CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());
  CHECK(names.size() == 16);
  CHECK_THROWS_WITH(evictor_policy("snapkv", "q3_k"), Catch::Contains("no policy for evictor 'snapkv' over codec 'q3_k'"));
}

TEST_CASE("quest reads its budget's pages per KV head and certifies the rest", "[eval][policies]") {
  const ModelShape shape{1, 8, 2, 64};
  const index_t tokens = 2048;  // 64 pages of 32 per KV head; the budget reads 512 / 32 = 16
  const auto keys = test::random_rows(tokens * 2, 64, 21);
  const auto values = test::random_rows(tokens * 2, 64, 22);
  const auto query = test::random_rows(8, 64, 23);
  const auto cache = quest_policy().make(shape, {});
  const SeqId seq = cache->add_sequence();
  cache->prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  REQUIRE(cache->certifies_unread());
  std::vector<float> out(query.size());
  AttendReport report;
  cache->attend_reported(seq, 0, std::span<const float>(query), std::span<float>(out), 0.125f, report);
  CHECK(report.pages_total == 2 * 64);
  CHECK(report.pages_read == 2 * kEvictionBudgetTokens / 32);
  CHECK(report.max_mass() > 0.0);  // 3/4 of the pages unread
}
