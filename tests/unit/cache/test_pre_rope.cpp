// Keys stored before RoPE (CacheConfig::key_rope) and rotated at read time must attend exactly
// like keys rotated by the caller and stored after RoPE, up to float rounding of the rotation.

#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <span>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

const ModelShape kShape{1, 8, 2, 64};

std::vector<float> attend(const auto& cache, SeqId s, const std::vector<float>& q) {
  std::vector<float> out(q.size());
  cache.attend(s, 0, std::span<const float>(q), std::span<float>(out), 0.125f);
  return out;
}

/// `rows` tokens of [kv_heads][head_dim] keys rotated to `positions` (double-precision reference).
std::vector<float> rotated(std::vector<float> keys, const std::vector<std::int64_t>& positions, const RopeSpec& rope) {
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  for (std::size_t t = 0; t < positions.size(); ++t) {
    for (index_t h = 0; h < kShape.kv_heads; ++h) {
      apply_rope_reference(rope, kShape.head_dim, positions[t], keys.data() + t * row + h * kShape.head_dim);
    }
  }
  return keys;
}

}  // namespace

TEST_CASE("pre-RoPE keys rotated at read attend like post-RoPE keys", "[cache][rope]") {
  const auto pairing = GENERATE(RopePairing::kAdjacent, RopePairing::kHalfSplit);
  const index_t tail_tokens = GENERATE(0, 32);
  RopeSpec rope;
  rope.theta = 500000.0;
  rope.pairing = pairing;
  CacheConfig pre_config;
  pre_config.page_size = 16;
  pre_config.tail_tokens = tail_tokens;
  pre_config.key_rope = rope;
  CacheConfig post_config = pre_config;
  post_config.key_rope.reset();
  KVCache<layout::GQA, quant::Float<float>> pre(kShape, pre_config), post(kShape, post_config);
  const SeqId a = pre.add_sequence(), b = post.add_sequence();

  // A prompt of 150 tokens (not a whole number of pages), then appends whose positions jump
  // past 2^18, so both parts of the RoPE tables are exercised.
  const index_t prompt = 150;
  auto keys = test::random_rows(static_cast<std::size_t>(prompt) * kShape.kv_heads, kShape.head_dim, 1, 4, 8.0f);
  const auto values = test::random_rows(static_cast<std::size_t>(prompt) * kShape.kv_heads, kShape.head_dim, 2);
  std::vector<std::int64_t> positions;
  for (index_t t = 0; t < prompt; ++t) positions.push_back(t);
  const auto post_keys = rotated(keys, positions, rope);
  pre.prefill(a, 0, std::span<const float>(keys), std::span<const float>(values));
  post.prefill(b, 0, std::span<const float>(post_keys), std::span<const float>(values));

  const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 3, 4, 2.0f);
  auto compare = [&] {
    const auto got = attend(pre, a, q);
    const auto want = attend(post, b, q);
    // Values are O(1) and scores move by far less than 1e-4: outputs agree to ~1e-5.
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(std::fabs(got[i] - want[i]) <= 2e-5f);
  };
  compare();
  std::int64_t position = prompt;
  for (int step = 0; step < 70; ++step) {
    position += step % 10 == 9 ? 40000 : 1;
    const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 100 + step, 4, 8.0f);
    const auto v = test::random_rows(kShape.kv_heads, kShape.head_dim, 200 + step);
    pre.append(a, 0, std::span<const float>(k), std::span<const float>(v), position);
    const auto k_post = rotated(k, {position}, rope);
    post.append(b, 0, std::span<const float>(k_post), std::span<const float>(v), position);
    if (step % 7 == 0) compare();
  }
  compare();
  CHECK(position > (std::int64_t{1} << 18));

  // read_back hands out keys as the kernels see them: rotated.
  const StoredTokens stored_pre = pre.read_back(a, 0, 1);
  const StoredTokens stored_post = post.read_back(b, 0, 1);
  REQUIRE(stored_pre.positions == stored_post.positions);
  for (std::size_t i = 0; i < stored_pre.keys.size(); ++i) {
    REQUIRE(std::fabs(stored_pre.keys[i] - stored_post.keys[i]) <= 1e-6f * (1.0f + std::fabs(stored_post.keys[i])));
  }
}

TEST_CASE("pre-RoPE storage rejects what its tables cannot rotate", "[cache][rope][errors]") {
  RopeSpec rope;
  rope.max_position = 1000;
  CacheConfig config;
  config.key_rope = rope;
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, config);
  const SeqId s = cache.add_sequence();
  const std::vector<float> k(static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim, 0.5f);
  cache.append(s, 0, std::span<const float>(k), std::span<const float>(k), 1000);
  CHECK_THROWS_MATCHES(cache.append(s, 0, std::span<const float>(k), std::span<const float>(k), 1001), Error,
                       Catch::Matchers::Predicate<Error>([](const Error& e) {
                         return e.code() == ErrorCode::kOutOfRange &&
                                std::string(e.what()).find("key_rope.max_position") != std::string::npos;
                       }));
  CHECK(cache.length(s, 0) == 1);

  CacheConfig odd = config;
  const ModelShape odd_shape{1, 2, 1, 7};
  CHECK_THROWS_MATCHES((KVCache<layout::GQA, quant::Float<float>>(odd_shape, odd)), Error,
                       Catch::Matchers::Predicate<Error>(
                           [](const Error& e) { return e.code() == ErrorCode::kInvalidConfig; }));
  rope.theta = 0.5;
  config.key_rope = rope;
  CHECK_THROWS_AS((KVCache<layout::GQA, quant::Float<float>>(kShape, config)), Error);
}

TEST_CASE("pre-RoPE tables are shared between caches and reported apart from total()", "[cache][rope]") {
  CacheConfig config;
  config.key_rope = RopeSpec{};
  KVCache<layout::GQA, quant::Float<half>> with(kShape, config), again(kShape, config), without(kShape);
  CHECK(without.memory().shared_tables == 0);
  // cos and sin rows of head_dim floats: 2^10 fine rows, max_position / 2^10 + 1 coarse ones and
  // the 256 in-page offsets of the slot tables; and the sign row.
  const std::size_t rows = 1024 + (std::size_t{1} << 20) / 1024 + 1 + 256;
  CHECK(with.memory().shared_tables == 2 * rows * kShape.head_dim * sizeof(float) + kShape.head_dim * sizeof(float));
  CHECK(with.memory().total() == without.memory().total());
  CHECK(RopeTables::shared(RopeSpec{}, kShape.head_dim) == RopeTables::shared(RopeSpec{}, kShape.head_dim));
}

TEST_CASE("an exact prefix keeps the first tokens exact and read_back in token order", "[cache][sinks]") {
  CacheConfig config;
  config.page_size = 16;
  config.exact_prefix_tokens = 3;
  KVCache<layout::GQA, quant::Q4_0> cache(ModelShape{1, 4, 2, 32}, config);
  const SeqId s = cache.add_sequence();
  const auto keys = test::random_rows(50 * 2, 32, 11);
  const auto values = test::random_rows(50 * 2, 32, 12);
  // Two chunks: the prefix fills from the first, the second starts after it.
  cache.prefill(s, 0, std::span<const float>(keys).first(2 * 2 * 32), std::span<const float>(values).first(2 * 2 * 32));
  cache.prefill(s, 0, std::span<const float>(keys).subspan(2 * 2 * 32), std::span<const float>(values).subspan(2 * 2 * 32));
  CHECK(cache.length(s, 0) == 50);
  CHECK(cache.pages(s, 0, 1).size() == 2);  // 47 tokens after the prefix: two pages and a tail of 15
  const StoredTokens stored = cache.read_back(s, 0, 1);
  REQUIRE(stored.size() == 50);
  for (index_t t = 0; t < 50; ++t) CHECK(stored.positions[t] == t);
  for (index_t t = 0; t < 3; ++t) {  // stream 1 of tokens 0..2, exact
    for (index_t c = 0; c < 32; ++c) CHECK(stored.keys[t * 32 + c] == keys[(t * 2 + 1) * 32 + c]);
  }
  double error = 0.0;  // the paged tokens are q4_0, not exact
  for (index_t c = 0; c < 32; ++c) error += std::fabs(stored.keys[3 * 32 + c] - keys[(3 * 2 + 1) * 32 + c]);
  CHECK(error > 0.0);
}
