// The README's "Bad input" table, one TEST_CASE per row. Each bad input must get its exact
// ErrorCode (and a message naming the bad value), and a call that throws must leave everything a
// caller can observe bit-for-bit as it was (the strong guarantee): every sequence's lengths and
// last positions, every stream's stored tokens (read_back) and page ids, attention outputs of
// every sequence and layer, codec parameters, every memory() field, and the pool's counters.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/alloc_failure.hpp"
#include "support/random_kv.hpp"


namespace {

using namespace kvpack;

// Three layers: 0 and 1 hold a page and a 4-token tail per stream, 2 holds a 5-token tail only
// (so a calibrating codec has not calibrated it yet). GQA groups of 2; head_dim 32 is q8_0's block.
const ModelShape kShape{3, 4, 2, 32};
constexpr index_t kPage = 16;
constexpr std::size_t kMaxPages = 25;  // odd: see the pool-exhaustion row
constexpr float kScale = 0.17677669f;  // 1/sqrt(32)

std::vector<float> rows(std::size_t n, std::uint32_t seed) { return test::random_rows(n, kShape.head_dim, seed); }
std::span<const float> view(const std::vector<float>& v) { return std::span<const float>(v); }

/// Bitwise equality of float vectors: NaN-safe, and -0 differs from +0.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// Everything a caller can observe about one sequence.
struct SequenceState {
  std::vector<index_t> lengths;              ///< [layers]
  std::vector<std::int64_t> last_positions;  ///< [layers]
  std::vector<std::vector<float>> outputs;   ///< [layers] attend output (empty for an empty layer)
  std::vector<StoredTokens> stored;          ///< [layers][streams] read_back
  std::vector<std::vector<PageId>> pages;    ///< [layers][streams]
};

struct Snapshot {
  std::vector<SequenceState> sequences;
  std::vector<bool> params_equal_to_first;  ///< filled by compare(), not captured
  MemoryUsage memory;
  std::size_t pool_in_use = 0;
  std::size_t pool_available = 0;
  std::size_t pool_reserved = 0;
  std::size_t sequence_count = 0;
};

/// A cache with four sequences: `target` (the one bad calls are made on), `other`, `child` (a
/// fork of `other` that diverged by one appended token per layer) and `empty` (no tokens).
template <class Quantizer>
struct Bench {
  using Cache = KVCache<layout::GQA, Quantizer>;
  using KeyParams = typename Quantizer::key_codec::params_type;
  using ValueParams = typename Quantizer::value_codec::params_type;

  static CacheConfig default_config() {
    CacheConfig c;
    c.page_size = kPage;
    c.max_pages = kMaxPages;
    return c;
  }

  Cache cache;
  SeqId target;
  SeqId other;
  SeqId child = 0;
  SeqId empty = 0;
  std::vector<float> query = test::random_rows(kShape.q_heads, kShape.head_dim, 5);

  explicit Bench(CacheConfig config = default_config())
      : cache(kShape, std::move(config)), target(cache.add_sequence()), other(cache.add_sequence()) {
    for (SeqId id : {target, other}) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        const std::size_t tokens = layer < 2 ? 20 : 5;
        const auto k = rows(tokens * kShape.kv_heads, static_cast<std::uint32_t>(100 + 10 * id + layer));
        const auto v = rows(tokens * kShape.kv_heads, static_cast<std::uint32_t>(200 + 10 * id + layer));
        cache.prefill(id, layer, view(k), view(v));
      }
    }
    child = cache.fork(other);
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const auto k = rows(kShape.kv_heads, 300 + layer);
      cache.append(child, layer, view(k), view(k), cache.last_position(child, layer) + 1);
    }
    empty = cache.add_sequence();
  }

  [[nodiscard]] std::vector<SeqId> ids() const { return {target, other, child, empty}; }

  [[nodiscard]] Snapshot snapshot() const {
    Snapshot s;
    for (SeqId id : ids()) {
      SequenceState state;
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        state.lengths.push_back(cache.length(id, layer));
        state.last_positions.push_back(cache.last_position(id, layer));
        std::vector<float> out;
        if (state.lengths.back() > 0) {
          out.resize(query.size());
          cache.attend(id, layer, view(query), std::span<float>(out), kScale);
        }
        state.outputs.push_back(std::move(out));
        for (index_t stream = 0; stream < cache.streams_per_layer(); ++stream) {
          state.stored.push_back(cache.read_back(id, layer, stream));
          const auto pages = cache.pages(id, layer, stream);
          state.pages.emplace_back(pages.begin(), pages.end());
        }
      }
      s.sequences.push_back(std::move(state));
    }
    s.memory = cache.memory();
    s.pool_in_use = cache.pool().pages_in_use();
    s.pool_available = cache.pool().pages_available();
    s.pool_reserved = cache.pool().bytes_reserved();
    s.sequence_count = cache.sequence_count();
    return s;
  }

  [[nodiscard]] std::vector<std::pair<KeyParams, ValueParams>> params() const {
    std::vector<std::pair<KeyParams, ValueParams>> all;
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      for (index_t stream = 0; stream < cache.streams_per_layer(); ++stream) all.push_back(cache.codec_params(layer, stream));
    }
    return all;
  }
};

/// What check_unchanged compares besides contents, lengths, memory() and the pool's page counts.
struct Strictness {
  bool page_ids = true;       ///< false against another cache, whose free list may be in another order
  bool pool_reserved = true;  ///< false where the pool may keep a slab it grew before a later throw
};

void check_unchanged(const Snapshot& before, const Snapshot& after, Strictness strict = {}) {
  REQUIRE(before.sequences.size() == after.sequences.size());
  for (std::size_t i = 0; i < before.sequences.size(); ++i) {
    INFO("sequence #" << i << " of {target, other, child, empty}");
    const SequenceState& b = before.sequences[i];
    const SequenceState& a = after.sequences[i];
    CHECK(b.lengths == a.lengths);
    CHECK(b.last_positions == a.last_positions);
    REQUIRE(b.outputs.size() == a.outputs.size());
    for (std::size_t layer = 0; layer < b.outputs.size(); ++layer) {
      INFO("layer " << layer);
      CHECK(same_bits(b.outputs[layer], a.outputs[layer]));
    }
    REQUIRE(b.stored.size() == a.stored.size());
    for (std::size_t j = 0; j < b.stored.size(); ++j) {
      INFO("(layer, stream) #" << j);
      CHECK(b.stored[j].positions == a.stored[j].positions);
      CHECK(same_bits(b.stored[j].keys, a.stored[j].keys));
      CHECK(same_bits(b.stored[j].values, a.stored[j].values));
    }
    if (strict.page_ids) CHECK(b.pages == a.pages);
  }
  CHECK(before.memory.page_payload == after.memory.page_payload);
  CHECK(before.memory.page_metadata == after.memory.page_metadata);
  CHECK(before.memory.tails == after.memory.tails);
  CHECK(before.memory.tables == after.memory.tables);
  CHECK(before.memory.codec_params == after.memory.codec_params);
  CHECK(before.memory.shared_tables == after.memory.shared_tables);
  CHECK(before.memory.pages_in_use == after.memory.pages_in_use);
  CHECK(before.memory.stored_elements == after.memory.stored_elements);
  CHECK(before.pool_in_use == after.pool_in_use);
  CHECK(before.pool_available == after.pool_available);
  if (strict.pool_reserved) CHECK(before.pool_reserved == after.pool_reserved);
  CHECK(before.sequence_count == after.sequence_count);
}

/// Runs `call`, which must throw kvpack::Error with exactly `code` and a message containing
/// `text`, and checks that nothing observable changed (codec parameters included).
template <class Quantizer, class Call>
void expect_rejected(const Bench<Quantizer>& bench, Call call, ErrorCode code, const std::string& text) {
  const Snapshot before = bench.snapshot();
  const auto params_before = bench.params();
  bool threw = false;
  try {
    call();
  } catch (const Error& e) {
    threw = true;
    INFO(e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(text) != std::string::npos);
    // OutOfPages is its own type (engines catch it to preempt); nothing else is.
    CHECK((dynamic_cast<const OutOfPages*>(&e) != nullptr) == (code == ErrorCode::kOutOfPages));
  }
  CHECK(threw);
  check_unchanged(before, bench.snapshot());
  CHECK(params_before == bench.params());
}

/// Builds a cache that must be refused with `code` and a message containing `text`.
template <class Quantizer = quant::Float<half>>
void expect_config_rejected(const ModelShape& shape, const CacheConfig& config, ErrorCode code,
                            const std::string& text, Quantizer quantizer = {}) {
  try {
    KVCache<layout::GQA, Quantizer> cache(shape, config, quantizer);
    FAIL("accepted: " << text);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(text) != std::string::npos);
  }
}

}  // namespace

// Float<half> checks magnitudes (fp16's range), Q8_0 checks its fp16 scales, FP8 calibrates a
// scale per layer on the layer's first page: three kinds of codec state a failed call must not touch.
#define KVPACK_BAD_INPUT_CODECS quant::Float<half>, quant::Q8_0, quant::FP8<quant::E4M3FN>

TEMPLATE_TEST_CASE("bad input: keys that are not whole [kv_heads][head_dim] rows", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const std::vector<float> ragged(kShape.kv_heads * kShape.head_dim + 1, 0.5f);
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(ragged), view(ragged)); }, ErrorCode::kInvalidArgument,
                  "prefill: keys must hold T > 0 rows of kv_heads * head_dim = 64 elements, got 65");
}

TEMPLATE_TEST_CASE("bad input: values whose token count differs from the keys'", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const auto k = rows(3 * kShape.kv_heads, 1);
  const auto v = rows(2 * kShape.kv_heads, 2);
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(k), view(v)); }, ErrorCode::kInvalidArgument,
                  "prefill: values must hold 192 elements (3 tokens), got 128");
}

TEMPLATE_TEST_CASE("bad input: observation queries that are not whole [q_heads][head_dim] rows",
                   "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const auto k = rows(3 * kShape.kv_heads, 1);
  const std::vector<float> queries(7, 0.0f);
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(k), view(k), view(queries)); },
                  ErrorCode::kInvalidArgument, "observation_queries must hold rows of q_heads * head_dim = 128");
}

TEMPLATE_TEST_CASE("bad input: mismatched head counts", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  // A token shaped [q_heads][head_dim] where [kv_heads][head_dim] is expected, and the reverse.
  const auto by_q_heads = rows(kShape.q_heads, 1);
  const auto by_kv_heads = rows(kShape.kv_heads, 2);
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(by_q_heads), view(by_q_heads), 20); },
                  ErrorCode::kInvalidArgument, "append: key and value must hold kv_heads * head_dim = 64 elements, got 128");
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(by_kv_heads), view(by_q_heads), 20); },
                  ErrorCode::kInvalidArgument, "got 64 and 128");
  std::vector<float> out(kShape.q_heads * kShape.head_dim);
  expect_rejected(b, [&] { b.cache.attend(b.target, 0, view(by_kv_heads), std::span<float>(out), kScale); },
                  ErrorCode::kInvalidArgument, "attend: query and out must hold q_heads * head_dim = 128 elements, got 64");
  std::vector<float> short_out(by_kv_heads.size());
  expect_rejected(b, [&] { b.cache.attend(b.target, 0, view(b.query), std::span<float>(short_out), kScale); },
                  ErrorCode::kInvalidArgument, "got 128 and 64");
  // Prefill keys by q_heads with values by kv_heads: the token counts disagree.
  const auto k = rows(3 * kShape.q_heads, 3);
  const auto v = rows(3 * kShape.kv_heads, 4);
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(k), view(v)); }, ErrorCode::kInvalidArgument,
                  "values must hold 384 elements (6 tokens), got 192");
}

TEST_CASE("bad input: head counts that are a multiple of kv_heads in both K and V cannot be told apart",
          "[cache][bad-input]") {
  // prefill takes flat spans: T tokens shaped [q_heads][head_dim] are exactly as long as
  // T * q_heads / kv_heads tokens shaped [kv_heads][head_dim]. The README says so; this pins it.
  Bench<quant::Float<half>> b;
  const auto k = rows(3 * kShape.q_heads, 1);
  b.cache.prefill(b.target, 0, view(k), view(k));
  CHECK(b.cache.length(b.target, 0) == 20 + 3 * kShape.q_heads / kShape.kv_heads);
}

TEMPLATE_TEST_CASE("bad input: layer out of range", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const auto k = rows(kShape.kv_heads, 1);
  std::vector<float> out(b.query.size());
  expect_rejected(b, [&] { b.cache.prefill(b.target, 3, view(k), view(k)); }, ErrorCode::kInvalidArgument,
                  "prefill: layer 3 out of range [0, 3)");
  expect_rejected(b, [&] { b.cache.append(b.target, -1, view(k), view(k), 100); }, ErrorCode::kInvalidArgument,
                  "append: layer -1 out of range");
  expect_rejected(b, [&] { b.cache.attend(b.target, 3, view(b.query), std::span<float>(out), kScale); },
                  ErrorCode::kInvalidArgument, "attend: layer 3 out of range");
  expect_rejected(b, [&] { (void)b.cache.length(b.target, 3); }, ErrorCode::kInvalidArgument, "length: layer 3");
  expect_rejected(b, [&] { (void)b.cache.read_back(b.target, 0, 2); }, ErrorCode::kInvalidArgument,
                  "read_back: stream 2 out of range [0, 2)");
  expect_rejected(b, [&] { (void)b.cache.pages(b.target, 0, -1); }, ErrorCode::kInvalidArgument, "pages: stream -1");
}

TEMPLATE_TEST_CASE("bad input: NaN or Inf in keys, values, observation queries or the query", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto k = rows(40 * kShape.kv_heads, 1);  // enough to fill pages: the check precedes allocation
  auto v = rows(40 * kShape.kv_heads, 2);
  k[37] = nan;
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(k), view(v)); }, ErrorCode::kNonFinite,
                  "prefill: keys[37] is NaN");
  k[37] = 0.0f;
  v[2559] = -inf;  // the very last element
  expect_rejected(b, [&] { b.cache.prefill(b.target, 2, view(k), view(v)); }, ErrorCode::kNonFinite,
                  "prefill: values[2559] is Inf");
  v[2559] = 0.0f;
  auto queries = rows(kShape.q_heads, 3);
  queries[5] = nan;
  expect_rejected(b, [&] { b.cache.prefill(b.target, 1, view(k), view(v), view(queries)); }, ErrorCode::kNonFinite,
                  "prefill: observation_queries[5] is NaN");
  auto one = rows(kShape.kv_heads, 4);
  one[0] = inf;
  expect_rejected(b, [&] { b.cache.append(b.target, 1, view(one), view(one), 20); }, ErrorCode::kNonFinite,
                  "append: keys[0] is Inf");
  auto q = b.query;
  q[127] = -inf;
  std::vector<float> out(q.size());
  expect_rejected(b, [&] { b.cache.attend(b.other, 0, view(q), std::span<float>(out), kScale); }, ErrorCode::kNonFinite,
                  "attend: query[127] is Inf");
  // Non-float inputs are checked after conversion: a half NaN is caught too.
  std::vector<half> kh(kShape.kv_heads * kShape.head_dim, half(0.25f));
  kh[9] = half::from_bits(0x7e00);
  expect_rejected(b, [&] { b.cache.append(b.target, 0, std::span<const half>(kh), std::span<const half>(kh), 20); },
                  ErrorCode::kNonFinite, "append: keys[9] is NaN");
}

// The check reads eight elements at a time and the rest one by one (cache.hpp, all_within):
// each lane of the block and of the remainder must catch, and name, its element.
TEST_CASE("bad input: a bad element is named in every lane of the check", "[cache][bad-input]") {
  const ModelShape shape{1, 1, 1, 12};  // one block of eight and a remainder of four
  KVCache<layout::GQA, quant::Float<half>> cache(shape, CacheConfig{});
  const SeqId seq = cache.add_sequence();
  const std::vector<float> good(12, 0.5f);
  const float bads[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity(), 70000.0f};
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (const float bad : bads) {
      for (const bool in_keys : {true, false}) {
        auto broken = good;
        broken[i] = bad;
        const std::string name = std::string(in_keys ? "keys" : "values") + "[" + std::to_string(i) + "]";
        const std::string text = std::isnan(bad) ? name + " is NaN" : std::isinf(bad) ? name + " is Inf" : name + " = 70000";
        INFO(text);
        bool threw = false;
        try {
          cache.append(seq, 0, view(in_keys ? broken : good), view(in_keys ? good : broken), 0);
        } catch (const Error& e) {
          threw = true;
          CHECK(e.code() == (std::isfinite(bad) ? ErrorCode::kOutOfRange : ErrorCode::kNonFinite));
          CHECK(std::string(e.what()).find("append: " + text) != std::string::npos);
        }
        CHECK(threw);
      }
    }
  }
  CHECK(cache.length(seq, 0) == 0);
  cache.append(seq, 0, view(good), view(good), 0);
  CHECK(cache.length(seq, 0) == 1);
}

TEMPLATE_TEST_CASE("bad input: a non-finite attention scale", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  std::vector<float> out(b.query.size());
  for (float scale : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    expect_rejected(b, [&] { b.cache.attend(b.target, 0, view(b.query), std::span<float>(out), scale); },
                    ErrorCode::kInvalidArgument, "is not finite");
  }
}

TEST_CASE("bad input: magnitudes the codec cannot store", "[cache][bad-input]") {
  {
    Bench<quant::Float<half>> b;  // fp16 tops out at 65504
    auto k = rows(kShape.kv_heads, 1);
    k[3] = 70000.0f;
    expect_rejected(b, [&] { b.cache.append(b.target, 0, view(k), view(k), 20); }, ErrorCode::kOutOfRange,
                    "append: keys[3] = 70000");
    expect_rejected(b, [&] { b.cache.append(b.target, 0, view(rows(kShape.kv_heads, 2)), view(k), 20); },
                    ErrorCode::kOutOfRange, "append: values[3] = 70000");
  }
  {
    Bench<quant::Q8_0> b;  // q8_0's block scale max|x|/127 is fp16
    auto k = rows(40 * kShape.kv_heads, 1);
    k[100] = 1e12f;
    expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(k), view(k)); }, ErrorCode::kOutOfRange,
                    "exceeds what this codec stores");
  }
  {
    // FP8 saturates, so a huge value is accepted; beyond half of fp32's max one could decode to
    // Inf (tests/unit/quant/test_fp8.cpp), so it is rejected.
    Bench<quant::FP8<quant::E4M3FN>> b;
    auto k = rows(kShape.kv_heads, 1);
    k[3] = 1e30f;
    CHECK_NOTHROW(b.cache.append(b.target, 0, view(k), view(k), 20));
    k[3] = std::numeric_limits<float>::max();
    expect_rejected(b, [&] { b.cache.append(b.target, 0, view(k), view(k), 21); }, ErrorCode::kOutOfRange,
                    "exceeds what this codec stores (|x| <= 170141173319264429905852091742258462720");
  }
}

TEMPLATE_TEST_CASE("bad input: zero length", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const std::vector<float> none;
  const auto k = rows(kShape.kv_heads, 1);
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(none), view(none)); }, ErrorCode::kInvalidArgument,
                  "keys must hold T > 0 rows");
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(none), view(k)); }, ErrorCode::kInvalidArgument,
                  "keys must hold T > 0 rows");
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(k), view(none)); }, ErrorCode::kInvalidArgument,
                  "values must hold 64 elements (1 tokens), got 0");
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(none), view(none), 20); }, ErrorCode::kInvalidArgument,
                  "got 0 and 0");
  std::vector<float> out(b.query.size());
  expect_rejected(b, [&] { b.cache.attend(b.empty, 0, view(b.query), std::span<float>(out), kScale); },
                  ErrorCode::kInvalidArgument, "layer 0 of sequence 4 holds no tokens");
  const std::vector<float> no_query;
  std::vector<float> no_out;
  expect_rejected(b, [&] { b.cache.attend(b.target, 0, view(no_query), std::span<float>(no_out), kScale); },
                  ErrorCode::kInvalidArgument, "got 0 and 0");
}

TEMPLATE_TEST_CASE("bad input: a position going backwards, repeated, or beyond int32", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;  // target's layer 0 holds positions 0..19
  const auto k = rows(kShape.kv_heads, 1);
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(k), view(k), 19); }, ErrorCode::kInvalidArgument,
                  "append: position 19 must be greater than the layer's last (19)");
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(k), view(k), 3); }, ErrorCode::kInvalidArgument,
                  "position 3 must be greater");
  expect_rejected(b, [&] { b.cache.append(b.empty, 0, view(k), view(k), -1); }, ErrorCode::kInvalidArgument,
                  "position -1 must be greater than the layer's last (-1)");
  const std::int64_t beyond = std::int64_t{std::numeric_limits<std::int32_t>::max()} + 1;
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(k), view(k), beyond); }, ErrorCode::kOutOfRange,
                  "append: position 2147483648 exceeds 2147483647");
  // prefill places tokens after the layer's last position, so it cannot go backwards; it can run
  // past int32 after a token appended at the last position.
  const SeqId edge = b.cache.add_sequence();
  b.cache.append(edge, 0, view(k), view(k), std::numeric_limits<std::int32_t>::max());
  expect_rejected(b, [&] { b.cache.prefill(edge, 0, view(k), view(k)); }, ErrorCode::kOutOfRange,
                  "prefill: positions would exceed 2147483647");
  CHECK(b.cache.length(edge, 0) == 1);
}

TEST_CASE("bad input: a position beyond the pre-RoPE tables", "[cache][bad-input]") {
  CacheConfig config = Bench<quant::Q8_0>::default_config();
  config.key_rope = RopeSpec{10000.0, RopePairing::kAdjacent, 64};
  Bench<quant::Q8_0> b(config);
  const auto k = rows(kShape.kv_heads, 1);
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(k), view(k), 65); }, ErrorCode::kOutOfRange,
                  "append: position 65 exceeds 64 (CacheConfig.key_rope.max_position");
  const auto many = rows(50 * kShape.kv_heads, 2);  // positions 20..69
  expect_rejected(b, [&] { b.cache.prefill(b.target, 0, view(many), view(many)); }, ErrorCode::kOutOfRange,
                  "prefill: positions would exceed 64");
}

TEMPLATE_TEST_CASE("bad input: an unknown sequence", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  const SeqId never = 12345;
  const auto k = rows(kShape.kv_heads, 1);
  std::vector<float> out(b.query.size());
  expect_rejected(b, [&] { b.cache.prefill(never, 0, view(k), view(k)); }, ErrorCode::kUnknownSequence,
                  "prefill: sequence 12345 is unknown or was released");
  expect_rejected(b, [&] { b.cache.append(never, 0, view(k), view(k), 0); }, ErrorCode::kUnknownSequence,
                  "append: sequence 12345");
  expect_rejected(b, [&] { b.cache.attend(never, 0, view(b.query), std::span<float>(out), kScale); },
                  ErrorCode::kUnknownSequence, "attend: sequence 12345");
  expect_rejected(b, [&] { (void)b.cache.fork(never); }, ErrorCode::kUnknownSequence, "fork: sequence 12345");
  expect_rejected(b, [&] { b.cache.release(never); }, ErrorCode::kUnknownSequence,
                  "release: sequence 12345 is unknown or already released");
  expect_rejected(b, [&] { (void)b.cache.length(never, 0); }, ErrorCode::kUnknownSequence, "length: sequence 12345");
  expect_rejected(b, [&] { (void)b.cache.last_position(never, 0); }, ErrorCode::kUnknownSequence, "last_position");
  expect_rejected(b, [&] { (void)b.cache.read_back(never, 0, 0); }, ErrorCode::kUnknownSequence, "read_back");
  expect_rejected(b, [&] { (void)b.cache.pages(never, 0, 0); }, ErrorCode::kUnknownSequence, "pages");
  expect_rejected(b, [&] { b.cache.pin(never, 0, 1); }, ErrorCode::kUnknownSequence, "pin: sequence 12345");
  expect_rejected(b, [&] { (void)b.cache.live_tokens(never, 0, 0); }, ErrorCode::kUnknownSequence, "live_tokens");
  // Ids are never reused: 0 was never issued, and the next id is not yet.
  expect_rejected(b, [&] { (void)b.cache.length(0, 0); }, ErrorCode::kUnknownSequence, "sequence 0 is unknown");
  expect_rejected(b, [&] { (void)b.cache.length(b.empty + 1, 0); }, ErrorCode::kUnknownSequence, "sequence 5 is unknown");
}

TEMPLATE_TEST_CASE("bad input: a released sequence", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  // A released fork of `target`: its pages are still target's, so using it must not touch them.
  const SeqId gone = b.cache.fork(b.target);
  b.cache.release(gone);
  const auto k = rows(kShape.kv_heads, 1);
  std::vector<float> out(b.query.size());
  expect_rejected(b, [&] { b.cache.append(gone, 0, view(k), view(k), 20); }, ErrorCode::kUnknownSequence,
                  "append: sequence 5 is unknown or was released");
  expect_rejected(b, [&] { b.cache.prefill(gone, 2, view(k), view(k)); }, ErrorCode::kUnknownSequence, "prefill");
  expect_rejected(b, [&] { b.cache.attend(gone, 0, view(b.query), std::span<float>(out), kScale); },
                  ErrorCode::kUnknownSequence, "attend: sequence 5");
  expect_rejected(b, [&] { (void)b.cache.read_back(gone, 0, 1); }, ErrorCode::kUnknownSequence, "read_back");
}

TEMPLATE_TEST_CASE("bad input: a double release", "[cache][bad-input]", KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  // Release `child` (which shares other's pages) for real, then again: the second release must
  // not drop the shared pages' reference counts a second time.
  const SeqId released = b.child;
  b.cache.release(released);
  CHECK(b.cache.pool().pages_in_use() == 8);  // target's and other's 3 layers x 2 streams x (1, 1, 0) pages
  b.child = b.target;  // keeps the snapshot's list of sequences to live ones
  expect_rejected(b, [&] { b.cache.release(released); }, ErrorCode::kUnknownSequence,
                  "release: sequence 3 is unknown or already released");
  for (index_t stream = 0; stream < kShape.kv_heads; ++stream) {
    for (PageId page : b.cache.pages(b.other, 0, stream)) CHECK(b.cache.pool().ref_count(page) == 1);
  }
}

TEMPLATE_TEST_CASE("bad input: fork of an unknown or released sequence", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  expect_rejected(b, [&] { (void)b.cache.fork(777); }, ErrorCode::kUnknownSequence, "fork: sequence 777 is unknown");
  const SeqId gone = b.cache.fork(b.other);
  b.cache.release(gone);
  expect_rejected(b, [&] { (void)b.cache.fork(gone); }, ErrorCode::kUnknownSequence, "fork: sequence 5 is unknown");
  // A failed fork issues no id: the next fork gets the next one.
  CHECK(b.cache.fork(b.other) == gone + 1);
}

TEMPLATE_TEST_CASE("bad input: the page pool exhausted mid-prefill or at a page boundary", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  // target and other: 2 layers x 2 streams x 1 page each; child shares other's.
  REQUIRE(b.cache.pool().pages_in_use() == 8);
  REQUIRE(b.cache.pool().pages_available() == kMaxPages - 8);
  // Layer 2 of target holds a 5-token tail; 5 + 300 tokens make 19 pages per stream, 38 > 17.
  const auto k = rows(300 * kShape.kv_heads, 1);
  const auto v = rows(300 * kShape.kv_heads, 2);
  expect_rejected(b, [&] { b.cache.prefill(b.target, 2, view(k), view(v)); }, ErrorCode::kOutOfPages,
                  "page pool exhausted: 38 pages requested, 17 available of 25");
  // Layer 2 was never calibrated: a calibrating codec (FP8) must still hold its initial scales.
  for (index_t stream = 0; stream < kShape.kv_heads; ++stream) {
    CHECK(b.cache.codec_params(2, stream) == Bench<TestType>().cache.codec_params(2, stream));
  }

  // Fill the pool but one page (pages come in pairs, one per stream; the capacity is odd), then
  // cross a page boundary on target's layer 0, which needs 2: all or none.
  const SeqId hog = b.cache.add_sequence();
  const auto hk = rows(8 * kPage * kShape.kv_heads, 3);  // 8 pages per stream
  b.cache.prefill(hog, 0, view(hk), view(hk));
  REQUIRE(b.cache.pool().pages_available() == 1);
  const auto one = rows(kShape.kv_heads, 6);
  for (std::int64_t position = 20; position < 31; ++position) b.cache.append(b.target, 0, view(one), view(one), position);
  REQUIRE(b.cache.pool().pages_available() == 1);  // target's layer-0 tail holds 15 of 16
  expect_rejected(b, [&] { b.cache.append(b.target, 0, view(one), view(one), 31); }, ErrorCode::kOutOfPages,
                  "page pool exhausted: 2 pages requested, 1 available of 25");
  // The pool is not left poisoned: once pages come back the same append succeeds.
  b.cache.release(hog);
  CHECK_NOTHROW(b.cache.append(b.target, 0, view(one), view(one), 31));
  CHECK(b.cache.length(b.target, 0) == 32);
}

TEST_CASE("bad input: invalid configuration values", "[cache][bad-input]") {
  const CacheConfig valid = Bench<quant::Float<half>>::default_config();
  auto with = [&](auto change) {
    CacheConfig c = valid;
    change(c);
    return c;
  };
  for (index_t page_size : {0, 8, 20, 272, -16}) {
    expect_config_rejected(kShape, with([&](CacheConfig& c) { c.page_size = page_size; }), ErrorCode::kInvalidConfig,
                           "CacheConfig.page_size must be a multiple of 16 in [16, 256], got " + std::to_string(page_size));
  }
  // 2^31 - 16 is a multiple of 16 whose window (tail + a page) overflowed int32 before the bound.
  for (index_t tail : {-16, 17, CacheConfig::kMaxTailTokens + 16, std::numeric_limits<index_t>::max() - 15}) {
    expect_config_rejected(kShape, with([&](CacheConfig& c) { c.tail_tokens = tail; }), ErrorCode::kInvalidConfig,
                           "CacheConfig.tail_tokens must be a non-negative multiple of page_size (16), at most "
                           "1048576, got " + std::to_string(tail));
  }
  expect_config_rejected(kShape, with([](CacheConfig& c) { c.max_pages = 0; }), ErrorCode::kInvalidConfig,
                         "CacheConfig.max_pages must be at least 1");
  for (index_t prefix : {-1, 4097}) {
    expect_config_rejected(kShape, with([&](CacheConfig& c) { c.exact_prefix_tokens = prefix; }),
                           ErrorCode::kInvalidConfig,
                           "CacheConfig.exact_prefix_tokens must be in [0, 4096], got " + std::to_string(prefix));
  }
  for (double theta : {std::numeric_limits<double>::quiet_NaN(), 1.0, -5.0}) {
    expect_config_rejected(kShape, with([&](CacheConfig& c) { c.key_rope = RopeSpec{theta}; }),
                           ErrorCode::kInvalidConfig, "RopeSpec.theta must be a finite base > 1");
  }
  expect_config_rejected(kShape, with([](CacheConfig& c) { c.key_rope = RopeSpec{10000.0, RopePairing::kAdjacent, -1}; }),
                         ErrorCode::kInvalidConfig, "RopeSpec.max_position must be in [0, 2^31 - 1], got -1");
  expect_config_rejected(ModelShape{3, 4, 2, 33}, with([](CacheConfig& c) { c.key_rope = RopeSpec{}; }),
                         ErrorCode::kInvalidConfig, "head_dim 33 must be even");
  quant::FP8Options fixed;
  fixed.calibrate = false;
  for (float scale : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    fixed.static_scale = scale;
    expect_config_rejected(kShape, valid, ErrorCode::kInvalidConfig, "FP8Options.static_scale must be finite and > 0",
                           quant::FP8<quant::E4M3FN>(fixed));
  }
}

TEMPLATE_TEST_CASE("bad input: a pinned span that is empty or starts before position 0", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  Bench<TestType> b;
  expect_rejected(b, [&] { b.cache.pin(b.target, 9, 8); }, ErrorCode::kInvalidArgument,
                  "pin: need 0 <= first <= last, got [9, 8]");
  expect_rejected(b, [&] { b.cache.pin(b.target, -1, 8); }, ErrorCode::kInvalidArgument,
                  "pin: need 0 <= first <= last, got [-1, 8]");
}

namespace {

template <class Evictor>
void expect_evictor_rejected(const Evictor& evictor, const std::string& text) {
  try {
    KVCache<layout::GQA, quant::Float<half>, Evictor> cache(kShape, {}, {}, {}, evictor);
    FAIL("accepted: " << text);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == ErrorCode::kInvalidConfig);
    CHECK(std::string(e.what()).find(text) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("bad input: evictor options that cannot work", "[cache][bad-input]") {
  expect_evictor_rejected(evict::StreamingLLM<>{-1, evict::Uniform{64}}, "evict::StreamingLLM.sinks must be >= 0, got -1");
  expect_evictor_rejected(evict::StreamingLLM<>{8, evict::Uniform{8}},
                          "evict::Uniform.tokens (8) must exceed the evictor's window (8)");
  evict::H2O<> h2o;
  h2o.recent_fraction = 1.5;
  expect_evictor_rejected(h2o, "evict::H2O.recent_fraction must be in [0, 1], got 1.5");
  evict::SnapKV<> snapkv;
  snapkv.kernel = 4;
  expect_evictor_rejected(snapkv, "evict::SnapKV needs window >= 0 and an odd kernel >= 1, got window 32 and kernel 4");
  evict::SnapKV<evict::Pyramid> pyramid;
  pyramid.budget.beta = 0;
  expect_evictor_rejected(pyramid, "evict::Pyramid needs tokens (1024) > the evictor's window (32) and beta >= 1 (0)");
}

TEST_CASE("bad input: an inconsistent model shape", "[cache][bad-input]") {
  const CacheConfig config;
  expect_config_rejected(ModelShape{0, 4, 2, 32}, config, ErrorCode::kInvalidConfig, "ModelShape.layers must be > 0, got 0");
  expect_config_rejected(ModelShape{3, 4, 0, 32}, config, ErrorCode::kInvalidConfig, "ModelShape.kv_heads must be > 0, got 0");
  expect_config_rejected(ModelShape{3, 4, -2, 32}, config, ErrorCode::kInvalidConfig, "kv_heads must be > 0, got -2");
  expect_config_rejected(ModelShape{3, 6, 4, 32}, config, ErrorCode::kInvalidConfig,
                         "ModelShape.q_heads (6) must be a positive multiple of kv_heads (4)");
  expect_config_rejected(ModelShape{3, 0, 2, 32}, config, ErrorCode::kInvalidConfig, "q_heads (0) must be a positive");
  expect_config_rejected(ModelShape{3, 2, 4, 32}, config, ErrorCode::kInvalidConfig, "q_heads (2) must be a positive");
  expect_config_rejected(ModelShape{3, 4, 2, 0}, config, ErrorCode::kInvalidConfig, "ModelShape.head_dim must be > 0, got 0");
}

TEST_CASE("bad input: a head_dim or page_size the codec does not support", "[cache][bad-input]") {
  const CacheConfig config;
  expect_config_rejected(ModelShape{3, 4, 2, 40}, config, ErrorCode::kUnsupported,
                         "q8_0 quantizes blocks of 32 channels: head_dim 40 is not a multiple of 32", quant::Q8_0{});
  expect_config_rejected(ModelShape{3, 4, 2, 4096}, config, ErrorCode::kUnsupported,
                         "q8_0 supports head_dim up to 2048, got 4096", quant::Q8_0{});
  expect_config_rejected(ModelShape{5, 8, 4, 8}, config, ErrorCode::kUnsupported,
                         "q4_0 quantizes blocks of 32 channels: head_dim 8 is not a multiple of 32", quant::Q4_0{});
  expect_config_rejected(ModelShape{3, 4, 2, 12}, config, ErrorCode::kUnsupported,
                         "int8 needs head_dim a multiple of 8 (got 12)", quant::Int8{});
  expect_config_rejected(ModelShape{3, 4, 2, 48}, config, ErrorCode::kUnsupported,
                         "KIVI values are quantized in groups of 32 channels: head_dim 48 must be a multiple of it",
                         quant::KIVI<2>{});
  CacheConfig small_pages;
  small_pages.page_size = 16;
  expect_config_rejected(ModelShape{3, 4, 2, 32}, small_pages, ErrorCode::kUnsupported,
                         "KIVI keys are quantized in groups of 32 tokens: page_size 16 must be a multiple of it",
                         quant::KIVI<4>{});
}

// With check_inputs off, any bit pattern is accepted and the results are unspecified, but the
// cache stays memory-safe and its accounting exact: under the ASan/UBSan build
// (cmake/run_sanitizers.sh) this also proves the codecs do no undefined arithmetic on NaN, Inf,
// subnormals or huge values (a float-to-integer conversion out of range would abort it).
TEMPLATE_TEST_CASE("bad input: any bit pattern with check_inputs off", "[cache][bad-input]", quant::Float<float>,
                   quant::Float<half>, quant::Float<bfloat16>, quant::FP8<quant::E4M3FN>, quant::FP8<quant::E5M2>,
                   quant::Int8, quant::Q8_0, quant::Q4_0, quant::KIVI<2>, quant::KIVI<4>) {
  CacheConfig config;
  config.page_size = 32;  // KIVI's key groups
  config.check_inputs = false;
  KVCache<layout::GQA, TestType> cache(kShape, config);
  std::mt19937 rng(7);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::infinity(),  std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),      std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::min(),      0.0f,
                            -0.0f,                                   1e30f};
  // Rows of arbitrary bits, special values, or ordinary values with one special among them.
  auto garbage = [&](std::size_t n, int kind) {
    std::vector<float> out = rows(n / kShape.head_dim, rng());
    for (float& x : out) {
      if (kind == 0) {
        const std::uint32_t bits = rng();
        std::memcpy(&x, &bits, sizeof(x));
      } else if (kind == 1) {
        x = specials[rng() % std::size(specials)];
      }
    }
    if (kind == 2) out[rng() % out.size()] = specials[rng() % std::size(specials)];
    return out;
  };
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  std::vector<SeqId> seqs;
  for (int kind = 0; kind < 3; ++kind) {
    const SeqId s = cache.add_sequence();
    seqs.push_back(s);
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const auto k = garbage(70 * row, kind);
      const auto v = garbage(70 * row, (kind + layer) % 3);
      cache.prefill(s, layer, view(k), view(v));
      for (int i = 0; i < 3; ++i) {
        cache.append(s, layer, view(garbage(row, kind)), view(garbage(row, 2)), cache.last_position(s, layer) + 1);
      }
      std::vector<float> out(kShape.q_heads * kShape.head_dim);
      for (int q = 0; q < 3; ++q) {
        const auto query = garbage(out.size(), q);
        cache.attend(s, layer, view(query), std::span<float>(out), kScale);
      }
      CHECK(cache.length(s, layer) == 73);
      for (index_t stream = 0; stream < kShape.kv_heads; ++stream) CHECK(cache.read_back(s, layer, stream).size() == 73);
    }
  }
  // 73 tokens per stream: 2 full pages each (the rest in the tail).
  CHECK(cache.pool().pages_in_use() == seqs.size() * kShape.layers * kShape.kv_heads * 2);
  for (SeqId s : seqs) cache.release(s);
  CHECK(cache.pool().pages_in_use() == 0);
  CHECK(cache.memory().stored_elements == 0);
}

// std::bad_alloc is not a kvpack::Error, but the strong guarantee covers it too: a write, fork or
// add_sequence that runs out of memory at any of its allocations leaves the cache as it was, and
// once memory is back the same call gives what it gives in a cache where nothing failed.
TEMPLATE_TEST_CASE("bad input: memory running out at any allocation of a call", "[cache][bad-input]",
                   KVPACK_BAD_INPUT_CODECS) {
  if (!test::kAllocationFailures) {
    WARN("operator new is not replaced in this build (ThreadSanitizer): allocation failures not injected");
    return;
  }
  Bench<TestType> b;
  Bench<TestType> twin;  // the same calls, no failures
  const auto one = rows(kShape.kv_heads, 6);
  for (std::int64_t position = 20; position < 31; ++position) {
    b.cache.append(b.target, 0, view(one), view(one), position);
    twin.cache.append(twin.target, 0, view(one), view(one), position);
  }
  const auto k = rows(40 * kShape.kv_heads, 1);
  const auto v = rows(40 * kShape.kv_heads, 2);
  // Runs call(bench) with the n-th allocation failing, n = 0, 1, ... until it succeeds.
  auto fail_each_allocation = [&](const char* what, auto call) {
    INFO(what);
    long failures = 0;
    for (;; ++failures) {
      REQUIRE(failures < 10000);
      const Snapshot before = b.snapshot();
      bool failed = false;
      test::allocations_until_failure = failures;
      try {
        call(b);
      } catch (const std::bad_alloc&) {
        failed = true;
      }
      test::allocations_until_failure = -1;
      if (!failed) break;
      INFO("allocation " << failures << " failed");
      check_unchanged(before, b.snapshot(), {true, false});
    }
    call(twin);
    check_unchanged(twin.snapshot(), b.snapshot(), {false, false});
    return failures;
  };
  // The first write of a layer (tails and tables created), with pages.
  CHECK(fail_each_allocation("first prefill of a layer", [&](auto& x) {
    x.cache.prefill(x.empty, 0, view(k), view(v));
  }) >= 5);
  // A prefill that grows tables that have no page yet (layer 2 holds a tail only).
  CHECK(fail_each_allocation("prefill growing the tables", [&](auto& x) {
    x.cache.prefill(x.target, 2, view(k), view(v));
  }) >= 2);
  // An append that completes a page and grows a one-page table.
  CHECK(fail_each_allocation("append completing a page", [&](auto& x) {
    x.cache.append(x.target, 0, view(one), view(one), 31);
  }) >= 2);
  SeqId forked = 0;
  CHECK(fail_each_allocation("fork", [&](auto& x) {
    const SeqId id = x.cache.fork(x.other);
    if (&x == &b) forked = id;
  }) >= 2);
  CHECK(forked == b.empty + 1);  // failed forks used up no id
  CHECK(b.cache.pool().ref_count(b.cache.pages(b.other, 0, 0)[0]) == 3);  // other, child, forked
  CHECK(fail_each_allocation("add_sequence", [&](auto& x) { (void)x.cache.add_sequence(); }) >= 1);
}
