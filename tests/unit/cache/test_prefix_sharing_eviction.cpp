// Prefix sharing in evicting caches: tokens on shared prompt pages are pinned in every sequence
// that holds them (evicting one would free nothing while others hold its page), so a sequence
// that adopted a cached prefix evicts exactly as a cache without sharing does with that span
// pinned; pages an evictor changed (dead slots, compaction) are never cached.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;
using TokenId = paging::TokenId;

const ModelShape kShape{2, 4, 2, 32};
constexpr index_t kPage = 16;
constexpr std::size_t kRow = 2 * 32;  // kv_heads * head_dim

std::vector<TokenId> tokens(std::size_t n, TokenId first) {
  std::vector<TokenId> out(n);
  std::iota(out.begin(), out.end(), first);
  return out;
}

/// One layer's K/V rows [from, to) of a seeded stream, and observation queries.
struct LayerRows {
  std::vector<float> keys, values, observation;
};
LayerRows layer_rows(std::size_t count, index_t layer) {
  const auto seed = static_cast<std::uint32_t>(layer);
  return {test::random_rows(count * 2, 32, 100 + seed), test::random_rows(count * 2, 32, 200 + seed),
          test::random_rows(8 * 4, 32, 300 + seed)};
}

template <class Cache>
void prefill_rows(Cache& cache, SeqId seq, std::size_t from, std::size_t to, bool observe) {
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    const LayerRows rows = layer_rows(to, layer);
    cache.prefill(seq, layer, std::span<const float>(rows.keys).subspan(from * kRow, (to - from) * kRow),
                  std::span<const float>(rows.values).subspan(from * kRow, (to - from) * kRow),
                  observe ? std::span<const float>(rows.observation) : std::span<const float>());
  }
}

template <class Cache>
void append_rows(Cache& cache, SeqId seq, std::int64_t position, std::uint32_t seed) {
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    const auto k = test::random_rows(2, 32, seed + static_cast<std::uint32_t>(layer));
    const auto v = test::random_rows(2, 32, seed + 50 + static_cast<std::uint32_t>(layer));
    cache.append(seq, layer, std::span<const float>(k), std::span<const float>(v), position);
  }
}

template <class Cache>
std::vector<float> attend(const Cache& cache, SeqId seq, index_t layer) {
  const auto q = test::random_rows(4, 32, 99);
  std::vector<float> out(q.size());
  cache.attend(seq, layer, std::span<const float>(q), std::span<float>(out), 0.17f);
  return out;
}

/// Every layer and stream of `seq` in `a` holds what `twin` of `b` holds, and attends alike.
template <class Cache>
void check_same(const Cache& a, SeqId seq, const Cache& b, SeqId twin) {
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    INFO("layer " << layer);
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      const StoredTokens x = a.read_back(seq, layer, s), y = b.read_back(twin, layer, s);
      CHECK(x.positions == y.positions);
      CHECK(x.keys == y.keys);
      CHECK(x.values == y.values);
    }
    CHECK(attend(a, seq, layer) == attend(b, twin, layer));
  }
}

/// Whether positions [0, n) all survive in every stream of every layer.
template <class Cache>
bool holds_prefix(const Cache& cache, SeqId seq, std::int32_t n) {
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      const StoredTokens stored = cache.read_back(seq, layer, s);
      if (stored.size() < n) return false;
      for (std::int32_t i = 0; i < n; ++i) {
        if (stored.positions[static_cast<std::size_t>(i)] != i) return false;
      }
    }
  }
  return true;
}

template <class Evictor>
void check_shared_prefix_under_eviction(const Evictor& evictor) {
  using Cache = KVCache<layout::GQA, quant::Float<half>, Evictor>;
  CacheConfig config;
  config.page_size = kPage;
  config.prefix_sharing = PrefixSharing{"evicting"};
  CacheConfig plain_config = config;
  plain_config.prefix_sharing.reset();
  Cache shared(kShape, config, {}, {}, evictor);
  Cache plain(kShape, plain_config, {}, {}, evictor);

  // A: a 64-token system prompt, under every budget below (nothing evicted), then shared.
  const PrefixHit a = shared.add_sequence(tokens(64, 1000));
  prefill_rows(shared, a.seq, 0, 64, false);
  REQUIRE(shared.share_prefix(a.seq) == 64);

  // B: the same prompt and 56 tokens of its own: the 64 adopted, the rest prefilled and evicted
  // from; the twin prefills all 120 with the 64 pinned.
  std::vector<TokenId> prompt_b = tokens(64, 1000);
  const std::vector<TokenId> own = tokens(56, 5000);
  prompt_b.insert(prompt_b.end(), own.begin(), own.end());
  const PrefixHit b = shared.add_sequence(prompt_b);
  REQUIRE(b.cached_tokens == 64);
  prefill_rows(shared, b.seq, 64, 120, true);
  const SeqId twin = plain.add_sequence();
  plain.pin(twin, 0, 63);
  prefill_rows(plain, twin, 0, 120, true);
  CHECK(shared.live_tokens(b.seq, 0, 0) < 120);  // the budget made B evict
  check_same(shared, b.seq, plain, twin);
  // Decode steps evict again (H2O, StreamingLLM): still the twin's choices, the prompt kept.
  for (std::int64_t position = 120; position < 140; ++position) {
    append_rows(shared, b.seq, position, static_cast<std::uint32_t>(position));
    append_rows(plain, twin, position, static_cast<std::uint32_t>(position));
  }
  check_same(shared, b.seq, plain, twin);
  CHECK(holds_prefix(shared, b.seq, 64));
  // The shared pages were never copied: B's first four pages are A's.
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    for (index_t s = 0; s < kShape.kv_heads; ++s) {
      const auto pa = shared.pages(a.seq, layer, s), pb = shared.pages(b.seq, layer, s);
      CHECK(std::equal(pa.begin(), pa.begin() + 4, pb.begin()));
    }
  }

  // A, once shared, keeps its prompt too when its own decoding makes it evict.
  if constexpr (Evictor::kEvictsOnAppend) {
    for (std::int64_t position = 64; position < 160; ++position) {
      append_rows(shared, a.seq, position, 7000 + static_cast<std::uint32_t>(position));
    }
    CHECK(shared.live_tokens(a.seq, 0, 0) < 160);
    CHECK(holds_prefix(shared, a.seq, 64));
  }
}

}  // namespace

TEST_CASE("evicting caches share prompt pages: the shared span is pinned and evicts as in a twin", "[cache][prefix][evict]") {
  SECTION("StreamingLLM") { check_shared_prefix_under_eviction(evict::StreamingLLM<>{4, evict::Uniform{80}}); }
  SECTION("H2O") { check_shared_prefix_under_eviction(evict::H2O<>{evict::Uniform{80}}); }
  SECTION("SnapKV") { check_shared_prefix_under_eviction(evict::SnapKV<>{.budget = evict::Uniform{80}}); }
}

TEST_CASE("pages an evictor changed are not cached", "[cache][prefix][evict]") {
  // StreamingLLM keeps 4 sinks and the newest 76 of 120 tokens: page 0 loses slots 4–15, so no
  // page from position 0 on is whole and nothing is shared.
  using Cache = KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>>;
  CacheConfig config;
  config.page_size = kPage;
  config.prefix_sharing = PrefixSharing{"evicting"};
  Cache cache(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{80}});
  const PrefixHit a = cache.add_sequence(tokens(120, 1000));
  prefill_rows(cache, a.seq, 0, 120, false);
  REQUIRE(cache.live_tokens(a.seq, 0, 0) == 80);
  CHECK(cache.share_prefix(a.seq) == 0);
  cache.release(a.seq);
  CHECK(cache.prefix_stats().cached_pages == 0);
  CHECK(cache.add_sequence(tokens(120, 1000)).cached_tokens == 0);
}

TEST_CASE("eviction's copy-on-write makes room from cached prefix pages, as writes do", "[cache][prefix][evict]") {
  // A pool full of cached pages no sequence uses: a fork's eviction must copy a page it shares
  // with its parent. It used to take the copy from the free list alone, fail, and leave the
  // tokens alive, so the fork grew past its budget while the index held reclaimable pages.
  using Cache = KVCache<layout::GQA, quant::Float<half>, evict::StreamingLLM<>>;
  CacheConfig config;
  config.page_size = kPage;
  config.prefix_sharing = PrefixSharing{"evicting"};
  config.max_pages = 12 + 40;  // the parent's 3 pages per (layer, stream), and 10 cached ones
  Cache cache(kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{80}});
  const SeqId parent = cache.add_sequence();
  prefill_rows(cache, parent, 0, 48, false);
  for (const TokenId first : {9000, 9500}) {  // two prompts within the budget: cached whole
    const PrefixHit cached = cache.add_sequence(tokens(80, first));
    prefill_rows(cache, cached.seq, 0, 80, false);
    cache.release(cached.seq);
  }
  REQUIRE(cache.prefix_stats().cached_pool_pages == 40);
  REQUIRE(cache.memory().pages_in_use == 52);  // the pool is full
  const SeqId child = cache.fork(parent);
  for (std::int64_t position = 48; position < 100; ++position) {
    append_rows(cache, child, position, 8000 + static_cast<std::uint32_t>(position));
  }
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    for (index_t s = 0; s < kShape.kv_heads; ++s) CHECK(cache.live_tokens(child, layer, s) == 80);
  }
  CHECK(cache.live_tokens(parent, 0, 0) == 48);
  CHECK(cache.prefix_stats().cached_pool_pages < 40);
}
