// StreamingLLM's re-rotation (ALGORITHMS.md §8.2): with keys stored before RoPE and
// `in_cache_positions`, every kept key is rotated by its index among the stream's live tokens and
// the query by the newest one's. Checked against a double-precision reference built here from the
// pre-RoPE keys the test wrote, over pages, the full-precision tail, the exact prefix, a pinned
// span (a gap in the kept positions) and both pair conventions.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

const ModelShape kShape{1, 8, 2, 64};
constexpr double kScale = 0.125;

/// Everything written to one sequence, before RoPE: [tokens][kv_heads][head_dim].
struct Written {
  std::vector<float> keys, values;
  [[nodiscard]] const float* key(std::int64_t position, index_t head) const {
    return keys.data() + (static_cast<std::size_t>(position) * kShape.kv_heads + head) * kShape.head_dim;
  }
  [[nodiscard]] const float* value(std::int64_t position, index_t head) const {
    return values.data() + (static_cast<std::size_t>(position) * kShape.kv_heads + head) * kShape.head_dim;
  }
};

/// softmax(scale q·k) v for one query head over the kept tokens (original positions `kept`),
/// each key rotated to `rotate_to(i)` and the query rotated to `query_at`, in double.
std::vector<double> reference_head(const Written& written, const std::vector<std::int32_t>& kept, index_t kv_head,
                                   const float* query, std::int64_t query_at, const RopeSpec& rope,
                                   auto rotate_to) {
  const std::size_t d = static_cast<std::size_t>(kShape.head_dim);
  std::vector<float> q(query, query + d);
  apply_rope_reference(rope, kShape.head_dim, query_at, q.data());
  std::vector<double> scores(kept.size());
  double top = -INFINITY;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    std::vector<float> k(written.key(kept[i], kv_head), written.key(kept[i], kv_head) + d);
    apply_rope_reference(rope, kShape.head_dim, rotate_to(i), k.data());
    double dot = 0.0;
    for (std::size_t c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
    scores[i] = kScale * dot;
    top = std::max(top, scores[i]);
  }
  std::vector<double> out(d, 0.0);
  double sum = 0.0;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const double p = std::exp(scores[i] - top);
    sum += p;
    const float* v = written.value(kept[i], kv_head);
    for (std::size_t c = 0; c < d; ++c) out[c] += p * v[c];
  }
  for (double& x : out) x /= sum;
  return out;
}

}  // namespace

TEST_CASE("StreamingLLM with in-cache positions rotates each kept key by its index in the cache",
          "[evict][cache][rope]") {
  const auto pairing = GENERATE(RopePairing::kAdjacent, RopePairing::kHalfSplit);
  const index_t tail_tokens = GENERATE(0, 32);
  const index_t exact_prefix = GENERATE(0, 4);
  RopeSpec rope;
  rope.theta = 10000.0;
  rope.pairing = pairing;
  CacheConfig config;
  config.page_size = 16;
  config.tail_tokens = tail_tokens;
  config.exact_prefix_tokens = exact_prefix;
  config.key_rope = rope;
  const index_t budget = 4 + 40;  // not a whole number of pages
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::StreamingLLM<>>;
  Cache cache(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{budget}, true});
  const SeqId seq = cache.add_sequence();
  cache.pin(seq, 30, 35);  // kept although outside the window: indices jump across it

  const index_t prompt = 75;
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  Written written;
  written.keys = test::random_rows(static_cast<std::size_t>(prompt) * kShape.kv_heads, kShape.head_dim, 1, 4, 6.0f);
  written.values = test::random_rows(static_cast<std::size_t>(prompt) * kShape.kv_heads, kShape.head_dim, 2);
  cache.prefill(seq, 0, std::span<const float>(written.keys), std::span<const float>(written.values));

  for (int step = 0; step < 60; ++step) {
    if (step > 0) {
      const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 100 + step, 4, 6.0f);
      const auto v = test::random_rows(kShape.kv_heads, kShape.head_dim, 300 + step);
      const std::int64_t position = static_cast<std::int64_t>(written.keys.size() / row);
      cache.append(seq, 0, std::span<const float>(k), std::span<const float>(v), position);
      written.keys.insert(written.keys.end(), k.begin(), k.end());
      written.values.insert(written.values.end(), v.begin(), v.end());
    }
    if (step % 7 != 0) continue;
    INFO("step " << step);
    const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 500 + step, 4, 2.0f);
    // The engine's part: it rotates its query to query_position, the newest token's index.
    const std::int64_t query_at = cache.query_position(seq, 0);
    REQUIRE(query_at == budget - 1);
    std::vector<float> rotated_q = q;
    for (index_t h = 0; h < kShape.q_heads; ++h) {
      apply_rope_reference(rope, kShape.head_dim, query_at, rotated_q.data() + static_cast<std::size_t>(h) * kShape.head_dim);
    }
    std::vector<float> out(q.size());
    cache.attend(seq, 0, std::span<const float>(rotated_q), std::span<float>(out), static_cast<float>(kScale));
    const std::int64_t written_tokens = static_cast<std::int64_t>(written.keys.size() / row);
    for (index_t kv_head = 0; kv_head < kShape.kv_heads; ++kv_head) {
      const std::vector<std::int32_t> kept = cache.read_back(seq, 0, kv_head).positions;
      // The pin (6 tokens) is outside the 4 sinks and the window: the window shrinks by it.
      REQUIRE(static_cast<index_t>(kept.size()) == budget);
      REQUIRE(kept.front() == 0);
      REQUIRE(kept.back() == written_tokens - 1);
      for (index_t h = kv_head * kShape.group_size(); h < (kv_head + 1) * kShape.group_size(); ++h) {
        const float* query = q.data() + static_cast<std::size_t>(h) * kShape.head_dim;
        const auto want = reference_head(written, kept, kv_head, query, query_at, rope,
                                         [](std::size_t i) { return static_cast<std::int64_t>(i); });
        // Had the cache rotated keys by their original positions (and the query by its own),
        // the output would differ by far more than the tolerance: the test sees the mode.
        const auto original = reference_head(written, kept, kv_head, query, written_tokens - 1, rope,
                                             [&](std::size_t i) { return static_cast<std::int64_t>(kept[i]); });
        double apart = 0.0;
        for (std::size_t c = 0; c < want.size(); ++c) {
          const double got = out[static_cast<std::size_t>(h) * kShape.head_dim + c];
          // Values are O(1); the rotation tables and float dot products move scores by ~1e-5.
          REQUIRE(std::fabs(got - want[c]) <= 5e-5);
          apart = std::max(apart, std::fabs(want[c] - original[c]));
        }
        CHECK(apart > 1e-3);
      }
    }
  }
}

TEST_CASE("in_cache_positions needs pre-RoPE keys and no page summaries", "[evict][cache][rope]") {
  const evict::StreamingLLM<> policy{4, evict::Uniform{64}, true};
  auto rejected = [](auto make, ErrorCode code, const std::string& text) {
    try {
      make();
      FAIL("accepted");
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find(text) != std::string::npos);
    }
  };
  rejected([&] { KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>> cache(kShape, {}, {}, {}, policy); },
           ErrorCode::kInvalidConfig, "needs keys stored before RoPE (CacheConfig.key_rope)");
  CacheConfig pre_rope;
  pre_rope.key_rope = RopeSpec{};
  rejected(
      [&] {
        KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>, select::Quest> cache(kShape, pre_rope, {}, {},
                                                                                             policy);
      },
      ErrorCode::kUnsupported, "select::Quest's page summaries stale");
  // Without the flag, the same configurations are accepted.
  KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>, select::Quest> keeps_positions(kShape, pre_rope);
  CHECK(keeps_positions.sequence_count() == 0);
}
