// Eviction: the policies' choices against references written here, and the cache applying them —
// memory goes down for every evictor × codec, attention reads exactly the kept tokens (dead slots
// and dead tail rows masked), pinned spans and the exact prefix survive, forks keep their pages
// (copy-on-write), compaction adds at most one re-quantization, and every byte comes back.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

evict::StreamTokens view(const std::vector<std::int32_t>& positions, const std::vector<float>& scores,
                         const std::vector<std::uint8_t>& pinned, index_t capacity) {
  return {positions, scores, pinned, capacity, 0};
}

std::vector<index_t> kept_indices(const std::vector<std::uint8_t>& keep) {
  std::vector<index_t> out;
  for (index_t i = 0; i < static_cast<index_t>(keep.size()); ++i) {
    if (keep[i] != 0) out.push_back(i);
  }
  return out;
}

/// The reference top-k: sort all candidates by (score desc, index asc).
std::vector<index_t> reference_best(const std::vector<float>& scores, std::vector<index_t> candidates, index_t k) {
  std::stable_sort(candidates.begin(), candidates.end(), [&](index_t a, index_t b) { return scores[a] > scores[b]; });
  candidates.resize(std::min<std::size_t>(candidates.size(), static_cast<std::size_t>(std::max<index_t>(k, 0))));
  return candidates;
}

}  // namespace

TEST_CASE("StreamingLLM keeps the sinks, every pinned token and the most recent ones up to its budget", "[evict]") {
  std::vector<std::int32_t> positions(100);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<std::uint8_t> pinned(100, 0);
  pinned[50] = 1;
  std::vector<std::uint8_t> keep(100);
  const evict::StreamingLLM<> policy{4, evict::Uniform{20}};
  policy.choose(view(positions, {}, pinned, 20), keep);
  // The pin counts towards the 20: the recent window shrinks to 15.
  std::vector<index_t> expected{0, 1, 2, 3, 50};
  for (index_t i = 85; i < 100; ++i) expected.push_back(i);
  CHECK(kept_indices(keep) == expected);
  // With 2 tokens already kept as the exact prefix, only 2 more sinks are needed.
  const std::vector<std::uint8_t> none(100, 0);
  evict::StreamTokens shifted = view(positions, {}, none, 18);
  shifted.exact_prefix = 2;
  policy.choose(shifted, keep);
  CHECK(kept_indices(keep).size() == 18);
  CHECK(keep[0] == 1);
  CHECK(keep[1] == 1);
  CHECK(keep[2] == 0);
}

TEST_CASE("H2O keeps its recent share and the highest scores, ties to the lower position", "[evict]") {
  std::vector<std::int32_t> positions(64);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> scores(64);
  for (index_t i = 0; i < 64; ++i) scores[i] = static_cast<float>((i * 37) % 11);  // many ties
  const std::vector<std::uint8_t> pinned(64, 0);
  std::vector<std::uint8_t> keep(64);
  evict::H2O<> policy;
  policy.budget.tokens = 16;
  policy.choose(view(positions, scores, pinned, 16), keep);
  // Recent half: the last 8; the other 8 by score among the first 56.
  std::vector<index_t> candidates(56);
  std::iota(candidates.begin(), candidates.end(), 0);
  std::vector<index_t> expected = reference_best(scores, candidates, 8);
  for (index_t i = 56; i < 64; ++i) expected.push_back(i);
  std::sort(expected.begin(), expected.end());
  CHECK(kept_indices(keep) == expected);
}

TEST_CASE("SnapKV pools the window's scores and keeps the window", "[evict]") {
  for (const evict::Pooling pooling : {evict::Pooling::kMax, evict::Pooling::kAvg}) {
    std::vector<std::int32_t> positions(80);
    std::iota(positions.begin(), positions.end(), 0);
    std::vector<float> scores(80);
    for (index_t i = 0; i < 80; ++i) scores[i] = std::fabs(std::sin(0.7f * static_cast<float>(i)));
    const std::vector<std::uint8_t> pinned(80, 0);
    std::vector<std::uint8_t> keep(80);
    evict::SnapKV<> policy;
    policy.window = 8;
    policy.kernel = 5;
    policy.pooling = pooling;
    policy.budget.tokens = 24;
    policy.choose(view(positions, scores, pinned, 24), keep);
    // Reference pooling over the 72 tokens before the window, zero padded.
    std::vector<float> pooled(80, 0.0f);
    for (index_t i = 0; i < 72; ++i) {
      float acc = pooling == evict::Pooling::kMax ? -1.0f : 0.0f;
      for (index_t j = i - 2; j <= i + 2; ++j) {
        const float x = j >= 0 && j < 72 ? scores[j] : 0.0f;
        acc = pooling == evict::Pooling::kMax ? std::max(acc, x) : acc + x / 5.0f;
      }
      pooled[i] = acc;
    }
    std::vector<index_t> candidates(72);
    std::iota(candidates.begin(), candidates.end(), 0);
    std::vector<index_t> expected = reference_best(pooled, candidates, 16);
    for (index_t i = 72; i < 80; ++i) expected.push_back(i);
    std::sort(expected.begin(), expected.end());
    CHECK(kept_indices(keep) == expected);
  }
}

TEST_CASE("Pyramid budgets slope down over layers with Uniform's mean", "[evict]") {
  const evict::Pyramid pyramid{1024, 20};
  const index_t window = 32, layers = 32, context = 8192;
  long total = 0;
  for (index_t l = 0; l < layers; ++l) {
    const index_t c = pyramid.capacity(l, layers, context, window);
    if (l > 0) CHECK(c <= pyramid.capacity(l - 1, layers, context, window));
    total += c;
  }
  // B = 992, min = 49, max = 1935, step = 60: the mean is max - 15.5·step + window.
  CHECK(pyramid.capacity(0, layers, context, window) == 1935 + 32);
  CHECK(pyramid.capacity(31, layers, context, window) == 1935 - 31 * 60 + 32);
  CHECK(std::abs(static_cast<double>(total) / layers - 1024.0) <= 31.0);  // the step's floor
  CHECK(pyramid.capacity(5, layers, 900, window) == 1024);   // T < C: no compression
  CHECK(pyramid.capacity(5, layers, 1500, window) == 1024);  // T < 2B: uniform
  // 2B above 2^31 (computed in 64 bits; it overflowed index_t before): T = 2·10^9 < 2B, uniform.
  const evict::Pyramid huge{1'500'000'000, 20};
  CHECK(huge.capacity(0, layers, 2'000'000'000, window) == 1'500'000'000);
  CHECK(huge.capacity(31, layers, 2'000'000'000, window) == 1'500'000'000);
}

TEST_CASE("every evictor keeps the token just written, whatever its window or pins", "[evict]") {
  // The newest token has no score yet (no query has read it); the query of its own step must see it.
  std::vector<std::int32_t> positions(40);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> scores(40, 1.0f);
  scores.back() = 0.0f;
  const std::vector<std::uint8_t> none(40, 0);
  std::vector<std::uint8_t> keep(40);
  evict::H2O<> heavy_only{evict::Uniform{8}, 0.0};  // no recent window asked for
  heavy_only.choose(view(positions, scores, none, 8), keep);
  CHECK(keep.back() == 1);
  CHECK(kept_indices(keep).size() == 8);
  // Pins that fill StreamingLLM's budget leave room for nothing else but the newest token.
  std::vector<std::uint8_t> pinned(40, 0);
  for (index_t i = 10; i < 20; ++i) pinned[i] = 1;
  const evict::StreamingLLM<> streaming{2, evict::Uniform{8}};
  streaming.choose(view(positions, {}, pinned, 8), keep);
  CHECK(keep.back() == 1);
  CHECK(kept_indices(keep).size() == 2 + 10 + 1);
}

TEST_CASE("H2O's recent window is its share of the uniform budget on every Pyramid layer", "[evict]") {
  // Pyramid sizes each layer's budget as k_l + the window recent(C); the window must not shrink
  // with a layer's budget (32 layers at 8192 tokens: the top layer keeps 537).
  const evict::H2O<evict::Pyramid> policy{evict::Pyramid{1024, 20}, 0.5};
  const index_t top = policy.capacity(31, 32, 8192);
  REQUIRE(top < 1024);
  std::vector<std::int32_t> positions(8192);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> scores(8192);
  for (index_t i = 0; i < 8192; ++i) scores[i] = static_cast<float>((i * 7919) % 8192);
  const std::vector<std::uint8_t> none(8192, 0);
  std::vector<std::uint8_t> keep(8192);
  policy.choose(view(positions, scores, none, top), keep);
  CHECK(std::all_of(keep.end() - 512, keep.end(), [](std::uint8_t k) { return k == 1; }));
  CHECK(kept_indices(keep).size() == static_cast<std::size_t>(top));
}

TEST_CASE("a NaN score ranks as the highest, and the choice stays deterministic", "[evict]") {
  std::vector<std::int32_t> positions(64);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> scores(64);
  for (index_t i = 0; i < 64; ++i) scores[i] = static_cast<float>(i % 9);
  scores[5] = scores[30] = std::nanf("");
  const std::vector<std::uint8_t> none(64, 0);
  std::vector<std::uint8_t> keep(64), again(64);
  const evict::H2O<> policy{evict::Uniform{12}, 0.25};
  policy.choose(view(positions, scores, none, 12), keep);
  policy.choose(view(positions, scores, none, 12), again);
  CHECK(keep == again);
  CHECK(keep[5] == 1);
  CHECK(keep[30] == 1);
  // The rest by the reference's order, NaN as +inf.
  std::vector<float> ranked = scores;
  ranked[5] = ranked[30] = INFINITY;
  std::vector<index_t> candidates(61);
  std::iota(candidates.begin(), candidates.end(), 0);
  std::vector<index_t> expected = reference_best(ranked, candidates, 9);
  for (index_t i = 61; i < 64; ++i) expected.push_back(i);
  std::sort(expected.begin(), expected.end());
  CHECK(kept_indices(keep) == expected);
}

TEST_CASE("observation scores are causal softmax column sums, reduced over the group", "[evict]") {
  const index_t d = 4, n = 6, q_heads = 2, window = 2;
  const auto keys = test::random_rows(n, d, 1);
  const auto queries = test::random_rows(static_cast<std::size_t>(window) * q_heads, d, 2);
  const std::vector<std::int32_t> positions{0, 1, 2, 3, 4, 5};
  for (const evict::GroupReduce reduce : {evict::GroupReduce::kMean, evict::GroupReduce::kMax, evict::GroupReduce::kSum}) {
    std::vector<float> out(n);
    evict::observation_scores(keys, positions, d, queries, q_heads, 0, 2, 5, 0.5f, reduce, out);
    std::vector<double> head_sum[2];
    for (index_t h = 0; h < 2; ++h) {
      head_sum[h].assign(n, 0.0);
      for (index_t w = 0; w < window; ++w) {
        const index_t visible = n - (window - 1 - w);  // query w sits at position 4 + w
        std::vector<double> p;
        double ignored[4];
        eval::exact_attention_head({keys.data(), d, visible, d}, {keys.data(), d, visible, d},
                                   queries.data() + (static_cast<std::size_t>(w) * q_heads + h) * d, 0.5, ignored, &p);
        for (index_t j = 0; j < visible; ++j) head_sum[h][j] += p[j];
      }
    }
    for (index_t j = 0; j < n; ++j) {
      const double expected = reduce == evict::GroupReduce::kMax ? std::max(head_sum[0][j], head_sum[1][j])
                              : reduce == evict::GroupReduce::kSum ? head_sum[0][j] + head_sum[1][j]
                                                                   : (head_sum[0][j] + head_sum[1][j]) / 2;
      CHECK(out[j] == Approx(expected).epsilon(1e-5));
    }
  }
}

namespace {

constexpr ModelShape kShape{1, 8, 2, 64};
constexpr index_t kBudget = 128;
constexpr index_t kPrompt = 640;
constexpr index_t kWindow = 16;

template <class E>
E make_evictor() {
  E evictor;
  if constexpr (requires { evictor.sinks; }) evictor.sinks = 4;
  if constexpr (requires { evictor.window; }) evictor.window = kWindow;
  evictor.budget.tokens = kBudget;
  return evictor;
}

/// out = softmax(scale q·k) v over what read_back returns, per query head, in double.
template <class Cache>
std::vector<double> exact_over_read_back(const Cache& cache, SeqId seq, const std::vector<float>& q, double scale) {
  const index_t group = kShape.group_size(), d = kShape.head_dim;
  std::vector<double> out(q.size());
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    const StoredTokens kept = cache.read_back(seq, 0, s);
    for (index_t h = s * group; h < (s + 1) * group; ++h) {
      eval::exact_attention_head({kept.keys.data(), d, kept.size(), d}, {kept.values.data(), d, kept.size(), d},
                                 q.data() + static_cast<std::size_t>(h) * d, scale, out.data() + static_cast<std::size_t>(h) * d);
    }
  }
  return out;
}

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

template <class Q>
constexpr bool kExactCodec = std::is_same_v<Q, quant::Float<float>> || std::is_same_v<Q, quant::Float<half>>;

/// A query for every head aimed at the key of an evicted token (position `target`): if a dead
/// slot were read, it would take most of the attention.
std::vector<float> query_at(const std::vector<float>& keys, index_t target) {
  std::vector<float> q(static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim);
  for (index_t h = 0; h < kShape.q_heads; ++h) {
    const index_t s = h / kShape.group_size();
    const float* k = keys.data() + (static_cast<std::size_t>(target) * kShape.kv_heads + s) * kShape.head_dim;
    double norm = 0.0;
    for (index_t c = 0; c < kShape.head_dim; ++c) norm += k[c] * k[c];
    for (index_t c = 0; c < kShape.head_dim; ++c) {
      q[static_cast<std::size_t>(h) * kShape.head_dim + c] = static_cast<float>(48.0 * k[c] / std::sqrt(norm));
    }
  }
  return q;
}

template <class Q, class E>
void check_eviction() {
  INFO(Q::key_codec::kName << " × " << E::kName);
  CacheConfig config;
  KVCache<layout::GQA, Q, E> cache(kShape, config, Q{}, {}, make_evictor<E>());
  KVCache<layout::GQA, Q> full(kShape, config);
  const SeqId seq = cache.add_sequence();
  const SeqId twin = full.add_sequence();
  const std::size_t rows = static_cast<std::size_t>(kPrompt) * kShape.kv_heads;
  const auto keys = test::random_rows(rows, kShape.head_dim, 11, 4, 5.0f);
  const auto values = test::random_rows(rows, kShape.head_dim, 12);
  const auto observation = test::random_rows(static_cast<std::size_t>(kWindow) * kShape.q_heads, kShape.head_dim, 13);
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values), std::span<const float>(observation));
  full.prefill(twin, 0, std::span<const float>(keys), std::span<const float>(values));

  const index_t page = config.page_size;
  std::set<std::int32_t> kept;
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    CHECK(cache.live_tokens(seq, 0, s) == kBudget);
    const StoredTokens stored = cache.read_back(seq, 0, s);
    CHECK(stored.size() == kBudget);
    CHECK(std::is_sorted(stored.positions.begin(), stored.positions.end()));
    CHECK(static_cast<index_t>(cache.pages(seq, 0, s).size()) <= 2 * (kBudget / page) + 1);
    if (s == 0) kept.insert(stored.positions.begin(), stored.positions.end());
  }
  if constexpr (std::is_same_v<E, evict::StreamingLLM<>>) {
    CHECK(kept.count(0) == 1);
    CHECK(kept.count(3) == 1);
    CHECK(kept.count(kPrompt - kBudget + 4) == 1);
    CHECK(kept.count(kPrompt - kBudget + 3) == 0);
  }
  if constexpr (std::is_same_v<E, evict::SnapKV<>>) {
    for (index_t p = kPrompt - kWindow; p < kPrompt; ++p) CHECK(kept.count(p) == 1);
  }
  const MemoryUsage usage = cache.memory();
  CHECK(usage.pages_in_use < full.memory().pages_in_use);
  CHECK(usage.total() < full.memory().total());
  CHECK(usage.stored_elements == static_cast<std::size_t>(kBudget) * kShape.kv_heads * 2 * kShape.head_dim);

  // Aim at a dropped token: the output must be attention over the kept tokens only.
  index_t dropped = kPrompt / 2;
  while (kept.count(dropped) != 0) ++dropped;
  const auto q = query_at(keys, dropped);
  std::vector<float> out(q.size());
  cache.attend(seq, 0, std::span<const float>(q), std::span<float>(out), 0.125f);
  CHECK(relative_error(out, exact_over_read_back(cache, seq, q, 0.125)) <= (kExactCodec<Q> ? 1e-4 : 3e-2));

  // Decode: the evictors that evict on append stay within the budget.
  for (index_t t = 0; t < 40; ++t) {
    const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 100 + t);
    const auto v = test::random_rows(kShape.kv_heads, kShape.head_dim, 200 + t);
    cache.attend(seq, 0, std::span<const float>(q), std::span<float>(out), 0.125f);
    cache.append(seq, 0, std::span<const float>(k), std::span<const float>(v), kPrompt + t);
  }
  CHECK(cache.live_tokens(seq, 0, 1) == (E::kEvictsOnAppend ? kBudget : kBudget + 40));
  cache.attend(seq, 0, std::span<const float>(q), std::span<float>(out), 0.125f);
  CHECK(relative_error(out, exact_over_read_back(cache, seq, q, 0.125)) <= (kExactCodec<Q> ? 1e-4 : 3e-2));

  cache.release(seq);
  const MemoryUsage empty = cache.memory();
  CHECK(empty.pages_in_use == 0);
  CHECK(empty.tails == 0);
  CHECK(empty.tables == 0);
  CHECK(empty.stored_elements == 0);
}

template <class E>
void check_every_codec() {
  check_eviction<quant::Float<float>, E>();
  check_eviction<quant::Float<half>, E>();
  check_eviction<quant::Int8, E>();
  check_eviction<quant::Q8_0, E>();
  check_eviction<quant::Q4_0, E>();
  check_eviction<quant::KIVI<4>, E>();
  check_eviction<quant::TurboQuant<8>, E>();
}

}  // namespace

TEST_CASE("StreamingLLM frees memory and attention reads only the kept tokens, for every codec", "[evict][cache]") {
  check_every_codec<evict::StreamingLLM<>>();
}
TEST_CASE("H2O frees memory and attention reads only the kept tokens, for every codec", "[evict][cache]") {
  check_every_codec<evict::H2O<>>();
}
TEST_CASE("SnapKV frees memory and attention reads only the kept tokens, for every codec", "[evict][cache]") {
  check_every_codec<evict::SnapKV<>>();
}

namespace {

/// Appends `count` random tokens to layer 0 from position `first`, attending with `q` before
/// each when given.
template <class Cache>
void decode(Cache& cache, SeqId seq, index_t first, index_t count, std::uint32_t seed,
            const std::vector<float>* q = nullptr) {
  std::vector<float> out(static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim);
  for (index_t t = 0; t < count; ++t) {
    if (q != nullptr) cache.attend(seq, 0, std::span<const float>(*q), std::span<float>(out), 0.125f);
    const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, seed + 2 * t);
    const auto v = test::random_rows(kShape.kv_heads, kShape.head_dim, seed + 2 * t + 1);
    cache.append(seq, 0, std::span<const float>(k), std::span<const float>(v), first + t);
  }
}

std::vector<std::int32_t> positions_of(const StoredTokens& stored) { return stored.positions; }

}  // namespace

TEST_CASE("eviction in a fork copies shared pages and leaves the parent as it was", "[evict][cache]") {
  using Cache = KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>>;
  Cache cache(kShape, {}, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{96}});
  const SeqId parent = cache.add_sequence();
  decode(cache, parent, 0, 90, 1);  // under the budget: nothing dropped
  const StoredTokens before = cache.read_back(parent, 0, 1);
  const SeqId child = cache.fork(parent);
  decode(cache, child, 90, 70, 500);  // the child drops 64 of its shared tokens
  CHECK(cache.live_tokens(child, 0, 1) == 96);
  CHECK(cache.live_tokens(parent, 0, 1) == 90);
  const StoredTokens after = cache.read_back(parent, 0, 1);
  CHECK(after.positions == before.positions);
  CHECK(after.keys == before.keys);
  CHECK(after.values == before.values);
  const auto child_positions = positions_of(cache.read_back(child, 0, 1));
  CHECK(child_positions.front() == 0);
  CHECK(child_positions[4] == 160 - 92);
  cache.release(parent);
  cache.release(child);
  CHECK(cache.memory().pages_in_use == 0);
  CHECK(cache.memory().total() == 0);
}

TEST_CASE("pinned spans and the exact prefix are never dropped", "[evict][cache]") {
  CacheConfig config;
  config.exact_prefix_tokens = 2;
  KVCache<layout::GQA, quant::Float<half>, evict::H2O<>> cache(kShape, config, {}, {}, [] {
    evict::H2O<> h2o;
    h2o.budget.tokens = 64;
    return h2o;
  }());
  const SeqId seq = cache.add_sequence();
  cache.pin(seq, 100, 109);
  CHECK_THROWS_AS(cache.pin(seq, 5, 4), Error);
  const std::size_t rows = 400 * static_cast<std::size_t>(kShape.kv_heads);
  const auto keys = test::random_rows(rows, kShape.head_dim, 3);
  const auto values = test::random_rows(rows, kShape.head_dim, 4);
  const auto observation = test::random_rows(8 * static_cast<std::size_t>(kShape.q_heads), kShape.head_dim, 5);
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values), std::span<const float>(observation));
  decode(cache, seq, 400, 50, 900);
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    const auto kept = positions_of(cache.read_back(seq, 0, s));
    CHECK(kept.size() == 64);
    CHECK(kept[0] == 0);
    CHECK(kept[1] == 1);
    for (std::int32_t p = 100; p <= 109; ++p) CHECK(std::count(kept.begin(), kept.end(), p) == 1);
  }
}

TEST_CASE("rows dropped in the tail window never become pages", "[evict][cache]") {
  CacheConfig config;
  config.tail_tokens = 64;
  KVCache<layout::GQA, quant::Q4_0, evict::StreamingLLM<>> cache(kShape, config, {}, {},
                                                                 evict::StreamingLLM<>{4, evict::Uniform{36}});
  const SeqId seq = cache.add_sequence();
  decode(cache, seq, 0, 500, 7);
  // 36 live tokens: the 4 sinks share a page with dead slots; the window lives in the tail.
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    CHECK(cache.live_tokens(seq, 0, s) == 36);
    CHECK(cache.pages(seq, 0, s).size() <= 2);
  }
  const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 8);
  std::vector<float> out(q.size());
  cache.attend(seq, 0, std::span<const float>(q), std::span<float>(out), 0.125f);
  CHECK(relative_error(out, exact_over_read_back(cache, seq, q, 0.125)) <= 3e-2);
}

TEST_CASE("SnapKV ranks a later prefill by its own window, not summed with an earlier one", "[evict][cache]") {
  evict::SnapKV<> snap;
  snap.window = 1;
  snap.kernel = 1;
  snap.budget.tokens = 3;
  KVCache<layout::GQA, quant::Float<float>, evict::SnapKV<>> cache(kShape, {}, {}, {}, snap);
  const SeqId seq = cache.add_sequence();
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  const auto keys = test::random_rows(16 * static_cast<std::size_t>(kShape.kv_heads), kShape.head_dim, 21, 4, 5.0f);
  const auto values = test::random_rows(16 * static_cast<std::size_t>(kShape.kv_heads), kShape.head_dim, 22);
  const auto half = [&](const std::vector<float>& all, int which) {
    return std::span<const float>(all.data() + which * 8 * row, 8 * row);
  };
  // Turn 1's window asks for token 2: kept, with the window's token 7 and one more.
  const std::vector<float> first_question = query_at(keys, 2);
  cache.prefill(seq, 0, half(keys, 0), half(values, 0), std::span<const float>(first_question));
  REQUIRE(cache.read_back(seq, 0, 0).positions.size() == 3);
  REQUIRE(cache.read_back(seq, 0, 0).positions[0] == 2);
  // Turn 2's window asks for tokens 9 and 11: they outrank token 2, whose score was turn 1's.
  std::vector<float> second_question = query_at(keys, 9);
  const std::vector<float> also = query_at(keys, 11);
  for (std::size_t i = 0; i < second_question.size(); ++i) second_question[i] += also[i];
  cache.prefill(seq, 0, half(keys, 1), half(values, 1), std::span<const float>(second_question));
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    INFO("stream " << s);
    CHECK(cache.read_back(seq, 0, s).positions == std::vector<std::int32_t>{9, 11, 15});
  }
}

TEST_CASE("an exact prefix that fills an evictor's budget is refused when the cache is built", "[evict][cache]") {
  CacheConfig config;
  config.exact_prefix_tokens = 64;
  using Streaming = KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>>;
  CHECK_THROWS_WITH(Streaming(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{64}}),
                    Catch::Contains("exact_prefix_tokens (64) must leave room for the newest token"));
  CHECK_NOTHROW(Streaming(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{65}}));
  // Pyramid's top layer keeps the least: its budget at long contexts is what counts.
  using Pyramid = KVCache<layout::GQA, quant::Float<half>, evict::H2O<evict::Pyramid>>;
  const ModelShape deep{8, 8, 2, 64};
  const evict::H2O<evict::Pyramid> h2o{evict::Pyramid{256, 20}, 0.5};
  const index_t least = h2o.capacity(7, 8, std::numeric_limits<index_t>::max());
  REQUIRE(least < 256);
  config.exact_prefix_tokens = least;
  CHECK_THROWS_AS(Pyramid(deep, config, {}, {}, h2o), Error);
  config.exact_prefix_tokens = least - 1;
  CHECK_NOTHROW(Pyramid(deep, config, {}, {}, h2o));
}

TEST_CASE("H2O keeps the token decode queries keep attending to", "[evict][cache]") {
  evict::H2O<> h2o;
  h2o.budget.tokens = 32;
  KVCache<layout::GQA, quant::Float<float>, evict::H2O<>> cache(kShape, {}, {}, {}, h2o);
  const SeqId seq = cache.add_sequence();
  const std::size_t rows = 64 * static_cast<std::size_t>(kShape.kv_heads);
  const auto keys = test::random_rows(rows, kShape.head_dim, 21);
  const auto values = test::random_rows(rows, kShape.head_dim, 22);
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  // Prefill without observation queries: all scores are 0, so the ties keep positions 0–15 (and
  // the recent 48–63); decode queries then aim at token 10, which must outlive its neighbours.
  const index_t heavy = 10;
  const auto q = query_at(keys, heavy);
  decode(cache, seq, 64, 200, 300, &q);
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    const auto kept = positions_of(cache.read_back(seq, 0, s));
    CHECK(kept.size() == 32);
    CHECK(std::count(kept.begin(), kept.end(), heavy) == 1);
    CHECK(std::count_if(kept.begin(), kept.end(), [](std::int32_t p) { return p < 64; }) < 16);
  }
}

TEST_CASE("compaction re-quantizes at most once more: error within twice the codec's own", "[evict][cache]") {
  // H2O with scattered scores leaves sparse pages, which compaction re-encodes.
  auto check = [](auto quantizer) {
    using Q = decltype(quantizer);
    INFO(Q::key_codec::kName);
    evict::H2O<> h2o;
    h2o.budget.tokens = 100;
    KVCache<layout::GQA, Q, evict::H2O<>> cache(kShape, {}, quantizer, {}, h2o);
    KVCache<layout::GQA, Q> full(kShape);
    const SeqId seq = cache.add_sequence();
    const SeqId twin = full.add_sequence();
    const std::size_t rows = 1024 * static_cast<std::size_t>(kShape.kv_heads);
    const auto keys = test::random_rows(rows, kShape.head_dim, 31, 4, 5.0f);
    const auto values = test::random_rows(rows, kShape.head_dim, 32);
    const auto observation = test::random_rows(32 * static_cast<std::size_t>(kShape.q_heads), kShape.head_dim, 33);
    cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values), std::span<const float>(observation));
    full.prefill(twin, 0, std::span<const float>(keys), std::span<const float>(values));
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      CHECK(static_cast<index_t>(cache.pages(seq, 0, s).size()) <= 2 * 100 / 32 + 1);
      const StoredTokens kept = cache.read_back(seq, 0, s);
      const StoredTokens all = full.read_back(twin, 0, s);
      double compacted = 0.0, once = 0.0;
      for (index_t i = 0; i < kept.size(); ++i) {
        const std::int32_t p = kept.positions[i];
        for (index_t c = 0; c < kShape.head_dim; ++c) {
          const std::size_t input = (static_cast<std::size_t>(p) * kShape.kv_heads + s) * kShape.head_dim + c;
          const std::size_t at_kept = static_cast<std::size_t>(i) * kShape.head_dim + c;
          const std::size_t at_all = static_cast<std::size_t>(p) * kShape.head_dim + c;
          compacted += std::pow(kept.values[at_kept] - values[input], 2) + std::pow(kept.keys[at_kept] - keys[input], 2);
          once += std::pow(all.values[at_all] - values[input], 2) + std::pow(all.keys[at_all] - keys[input], 2);
        }
      }
      INFO("rms error after compaction " << std::sqrt(compacted) << ", of one quantization " << std::sqrt(once));
      CHECK(std::sqrt(compacted) <= 2.0 * std::sqrt(once) + 1e-6);
    }
  };
  check(quant::Float<half>{});
  check(quant::Int8{});
  check(quant::Q8_0{});
  check(quant::Q4_0{});
  check(quant::KIVI<4>{});
  check(quant::KIVI<2>{});
}

TEST_CASE("compaction leaves a whole leading page as it was encoded", "[evict][cache]") {
  // TurboQuant does not re-encode to the same values: a rewritten page would read back
  // differently from its twin's (and prefix sharing could cache such a page as untouched).
  evict::H2O<> h2o;
  h2o.budget.tokens = 100;
  KVCache<layout::GQA, quant::TurboQuant<8>, evict::H2O<>> cache(kShape, {}, {}, {}, h2o);
  KVCache<layout::GQA, quant::TurboQuant<8>> full(kShape);
  const SeqId seq = cache.add_sequence();
  const SeqId twin = full.add_sequence();
  cache.pin(seq, 0, 31);  // page 0 stays whole
  const std::size_t rows = 1024 * static_cast<std::size_t>(kShape.kv_heads);
  const auto keys = test::random_rows(rows, kShape.head_dim, 41, 4, 5.0f);
  const auto values = test::random_rows(rows, kShape.head_dim, 42);
  const auto observation = test::random_rows(32 * static_cast<std::size_t>(kShape.q_heads), kShape.head_dim, 43);
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values), std::span<const float>(observation));
  full.prefill(twin, 0, std::span<const float>(keys), std::span<const float>(values));
  for (index_t s = 0; s < kShape.kv_heads; ++s) {
    INFO("stream " << s);
    REQUIRE(static_cast<index_t>(cache.pages(seq, 0, s).size()) <= 2 * 100 / 32 + 1);  // compacted
    const StoredTokens kept = cache.read_back(seq, 0, s);
    const StoredTokens all = full.read_back(twin, 0, s);
    const std::size_t page = 32 * static_cast<std::size_t>(kShape.head_dim);
    REQUIRE(std::vector<std::int32_t>(kept.positions.begin(), kept.positions.begin() + 32) ==
            std::vector<std::int32_t>(all.positions.begin(), all.positions.begin() + 32));
    CHECK(std::equal(kept.keys.begin(), kept.keys.begin() + page, all.keys.begin()));
    CHECK(std::equal(kept.values.begin(), kept.values.begin() + page, all.values.begin()));
  }
}

TEST_CASE("with the pool exhausted, eviction in a fork keeps shared tokens and fails nothing", "[evict][cache]") {
  CacheConfig config;
  config.max_pages = 12;
  KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>> cache(kShape, config, {}, {},
                                                                 evict::StreamingLLM<>{4, evict::Uniform{64}});
  const SeqId parent = cache.add_sequence();
  decode(cache, parent, 0, 64, 1);  // 2 pages per stream: 4 pages
  const SeqId child = cache.fork(parent);
  // 8 more pages fill the pool; the copies eviction needs do not fit, so nothing shared dies.
  decode(cache, child, 64, 128, 77);
  CHECK(cache.memory().pages_in_use <= 12);
  CHECK(cache.live_tokens(child, 0, 0) >= 64);
  CHECK(positions_of(cache.read_back(parent, 0, 0)).size() == 64);
  cache.release(child);
  cache.release(parent);
  CHECK(cache.memory().total() == 0);
}

TEST_CASE("evictors work on keys stored before RoPE", "[evict][cache]") {
  CacheConfig config;
  config.key_rope = RopeSpec{};
  KVCache<layout::GQA, quant::Q8_0, evict::SnapKV<>> cache(kShape, config, {}, {}, make_evictor<evict::SnapKV<>>());
  const SeqId seq = cache.add_sequence();
  const std::size_t rows = static_cast<std::size_t>(kPrompt) * kShape.kv_heads;
  const auto keys = test::random_rows(rows, kShape.head_dim, 41);
  const auto values = test::random_rows(rows, kShape.head_dim, 42);
  const auto observation = test::random_rows(static_cast<std::size_t>(kWindow) * kShape.q_heads, kShape.head_dim, 43);
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values), std::span<const float>(observation));
  CHECK(cache.live_tokens(seq, 0, 0) == kBudget);
  const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 44);
  std::vector<float> out(q.size());
  cache.attend(seq, 0, std::span<const float>(q), std::span<float>(out), 0.125f);
  CHECK(relative_error(out, exact_over_read_back(cache, seq, q, 0.125)) <= 3e-2);
}
