// Eviction: the policies' choices against references written here, and the cache applying them —
// memory goes down for every evictor × codec, attention reads exactly the kept tokens (dead slots
// and dead tail rows masked), pinned spans and the exact prefix survive, forks keep their pages
// (copy-on-write), compaction adds at most one re-quantization, and every byte comes back.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
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

TEST_CASE("StreamingLLM keeps the sinks and the most recent tokens, and every pinned one", "[evict]") {
  std::vector<std::int32_t> positions(100);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<std::uint8_t> pinned(100, 0);
  pinned[50] = 1;
  std::vector<std::uint8_t> keep(100);
  const evict::StreamingLLM<> policy{4, evict::Uniform{20}};
  policy.choose(view(positions, {}, pinned, 20), keep);
  std::vector<index_t> expected{0, 1, 2, 3, 50};
  for (index_t i = 84; i < 100; ++i) expected.push_back(i);
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
