// select::Quest inside KVCache: attend reads the pages whose keys may score highest (plus the
// tail), layers below dense_layers read everything, and the certified bound on the attention mass
// left unread — by Quest, by an evictor, or both — is never below the true mass, computed here
// against a KeepAll twin that holds every token.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

constexpr ModelShape kShape{2, 8, 2, 64};
constexpr float kScale = 0.125f;

struct Data {
  std::vector<float> keys, values;
  index_t tokens = 0;
};

/// Random K/V with outlier key channels; the keys of `needles` (token indices) are set to a
/// common direction per KV head, 8× a random key's size, so a query along it finds them and their
/// pages' bounds stand out.
Data make_data(index_t tokens, std::uint32_t seed, const std::vector<index_t>& needles = {}) {
  Data d;
  d.tokens = tokens;
  const std::size_t rows = static_cast<std::size_t>(tokens) * kShape.kv_heads;
  d.keys = test::random_rows(rows, kShape.head_dim, seed, 4, 4.0f);
  d.values = test::random_rows(rows, kShape.head_dim, seed + 1);
  const auto direction = test::random_rows(kShape.kv_heads, kShape.head_dim, seed + 2);
  for (index_t t : needles) {
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      for (index_t c = 0; c < kShape.head_dim; ++c) {
        d.keys[(static_cast<std::size_t>(t) * kShape.kv_heads + s) * kShape.head_dim + c] =
            8.0f * direction[static_cast<std::size_t>(s) * kShape.head_dim + c];
      }
    }
  }
  return d;
}

/// A query per head along the needles' direction (or random), scaled to dominate.
std::vector<float> query_along(std::uint32_t seed, float strength) {
  const auto direction = test::random_rows(kShape.kv_heads, kShape.head_dim, seed + 2);
  auto q = test::random_rows(kShape.q_heads, kShape.head_dim, seed + 7);
  for (index_t h = 0; h < kShape.q_heads; ++h) {
    const index_t s = h / kShape.group_size();
    for (index_t c = 0; c < kShape.head_dim; ++c) {
      q[static_cast<std::size_t>(h) * kShape.head_dim + c] =
          0.3f * q[static_cast<std::size_t>(h) * kShape.head_dim + c] +
          strength * direction[static_cast<std::size_t>(s) * kShape.head_dim + c];
    }
  }
  return q;
}

template <class Cache>
void fill(Cache& cache, SeqId seq, const Data& d) {
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    cache.prefill(seq, layer, std::span<const float>(d.keys), std::span<const float>(d.values));
  }
}

template <class Cache>
std::vector<float> attend(const Cache& cache, SeqId seq, index_t layer, const std::vector<float>& q,
                          AttendReport* report = nullptr) {
  std::vector<float> out(q.size());
  cache.attend(seq, layer, std::span<const float>(q), std::span<float>(out), kScale, report);
  return out;
}

/// Positions of the live slots of page `index` of a stream.
template <class Cache>
std::vector<std::int32_t> live_positions(const Cache& cache, SeqId seq, index_t layer, index_t s, index_t index) {
  const PageId id = cache.pages(seq, layer, s)[static_cast<std::size_t>(index)];
  const index_t page = cache.config().page_size;
  const std::byte* metadata = cache.pool().metadata(id);
  std::vector<std::int32_t> out;
  for (index_t t = 0; t < page; ++t) {
    std::uint64_t word = 0;
    std::memcpy(&word, metadata + page * sizeof(std::int32_t) + (t / 64) * sizeof(word), sizeof(word));
    if (((word >> (t % 64)) & 1u) == 0) continue;
    std::int32_t position = 0;
    std::memcpy(&position, metadata + t * sizeof(position), sizeof(position));
    out.push_back(position);
  }
  return out;
}

/// The positions attend read in a stream: every live token but those of the pages it skipped.
template <class Cache>
std::set<std::int32_t> read_positions(const Cache& cache, SeqId seq, index_t layer, index_t s, const AttendReport& report) {
  const StoredTokens live = cache.read_back(seq, layer, s);
  std::set<std::int32_t> read(live.positions.begin(), live.positions.end());
  const auto& taken = report.read_pages[static_cast<std::size_t>(s)];
  for (index_t i = 0; i < static_cast<index_t>(cache.pages(seq, layer, s).size()); ++i) {
    if (std::find(taken.begin(), taken.end(), i) != taken.end()) continue;
    for (std::int32_t p : live_positions(cache, seq, layer, s, i)) read.erase(p);
  }
  return read;
}

/// Per query head: the true softmax mass, over every token the twin holds, of the positions not
/// in `read` (keys as the twin decodes them).
template <class Twin>
std::vector<double> true_unread_mass(const Twin& twin, SeqId seq, index_t layer, index_t s,
                                     const std::set<std::int32_t>& read, const std::vector<float>& q) {
  const StoredTokens all = twin.read_back(seq, layer, s);
  std::vector<double> masses;
  for (index_t h = s * kShape.group_size(); h < (s + 1) * kShape.group_size(); ++h) {
    std::vector<double> p;
    std::vector<double> ignored(kShape.head_dim);
    eval::exact_attention_head({all.keys.data(), kShape.head_dim, all.size(), kShape.head_dim},
                               {all.values.data(), kShape.head_dim, all.size(), kShape.head_dim},
                               q.data() + static_cast<std::size_t>(h) * kShape.head_dim, kScale, ignored.data(), &p);
    double mass = 0.0;
    for (index_t i = 0; i < all.size(); ++i) mass += read.count(all.positions[i]) != 0 ? 0.0 : p[i];
    masses.push_back(mass);
  }
  return masses;
}

}  // namespace

TEST_CASE("Quest with a budget above the context reads like DenseRead", "[quest][cache]") {
  select::Quest quest;
  quest.token_budget = 1 << 20;
  quest.dense_layers = 0;
  KVCache<layout::GQA, quant::Q8_0, evict::KeepAll, select::Quest> cache(kShape, {}, {}, {}, {}, quest);
  KVCache<layout::GQA, quant::Q8_0> dense(kShape);
  const Data d = make_data(700, 1);
  const SeqId a = cache.add_sequence();
  const SeqId b = dense.add_sequence();
  fill(cache, a, d);
  fill(dense, b, d);
  const auto q = query_along(1, 1.0f);
  AttendReport report;
  CHECK(attend(cache, a, 1, q, &report) == attend(dense, b, 1, q));
  CHECK(report.pages_read == report.pages_total);
  CHECK(report.max_mass() == 0.0);
  CHECK_FALSE(report.fired);
  // The summaries are what Quest costs: 2·head_dim + 2 floats per page.
  CHECK(cache.memory().page_metadata - dense.memory().page_metadata ==
        cache.memory().pages_in_use * (2 * kShape.head_dim + 2) * sizeof(float));
}

TEST_CASE("Quest reads the pages of the needles, the dense layers read everything", "[quest][cache]") {
  select::Quest quest;
  quest.token_budget = 3 * 32;  // three pages per KV head
  quest.dense_layers = 1;
  using Cache = KVCache<layout::GQA, quant::Float<float>, evict::KeepAll, select::Quest>;
  Cache cache(kShape, {}, {}, {}, {}, quest);
  KVCache<layout::GQA, quant::Float<float>> dense(kShape);
  const std::vector<index_t> needles{100, 550, 801};  // pages 3, 17 and 25
  const Data d = make_data(1000, 2, needles);
  const SeqId a = cache.add_sequence();
  const SeqId b = dense.add_sequence();
  fill(cache, a, d);
  fill(dense, b, d);
  const auto q = query_along(2, 1.5f);
  CHECK(attend(cache, a, 0, q) == attend(dense, b, 0, q));  // layer 0 is dense

  AttendReport report;
  const auto out = attend(cache, a, 1, q, &report);
  CHECK(report.pages_read == 3 * static_cast<std::size_t>(kShape.kv_heads));
  for (index_t s = 0; s < kShape.kv_heads; ++s) CHECK(report.read_pages[s] == std::vector<index_t>{3, 17, 25});
  // Reference: exact attention over pages 3, 17, 25 and the 8-token tail (992..999).
  for (index_t h = 0; h < kShape.q_heads; ++h) {
    const index_t s = h / kShape.group_size();
    std::vector<float> k, v;
    for (index_t t = 0; t < d.tokens; ++t) {
      const index_t page = t / 32;
      if (t < 992 && page != 3 && page != 17 && page != 25) continue;
      const std::size_t at = (static_cast<std::size_t>(t) * kShape.kv_heads + s) * kShape.head_dim;
      k.insert(k.end(), d.keys.begin() + at, d.keys.begin() + at + kShape.head_dim);
      v.insert(v.end(), d.values.begin() + at, d.values.begin() + at + kShape.head_dim);
    }
    std::vector<double> want(kShape.head_dim);
    const index_t n = static_cast<index_t>(k.size() / kShape.head_dim);
    eval::exact_attention_head({k.data(), kShape.head_dim, n, kShape.head_dim}, {v.data(), kShape.head_dim, n, kShape.head_dim},
                               q.data() + static_cast<std::size_t>(h) * kShape.head_dim, kScale, want.data());
    for (index_t c = 0; c < kShape.head_dim; ++c) {
      CHECK(out[static_cast<std::size_t>(h) * kShape.head_dim + c] == Approx(want[c]).margin(1e-5));
    }
  }
}

namespace {

/// Runs `cache` (with Quest) and a KeepAll twin over the same tokens and queries, and checks the
/// certified bound per head against the true unread mass. Returns the largest bound/true ratio
/// seen where the true mass is above 1e-3 (how loose it gets where it matters).
template <class Cache, class Twin>
double check_bound(Cache& cache, Twin& twin, const Data& d, const std::vector<std::vector<float>>& queries,
                   index_t decode_tokens) {
  const SeqId a = cache.add_sequence();
  const SeqId b = twin.add_sequence();
  const auto observation = test::random_rows(16 * static_cast<std::size_t>(kShape.q_heads), kShape.head_dim, 99);
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    cache.prefill(a, layer, std::span<const float>(d.keys), std::span<const float>(d.values),
                  std::span<const float>(observation));
    twin.prefill(b, layer, std::span<const float>(d.keys), std::span<const float>(d.values));
  }
  for (index_t t = 0; t < decode_tokens; ++t) {
    const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 5000 + 2 * t);
    const auto v = test::random_rows(kShape.kv_heads, kShape.head_dim, 5001 + 2 * t);
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      cache.append(a, layer, std::span<const float>(k), std::span<const float>(v), d.tokens + t);
      twin.append(b, layer, std::span<const float>(k), std::span<const float>(v), d.tokens + t);
    }
  }
  double loosest = 1.0;
  for (const auto& q : queries) {
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      AttendReport report;
      (void)attend(cache, a, layer, q, &report);
      for (index_t s = 0; s < kShape.kv_heads; ++s) {
        const auto truth = true_unread_mass(twin, b, layer, s, read_positions(cache, a, layer, s, report), q);
        for (index_t g = 0; g < kShape.group_size(); ++g) {
          const double bound = report.heads[static_cast<std::size_t>(s * kShape.group_size() + g)].mass;
          INFO("layer " << layer << " head " << s * kShape.group_size() + g << ": bound " << bound << ", true " << truth[g]);
          CHECK(bound >= truth[g] - 1e-7);
          CHECK(report.heads[static_cast<std::size_t>(s * kShape.group_size() + g)].fired(0.5) == (bound > 0.5));
          if (truth[g] > 1e-3) loosest = std::max(loosest, bound / truth[g]);
        }
      }
    }
  }
  return loosest;
}

}  // namespace

TEST_CASE("the certified bound is never below the true unread mass: Quest alone", "[quest][cache][bound]") {
  select::Quest quest;
  quest.token_budget = 4 * 32;
  quest.dense_layers = 1;
  const Data d = make_data(1500, 3, {40, 700, 1300});
  std::vector<std::vector<float>> queries{query_along(3, 0.0f), query_along(3, 0.5f), query_along(3, 3.0f),
                                          std::vector<float>(kShape.q_heads * kShape.head_dim, 0.0f)};
  auto run = [&](auto quantizer) {
    using Q = decltype(quantizer);
    INFO(Q::key_codec::kName);
    KVCache<layout::GQA, Q, evict::KeepAll, select::Quest> cache(kShape, {}, {}, {}, {}, quest);
    KVCache<layout::GQA, Q> twin(kShape);
    // Measured: at most 1.21× the true mass where that is above 1e-3 (f16, q8_0, q4_0).
    CHECK(check_bound(cache, twin, d, queries, 20) < 2.0);
  };
  run(quant::Float<half>{});
  run(quant::Q8_0{});
  run(quant::Q4_0{});
}

TEST_CASE("the certified bound covers evicted tokens: StreamingLLM and SnapKV with Quest", "[quest][cache][bound]") {
  const Data d = make_data(1200, 4, {60, 600, 1100});
  std::vector<std::vector<float>> queries{query_along(4, 0.0f), query_along(4, 1.0f), query_along(4, 4.0f)};
  select::Quest reads_all;
  reads_all.token_budget = 1 << 20;
  select::Quest selective;
  selective.token_budget = 3 * 32;
  selective.dense_layers = 1;
  for (const select::Quest& quest : {reads_all, selective}) {
    INFO("token budget " << quest.token_budget);
    {
      using Cache = KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>, select::Quest>;
      Cache cache(kShape, {}, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{200}}, quest);
      KVCache<layout::GQA, quant::Q8_0> twin(kShape);
      CHECK(check_bound(cache, twin, d, queries, 70) < 2.0);  // measured 1.50×
      cache.release(1);
      CHECK(cache.memory().total() == 0);  // ghosts included
    }
    {
      evict::SnapKV<> snapkv;
      snapkv.window = 16;
      snapkv.budget.tokens = 256;
      CacheConfig config;
      config.tail_tokens = 64;  // rows dropped in the tail: exact scores in the bound
      using Cache = KVCache<layout::GQA, quant::Float<half>, evict::SnapKV<>, select::Quest>;
      Cache cache(kShape, config, {}, {}, snapkv, quest);
      KVCache<layout::GQA, quant::Float<half>> twin(kShape, config);
      CHECK(check_bound(cache, twin, d, queries, 10) < 2.0);  // measured 1.29×
    }
  }
}

TEST_CASE("H2O with Quest's summaries: the same evictions and outputs, and a bound on what it dropped",
          "[quest][cache][bound]") {
  const evict::H2O<> h2o{evict::Uniform{160}};
  select::Quest summaries;
  summaries.dense_layers = kShape.layers;  // every page read: H2O scores every live token
  KVCache<layout::GQA, quant::Float<half>, evict::H2O<>, select::Quest> cache(kShape, {}, {}, {}, h2o, summaries);
  KVCache<layout::GQA, quant::Float<half>, evict::H2O<>> plain(kShape, {}, {}, {}, h2o);
  KVCache<layout::GQA, quant::Float<half>> twin(kShape);
  const Data d = make_data(600, 6, {300});
  const auto observation = test::random_rows(16 * static_cast<std::size_t>(kShape.q_heads), kShape.head_dim, 61);
  const SeqId a = cache.add_sequence();
  const SeqId b = plain.add_sequence();
  const SeqId c = twin.add_sequence();
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    cache.prefill(a, layer, std::span<const float>(d.keys), std::span<const float>(d.values),
                  std::span<const float>(observation));
    plain.prefill(b, layer, std::span<const float>(d.keys), std::span<const float>(d.values),
                  std::span<const float>(observation));
    twin.prefill(c, layer, std::span<const float>(d.keys), std::span<const float>(d.values));
  }
  double largest_mass = 0.0;
  for (index_t t = 0; t < 48; ++t) {
    // Every 8th step asks along the needle's direction, which H2O may have dropped.
    const auto q = t % 8 == 7 ? query_along(6, 3.0f) : test::random_rows(kShape.q_heads, kShape.head_dim, 700 + t);
    const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 800 + 2 * t);
    const auto v = test::random_rows(kShape.kv_heads, kShape.head_dim, 801 + 2 * t);
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      AttendReport report;
      const auto with_summaries = attend(cache, a, layer, q, &report);
      CHECK(with_summaries == attend(plain, b, layer, q));  // the scores H2O keeps are the same
      CHECK(report.pages_read == report.pages_total);
      for (index_t s = 0; s < kShape.kv_heads; ++s) {
        const StoredTokens kept = cache.read_back(a, layer, s);
        CHECK(kept.positions == plain.read_back(b, layer, s).positions);
        const std::set<std::int32_t> read(kept.positions.begin(), kept.positions.end());
        const auto truth = true_unread_mass(twin, c, layer, s, read, q);
        for (index_t g = 0; g < kShape.group_size(); ++g) {
          const double bound = report.heads[static_cast<std::size_t>(s * kShape.group_size() + g)].mass;
          INFO("step " << t << " layer " << layer << " head " << s * kShape.group_size() + g << ": bound " << bound
                       << ", true " << truth[g]);
          CHECK(bound >= truth[g] - 1e-7);
          largest_mass = std::max(largest_mass, truth[g]);
        }
      }
      cache.append(a, layer, std::span<const float>(k), std::span<const float>(v), d.tokens + t);
      plain.append(b, layer, std::span<const float>(k), std::span<const float>(v), d.tokens + t);
      twin.append(c, layer, std::span<const float>(k), std::span<const float>(v), d.tokens + t);
    }
  }
  CHECK(cache.live_tokens(a, 0, 0) < twin.live_tokens(c, 0, 0));  // H2O did evict
  CHECK(largest_mass > 1e-3);                      // and what it dropped mattered somewhere
}

TEST_CASE("H2O with Quest skipping pages is refused: unread tokens would go unscored", "[quest][cache]") {
  select::Quest selective;
  selective.dense_layers = kShape.layers - 1;
  try {
    KVCache<layout::GQA, quant::Float<half>, evict::H2O<>, select::Quest> cache(kShape, {}, {}, {}, {}, selective);
    FAIL("accepted");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK(std::string(e.what()).find("dense_layers must cover all 2 layers, got 1") != std::string::npos);
  }
}

TEST_CASE("the detector fires when an evicted needle is asked for", "[quest][cache][bound]") {
  select::Quest quest;
  quest.token_budget = 1 << 20;  // read every page: only eviction leaves tokens unread
  using Cache = KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>, select::Quest>;
  Cache cache(kShape, {}, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{128}}, quest);
  const Data d = make_data(1024, 5, {500});
  const SeqId seq = cache.add_sequence();
  fill(cache, seq, d);
  AttendReport asked;
  asked.epsilon = 0.1;
  (void)attend(cache, seq, 1, query_along(5, 4.0f), &asked);  // the needle held ≥ 90 % with every token
  CHECK(asked.fired);
  CHECK(asked.max_mass() > 0.9);
  CHECK(asked.pages_read == asked.pages_total);
  // Without summaries an evicting cache cannot certify anything, and says so.
  KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>> no_summaries(kShape);
  const SeqId other = no_summaries.add_sequence();
  no_summaries.prefill(other, 0, std::span<const float>(d.keys), std::span<const float>(d.values));
  AttendReport unasked;
  const auto q = query_along(5, 1.0f);
  std::vector<float> out(q.size());
  CHECK_THROWS_WITH(no_summaries.attend(other, 0, std::span<const float>(q), std::span<float>(out), kScale, &unasked),
                    Catch::Contains("needs its pages' summaries"));
}
