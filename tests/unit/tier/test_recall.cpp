// Bound-driven recall: with every token written through to a tier, a question about a token the
// evictor dropped makes the certified bound fire, and attend_with_recall's output equals exact
// attention over every token written (an fp32 cache: to float rounding) up to what the bound
// left out; only the unread spans the bound implicates are fetched; the report's spans cover
// every dropped token; a cache that dropped nothing never recalls; a tier that lost an entry is
// reported, not papered over.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/kvpack.hpp"
#include "kvpack/tier.hpp"
#include "unit/io/thrown_error.hpp"

using namespace kvpack;

namespace {

constexpr ModelShape kShape{1, 4, 2, 32};
constexpr index_t kTokens = 500;  // not a multiple of the page size

struct Prompt {
  std::vector<float> keys, values;
  std::vector<std::int64_t> positions;
};

Prompt random_prompt(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Prompt p;
  p.keys.resize(static_cast<std::size_t>(kTokens) * kShape.kv_heads * kShape.head_dim);
  p.values.resize(p.keys.size());
  for (float& x : p.keys) x = normal(rng);
  for (float& x : p.values) x = normal(rng);
  for (index_t t = 0; t < kTokens; ++t) p.positions.push_back(t);
  return p;
}

/// A question every query head of which points at token `target`'s key, strongly.
std::vector<float> question_for(const Prompt& p, index_t target, float strength) {
  const index_t d = kShape.head_dim, group = kShape.q_heads / kShape.kv_heads;
  std::vector<float> q(static_cast<std::size_t>(kShape.q_heads) * d);
  for (index_t h = 0; h < kShape.q_heads; ++h) {
    const float* k = &p.keys[(static_cast<std::size_t>(target) * kShape.kv_heads + h / group) * d];
    for (index_t c = 0; c < d; ++c) q[static_cast<std::size_t>(h) * d + c] = strength * k[c] / std::sqrt(float(d));
  }
  return q;
}

double largest_error(std::span<const float> out, const std::vector<double>& reference) {
  double worst = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(out[i] - reference[i]));
  return worst;
}

/// Tokens of `p` not live in stream `s` of the cache, each inside one of the report's spans of
/// the stream, and the spans' counts adding up to them (every page read: nothing else is unread).
template <class Cache>
void check_spans_cover_dropped(const Cache& cache, SeqId seq, const AttendReport& report, index_t tokens) {
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    const StoredTokens live = cache.read_back(seq, 0, s);
    const std::vector<UnreadSpan>& spans = report.unread_spans[static_cast<std::size_t>(s)];
    index_t counted = 0;
    for (const UnreadSpan& span : spans) counted += span.tokens;
    CHECK(counted == tokens - live.size());
    CHECK(report.unread_score_bounds[static_cast<std::size_t>(s)].size() ==
          spans.size() * static_cast<std::size_t>(kShape.q_heads / kShape.kv_heads));
    for (std::int32_t t = 0; t < tokens; ++t) {
      if (std::binary_search(live.positions.begin(), live.positions.end(), t)) continue;
      INFO("stream " << s << " dropped position " << t);
      CHECK(std::any_of(spans.begin(), spans.end(),
                        [&](const UnreadSpan& span) { return span.first_position <= t && t <= span.last_position; }));
    }
  }
}

/// The largest value norm of `p`.
double largest_value_norm(const Prompt& p) {
  double top = 0.0;
  for (std::size_t row = 0; row < p.values.size() / kShape.head_dim; ++row) {
    double sum = 0.0;
    for (index_t c = 0; c < kShape.head_dim; ++c) sum += std::pow(p.values[row * kShape.head_dim + c], 2.0);
    top = std::max(top, std::sqrt(sum));
  }
  return top;
}

/// Appends `p` one token at a time, each followed by a question on an earlier token, so that
/// H2O's scores vary: it drops slots from pages and compacts them.
template <class Cache>
void decode_with_questions(Cache& cache, SeqId seq, const Prompt& p) {
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  std::vector<float> out(static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim);
  for (index_t t = 0; t < kTokens; ++t) {
    cache.append(seq, 0, std::span<const float>(p.keys.data() + t * row, row),
                 std::span<const float>(p.values.data() + t * row, row), t);
    cache.attend(seq, 0, std::span<const float>(question_for(p, t / 2, 1.0f)), std::span<float>(out), scale);
  }
}

select::Quest summaries_only() {
  select::Quest quest;
  quest.dense_layers = std::numeric_limits<index_t>::max();
  return quest;
}

}  // namespace

TEST_CASE("a dropped token the question needs is recalled from the tier, exactly", "[tier][recall]") {
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::StreamingLLM<>, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  Cache cache(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{64}}, summaries_only());
  const Prompt p = random_prompt(3);
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(p.keys), std::span<const float>(p.values));
  REQUIRE(cache.live_tokens(seq, 0, 0) == 64);

  tier::HostTier host(64 << 20);
  tier::RecallStore store(host, "test-recall", 100);
  store.write(seq, 0, kShape.kv_heads, kShape.head_dim, p.keys, p.values, p.positions);
  CHECK(store.stats().bytes_written == 2 * 5 * (8 + 100 * 4 + 2 * 100 * 32 * 4));  // 2 streams x 5 chunks

  const index_t dropped = 250;  // neither a sink nor recent: StreamingLLM dropped it
  const std::vector<float> question = question_for(p, dropped, 4.0f);
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  const std::vector<double> exact =
      eval::exact_attention(p.keys, p.values, kShape.kv_heads, kShape.head_dim, question, scale);

  std::vector<float> without(question.size()), with(question.size());
  cache.attend(seq, 0, std::span<const float>(question), std::span<float>(without), scale);
  REQUIRE(largest_error(without, exact) > 0.1);  // the failure recall is for

  AttendReport report;
  report.epsilon = 0.01;
  const index_t recalled = tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report);
  CHECK(report.fired);
  check_spans_cover_dropped(cache, seq, report, kTokens);
  CHECK(recalled == kShape.kv_heads);
  const tier::RecallStats& stats = store.stats();
  // Random keys give every span's box a bound near the needle's score: every span is fetched.
  CHECK(stats.spans_left == 0);
  CHECK(stats.max_mass_left == 0.0);
  CHECK(largest_error(with, exact) < 1e-5);
  CHECK(stats.attends == 1);
  CHECK(stats.recalls == 1);
  CHECK(stats.streams_recalled == 2);
  CHECK(stats.tokens_recalled == 2 * (kTokens - 64));
  CHECK(stats.bytes_fetched == stats.bytes_written);

  SECTION("a tier that lost an entry is reported") {
    (void)host.erase("test-recall-s" + std::to_string(seq) + "-l0-h1-c2");
    const auto error = test::thrown_error([&] { (void)tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnavailable);
    CHECK_THAT(error->what(), Catch::Contains("no longer holds 'test-recall-s"));
  }
  SECTION("forget removes the sequence's entries, and recall then reports what it cannot fetch") {
    store.forget(seq);
    CHECK(host.used_bytes() == 0);
    const auto error = test::thrown_error(
        [&] { (void)tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnavailable);
    CHECK_THAT(error->what(),
               Catch::Contains("holds no entry for") && Catch::Contains("which the cache dropped"));
  }
  SECTION("a store written through for part of the sequence only") {
    tier::RecallStore partial(host, "test-recall-partial", 100);
    const std::size_t tokens = static_cast<std::size_t>(kTokens / 2);
    const std::size_t floats = tokens * kShape.kv_heads * kShape.head_dim;
    partial.write(seq, 0, kShape.kv_heads, kShape.head_dim, std::span(p.keys).first(floats),
                  std::span(p.values).first(floats), std::span(p.positions).first(tokens));
    const auto error = test::thrown_error(
        [&] { (void)tier::attend_with_recall(cache, partial, seq, 0, question, with, scale, report); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnavailable);
    CHECK_THAT(error->what(), Catch::Contains("holds no entry for"));
  }
}

TEST_CASE("recall fetches only the spans the bound implicates", "[tier][recall]") {
  // Keys near one of 8 topic channels (64 tokens per topic) and a needle on channel 31 that no
  // topic uses: a question on channel 31 bounds every other span's score near 0, so once the
  // needle's span is back, the rest is certified below epsilon without being fetched.
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::StreamingLLM<>, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  Cache cache(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{64}}, summaries_only());
  Prompt p = random_prompt(5);
  const index_t d = kShape.head_dim, needle = 250;
  for (std::size_t row = 0; row < p.keys.size() / d; ++row) {
    const auto t = static_cast<index_t>(row / kShape.kv_heads);
    float* key = &p.keys[row * d];
    for (index_t c = 0; c < d; ++c) key[c] *= 0.05f;
    key[t == needle ? 31 : (t / 64) % 8] += 3.0f;
  }
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(p.keys), std::span<const float>(p.values));
  tier::HostTier host(64 << 20);
  tier::RecallStore store(host, "topics", 50);
  store.write(seq, 0, kShape.kv_heads, d, p.keys, p.values, p.positions);

  std::vector<float> question(static_cast<std::size_t>(kShape.q_heads) * d, 0.0f);
  for (index_t h = 0; h < kShape.q_heads; ++h) question[static_cast<std::size_t>(h) * d + 31] = 28.0f;  // score ~15
  const float scale = 1.0f / std::sqrt(float(d));
  const std::vector<double> exact = eval::exact_attention(p.keys, p.values, kShape.kv_heads, d, question, scale);
  std::vector<float> without(question.size()), with(question.size());
  cache.attend(seq, 0, std::span<const float>(question), std::span<float>(without), scale);
  REQUIRE(largest_error(without, exact) > 0.1);

  AttendReport report;
  report.epsilon = 0.01;
  CHECK(tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report) == kShape.kv_heads);
  check_spans_cover_dropped(cache, seq, report, kTokens);
  const tier::RecallStats& stats = store.stats();
  CHECK(stats.spans_left > 0);
  CHECK(stats.bytes_fetched <= stats.bytes_written / 4);
  CHECK(stats.max_mass_left <= report.epsilon);
  // What was left out moves each output by at most 2 · mass · max‖v‖ (unread_bound.hpp).
  CHECK(largest_error(with, exact) <= 2.0 * stats.max_mass_left * largest_value_norm(p) + 1e-5);
}

TEST_CASE("the report's unread spans cover what H2O dropped from pages and compacted away", "[tier][recall]") {
  using Cache = KVCache<layout::GQA, quant::Float<half>, evict::H2O<>, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  Cache cache(kShape, config, {}, {}, evict::H2O<>{evict::Uniform{96}}, summaries_only());
  const Prompt p = random_prompt(6);
  const SeqId seq = cache.add_sequence();
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  std::vector<float> out(static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim);
  decode_with_questions(cache, seq, p);
  AttendReport report;
  cache.attend(seq, 0, std::span<const float>(question_for(p, 7, 1.0f)), std::span<float>(out), scale, &report);
  check_spans_cover_dropped(cache, seq, report, kTokens);
}

TEST_CASE("recall fetches the fewest spans in order of share", "[tier][recall]") {
  // Random spans, bounds and attended sums: the k spans_needed returns leaves every head at most
  // epsilon and k - 1 would not.
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t count = 1 + rng() % 40, heads = 1 + rng() % 4;
    std::vector<UnreadSpan> spans(count);
    for (UnreadSpan& span : spans) span.tokens = 1 + static_cast<index_t>(rng() % 64);
    std::vector<float> bounds(count * heads);
    for (float& u : bounds) u = uniform(rng);
    std::vector<tier::recall_detail::Softmax> attended(heads);
    for (auto& a : attended) a = {uniform(rng), 1.0 + (rng() % 1000)};
    const double epsilon = std::pow(10.0, -1.0 - trial % 4);
    const std::vector<std::size_t> order = tier::recall_detail::spans_by_share(spans, bounds, attended);
    const std::size_t k = tier::recall_detail::spans_needed(spans, bounds, order, attended, epsilon);
    const auto worst = [&](std::size_t first) {
      double top = 0.0;
      for (std::size_t h = 0; h < heads; ++h) {
        top = std::max(top, tier::recall_detail::mass_left(spans, bounds, std::span<const std::size_t>(order).subspan(first),
                                                           static_cast<index_t>(h), attended[h]));
      }
      return top;
    };
    INFO("trial " << trial << ": " << count << " spans, k = " << k);
    CHECK(worst(k) <= epsilon);
    if (k > 0) CHECK(worst(k - 1) > epsilon);
  }
}

namespace {

/// A host tier that can be taken down: put and get then throw kUnavailable.
class SwitchableTier final : public tier::Tier {
 public:
  bool down = false;
  [[nodiscard]] std::string describe() const override { return "switchable"; }
  void put(std::string_view key, std::span<const std::byte> bytes) override {
    if (down) throw Error(ErrorCode::kUnavailable, "switchable: down");
    host_.put(key, bytes);
  }
  [[nodiscard]] std::optional<std::vector<std::byte>> get(std::string_view key) override {
    if (down) throw Error(ErrorCode::kUnavailable, "switchable: down");
    return host_.get(key);
  }
  bool erase(std::string_view key) override { return host_.erase(key); }
  [[nodiscard]] tier::TierStats stats() const override { return host_.stats(); }

 private:
  tier::HostTier host_{64 << 20};
};

/// What stream s of the cache holds plus what the store holds for it: every position of
/// [0, tokens) exactly once.
template <class Cache>
void check_live_and_demoted_partition(const Cache& cache, tier::RecallStore& store, SeqId seq, index_t tokens) {
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    std::vector<std::int32_t> all = cache.read_back(seq, 0, s).positions;
    const StoredTokens demoted = store.read(seq, 0, s);
    all.insert(all.end(), demoted.positions.begin(), demoted.positions.end());
    std::sort(all.begin(), all.end());
    std::vector<std::int32_t> expected(static_cast<std::size_t>(tokens));
    for (index_t t = 0; t < tokens; ++t) expected[static_cast<std::size_t>(t)] = t;
    INFO("stream " << s);
    CHECK(all == expected);
  }
}

}  // namespace

TEST_CASE("write-back: the cache demotes what it drops, and recall brings it back exactly", "[tier][recall]") {
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::StreamingLLM<>, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  Cache cache(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{64}}, summaries_only());
  SwitchableTier tier;
  tier::RecallStore store(tier, "demoted", 100);
  cache.set_demotion_sink([&store](const DroppedTokens& dropped) { store.demote(dropped); });
  const Prompt p = random_prompt(7);
  const SeqId seq = cache.add_sequence();
  const std::size_t prompt = static_cast<std::size_t>(kTokens - 20) * kShape.kv_heads * kShape.head_dim;

  SECTION("only the dropped tokens are written, as the cache held them") {
    cache.prefill(seq, 0, std::span<const float>(p.keys.data(), prompt), std::span<const float>(p.values.data(), prompt));
    REQUIRE(cache.live_tokens(seq, 0, 0) == 64);
    const std::uint64_t dropped = kTokens - 20 - 64;  // per stream: 416 = 4 entries of 100 and one of 16
    CHECK(store.stats().tokens_demoted == 2 * dropped);
    CHECK(store.stats().bytes_written == 2 * (5 * 8 + dropped * 4 + 2 * dropped * 32 * 4));
    check_live_and_demoted_partition(cache, store, seq, kTokens - 20);
    // An fp32 cache demotes the rows as they were written.
    const StoredTokens demoted = store.read(seq, 0, 1);
    for (index_t i = 0; i < demoted.size(); ++i) {
      const std::size_t at = (static_cast<std::size_t>(demoted.positions[i]) * kShape.kv_heads + 1) * kShape.head_dim;
      INFO("position " << demoted.positions[i]);
      CHECK(std::equal(p.keys.begin() + at, p.keys.begin() + at + kShape.head_dim,
                       demoted.keys.begin() + i * kShape.head_dim));
      CHECK(std::equal(p.values.begin() + at, p.values.begin() + at + kShape.head_dim,
                       demoted.values.begin() + i * kShape.head_dim));
    }
  }
  SECTION("a tier that refuses keeps the tokens in the cache until a write can demote them") {
    tier.down = true;
    cache.prefill(seq, 0, std::span<const float>(p.keys.data(), prompt), std::span<const float>(p.values.data(), prompt));
    CHECK(cache.live_tokens(seq, 0, 0) == kTokens - 20);  // over budget: nothing dropped
    CHECK(store.stats().demotions_failed == 2);
    CHECK(cache.demotions_refused() == 2);
    CHECK(store.stats().tokens_demoted == 0);
    CHECK(store.entries(seq, 0, 0).empty());
    tier.down = false;
  }
  // Decode steps: each drops a token from the recent window (demoted there and then).
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  if (cache.length(seq, 0) == 0) {
    cache.prefill(seq, 0, std::span<const float>(p.keys.data(), prompt), std::span<const float>(p.values.data(), prompt));
  }
  for (index_t t = kTokens - 20; t < kTokens; ++t) {
    cache.append(seq, 0, std::span<const float>(p.keys.data() + t * row, row),
                 std::span<const float>(p.values.data() + t * row, row), t);
  }
  REQUIRE(cache.live_tokens(seq, 0, 0) == 64);
  check_live_and_demoted_partition(cache, store, seq, kTokens);
  CHECK(store.stats().tokens_demoted == 2 * (kTokens - 64));

  const std::vector<float> question = question_for(p, 250, 4.0f);
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  const std::vector<double> exact =
      eval::exact_attention(p.keys, p.values, kShape.kv_heads, kShape.head_dim, question, scale);
  std::vector<float> without(question.size()), with(question.size());
  cache.attend(seq, 0, std::span<const float>(question), std::span<float>(without), scale);
  REQUIRE(largest_error(without, exact) > 0.1);
  AttendReport report;
  report.epsilon = 0.01;
  CHECK(tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report) == kShape.kv_heads);
  CHECK(store.stats().max_mass_left <= report.epsilon);
  CHECK(largest_error(with, exact) <= 2.0 * store.stats().max_mass_left * largest_value_norm(p) + 1e-5);
  CHECK(store.stats().tokens_recalled <= 2 * (kTokens - 64));

  const auto mixed = test::thrown_error([&] { store.write(seq, 0, kShape.kv_heads, kShape.head_dim, p.keys, p.values, p.positions); });
  REQUIRE(mixed);
  CHECK_THAT(mixed->what(), Catch::Contains("demoted"));
}

TEST_CASE("write-back from a compacting fp16 H2O cache: every token is live or demoted, once", "[tier][recall]") {
  using Cache = KVCache<layout::GQA, quant::Float<half>, evict::H2O<>, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  Cache cache(kShape, config, {}, {}, evict::H2O<>{evict::Uniform{96}}, summaries_only());
  tier::HostTier host(64 << 20);
  tier::RecallStore store(host, "h2o", 64);
  cache.set_demotion_sink([&store](const DroppedTokens& dropped) { store.demote(dropped); });
  const Prompt p = random_prompt(8);
  const SeqId seq = cache.add_sequence();
  decode_with_questions(cache, seq, p);
  REQUIRE(cache.live_tokens(seq, 0, 0) == 96);
  check_live_and_demoted_partition(cache, store, seq, kTokens);
  // fp16 pages demote their tokens as they decode: each within fp16's rounding of the input.
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    const StoredTokens demoted = store.read(seq, 0, s);
    for (index_t i = 0; i < demoted.size(); ++i) {
      const std::size_t at = (static_cast<std::size_t>(demoted.positions[i]) * kShape.kv_heads + s) * kShape.head_dim;
      for (index_t c = 0; c < kShape.head_dim; ++c) {
        const std::size_t j = static_cast<std::size_t>(i) * kShape.head_dim + c;
        REQUIRE(std::fabs(demoted.keys[j] - p.keys[at + c]) <= 0x1p-11f * std::fabs(p.keys[at + c]) + 0x1p-24f);
        REQUIRE(std::fabs(demoted.values[j] - p.values[at + c]) <= 0x1p-11f * std::fabs(p.values[at + c]) + 0x1p-24f);
      }
    }
  }
  // Recall over what the cache and the store hold equals exact attention over both, up to the
  // bound on what it left unread.
  const std::vector<float> question = question_for(p, 100, 4.0f);
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  std::vector<float> keys, values;
  StoredTokens whole[2];
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    StoredTokens live = cache.read_back(seq, 0, s);
    const StoredTokens demoted = store.read(seq, 0, s);
    live.positions.insert(live.positions.end(), demoted.positions.begin(), demoted.positions.end());
    live.keys.insert(live.keys.end(), demoted.keys.begin(), demoted.keys.end());
    live.values.insert(live.values.end(), demoted.values.begin(), demoted.values.end());
    whole[s] = std::move(live);
  }
  // Rows [T][streams][dim] in any token order (attention does not depend on it).
  for (std::size_t i = 0; i < whole[0].positions.size(); ++i) {
    for (const StoredTokens& stream : whole) {
      keys.insert(keys.end(), stream.keys.begin() + i * kShape.head_dim, stream.keys.begin() + (i + 1) * kShape.head_dim);
      values.insert(values.end(), stream.values.begin() + i * kShape.head_dim,
                    stream.values.begin() + (i + 1) * kShape.head_dim);
    }
  }
  const std::vector<double> exact = eval::exact_attention(keys, values, kShape.kv_heads, kShape.head_dim, question, scale);
  std::vector<float> with(question.size());
  AttendReport report;
  report.epsilon = 0.01;
  CHECK(tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report) > 0);
  CHECK(store.stats().max_mass_left <= report.epsilon);
  CHECK(largest_error(with, exact) <= 2.0 * store.stats().max_mass_left * 1.001 * largest_value_norm(p) + 1e-4);
}

TEST_CASE("a cache that stores keys before RoPE demotes them rotated to their positions", "[tier][recall]") {
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::H2O<>, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  config.key_rope = RopeSpec{};
  Cache cache(kShape, config, {}, {}, evict::H2O<>{evict::Uniform{64}}, summaries_only());
  tier::HostTier host(64 << 20);
  tier::RecallStore store(host, "rope");
  cache.set_demotion_sink([&store](const DroppedTokens& dropped) { store.demote(dropped); });
  const Prompt p = random_prompt(9);  // keys as the engine hands them: before RoPE
  const SeqId seq = cache.add_sequence();
  const std::size_t prompt = static_cast<std::size_t>(200) * kShape.kv_heads * kShape.head_dim;
  cache.prefill(seq, 0, std::span<const float>(p.keys.data(), prompt), std::span<const float>(p.values.data(), prompt));
  REQUIRE(cache.live_tokens(seq, 0, 1) == 64);
  CHECK(cache.demotions_refused() == 0);
  const StoredTokens demoted = store.read(seq, 0, 1);
  REQUIRE(demoted.size() == 200 - 64);
  std::vector<float> rotated(static_cast<std::size_t>(kShape.head_dim));
  for (index_t i = 0; i < demoted.size(); ++i) {
    const std::size_t at = (static_cast<std::size_t>(demoted.positions[i]) * kShape.kv_heads + 1) * kShape.head_dim;
    std::copy_n(p.keys.begin() + at, kShape.head_dim, rotated.begin());
    apply_rope_reference(*config.key_rope, kShape.head_dim, demoted.positions[i], rotated.data());
    INFO("position " << demoted.positions[i]);
    CHECK(std::equal(rotated.begin(), rotated.end(), demoted.keys.begin() + i * kShape.head_dim));
  }
}

TEST_CASE("fp16 entries: exact for an fp16 cache's demotions, rounded otherwise, fp32 where fp16 overflows",
          "[tier][recall]") {
  const index_t d = kShape.head_dim;
  SECTION("an fp16 cache demotes the same tokens into half the value bytes") {
    using Cache = KVCache<layout::GQA, quant::Float<half>, evict::H2O<>, select::Quest>;
    CacheConfig config;
    config.page_size = 16;
    Cache cache(kShape, config, {}, {}, evict::H2O<>{evict::Uniform{96}}, summaries_only());
    tier::HostTier host(64 << 20);
    tier::RecallStore wide(host, "wide", 64), narrow(host, "narrow", 64, tier::EntryPrecision::kF16);
    cache.set_demotion_sink([&](const DroppedTokens& dropped) {
      wide.demote(dropped);
      narrow.demote(dropped);
    });
    const Prompt p = random_prompt(10);
    const SeqId seq = cache.add_sequence();
    decode_with_questions(cache, seq, p);
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      const StoredTokens a = wide.read(seq, 0, s), b = narrow.read(seq, 0, s);
      CHECK(a.size() == kTokens - 96);
      CHECK(a.positions == b.positions);
      CHECK(a.keys == b.keys);
      CHECK(a.values == b.values);
    }
    // Each token's key and value rows take 2·d bytes fewer each.
    CHECK(wide.stats().bytes_written - narrow.stats().bytes_written == 4 * d * narrow.stats().tokens_demoted);
  }
  SECTION("fp32 rows are rounded to fp16, except an entry fp16 cannot hold") {
    Prompt p = random_prompt(11);
    const std::size_t huge = (150 * static_cast<std::size_t>(kShape.kv_heads) + 0) * d + 3;  // token 150, stream 0
    p.keys[huge] = 1e6f;
    tier::HostTier host(64 << 20);
    tier::RecallStore store(host, "rounded", 100, tier::EntryPrecision::kF16);
    store.write(1, 0, kShape.kv_heads, d, p.keys, p.values, p.positions);
    // Stream 0's second entry (tokens 100-199) stays fp32; the other nine are fp16.
    CHECK(store.stats().bytes_written == 10 * (8 + 100 * 4) + 9 * 2 * 100 * d * 2 + 2 * 100 * d * 4);
    bool rounded = false;
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      const StoredTokens back = store.read(1, 0, s);
      REQUIRE(back.size() == kTokens);
      for (index_t t = 0; t < kTokens; ++t) {
        const bool wide = s == 0 && t >= 100 && t < 200;
        for (index_t c = 0; c < d; ++c) {
          const std::size_t at = (static_cast<std::size_t>(t) * kShape.kv_heads + s) * d + c;
          const std::size_t j = static_cast<std::size_t>(t) * d + c;
          for (const auto& [given, stored] : {std::pair{p.keys[at], back.keys[j]}, std::pair{p.values[at], back.values[j]}}) {
            const float allowed = wide ? 0.0f : 0x1p-11f * std::fabs(given) + 0x1p-25f;
            if (std::fabs(stored - given) > allowed) FAIL("token " << t << " stream " << s << " channel " << c);
            rounded |= stored != given;
          }
        }
      }
    }
    CHECK(rounded);
  }
  SECTION("an entry whose element size is neither 2 nor 4 is refused") {
    tier::HostTier host(1 << 20);
    tier::RecallStore store(host, "damaged", 16, tier::EntryPrecision::kF16);
    const std::vector<float> rows(2 * 8, 0.5f);
    store.write(1, 0, 2, 8, rows, rows, std::vector<std::int64_t>{0});
    std::vector<std::byte> entry = *host.get("damaged-s1-l0-h0-c0");
    REQUIRE(entry.size() == 8 + 4 + 2 * 8 * 2);
    const std::uint16_t three = 3;
    std::memcpy(entry.data() + 6, &three, 2);
    host.put("damaged-s1-l0-h0-c0", entry);
    const auto error = test::thrown_error([&] { (void)store.read(1, 0, 0); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("does not match its header"));
  }
}

TEST_CASE("a cache that dropped nothing never recalls", "[tier][recall]") {
  using Cache = KVCache<layout::GQA, quant::Float<float>>;
  Cache cache(kShape);
  const Prompt p = random_prompt(4);
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span<const float>(p.keys), std::span<const float>(p.values));
  tier::HostTier host(64 << 20);
  tier::RecallStore store(host, "keep-all");
  store.write(seq, 0, kShape.kv_heads, kShape.head_dim, p.keys, p.values, p.positions);
  const std::vector<float> question = question_for(p, 250, 4.0f);
  std::vector<float> with(question.size()), plain(question.size());
  AttendReport report;
  report.epsilon = 1e-9;
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  CHECK(tier::attend_with_recall(cache, store, seq, 0, question, with, scale, report) == 0);
  cache.attend(seq, 0, std::span<const float>(question), std::span<float>(plain), scale);
  CHECK(with == plain);
  CHECK_FALSE(report.fired);
  CHECK(store.stats().recalls == 0);
  CHECK(store.stats().bytes_fetched == 0);
}

TEST_CASE("pages Quest skipped over positions with gaps are live, not missing from the store", "[tier][recall]") {
  // Positions 0, 3, 6, …: a skipped page's span covers positions no token has. Nothing was
  // dropped, so recall needs no entry and attends exactly over every token.
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::KeepAll, select::Quest>;
  CacheConfig config;
  config.page_size = 16;
  select::Quest quest;
  quest.dense_layers = 0;
  quest.token_budget = 64;
  Cache cache(kShape, config, {}, {}, {}, quest);
  const Prompt p = random_prompt(5);
  const SeqId seq = cache.add_sequence();
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  for (index_t t = 0; t < kTokens; ++t) {
    cache.append(seq, 0, std::span<const float>(p.keys.data() + t * row, row),
                 std::span<const float>(p.values.data() + t * row, row), 3 * t);
  }
  tier::HostTier host(1 << 20);
  tier::RecallStore empty(host, "nothing-written");
  const std::vector<float> question = question_for(p, 250, 1.0f);
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  std::vector<float> with(question.size());
  AttendReport report;
  report.epsilon = 1e-9;
  CHECK(tier::attend_with_recall(cache, empty, seq, 0, question, with, scale, report) > 0);
  REQUIRE(report.fired);
  CHECK(empty.stats().tokens_recalled == 0);
  const std::vector<double> exact =
      eval::exact_attention(p.keys, p.values, kShape.kv_heads, kShape.head_dim, question, scale);
  CHECK(largest_error(with, exact) < 1e-5);
}

TEST_CASE("dropped slots of a page attend read are missing from an empty store, whatever is live beside them",
          "[tier][recall]") {
  // H2O drops 3 of 64 tokens, slots of pages that stay and are read: each span's range holds
  // live tokens. Those were read, not left unread, so they cannot stand in for the dropped ones
  // (they did until the eighth session of 2026-12-07: recall returned, missing the needle, and
  // claimed ≤ epsilon).
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::H2O<>, select::Quest>;
  CacheConfig config;
  config.page_size = 32;
  Cache cache(kShape, config, {}, {}, evict::H2O<>{evict::Uniform{61}}, summaries_only());
  const Prompt p = random_prompt(11);
  const index_t tokens = 64;
  const std::size_t floats = static_cast<std::size_t>(tokens) * kShape.kv_heads * kShape.head_dim;
  const SeqId seq = cache.add_sequence();
  cache.prefill(seq, 0, std::span(p.keys).first(floats), std::span(p.values).first(floats));
  REQUIRE(cache.live_tokens(seq, 0, 0) == 61);
  const StoredTokens live = cache.read_back(seq, 0, 0);
  index_t dropped = 0;
  while (std::binary_search(live.positions.begin(), live.positions.end(), dropped)) ++dropped;
  const std::vector<float> question = question_for(p, dropped, 4.0f);
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  std::vector<float> out(question.size());
  AttendReport report;
  report.epsilon = 1e-3;
  cache.attend(seq, 0, std::span<const float>(question), std::span<float>(out), scale, &report);
  REQUIRE(report.fired);
  for (const UnreadSpan& span : report.unread_spans[0]) {
    CHECK(span.live == 0);  // every page was read
    CHECK(span.last_position - span.first_position + 1 > span.tokens);  // live tokens in range
  }

  tier::HostTier host(1 << 20);
  tier::RecallStore empty(host, "nothing-written");
  const auto error =
      test::thrown_error([&] { (void)tier::attend_with_recall(cache, empty, seq, 0, question, out, scale, report); });
  REQUIRE(error);
  CHECK(error->code() == ErrorCode::kUnavailable);
  CHECK_THAT(error->what(), Catch::Contains("holds no entry for"));

  SECTION("with every token written through, recall brings the needle back") {
    tier::RecallStore store(host, "all-written", 16);
    store.write(seq, 0, kShape.kv_heads, kShape.head_dim, std::span(p.keys).first(floats),
                std::span(p.values).first(floats), std::span(p.positions).first(static_cast<std::size_t>(tokens)));
    CHECK(tier::attend_with_recall(cache, store, seq, 0, question, out, scale, report) > 0);
    const std::vector<double> exact = eval::exact_attention(std::span(p.keys).first(floats),
                                                            std::span(p.values).first(floats), kShape.kv_heads,
                                                            kShape.head_dim, question, scale);
    CHECK(store.stats().max_mass_left <= report.epsilon);
    CHECK(largest_error(out, exact) <= 2.0 * store.stats().max_mass_left * largest_value_norm(p) + 1e-5);
  }
}

TEST_CASE("a write-through the tier refuses halfway leaves neither entries nor a record behind", "[tier][recall]") {
  // A tier that takes `accepted` puts and then refuses.
  class FailingTier final : public tier::Tier {
   public:
    int accepted = 1000;
    [[nodiscard]] std::string describe() const override { return "failing"; }
    void put(std::string_view key, std::span<const std::byte> bytes) override {
      if (accepted-- <= 0) throw Error(ErrorCode::kUnavailable, "failing: full");
      host.put(key, bytes);
    }
    [[nodiscard]] std::optional<std::vector<std::byte>> get(std::string_view key) override { return host.get(key); }
    bool erase(std::string_view key) override { return host.erase(key); }
    [[nodiscard]] tier::TierStats stats() const override { return host.stats(); }
    tier::HostTier host{1 << 20};
  };
  FailingTier failing;
  tier::RecallStore store(failing, "halfway", 4);
  const index_t streams = 2, dim = 8, tokens = 10;  // 3 chunks x 2 streams
  std::vector<float> rows(static_cast<std::size_t>(tokens * streams * dim));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(tokens));
  for (index_t t = 0; t < tokens; ++t) positions[static_cast<std::size_t>(t)] = 10 + t;
  const std::size_t first_four = static_cast<std::size_t>(4 * streams * dim);
  const auto head = std::span<const float>(rows).first(first_four);
  const auto rest = std::span<const float>(rows).subspan(first_four);
  store.write(7, 0, streams, dim, head, head, std::span(positions).first(4));
  const std::size_t used = failing.host.used_bytes();
  failing.accepted = 3;  // the fourth put of the next write fails
  const auto refused =
      test::thrown_error([&] { store.write(7, 0, streams, dim, rest, rest, std::span(positions).subspan(4)); });
  REQUIRE(refused);
  CHECK(refused->code() == ErrorCode::kUnavailable);
  CHECK(failing.host.used_bytes() == used);  // the three entries it put are erased
  CHECK(store.entries(7, 0, 0).size() == 1);
  CHECK(store.entries(7, 0, 1).size() == 1);
  failing.accepted = 1000;
  store.write(7, 0, streams, dim, rest, rest, std::span(positions).subspan(4));  // the retry is taken
  const StoredTokens back = store.read(7, 0, 1);
  CHECK(back.positions.size() == static_cast<std::size_t>(tokens));
  CHECK(back.keys[dim] == rows[3 * dim]);  // token 1 of stream 1

  failing.accepted = 0;  // a first write to a new layer that fails leaves no record of it
  CHECK(test::thrown_error([&] { store.write(7, 1, streams, dim, head, head, std::span(positions).first(4)); }));
  CHECK(store.entries(7, 1, 0).empty());
  failing.accepted = 1000;
  store.demote(DroppedTokens{7, 1, 0, back});  // so the layer can still take either mode
  CHECK(store.entries(7, 1, 0).size() == 3);
}

TEST_CASE("RecallStore refuses writes that do not fit", "[tier][recall]") {
  tier::HostTier host(1 << 20);
  tier::RecallStore store(host, "checks");
  const std::vector<float> rows(2 * 2 * 8);
  const std::vector<std::int64_t> two{0, 1};
  CHECK(test::thrown_error([&] { store.write(1, 0, 2, 8, rows, rows, std::vector<std::int64_t>{0}); }));
  store.write(1, 0, 2, 8, rows, rows, two);
  const auto backwards = test::thrown_error([&] { store.write(1, 0, 2, 8, rows, rows, two); });
  REQUIRE(backwards);
  CHECK_THAT(backwards->what(), Catch::Contains("positions must increase"));
  CHECK(test::thrown_error([&] { store.write(1, 0, 4, 4, rows, rows, std::vector<std::int64_t>{5, 6}); }));
  CHECK(test::thrown_error([&] { tier::RecallStore bad(host, "bad/name"); }));
  const StoredTokens back = store.read(1, 0, 1);
  CHECK(back.positions == std::vector<std::int32_t>{0, 1});
  CHECK(back.keys.size() == 16);
}
