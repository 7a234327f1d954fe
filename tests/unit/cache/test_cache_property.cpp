// Long random sequences of add / prefill / append / fork / release / attend, checked against a
// plain reference model after every attend, with exact memory accounting checked throughout.

#include <catch2/catch.hpp>

#include <algorithm>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "support/reference_cache.hpp"

namespace {

using namespace kvpack;

template <class Cache>
std::set<PageId> all_pages(const Cache& cache, const std::vector<SeqId>& live, index_t layers, index_t streams) {
  std::set<PageId> pages;
  for (SeqId id : live) {
    for (index_t l = 0; l < layers; ++l) {
      for (index_t s = 0; s < streams; ++s) {
        for (PageId p : cache.pages(id, l, s)) pages.insert(p);
      }
    }
  }
  return pages;
}

/// What a run varies besides the quantizer: the exact prefix (sinks) and pre-RoPE key storage.
struct Options {
  index_t exact_prefix = 0;
  std::optional<RopeSpec> key_rope{};
};

template <class Quantizer>
void run_random_operations(index_t tail_tokens, std::uint32_t seed, index_t page_size = 16, Options options = {},
                           Quantizer quantizer = {}) {
  const ModelShape shape{3, 4, 2, 32};
  CacheConfig config;
  config.page_size = page_size;
  config.tail_tokens = tail_tokens;
  config.exact_prefix_tokens = options.exact_prefix;
  config.key_rope = options.key_rope;
  KVCache<layout::GQA, Quantizer> cache(shape, config, quantizer);
  test::ReferenceCache<Quantizer> model(shape, config.page_size, tail_tokens, options.exact_prefix, options.key_rope);
  const index_t row = shape.kv_heads * shape.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  std::mt19937 rng(seed);
  std::vector<SeqId> live;
  std::set<std::pair<SeqId, index_t>> written_layers;  // tails are allocated on first write
  std::uint32_t data_seed = seed * 1000;
  int attends = 0;

  for (int step = 0; step < 400; ++step) {
    const unsigned op = rng() % 100;
    if (live.empty() || (op < 8 && live.size() < 5)) {
      const SeqId id = cache.add_sequence();
      model.add(id);
      live.push_back(id);
      continue;
    }
    const SeqId id = live[rng() % live.size()];
    const index_t layer = static_cast<index_t>(rng() % shape.layers);
    if (op < 30) {
      const index_t tokens = 1 + static_cast<index_t>(rng() % 40);
      const auto keys = test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim, ++data_seed, 2);
      const auto values = test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim, ++data_seed);
      cache.prefill(id, layer, std::span<const float>(keys), std::span<const float>(values));
      const auto& seq = model.sequences().at(id);
      model.write(id, layer, keys, values, seq[layer].last_position + tokens);
      written_layers.insert({id, layer});
    } else if (op < 60) {
      const auto key = test::random_rows(shape.kv_heads, shape.head_dim, ++data_seed, 2);
      const auto value = test::random_rows(shape.kv_heads, shape.head_dim, ++data_seed);
      const std::int64_t position = model.sequences().at(id)[layer].last_position + 1 + rng() % 3;
      cache.append(id, layer, std::span<const float>(key), std::span<const float>(value), position);
      model.write(id, layer, key, value, position);
      written_layers.insert({id, layer});
    } else if (op < 66 && live.size() < 5) {
      const SeqId child = cache.fork(id);
      model.fork(id, child);
      live.push_back(child);
      for (index_t l = 0; l < shape.layers; ++l) {
        if (written_layers.count({id, l})) written_layers.insert({child, l});
      }
    } else if (op < 72) {
      cache.release(id);
      model.release(id);
      live.erase(std::find(live.begin(), live.end(), id));
      for (index_t l = 0; l < shape.layers; ++l) written_layers.erase({id, l});
    } else if (model.tokens(id, layer) > 0) {
      const auto query = test::random_rows(shape.q_heads, shape.head_dim, ++data_seed, 2, 3.0f);
      std::vector<float> out(query.size());
      cache.attend(id, layer, std::span<const float>(query), std::span<float>(out), scale);
      std::vector<double> bounds;
      const auto expected = model.attend(
          cache.quantizer(), id, layer, query, scale, [&](index_t s) { return cache.codec_params(layer, s); },
          &bounds, test::active_operands<typename Quantizer::key_codec>(),
          test::active_operands<typename Quantizer::value_codec>());
      for (std::size_t i = 0; i < out.size(); ++i) {
        INFO("step " << step << " seq " << id << " layer " << layer << " element " << i);
        REQUIRE(std::fabs(out[i] - expected[i]) <= bounds[i / shape.head_dim]);
      }
      ++attends;
    }

    // Exact accounting, derived from the model alone.
    const MemoryUsage usage = cache.memory();
    std::size_t expected_pages_per_stream_sum = 0;
    std::size_t elements = 0;
    for (const auto& [sid, seq] : model.sequences()) {
      for (index_t l = 0; l < shape.layers; ++l) {
        const index_t n = seq[l].tokens(row);
        expected_pages_per_stream_sum += static_cast<std::size_t>(model.pages_for(n)) * shape.kv_heads;
        elements += static_cast<std::size_t>(n) * shape.kv_heads * 2 * shape.head_dim;
        std::size_t stream_pages = 0;
        for (index_t s = 0; s < shape.kv_heads; ++s) stream_pages += cache.pages(sid, l, s).size();
        REQUIRE(stream_pages == static_cast<std::size_t>(model.pages_for(n)) * shape.kv_heads);
        REQUIRE(cache.length(sid, l) == n);
      }
    }
    const auto unique = all_pages(cache, live, shape.layers, shape.kv_heads);
    REQUIRE(usage.pages_in_use == unique.size());
    REQUIRE(unique.size() <= expected_pages_per_stream_sum);  // forks share pages
    REQUIRE(usage.page_payload == unique.size() * cache.page_format_info().payload_bytes);
    REQUIRE(usage.page_metadata == unique.size() * cache.page_format_info().metadata_bytes);
    const std::size_t tail_capacity = static_cast<std::size_t>(options.exact_prefix + tail_tokens + config.page_size);
    REQUIRE(usage.tails == written_layers.size() * tail_capacity *
                               (2 * static_cast<std::size_t>(row) * sizeof(float) + sizeof(std::int32_t)));
    REQUIRE(usage.stored_elements == elements);
  }
  CHECK(attends > 20);

  for (SeqId id : live) cache.release(id);
  const MemoryUsage empty = cache.memory();
  CHECK(empty.pages_in_use == 0);
  CHECK(empty.page_payload == 0);
  CHECK(empty.tails == 0);
  CHECK(empty.tables == 0);
  CHECK(empty.stored_elements == 0);
  CHECK(cache.pool().pages_available() == cache.pool().capacity());
}

}  // namespace

TEMPLATE_TEST_CASE("random operation sequences match the reference model", "[cache][property]",
                   quant::Float<float>, quant::Float<half>, quant::Float<bfloat16>, quant::FP8<quant::E4M3FN>,
                   quant::FP8<quant::E5M2>, quant::Int8, quant::Q8_0, quant::Q4_0,
                   (quant::Mixed<quant::Q8_0, quant::Q4_0>)) {
  SECTION("no extra tail") { run_random_operations<TestType>(0, 1); }
  SECTION("a one-page full-precision tail") { run_random_operations<TestType>(16, 2); }
  SECTION("a two-page tail, other data") { run_random_operations<TestType>(32, 3); }
}

TEMPLATE_TEST_CASE("random operation sequences match the reference model with KIVI's 32-token key groups",
                   "[cache][property]", quant::KIVI<2>, quant::KIVI<4>) {
  SECTION("no extra tail") { run_random_operations<TestType>(0, 4, 32); }
  SECTION("a one-page full-precision tail (KIVI's residual)") { run_random_operations<TestType>(32, 5, 32); }
}

TEMPLATE_TEST_CASE("random operation sequences match the reference model with exact sinks and pre-RoPE keys",
                   "[cache][property][rope]", quant::Float<half>, quant::Q4_0, quant::Int8) {
  RopeSpec rope;
  rope.theta = 10000.0;
  SECTION("one sink, no tail") { run_random_operations<TestType>(0, 6, 16, {1, rope}); }
  SECTION("four sinks and a tail, half-split pairs") {
    rope.pairing = RopePairing::kHalfSplit;
    run_random_operations<TestType>(16, 7, 16, {4, rope});
  }
  SECTION("sinks without RoPE") { run_random_operations<TestType>(16, 8, 16, {3, std::nullopt}); }
}

TEMPLATE_TEST_CASE("random operation sequences match the reference model for KVQuant", "[cache][property][kvquant]",
                   quant::KVQuant<2>, quant::KVQuant<3>, quant::KVQuant<4>) {
  const ModelShape shape{3, 4, 2, 32};
  quant::KVQuantCalibrator calibrator(shape, {TestType::key_codec::kBits, 0.01, true, 50, 1});
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    calibrator.add(layer, test::random_rows(200 * 2, 32, 700 + layer, 2), test::random_rows(200 * 2, 32, 800 + layer));
  }
  const TestType quantizer(calibrator.finish(), 0.01);
  SECTION("as published: pre-RoPE keys, the first token exact") {
    run_random_operations<TestType>(0, 9, 16, {1, RopeSpec{}}, quantizer);
  }
  SECTION("post-RoPE keys, a tail") { run_random_operations<TestType>(32, 10, 16, {}, quantizer); }
}

TEMPLATE_TEST_CASE("random operation sequences match the reference model with TurboQuant and QJL",
                   "[cache][property][turboquant]", quant::TurboQuant<6>,
                   (quant::TurboQuant<7, quant::TurboVariant::kProd, quant::TurboVariant::kMse>),
                   (quant::TurboQuant<5, quant::TurboVariant::kProd, quant::TurboVariant::kProd>), (quant::QJL<64, 8>)) {
  SECTION("no extra tail") { run_random_operations<TestType>(0, 6); }
  SECTION("a one-page full-precision tail") { run_random_operations<TestType>(16, 7); }
}
