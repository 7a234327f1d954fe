// Prefix sharing inside KVCache (CacheConfig::prefix_sharing): add_sequence(tokens) adopts the
// cached pages of a prompt prefix, prefill continues after them, prompts are cached at release and
// by share_prefix, a full pool reclaims cached pages, and errors leave the cache as it was.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/alloc_failure.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;
using TokenId = paging::TokenId;

const ModelShape kShape{2, 4, 2, 32};  // 2 layers, 2 KV heads of 32: q8_0's blocks fit
constexpr index_t kPage = 16;
constexpr std::size_t kRow = 2 * 32;  // kv_heads * head_dim

CacheConfig sharing_config(index_t tail_tokens = 0) {
  CacheConfig config;
  config.page_size = kPage;
  config.tail_tokens = tail_tokens;
  config.prefix_sharing = PrefixSharing{"test-model"};
  return config;
}

std::vector<TokenId> tokens(std::size_t n, TokenId first) {
  std::vector<TokenId> out(n);
  std::iota(out.begin(), out.end(), first);
  return out;
}

/// K/V rows of one layer: [tokens][kv_heads][head_dim], rows [from, to) of a seeded stream, so a
/// prompt's first rows are the same whichever sequence writes them.
struct Rows {
  std::vector<float> keys, values;
};
Rows rows(std::size_t count, std::uint32_t seed, index_t layer) {
  return {test::random_rows(count * 2, 32, seed * 16 + static_cast<std::uint32_t>(layer)),
          test::random_rows(count * 2, 32, seed * 16 + 8 + static_cast<std::uint32_t>(layer))};
}
/// The K/V of a prompt whose first `shared` tokens come from stream `a` and the rest from `b`.
Rows prompt_rows(std::size_t shared, std::uint32_t a, std::size_t own, std::uint32_t b, index_t layer) {
  Rows out = rows(shared, a, layer);
  const Rows rest = rows(own, b, layer);
  out.keys.insert(out.keys.end(), rest.keys.begin(), rest.keys.end());
  out.values.insert(out.values.end(), rest.values.begin(), rest.values.end());
  return out;
}

template <class Cache>
void prefill_from(Cache& cache, SeqId seq, const std::vector<Rows>& layers, std::size_t from) {
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    const Rows& r = layers[static_cast<std::size_t>(layer)];
    cache.prefill(seq, layer, std::span<const float>(r.keys).subspan(from * kRow),
                  std::span<const float>(r.values).subspan(from * kRow));
  }
}

std::vector<Rows> all_layers(std::size_t shared, std::uint32_t a, std::size_t own, std::uint32_t b) {
  std::vector<Rows> out;
  for (index_t layer = 0; layer < kShape.layers; ++layer) out.push_back(prompt_rows(shared, a, own, b, layer));
  return out;
}

template <class Cache>
std::vector<float> attend(const Cache& cache, SeqId seq, index_t layer) {
  const auto q = test::random_rows(static_cast<std::size_t>(kShape.q_heads), 32, 99);
  std::vector<float> out(q.size());
  cache.attend(seq, layer, std::span<const float>(q), std::span<float>(out), 0.17f);
  return out;
}

template <class Cache>
std::size_t pages_of(const Cache& cache) {
  return cache.memory().pages_in_use;
}

/// Streams a token page covers: layers × KV heads.
constexpr std::size_t kStreams = 2 * 2;

template <class Quantizer>
void check_hit_matches_full_prefill(const CacheConfig& config, std::size_t a_len, std::size_t common,
                                    std::size_t own) {
  // A: an a_len-token prompt (K/V stream 1); B: A's first `common` tokens and `own` of its own
  // (stream 2), against a cache without sharing that prefills B's whole prompt.
  const index_t tail_tokens = config.tail_tokens;
  KVCache<layout::GQA, Quantizer> shared(kShape, config);
  CacheConfig plain_config = config;
  plain_config.prefix_sharing.reset();
  KVCache<layout::GQA, Quantizer> plain(kShape, plain_config);
  const auto page = static_cast<std::size_t>(kPage);
  const auto tail = static_cast<std::size_t>(tail_tokens);
  auto pages_after_prefill = [&](std::size_t n) { return n >= tail + page ? (n - tail) / page : 0; };

  const PrefixHit a = shared.add_sequence(tokens(a_len, 1000));
  CHECK(a.cached_tokens == 0);
  prefill_from(shared, a.seq, all_layers(a_len, 1, 0, 2), 0);
  // Whole pages of the prompt that left the tail.
  const std::size_t cached_pages = pages_after_prefill(a_len);
  CHECK(shared.share_prefix(a.seq) == static_cast<index_t>(cached_pages * page));

  std::vector<TokenId> prompt_b = tokens(common, 1000);
  const std::vector<TokenId> own_tokens = tokens(own, 5000);
  prompt_b.insert(prompt_b.end(), own_tokens.begin(), own_tokens.end());
  const std::size_t pages_before = pages_of(shared);
  const PrefixHit b = shared.add_sequence(prompt_b);
  // Matching whole pages, leaving max(1, tail) tokens to prefill.
  const std::size_t left = std::max<std::size_t>(1, tail);
  const std::size_t hit = std::min({cached_pages, common / page, (prompt_b.size() - left) / page}) * page;
  REQUIRE(static_cast<std::size_t>(b.cached_tokens) == hit);
  CHECK(pages_of(shared) == pages_before);  // adopted, not copied
  CHECK(shared.length(b.seq, 1) == b.cached_tokens);
  CHECK(shared.last_position(b.seq, 1) == b.cached_tokens - 1);
  const std::vector<Rows> kv_b = all_layers(common, 1, own, 2);
  prefill_from(shared, b.seq, kv_b, hit);
  // Only B's unshared whole pages are new.
  CHECK(pages_of(shared) == pages_before + (pages_after_prefill(prompt_b.size()) - hit / page) * kStreams);

  const SeqId full = plain.add_sequence();
  prefill_from(plain, full, kv_b, 0);
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    CHECK(shared.length(b.seq, layer) == plain.length(full, layer));
    CHECK(attend(shared, b.seq, layer) == attend(plain, full, layer));  // bit-identical
    for (index_t s = 0; s < 2; ++s) {
      const StoredTokens x = shared.read_back(b.seq, layer, s), y = plain.read_back(full, layer, s);
      CHECK(x.positions == y.positions);
      CHECK(x.keys == y.keys);
      CHECK(x.values == y.values);
    }
  }
  const paging::PrefixIndexStats stats = shared.prefix_stats();
  CHECK(stats.lookups == 2);
  CHECK(stats.hit_tokens == hit);
  CHECK(stats.pages_saved == hit / kPage * kStreams);
}

}  // namespace

TEST_CASE("a second sequence reuses the cached prompt pages and attends bit-identically to a full prefill",
          "[cache][prefix]") {
  SECTION("f16, no extra tail") { check_hit_matches_full_prefill<quant::Float<half>>(sharing_config(), 100, 80, 40); }
  SECTION("q8_0, no extra tail") { check_hit_matches_full_prefill<quant::Q8_0>(sharing_config(), 100, 80, 40); }
  SECTION("q8_0, B a prefix of A") { check_hit_matches_full_prefill<quant::Q8_0>(sharing_config(), 100, 64, 0); }
  // With a 32-token fp32 tail, A's last 32 tokens were never encoded, and the hit leaves at
  // least 32 tokens to prefill so that B's tail fills as a full prefill's does: B, A's first 100
  // tokens, reuses 64 of A's 128 cached, not 96.
  SECTION("q4_0, tail_tokens 32") { check_hit_matches_full_prefill<quant::Q4_0>(sharing_config(32), 100, 80, 40); }
  SECTION("q4_0, tail_tokens 32, B a prefix of A") {
    check_hit_matches_full_prefill<quant::Q4_0>(sharing_config(32), 160, 100, 0);
  }
  // Keys stored before RoPE are rotated by the positions in the shared pages' metadata.
  SECTION("q8_0, pre-RoPE keys") {
    CacheConfig config = sharing_config();
    config.key_rope = RopeSpec{};
    check_hit_matches_full_prefill<quant::Q8_0>(config, 100, 80, 40);
  }
  // Page summaries live in the shared pages' metadata, written once from the same bytes.
  SECTION("f16 with select::Quest") {
    // Not templated on the selector: a direct check of one combination.
    using Quest = KVCache<layout::GQA, quant::Float<half>, evict::KeepAll, select::Quest>;
    select::Quest quest;
    quest.token_budget = 32;
    quest.dense_layers = 0;
    Quest shared(kShape, sharing_config(), {}, {}, {}, quest);
    CacheConfig plain_config = sharing_config();
    plain_config.prefix_sharing.reset();
    Quest plain(kShape, plain_config, {}, {}, {}, quest);
    const PrefixHit a = shared.add_sequence(tokens(100, 0));
    prefill_from(shared, a.seq, all_layers(100, 1, 0, 2), 0);
    shared.share_prefix(a.seq);
    std::vector<TokenId> prompt_b = tokens(80, 0);
    const std::vector<TokenId> own = tokens(40, 900);
    prompt_b.insert(prompt_b.end(), own.begin(), own.end());
    const PrefixHit b = shared.add_sequence(prompt_b);
    REQUIRE(b.cached_tokens == 80);
    const std::vector<Rows> kv_b = all_layers(80, 1, 40, 2);
    prefill_from(shared, b.seq, kv_b, 80);
    const SeqId full = plain.add_sequence();
    prefill_from(plain, full, kv_b, 0);
    for (index_t layer = 0; layer < kShape.layers; ++layer) CHECK(attend(shared, b.seq, layer) == attend(plain, full, layer));
  }
}

TEST_CASE("the hit leaves the tail's tokens and the last token to prefill", "[cache][prefix]") {
  KVCache<layout::GQA, quant::Q8_0> cache(kShape, sharing_config(32));
  const std::vector<TokenId> prompt = tokens(96, 0);
  const PrefixHit a = cache.add_sequence(prompt);
  prefill_from(cache, a.seq, all_layers(96, 1, 0, 2), 0);
  CHECK(cache.share_prefix(a.seq) == 64);  // 96 − 32 tail tokens = 4 pages
  // The same 96 tokens: at most 96 − 32 may be reused.
  CHECK(cache.add_sequence(prompt).cached_tokens == 64);

  KVCache<layout::GQA, quant::Q8_0> no_tail(kShape, sharing_config(0));
  const PrefixHit c = no_tail.add_sequence(prompt);
  prefill_from(no_tail, c.seq, all_layers(96, 1, 0, 2), 0);
  CHECK(no_tail.share_prefix(c.seq) == 96);
  // All 96 cached, but the last token is always left to prefill: 5 pages.
  CHECK(no_tail.add_sequence(prompt).cached_tokens == 80);
  CHECK(no_tail.add_sequence(tokens(97, 0)).cached_tokens == 96);
}

TEST_CASE("partial pages and differing tokens are never shared", "[cache][prefix]") {
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, sharing_config());
  const PrefixHit a = cache.add_sequence(tokens(40, 0));
  prefill_from(cache, a.seq, all_layers(40, 1, 0, 2), 0);
  CHECK(cache.share_prefix(a.seq) == 32);  // 2 whole pages; the last 8 tokens are not a page
  CHECK(cache.prefix_stats().cached_pages == 2);

  std::vector<TokenId> prompt = tokens(60, 0);
  CHECK(cache.add_sequence(prompt).cached_tokens == 32);
  prompt[31] = -7;  // the second page differs in its last token
  CHECK(cache.add_sequence(prompt).cached_tokens == 16);
  prompt[0] = -7;
  CHECK(cache.add_sequence(prompt).cached_tokens == 0);
}

TEST_CASE("different salts never share; a fork shares the lease", "[cache][prefix]") {
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, sharing_config());
  const std::vector<TokenId> prompt = tokens(64, 0);
  const PrefixHit a = cache.add_sequence(prompt, "tenant-a");
  prefill_from(cache, a.seq, all_layers(64, 1, 0, 2), 0);
  cache.share_prefix(a.seq);
  CHECK(cache.add_sequence(prompt, "tenant-b").cached_tokens == 0);
  CHECK(cache.add_sequence(prompt).cached_tokens == 0);
  const PrefixHit b = cache.add_sequence(prompt, "tenant-a");
  CHECK(b.cached_tokens == 48);
  CHECK(cache.prefix_stats().namespaces == 1);

  // The fork keeps b's 3 pages pinned after a and b go. Only a's fourth page, which b wrote
  // again for itself (the index keeps the first copy), is freed by eviction.
  prefill_from(cache, b.seq, all_layers(64, 1, 0, 2), 48);
  const std::vector<float> before = attend(cache, b.seq, 0);
  const SeqId forked = cache.fork(b.seq);
  cache.release(a.seq);
  cache.release(b.seq);
  const std::size_t pages = pages_of(cache);
  CHECK(pages == 5 * kStreams);
  const paging::PrefixEviction evicted = cache.evict_prefix_cache();
  CHECK(evicted.token_pages == 1);  // the fork's lease pins the first three
  CHECK(evicted.pool_pages_freed == kStreams);
  CHECK(pages_of(cache) == pages - kStreams);
  CHECK(attend(cache, forked, 0) == before);
}

TEST_CASE("releasing the first sequence keeps the pages for the second; evicting then empties the pool",
          "[cache][prefix]") {
  KVCache<layout::GQA, quant::Q8_0> cache(kShape, sharing_config());
  const std::vector<TokenId> prompt = tokens(70, 0);
  const PrefixHit a = cache.add_sequence(prompt);
  prefill_from(cache, a.seq, all_layers(70, 1, 0, 2), 0);
  const PrefixHit early = cache.add_sequence(prompt);
  CHECK(early.cached_tokens == 0);  // nothing cached until share_prefix or release
  cache.release(early.seq);
  cache.release(a.seq);  // caches its 4 whole prompt pages
  CHECK(cache.prefix_stats().cached_pages == 4);
  CHECK(pages_of(cache) == 4 * kStreams);  // the index holds them: nothing else does

  const PrefixHit b = cache.add_sequence(prompt);
  CHECK(b.cached_tokens == 64);
  prefill_from(cache, b.seq, all_layers(70, 1, 0, 2), 64);
  const std::vector<float> before = attend(cache, b.seq, 1);
  // Evicting while b lives drops the index's references only: b's pages stay.
  CHECK(cache.evict_prefix_cache().pool_pages_freed == 0);
  CHECK(attend(cache, b.seq, 1) == before);
  CHECK(pages_of(cache) == 4 * kStreams);
  cache.release(b.seq);  // caches the 4 pages again (b holds them), nothing more: 70 tokens
  CHECK(cache.prefix_stats().cached_pages == 4);
  CHECK(cache.evict_prefix_cache().pool_pages_freed == 4 * kStreams);
  const MemoryUsage m = cache.memory();
  CHECK(m.pages_in_use == 0);
  CHECK(m.total() == 0);
  CHECK(cache.prefix_stats().cached_pages == 0);
}

TEST_CASE("a full pool reclaims cached prefix pages before failing a write", "[cache][prefix]") {
  CacheConfig config = sharing_config();
  config.max_pages = 8 * kStreams;
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, config);
  const PrefixHit a = cache.add_sequence(tokens(96, 0));
  prefill_from(cache, a.seq, all_layers(96, 1, 0, 2), 0);  // 6 pages per stream
  cache.release(a.seq);
  REQUIRE(pages_of(cache) == 6 * kStreams);

  // 5 pages per stream need 3 of the 6 cached ones back: the least recently used leaves go.
  const SeqId c = cache.add_sequence();
  prefill_from(cache, c, all_layers(80, 3, 0, 4), 0);
  CHECK(cache.length(c, 0) == 80);
  CHECK(cache.prefix_stats().cached_pages == 3);
  CHECK(cache.prefix_stats().evicted_pages == 3);
  CHECK(pages_of(cache) == 8 * kStreams);
  // The surviving prefix still serves a hit.
  CHECK(cache.add_sequence(tokens(96, 0)).cached_tokens == 48);
}

TEST_CASE("a pool full of pages a live sequence holds still fails, leaving everything as it was",
          "[cache][prefix]") {
  CacheConfig config = sharing_config();
  config.max_pages = 6 * kStreams;
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, config);
  const PrefixHit a = cache.add_sequence(tokens(96, 0));
  prefill_from(cache, a.seq, all_layers(96, 1, 0, 2), 0);
  cache.share_prefix(a.seq);
  const PrefixHit b = cache.add_sequence(tokens(112, 0));
  REQUIRE(b.cached_tokens == 96);
  const std::vector<float> before = attend(cache, b.seq, 0);
  const MemoryUsage m = cache.memory();
  const Rows extra = rows(16, 5, 0);
  try {
    cache.prefill(b.seq, 0, std::span<const float>(extra.keys), std::span<const float>(extra.values));
    FAIL("expected OutOfPages");
  } catch (const OutOfPages& e) {
    CHECK(e.code() == ErrorCode::kOutOfPages);
  }
  CHECK(cache.length(b.seq, 0) == 96);
  CHECK(attend(cache, b.seq, 0) == before);
  CHECK(cache.memory().pages_in_use == m.pages_in_use);
  CHECK(cache.memory().total() == m.total());
  CHECK(cache.prefix_stats().cached_pages == 6);  // pinned by a and b: nothing to reclaim
}

TEST_CASE("a calibrating FP8 cache shares only pages encoded with its calibrated scales", "[cache][prefix]") {
  KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> cache(kShape, sharing_config());
  const std::vector<TokenId> prompt = tokens(64, 0);
  // A sequence that wrote less than a page calibrated nothing and caches nothing.
  const PrefixHit partial = cache.add_sequence(prompt);
  prefill_from(cache, partial.seq, all_layers(10, 1, 0, 2), 0);
  CHECK(cache.share_prefix(partial.seq) == 0);
  const auto uncalibrated = cache.codec_params(0, 0);

  const PrefixHit a = cache.add_sequence(prompt);
  prefill_from(cache, a.seq, all_layers(64, 1, 0, 2), 0);  // calibrates every layer
  CHECK(cache.codec_params(0, 0).first.scale != uncalibrated.first.scale);
  CHECK(cache.share_prefix(a.seq) == 64);
  const PrefixHit b = cache.add_sequence(prompt);
  REQUIRE(b.cached_tokens == 48);
  prefill_from(cache, b.seq, all_layers(64, 1, 0, 2), 48);
  for (index_t layer = 0; layer < kShape.layers; ++layer) CHECK(attend(cache, b.seq, layer) == attend(cache, a.seq, layer));
}

TEST_CASE("pages written at other positions than 0, 1, ... are not cached", "[cache][prefix]") {
  KVCache<layout::GQA, quant::Float<float>> cache(kShape, sharing_config());
  const PrefixHit a = cache.add_sequence(tokens(40, 0));
  const auto k = test::random_rows(2, 32, 1), v = test::random_rows(2, 32, 2);
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    for (std::int64_t t = 0; t < 40; ++t) {
      // A gap after token 19: the second page holds positions 16 … 19, 30 … 41.
      cache.append(a.seq, layer, std::span<const float>(k), std::span<const float>(v), t < 20 ? t : t + 10);
    }
  }
  CHECK(cache.share_prefix(a.seq) == 16);
}

TEST_CASE("prefix sharing's bad input", "[cache][prefix][errors]") {
  auto code_of = [](auto&& call) -> std::optional<ErrorCode> {
    try {
      call();
    } catch (const Error& e) {
      return e.code();
    }
    return std::nullopt;
  };
  SECTION("configurations it rejects when the cache is built") {
    CacheConfig config = sharing_config();
    config.prefix_sharing->model_id.clear();
    CHECK(code_of([&] { KVCache<layout::GQA, quant::Q8_0> c(kShape, config); }) == ErrorCode::kInvalidConfig);
    config = sharing_config();
    config.exact_prefix_tokens = 4;
    CHECK(code_of([&] { KVCache<layout::GQA, quant::Q8_0> c(kShape, config); }) == ErrorCode::kUnsupported);
  }
  SECTION("calls that fail leave the cache as it was") {
    KVCache<layout::GQA, quant::Q8_0> off(kShape, [] {
      CacheConfig c = sharing_config();
      c.prefix_sharing.reset();
      return c;
    }());
    const std::vector<TokenId> prompt = tokens(40, 0);
    CHECK(code_of([&] { (void)off.add_sequence(prompt); }) == ErrorCode::kUnsupported);
    CHECK(off.sequence_count() == 0);
    const SeqId plain = off.add_sequence();
    CHECK(code_of([&] { off.share_prefix(plain); }) == ErrorCode::kUnsupported);

    KVCache<layout::GQA, quant::Q8_0> cache(kShape, sharing_config());
    const PrefixHit a = cache.add_sequence(prompt);
    prefill_from(cache, a.seq, all_layers(40, 1, 0, 2), 0);
    const SeqId untokened = cache.add_sequence();
    const MemoryUsage m = cache.memory();
    const std::size_t lookups = cache.prefix_stats().lookups;
    CHECK(code_of([&] { cache.share_prefix(untokened); }) == ErrorCode::kInvalidArgument);
    CHECK(code_of([&] { cache.share_prefix(SeqId{12345}); }) == ErrorCode::kUnknownSequence);
    cache.release(untokened);
    CHECK(code_of([&] { cache.share_prefix(untokened); }) == ErrorCode::kUnknownSequence);
    CHECK(cache.prefix_stats().cached_pages == 0);
    CHECK(cache.prefix_stats().lookups == lookups);
    CHECK(cache.memory().pages_in_use == m.pages_in_use);
    CHECK(cache.length(a.seq, 0) == 40);
  }
}

TEST_CASE("a cache destroyed with live sequences, leases and cached pages frees everything", "[cache][prefix]") {
  // Run under ASan/LSan in the sanitizer job: the index goes after every lease, before the pool.
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, sharing_config());
  const PrefixHit a = cache.add_sequence(tokens(64, 0));
  prefill_from(cache, a.seq, all_layers(64, 1, 0, 2), 0);
  cache.share_prefix(a.seq);
  const PrefixHit b = cache.add_sequence(tokens(64, 0));
  CHECK(b.cached_tokens == 48);
  (void)cache.fork(b.seq);
  CHECK(cache.prefix_stats().cached_pages == 4);
}

TEST_CASE("prefix sharing's calls running out of memory at any allocation leave the cache as it was",
          "[cache][prefix][errors]") {
  if (!test::kAllocationFailures) {
    WARN("operator new is not replaced in this build (ThreadSanitizer): allocation failures not injected");
    return;
  }
  KVCache<layout::GQA, quant::Q8_0> cache(kShape, sharing_config());
  const std::vector<TokenId> prompt = tokens(64, 0);
  const PrefixHit a = cache.add_sequence(prompt);
  prefill_from(cache, a.seq, all_layers(64, 1, 0, 2), 0);
  // Runs call() with the n-th allocation failing, n = 0, 1, ... until it succeeds; returns the
  // failures. What a failed call may change: only the index's lookup counters (match counts
  // the lookup before the sequence's buffers are allocated).
  auto fail_each_allocation = [&](const char* what, auto call) {
    INFO(what);
    long failures = 0;
    for (;; ++failures) {
      REQUIRE(failures < 10000);
      const MemoryUsage before = cache.memory();
      const std::size_t sequences = cache.sequence_count();
      const paging::PrefixIndexStats stats = cache.prefix_stats();
      bool failed = false;
      test::allocations_until_failure = failures;
      try {
        call();
      } catch (const std::bad_alloc&) {
        failed = true;
      }
      test::allocations_until_failure = -1;
      if (!failed) break;
      INFO("allocation " << failures << " failed");
      const MemoryUsage after = cache.memory();
      CHECK(after.pages_in_use == before.pages_in_use);
      CHECK(after.total() == before.total());
      CHECK(after.stored_elements == before.stored_elements);
      CHECK(cache.sequence_count() == sequences);
      CHECK(cache.prefix_stats().cached_pages == stats.cached_pages);
      CHECK(cache.prefix_stats().inserted_pages == stats.inserted_pages);
      CHECK(cache.length(a.seq, 0) == 64);
    }
    return failures;
  };
  // (No CHECK inside a call: Catch would take its bad_alloc for a failed assertion.)
  index_t shared = 0;
  CHECK(fail_each_allocation("share_prefix", [&] { shared = cache.share_prefix(a.seq); }) >= 3);
  CHECK(shared == 64);
  CHECK(cache.prefix_stats().cached_pages == 4);
  PrefixHit b;
  CHECK(fail_each_allocation("add_sequence with a hit", [&] { b = cache.add_sequence(prompt); }) >= 3);
  REQUIRE(b.cached_tokens == 48);
  CHECK(cache.pool().ref_count(cache.pages(b.seq, 0, 0)[0]) == 3);  // a, the index, b
  SeqId forked = 0;
  CHECK(fail_each_allocation("fork of a sequence with a lease", [&] { forked = cache.fork(b.seq); }) >= 1);
  CHECK(cache.pool().ref_count(cache.pages(forked, 0, 0)[0]) == 4);
  cache.release(a.seq);
  cache.release(b.seq);
  cache.release(forked);
  CHECK(cache.evict_prefix_cache().pool_pages_freed == 4 * kStreams);
  CHECK(cache.memory().pages_in_use == 0);
}

TEST_CASE("CrossLayer caches share their written layers' pages", "[cache][prefix]") {
  // 4 model layers, 2 cache layers (written by layers 0 and 2): a token page covers 2 x 2 streams.
  const ModelShape shape{4, 4, 2, 32};
  using Cache = KVCache<layout::CrossLayer<layout::GQA, 2>, quant::Q8_0>;
  Cache shared(shape, sharing_config());
  CacheConfig plain_config = sharing_config();
  plain_config.prefix_sharing.reset();
  Cache plain(shape, plain_config);
  auto write = [&](Cache& cache, SeqId seq, std::size_t from, std::size_t count) {
    for (index_t layer : {0, 2}) {
      const Rows r = prompt_rows(48, 1, 24, 2, layer);
      cache.prefill(seq, layer, std::span<const float>(r.keys).subspan(from * kRow, (count - from) * kRow),
                    std::span<const float>(r.values).subspan(from * kRow, (count - from) * kRow));
    }
  };
  const PrefixHit a = shared.add_sequence(tokens(72, 0));
  write(shared, a.seq, 0, 72);
  CHECK(shared.share_prefix(a.seq) == 64);
  const std::size_t pages = shared.memory().pages_in_use;
  CHECK(pages == 4 * kStreams);
  const PrefixHit b = shared.add_sequence(tokens(72, 0));
  REQUIRE(b.cached_tokens == 64);
  write(shared, b.seq, 64, 72);
  CHECK(shared.memory().pages_in_use == pages);  // B's 8 own tokens stay in its tail
  const SeqId full = plain.add_sequence();
  write(plain, full, 0, 72);
  const auto q = test::random_rows(4, 32, 7);
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    std::vector<float> x(q.size()), y(q.size());
    shared.attend(b.seq, layer, std::span<const float>(q), std::span<float>(x), 0.2f);
    plain.attend(full, layer, std::span<const float>(q), std::span<float>(y), 0.2f);
    CHECK(x == y);
  }
}

TEST_CASE("sequences sharing a prompt are added, written and released from several threads", "[cache][prefix][threads]") {
  CacheConfig config = sharing_config();
  config.max_pages = 40 * kStreams;  // tight: writes reclaim cached pages while others match
  KVCache<layout::GQA, quant::Float<half>> cache(kShape, config);
  const std::vector<Rows> kv = all_layers(64, 1, 0, 2);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  std::atomic<long> hits{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 30; ++i) {
        // Every prompt starts with the same 48 tokens; the rest depends on the thread and turn.
        std::vector<TokenId> prompt = tokens(64, 0);
        for (std::size_t j = 48; j < 64; ++j) prompt[j] = 100000 + t * 1000 + (i % 3);
        try {
          const PrefixHit h = cache.add_sequence(prompt);
          hits += h.cached_tokens;
          prefill_from(cache, h.seq, kv, static_cast<std::size_t>(h.cached_tokens));
          if (i % 2 == 0) cache.share_prefix(h.seq);
          if (cache.length(h.seq, 1) != 64) ++failures;
          cache.release(h.seq);
        } catch (const std::exception&) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  CHECK(failures == 0);
  CHECK(hits > 0);
  CHECK(cache.sequence_count() == 0);
  cache.evict_prefix_cache();
  CHECK(cache.memory().pages_in_use == 0);
  CHECK(cache.prefix_stats().cached_pages == 0);
}
