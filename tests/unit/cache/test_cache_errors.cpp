// Bad input gets a kvpack::Error with a clear message, and the cache is exactly as it was:
// lengths, memory accounting, and another sequence's attention output.

#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;
using Cache = KVCache<layout::GQA, quant::Q8_0>;

const ModelShape kShape{2, 4, 2, 32};

struct Snapshot {
  std::vector<index_t> lengths;
  MemoryUsage memory;
  std::vector<float> other_output;
  std::size_t sequences;
  bool operator==(const Snapshot& o) const {
    return lengths == o.lengths && memory.total() == o.memory.total() &&
           memory.pages_in_use == o.memory.pages_in_use && memory.stored_elements == o.memory.stored_elements &&
           other_output == o.other_output && sequences == o.sequences;
  }
};

struct Fixture {
  CacheConfig config = [] {
    CacheConfig c;
    c.page_size = 16;
    c.max_pages = 20;
    return c;
  }();
  Cache cache{kShape, config};
  SeqId target = cache.add_sequence();
  SeqId other = cache.add_sequence();
  std::vector<float> query = test::random_rows(kShape.q_heads, kShape.head_dim, 5);

  Fixture() {
    for (SeqId id : {target, other}) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        const auto k = test::random_rows(20 * kShape.kv_heads, kShape.head_dim, 100 + id + layer);
        const auto v = test::random_rows(20 * kShape.kv_heads, kShape.head_dim, 200 + id + layer);
        cache.prefill(id, layer, std::span<const float>(k), std::span<const float>(v));
      }
    }
  }

  Snapshot snapshot() const {
    Snapshot s;
    for (SeqId id : {target, other}) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) s.lengths.push_back(cache.length(id, layer));
    }
    s.memory = cache.memory();
    s.other_output.resize(query.size());
    cache.attend(other, 0, std::span<const float>(query), std::span<float>(s.other_output), 0.2f);
    s.sequences = cache.sequence_count();
    return s;
  }
};

/// Runs `call`, which must throw kvpack::Error with `code` and a message containing `text`,
/// and checks the cache's observable state did not change.
template <class Call>
void expect_rejected(Fixture& f, Call call, ErrorCode code, const std::string& text) {
  const Snapshot before = f.snapshot();
  try {
    call();
    FAIL("no exception");
  } catch (const Error& e) {
    CHECK(e.code() == code);
    INFO(e.what());
    CHECK(std::string(e.what()).find(text) != std::string::npos);
  }
  CHECK(f.snapshot() == before);
}

std::vector<float> rows(std::size_t n, std::uint32_t seed) { return test::random_rows(n, kShape.head_dim, seed); }

}  // namespace

TEST_CASE("shape errors are rejected before any change", "[cache][errors]") {
  Fixture f;
  const auto k = rows(3 * kShape.kv_heads, 1);
  const auto v = rows(3 * kShape.kv_heads, 2);
  const auto short_v = rows(2 * kShape.kv_heads, 3);
  expect_rejected(f, [&] { f.cache.prefill(f.target, 0, std::span<const float>(k), std::span<const float>(short_v)); },
                  ErrorCode::kInvalidArgument, "values must hold");
  const std::vector<float> ragged(kShape.kv_heads * kShape.head_dim + 1, 0.5f);
  expect_rejected(f, [&] { f.cache.prefill(f.target, 0, std::span<const float>(ragged), std::span<const float>(ragged)); },
                  ErrorCode::kInvalidArgument, "keys must hold");
  const std::vector<float> empty;
  expect_rejected(f, [&] { f.cache.prefill(f.target, 0, std::span<const float>(empty), std::span<const float>(empty)); },
                  ErrorCode::kInvalidArgument, "T > 0");
  const std::vector<float> bad_queries(7, 0.0f);
  expect_rejected(f, [&] {
    f.cache.prefill(f.target, 0, std::span<const float>(k), std::span<const float>(v), std::span<const float>(bad_queries));
  }, ErrorCode::kInvalidArgument, "observation_queries");
  expect_rejected(f, [&] { f.cache.append(f.target, 0, std::span<const float>(k), std::span<const float>(v), 99); },
                  ErrorCode::kInvalidArgument, "append: key and value must hold");
  std::vector<float> out(f.query.size());
  std::vector<float> short_out(out.size() - 1);
  expect_rejected(f, [&] { f.cache.attend(f.target, 0, std::span<const float>(f.query), std::span<float>(short_out), 1.0f); },
                  ErrorCode::kInvalidArgument, "query and out must hold");
  expect_rejected(f, [&] { f.cache.prefill(f.target, 2, std::span<const float>(k), std::span<const float>(v)); },
                  ErrorCode::kInvalidArgument, "layer 2 out of range");
  expect_rejected(f, [&] { f.cache.attend(f.target, -1, std::span<const float>(f.query), std::span<float>(out), 1.0f); },
                  ErrorCode::kInvalidArgument, "layer -1 out of range");
}

TEST_CASE("non-finite and unrepresentable inputs are rejected", "[cache][errors]") {
  Fixture f;
  auto k = rows(3 * kShape.kv_heads, 1);
  const auto v = rows(3 * kShape.kv_heads, 2);
  k[37] = std::numeric_limits<float>::quiet_NaN();
  expect_rejected(f, [&] { f.cache.prefill(f.target, 0, std::span<const float>(k), std::span<const float>(v)); },
                  ErrorCode::kNonFinite, "keys[37] is NaN");
  k[37] = std::numeric_limits<float>::infinity();
  expect_rejected(f, [&] { f.cache.prefill(f.target, 1, std::span<const float>(k), std::span<const float>(v)); },
                  ErrorCode::kNonFinite, "keys[37] is Inf");
  k[37] = 1e12f;  // q8_0's fp16 scale (max|x|/127) would overflow
  expect_rejected(f, [&] { f.cache.prefill(f.target, 0, std::span<const float>(k), std::span<const float>(v)); },
                  ErrorCode::kOutOfRange, "exceeds what this codec stores");
  auto q = f.query;
  q[3] = -std::numeric_limits<float>::infinity();
  std::vector<float> out(q.size());
  expect_rejected(f, [&] { f.cache.attend(f.target, 0, std::span<const float>(q), std::span<float>(out), 1.0f); },
                  ErrorCode::kNonFinite, "query[3] is Inf");
  expect_rejected(f, [&] {
    f.cache.attend(f.target, 0, std::span<const float>(f.query), std::span<float>(out), std::numeric_limits<float>::quiet_NaN());
  }, ErrorCode::kInvalidArgument, "scale");
}

TEST_CASE("a cache in half precision rejects values beyond the fp16 range", "[cache][errors]") {
  KVCache<layout::GQA, quant::Float<half>> cache(kShape);
  const SeqId s = cache.add_sequence();
  auto k = rows(kShape.kv_heads, 1);
  const auto v = rows(kShape.kv_heads, 2);
  k[0] = 70000.0f;
  CHECK_THROWS_WITH(cache.append(s, 0, std::span<const float>(k), std::span<const float>(v), 0),
                    Catch::Contains("exceeds what this codec stores"));
  CHECK(cache.length(s, 0) == 0);
}

TEST_CASE("checks can be switched off for engines that validate upstream", "[cache][errors]") {
  CacheConfig config;
  config.check_inputs = false;
  KVCache<layout::GQA, quant::Float<float>> cache(kShape, config);
  const SeqId s = cache.add_sequence();
  auto k = rows(kShape.kv_heads, 1);
  const auto v = rows(kShape.kv_heads, 2);
  k[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_NOTHROW(cache.append(s, 0, std::span<const float>(k), std::span<const float>(v), 0));
  CHECK(cache.length(s, 0) == 1);
}

TEST_CASE("unknown, released and double-released sequences", "[cache][errors]") {
  Fixture f;
  const auto k = rows(kShape.kv_heads, 1);
  const auto v = rows(kShape.kv_heads, 2);
  std::vector<float> out(f.query.size());
  expect_rejected(f, [&] { f.cache.append(12345, 0, std::span<const float>(k), std::span<const float>(v), 100); },
                  ErrorCode::kUnknownSequence, "sequence 12345 is unknown");
  const SeqId gone = f.cache.add_sequence();
  f.cache.release(gone);
  expect_rejected(f, [&] { f.cache.attend(gone, 0, std::span<const float>(f.query), std::span<float>(out), 1.0f); },
                  ErrorCode::kUnknownSequence, "unknown or was released");
  expect_rejected(f, [&] { f.cache.release(gone); }, ErrorCode::kUnknownSequence, "already released");
  expect_rejected(f, [&] { (void)f.cache.fork(gone); }, ErrorCode::kUnknownSequence, "fork");
}

TEST_CASE("positions must grow and attention needs tokens", "[cache][errors]") {
  Fixture f;
  const auto k = rows(kShape.kv_heads, 1);
  const auto v = rows(kShape.kv_heads, 2);
  expect_rejected(f, [&] { f.cache.append(f.target, 0, std::span<const float>(k), std::span<const float>(v), 19); },
                  ErrorCode::kInvalidArgument, "position 19 must be greater");
  expect_rejected(f, [&] { f.cache.append(f.target, 0, std::span<const float>(k), std::span<const float>(v), 3); },
                  ErrorCode::kInvalidArgument, "position 3");
  const SeqId fresh = f.cache.add_sequence();
  std::vector<float> out(f.query.size());
  CHECK_THROWS_WITH(f.cache.attend(fresh, 0, std::span<const float>(f.query), std::span<float>(out), 1.0f),
                    Catch::Contains("holds no tokens"));
}

TEST_CASE("pool exhaustion mid-prefill throws OutOfPages and changes nothing", "[cache][errors]") {
  Fixture f;  // 2 sequences x 2 layers x 2 streams x 1 page = 8 of 20 pages used
  REQUIRE(f.cache.memory().pages_in_use == 8);
  const auto k = rows(120 * kShape.kv_heads, 1);  // 8 pages per stream: 16 more than the 12 left
  const auto v = rows(120 * kShape.kv_heads, 2);
  expect_rejected(f, [&] { f.cache.prefill(f.target, 1, std::span<const float>(k), std::span<const float>(v)); },
                  ErrorCode::kOutOfPages, "page pool exhausted");
  CHECK_THROWS_AS(f.cache.prefill(f.target, 1, std::span<const float>(k), std::span<const float>(v)), OutOfPages);
  // What fits still works afterwards.
  const auto k2 = rows(40 * kShape.kv_heads, 3);
  const auto v2 = rows(40 * kShape.kv_heads, 4);
  CHECK_NOTHROW(f.cache.prefill(f.target, 1, std::span<const float>(k2), std::span<const float>(v2)));
  CHECK(f.cache.length(f.target, 1) == 60);
}

TEST_CASE("invalid configurations name the bad value", "[cache][errors]") {
  CacheConfig config;
  config.page_size = 20;
  CHECK_THROWS_WITH((KVCache<layout::GQA, quant::Float<half>>(kShape, config)), Catch::Contains("page_size must be"));
  config.page_size = 16;
  config.tail_tokens = 17;
  CHECK_THROWS_WITH((KVCache<layout::GQA, quant::Float<half>>(kShape, config)), Catch::Contains("tail_tokens"));
  CHECK_THROWS_WITH((KVCache<layout::GQA, quant::Float<half>>(ModelShape{2, 6, 4, 32})), Catch::Contains("multiple of kv_heads"));
  CHECK_THROWS_WITH((KVCache<layout::GQA, quant::Float<half>>(ModelShape{0, 4, 2, 32})), Catch::Contains("layers"));
  try {
    KVCache<layout::GQA, quant::Q4_0> cache(ModelShape{5, 8, 4, 8});  // stories260K's head_dim 8
    FAIL("q4_0 accepted head_dim 8");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK(std::string(e.what()).find("head_dim 8 is not a multiple of 32") != std::string::npos);
  }
}
