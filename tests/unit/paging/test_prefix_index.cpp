#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvpack/kernels/cuda/page_ledger.hpp"
#include "kvpack/paging/fingerprint.hpp"
#include "kvpack/paging/page_pool.hpp"
#include "kvpack/paging/prefix_index.hpp"

using kvpack::ErrorCode;
using kvpack::PageId;
using kvpack::paging::Fingerprint;
using kvpack::paging::PageFormat;
using kvpack::paging::PagePool;
using kvpack::paging::PrefixIndex;
using kvpack::paging::PrefixIndexOptions;
using kvpack::paging::PrefixKey;
using kvpack::paging::PrefixLease;
using kvpack::paging::TokenId;
using Tokens = std::vector<TokenId>;

namespace {

constexpr kvpack::index_t kPage = 4;  // small pages: prefixes diverge inside pages often

PrefixKey make_key(std::string codec = "q8_0", std::uint64_t params = 7, std::string salt = "") {
  PrefixKey key;
  key.model_id = "llama-3.1-8b";
  key.layout = "gqa";
  key.shape = {2, 8, 2, 64};
  key.page_size = kPage;
  key.codec = std::move(codec);
  key.codec_params = params;
  key.salt = std::move(salt);
  return key;
}

// A sequence as a cache would hold it: its own reference on every page it prefilled.
struct Sequence {
  Tokens tokens;
  std::vector<PageId> pages;  // [whole pages][streams]
  PrefixLease lease;
};

// The device cache's pool without its GPU arena: the same ledger, which (unlike PagePool) refuses
// a release of a page nobody holds, so an index that releases once too often ends the test.
class LedgerPool {
 public:
  explicit LedgerPool(std::size_t capacity) : ledger_(capacity) {}
  void allocate(std::span<PageId> out) {
    for (PageId& id : out) id = ledger_.allocate();
  }
  void retain(PageId id) noexcept { ledger_.retain(id); }
  void release(PageId id) noexcept { ledger_.release(id); }
  [[nodiscard]] std::uint32_t ref_count(PageId id) const noexcept { return ledger_.holders(id); }
  [[nodiscard]] const PageFormat& format() const noexcept { return format_; }
  [[nodiscard]] std::size_t pages_in_use() const { return ledger_.pages_in_use(); }

 private:
  kvpack::kernels::cuda::PageLedger ledger_;
  PageFormat format_{64, 0};  // the device keeps slot metadata on the host
};

// Prefills the whole pages of `tokens` into fresh pool pages (one per stream) and caches them.
template <class Pool>
Sequence prefill_and_insert(PrefixIndex& index, Pool& pool, const PrefixKey& key, Tokens tokens) {
  Sequence s;
  s.tokens = std::move(tokens);
  const std::size_t whole = s.tokens.size() / kPage;
  s.pages.resize(whole * index.streams());
  pool.allocate(s.pages);
  s.lease = index.insert(key, std::span<const TokenId>(s.tokens).first(whole * kPage), s.pages);
  return s;
}

template <class Pool>
void release(Pool& pool, Sequence& s) {
  for (PageId id : s.pages) pool.release(id);
  s.pages.clear();
  s.lease.reset();
}

Tokens random_tokens(std::mt19937& rng, std::size_t n, int alphabet) {
  std::uniform_int_distribution<TokenId> token(0, alphabet - 1);
  Tokens out(n);
  for (TokenId& t : out) t = token(rng);
  return out;
}

// Sequences that share prefixes of any length with earlier ones, as prompts with a common system
// prompt or a conversation's earlier turns do.
Tokens next_sequence(std::mt19937& rng, const std::vector<Tokens>& earlier) {
  Tokens out;
  if (!earlier.empty() && rng() % 4 != 0) {
    const Tokens& base = earlier[rng() % earlier.size()];
    out.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(rng() % (base.size() + 1)));
  }
  const Tokens more = random_tokens(rng, rng() % 14, 3);
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

std::uint64_t constant_hash(std::span<const TokenId>) noexcept { return 42; }

// The brute-force reference: every (namespace, whole-page token prefix) ever inserted, with the
// page ids of its last page as the first insert gave them.
struct Reference {
  std::map<std::pair<int, Tokens>, std::vector<PageId>> pages;

  void insert(int ns, const Sequence& s, std::size_t streams) {
    for (std::size_t p = 0; p < s.tokens.size() / kPage; ++p) {
      Tokens prefix(s.tokens.begin(),
                    s.tokens.begin() + static_cast<std::ptrdiff_t>((p + 1) * kPage));
      const auto first = s.pages.begin() + static_cast<std::ptrdiff_t>(p * streams);
      pages.emplace(std::pair{ns, std::move(prefix)},
                    std::vector<PageId>(first, first + static_cast<std::ptrdiff_t>(streams)));
    }
  }
  [[nodiscard]] std::size_t longest(int ns, const Tokens& tokens) const {
    std::size_t best = 0;
    for (std::size_t p = 1; p * kPage <= tokens.size(); ++p) {
      if (pages.count({ns, Tokens(tokens.begin(),
                                  tokens.begin() + static_cast<std::ptrdiff_t>(p * kPage))}))
        best = p;
    }
    return best;
  }
};

template <class Pool>
void check_against_reference(PrefixIndexOptions options, Pool pool) {
  constexpr std::size_t kStreams = 3;
  PrefixIndex index(pool, kPage, kStreams, options);
  // Three namespaces: another codec parameter set and another salt must not see the first's pages.
  const PrefixKey keys[3] = {make_key("q8_0", 7), make_key("q8_0", 8),
                             make_key("q8_0", 7, "tenant-b")};
  std::mt19937 rng(1234);
  std::vector<Tokens> earlier;
  Reference reference;
  std::uint64_t expected_hit_tokens = 0;
  std::uint64_t expected_lookup_tokens = 0;
  for (int step = 0; step < 600; ++step) {
    const int ns = static_cast<int>(rng() % 3);
    Tokens tokens = next_sequence(rng, earlier);
    if (rng() % 2 == 0) {
      Sequence s = prefill_and_insert(index, pool, keys[ns], tokens);
      reference.insert(ns, s, kStreams);
      release(pool, s);  // the index's references keep the pages
      earlier.push_back(std::move(tokens));
    } else {
      const auto match = index.match(keys[ns], tokens);
      const std::size_t expected = reference.longest(ns, tokens);
      REQUIRE(match.pages == expected);
      CHECK(match.tokens == expected * kPage);
      CHECK(match.lease.pages() == expected);
      CHECK(index.cached_prefix_pages(keys[ns], tokens) == expected);
      for (std::size_t p = 0; p < match.pages; ++p) {
        const Tokens prefix(tokens.begin(),
                            tokens.begin() + static_cast<std::ptrdiff_t>((p + 1) * kPage));
        const auto ids = match.page(p);
        CHECK(std::vector<PageId>(ids.begin(), ids.end()) == reference.pages.at({ns, prefix}));
        for (PageId id : ids) CHECK(pool.ref_count(id) == 1);  // the index's reference only
      }
      expected_hit_tokens += expected * kPage;
      expected_lookup_tokens += tokens.size();
    }
  }
  const auto stats = index.stats();
  CHECK(stats.cached_pages == reference.pages.size());
  CHECK(stats.cached_pool_pages == reference.pages.size() * kStreams);
  CHECK(stats.inserted_pages == reference.pages.size());
  CHECK(stats.hit_tokens == expected_hit_tokens);
  CHECK(stats.lookup_tokens == expected_lookup_tokens);
  CHECK(stats.pages_saved == expected_hit_tokens / kPage * kStreams);
  CHECK(pool.pages_in_use() == reference.pages.size() * kStreams);
  CHECK(stats.evictable_pages > 0);

  const auto evicted = index.evict_unreferenced(PrefixIndex::kAllPages);
  CHECK(evicted.token_pages == reference.pages.size());
  CHECK(evicted.pool_pages_freed == reference.pages.size() * kStreams);
  CHECK(pool.pages_in_use() == 0);
  CHECK(index.stats().cached_pages == 0);
  CHECK(index.stats().namespaces == 0);
}

void check_against_reference(PrefixIndexOptions options) {
  check_against_reference(options, PagePool(PageFormat{64, 8}, 1 << 16));
}

}  // namespace

TEST_CASE("match finds the longest cached whole-page prefix, as a brute-force search does",
          "[paging][prefix]") {
  check_against_reference({});
}

TEST_CASE("over the device pool's ledger the index matches, counts and frees as over PagePool",
          "[paging][prefix]") {
  check_against_reference({}, LedgerPool(1 << 16));
  check_against_reference({&constant_hash}, LedgerPool(1 << 16));
}

TEST_CASE("with every page hashing alike, matching still compares tokens and stays exact",
          "[paging][prefix]") {
  check_against_reference(PrefixIndexOptions{&constant_hash});
}

TEST_CASE("a partial last page never matches", "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 64);
  PrefixIndex index(pool, kPage, 1);
  const PrefixKey key = make_key();
  Sequence s = prefill_and_insert(index, pool, key, {1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(index.match(key, Tokens{1, 2, 3, 4, 5, 6, 7}).pages == 1);
  CHECK(index.match(key, Tokens{1, 2, 3}).pages == 0);
  CHECK(index.match(key, Tokens{1, 2, 3, 4, 5, 6, 7, 8, 9}).pages == 2);
  CHECK(index.match(key, Tokens{}).pages == 0);
  release(pool, s);
}

TEST_CASE("pages cached under one key are never found under a key that differs in any field",
          "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 256);
  PrefixIndex index(pool, kPage, 2);
  const PrefixKey base = make_key();
  const Tokens tokens{5, 6, 7, 8, 9, 10, 11, 12};
  Sequence s = prefill_and_insert(index, pool, base, tokens);
  REQUIRE(index.match(base, tokens).pages == 2);

  std::vector<PrefixKey> others(7, base);
  others[0].model_id = "llama-3.1-8b-instruct";
  others[1].layout = "cross_layer<gqa,2>";
  others[2].shape.kv_heads = 4;
  others[3].codec = "q4_0";
  others[4].codec_params = 8;   // same codec, another scale or codebook
  others[5].cache_options = 1;  // e.g. pre-RoPE keys
  others[6].salt = "tenant-b";
  for (const PrefixKey& other : others) {
    CHECK_FALSE(other == base);
    CHECK(index.match(other, tokens).pages == 0);
  }

  // The same tokens under another codec get their own pages, and each key finds its own.
  Sequence t = prefill_and_insert(index, pool, others[3], tokens);
  const auto mine = index.match(base, tokens);
  const auto theirs = index.match(others[3], tokens);
  REQUIRE(mine.pages == 2);
  REQUIRE(theirs.pages == 2);
  CHECK(mine.page_ids == s.pages);
  CHECK(theirs.page_ids == t.pages);
  CHECK(index.stats().namespaces == 2);
  release(pool, s);
  release(pool, t);
}

TEST_CASE("fingerprints change with any parameter and keep run boundaries", "[paging][prefix]") {
  const std::vector<float> scales{0.5f, 0.25f, 1.0f};
  std::vector<float> other = scales;
  other[2] = 1.0000001f;
  const auto of = [](std::span<const float> s) { return Fingerprint().add(s).value(); };
  CHECK(of(scales) == of(scales));
  CHECK(of(scales) != of(other));
  CHECK(Fingerprint().add(std::uint64_t{1}).value() !=
        Fingerprint(1).add(std::uint64_t{1}).value());  // seeds
  const std::vector<int> a{1, 2}, b{3}, c{1}, d{2, 3};
  CHECK(Fingerprint().add(std::span<const int>(a)).add(std::span<const int>(b)).value() !=
        Fingerprint().add(std::span<const int>(c)).add(std::span<const int>(d)).value());
  CHECK(Fingerprint().add(std::string_view("ab")).add(std::string_view("c")).value() !=
        Fingerprint().add(std::string_view("a")).add(std::string_view("bc")).value());
  CHECK(make_key().fingerprint() != make_key("q8_0", 7, "x").fingerprint());
}

TEST_CASE("colliding siblings stay findable while others of their probe run are evicted",
          "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 256);
  PrefixIndex index(pool, kPage, 1, PrefixIndexOptions{&constant_hash});
  const PrefixKey key = make_key();
  constexpr int kSiblings = 40;
  for (int i = 0; i < kSiblings; ++i) {  // one page each, inserted oldest first
    Sequence s = prefill_and_insert(index, pool, key, {i, i, i, i});
    release(pool, s);
  }
  CHECK(index.evict_unreferenced(kSiblings / 2).token_pages == kSiblings / 2);
  for (int i = 0; i < kSiblings; ++i) {
    INFO("sibling " << i);
    CHECK(index.cached_prefix_pages(key, Tokens{i, i, i, i}) == (i < kSiblings / 2 ? 0u : 1u));
  }
  CHECK(index.cached_prefix_pages(key, Tokens{99, 99, 99, 99}) == 0);
  index.evict_unreferenced(PrefixIndex::kAllPages);
  CHECK(pool.pages_in_use() == 0);
}

TEST_CASE("eviction takes least recently used leaves, a sequence's tail before its prefix",
          "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 256);
  PrefixIndex index(pool, kPage, 2);
  const PrefixKey key = make_key();
  const Tokens shared{1, 1, 1, 1};
  const Tokens a{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};  // shared page, then two of its own
  const Tokens b{1, 1, 1, 1, 4, 4, 4, 4};              // shared page, then one of its own
  const Tokens c{5, 5, 5, 5, 6, 6, 6, 6};
  for (const Tokens* t : {&a, &b, &c}) {
    Sequence s = prefill_and_insert(index, pool, key, *t);
    release(pool, s);
  }
  (void)index.match(key, a);  // a is now the most recent; its lease goes at once
  const auto cached = [&](const Tokens& t) { return index.cached_prefix_pages(key, t); };

  // One pool page needed: one leaf (2 streams) goes. Oldest is b's own page (c is newer).
  CHECK(index.evict_unreferenced(1).token_pages == 1);
  CHECK(cached(b) == 1);  // its tail went, the shared page stays (a still extends it)
  CHECK(cached(a) == 3);
  CHECK(cached(c) == 2);
  // c's tail, then c's first page (a leaf now, as old as its child was).
  CHECK(index.evict_unreferenced(2).pool_pages_freed == 2);
  CHECK(cached(c) == 1);
  CHECK(index.evict_unreferenced(1).token_pages == 1);
  CHECK(cached(c) == 0);
  // a's pages, deepest first; the shared page goes last.
  CHECK(index.evict_unreferenced(1).token_pages == 1);
  CHECK(cached(a) == 2);
  CHECK(index.evict_unreferenced(1).token_pages == 1);
  CHECK(cached(a) == 1);
  CHECK(cached(shared) == 1);
  CHECK(index.evict_unreferenced(1).token_pages == 1);
  CHECK(cached(shared) == 0);
  CHECK(index.evict_unreferenced(PrefixIndex::kAllPages).token_pages == 0);
  CHECK(pool.pages_in_use() == 0);
}

TEST_CASE("reclaim never frees a page a live sequence holds", "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 256);
  PrefixIndex index(pool, kPage, 2);
  const PrefixKey key = make_key();
  Sequence live = prefill_and_insert(index, pool, key, {1, 2, 3, 4, 5, 6, 7, 8});
  Sequence reader;  // matched the same prefix, kept the ids in its tables like a cache would
  {
    auto m = index.match(key, Tokens{1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9});
    REQUIRE(m.pages == 2);
    reader.pages = m.page_ids;
    for (PageId id : reader.pages) pool.retain(id);
    reader.lease = std::move(m.lease);
  }
  // A sequence that dropped its lease but still holds its pages (its nodes are evictable, its
  // pages are not freed).
  Sequence finished = prefill_and_insert(index, pool, key, {7, 7, 7, 7});
  finished.lease.reset();
  live.lease.reset();  // the reader's lease alone pins the path now

  const auto done = index.evict_unreferenced(PrefixIndex::kAllPages);
  CHECK(done.token_pages == 1);       // only the finished sequence's page
  CHECK(done.pool_pages_freed == 0);  // which its sequence still holds
  CHECK(index.cached_prefix_pages(key, live.tokens) == 2);
  for (PageId id : live.pages) CHECK(pool.ref_count(id) == 3);  // live, reader, index
  for (PageId id : finished.pages) CHECK(pool.ref_count(id) == 1);

  // A fork shares the lease: dropping the original keeps the path pinned.
  PrefixLease fork = reader.lease.share();
  reader.lease.reset();
  CHECK(index.evict_unreferenced(PrefixIndex::kAllPages).token_pages == 0);
  fork.reset();
  release(pool, live);
  release(pool, reader);
  release(pool, finished);
  const auto rest = index.evict_unreferenced(PrefixIndex::kAllPages);
  CHECK(rest.token_pages == 2);
  CHECK(rest.pool_pages_freed == 4);
  CHECK(pool.pages_in_use() == 0);
}

TEST_CASE("inserting an already cached path keeps the first pages and balances references",
          "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 256);
  PrefixIndex index(pool, kPage, 2);
  const PrefixKey key = make_key();
  Sequence first = prefill_and_insert(index, pool, key, {1, 2, 3, 4});
  Sequence again = prefill_and_insert(index, pool, key, {1, 2, 3, 4, 5, 6, 7, 8});
  for (PageId id : first.pages) CHECK(pool.ref_count(id) == 2);
  for (std::size_t i = 0; i < 2; ++i)
    CHECK(pool.ref_count(again.pages[i]) == 1);  // duplicate: not cached
  for (std::size_t i = 2; i < 4; ++i) CHECK(pool.ref_count(again.pages[i]) == 2);
  const auto m = index.match(key, again.tokens);
  REQUIRE(m.pages == 2);
  CHECK(std::vector<PageId>(m.page(0).begin(), m.page(0).end()) ==
        std::vector<PageId>(first.pages));
  CHECK(index.stats().inserted_pages == 2);
  release(pool, first);
  release(pool, again);
  CHECK(pool.pages_in_use() == 4);
  index.evict_unreferenced(PrefixIndex::kAllPages);
  CHECK(pool.pages_in_use() == 4);  // m's lease still pins the path
}

TEST_CASE("destroying the index releases its references", "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 64);
  {
    PrefixIndex index(pool, kPage, 3);
    Sequence s = prefill_and_insert(index, pool, make_key(), {1, 2, 3, 4, 5, 6, 7, 8});
    release(pool, s);
    CHECK(pool.pages_in_use() == 6);
  }
  CHECK(pool.pages_in_use() == 0);
}

TEST_CASE("statistics count hits, the hit rate and the pages saved", "[paging][prefix]") {
  PagePool pool(PageFormat{128, 16}, 256);
  PrefixIndex index(pool, kPage, 5);
  const PrefixKey key = make_key();
  const std::size_t empty_bytes = index.stats().index_bytes;
  Sequence s = prefill_and_insert(index, pool, key, {1, 2, 3, 4, 5, 6, 7, 8});
  (void)index.match(key, Tokens{1, 2, 3, 4, 5, 6, 7, 8, 9, 10});  // 8 of 10 tokens
  (void)index.match(key, Tokens{1, 2, 3, 4, 0, 0});               // 4 of 6
  (void)index.match(key, Tokens{9, 9, 9, 9});                     // 0 of 4
  const auto stats = index.stats();
  CHECK(stats.lookups == 3);
  CHECK(stats.lookup_tokens == 20);
  CHECK(stats.hit_tokens == 12);
  CHECK(stats.hit_pages == 3);
  CHECK(stats.pages_saved == 15);
  CHECK(stats.hit_rate() == Approx(0.6));
  CHECK(stats.cached_pages == 2);
  CHECK(stats.cached_pool_pages == 10);
  CHECK(stats.cached_page_bytes == 10 * (128 + 16));
  CHECK(stats.index_bytes > empty_bytes);
  CHECK(stats.evictable_pages == 0);  // s's lease pins its leaf
  release(pool, s);
  CHECK(index.stats().evictable_pages == 1);
}

TEST_CASE("bad input is rejected with a named error and changes nothing", "[paging][prefix]") {
  PagePool pool(PageFormat{64, 8}, 64);
  const auto code_of = [](auto&& call) {
    try {
      call();
    } catch (const kvpack::Error& e) {
      return e.code();
    }
    FAIL("no error");
    return ErrorCode::kUnsupported;
  };
  CHECK(code_of([&] { PrefixIndex(pool, 0, 1); }) == ErrorCode::kInvalidConfig);
  CHECK(code_of([&] { PrefixIndex(pool, kPage, 0); }) == ErrorCode::kInvalidConfig);
  CHECK(code_of([&] { PrefixIndex(pool, kPage, 1, PrefixIndexOptions{nullptr}); }) ==
        ErrorCode::kInvalidConfig);

  PrefixIndex index(pool, kPage, 2);
  const Tokens tokens{1, 2, 3, 4};
  std::vector<PageId> pages(2);
  pool.allocate(pages);
  std::vector<PrefixKey> bad(5, make_key());
  bad[0].model_id.clear();
  bad[1].layout.clear();
  bad[2].codec.clear();
  bad[3].shape.head_dim = 0;
  bad[4].page_size = 2 * kPage;
  for (const PrefixKey& key : bad) {
    CHECK(code_of([&] { (void)index.match(key, tokens); }) == ErrorCode::kInvalidArgument);
    CHECK(code_of([&] { (void)index.insert(key, tokens, pages); }) == ErrorCode::kInvalidArgument);
  }
  const PrefixKey key = make_key();
  CHECK(code_of([&] {
          (void)index.insert(key, Tokens{1, 2, 3, 4, 5}, pages);
        }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] {
          (void)index.insert(key, tokens, std::span<const PageId>(pages).first(1));
        }) == ErrorCode::kInvalidArgument);
  try {
    (void)index.insert(key, Tokens{1, 2, 3, 4, 5}, pages);
  } catch (const kvpack::Error& e) {
    CHECK(std::string(e.what()).find("5 tokens is not a multiple of page_size 4") !=
          std::string::npos);
  }
  const auto stats = index.stats();
  CHECK(stats.cached_pages == 0);
  CHECK(stats.namespaces == 0);
  CHECK(stats.lookups == 0);
  for (PageId id : pages) CHECK(pool.ref_count(id) == 1);
  for (PageId id : pages) pool.release(id);
  CHECK(pool.pages_in_use() == 0);
}

TEST_CASE("concurrent match, insert, lease release and eviction balance to zero",
          "[paging][prefix][threads]") {
  constexpr std::size_t kStreams = 2;
  PagePool pool(PageFormat{64, 8}, 1 << 14);
  PrefixIndex index(pool, kPage, kStreams);
  const PrefixKey key = make_key();
  const Tokens system{9, 9, 9, 9, 8, 8, 8, 8};  // two shared pages
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<std::uint32_t>(t));
      for (int i = 0; i < 300; ++i) {
        Tokens tokens = system;
        const Tokens own =
            random_tokens(rng, kPage * (1 + rng() % 2), 2);  // often equal across threads
        tokens.insert(tokens.end(), own.begin(), own.end());
        auto m = index.match(key, tokens);
        std::vector<PageId> table(tokens.size() / kPage * kStreams);
        std::copy(m.page_ids.begin(), m.page_ids.end(), table.begin());
        for (PageId id : m.page_ids) pool.retain(id);
        pool.allocate(std::span<PageId>(table).subspan(m.page_ids.size()));
        PrefixLease lease = index.insert(key, tokens, table);
        m.lease.reset();
        for (PageId id : table) pool.release(id);
        lease.reset();
        if (i % 8 == 0) (void)index.evict_unreferenced(kStreams * (1 + rng() % 4));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(index.stats().lookups == 1200);
  index.evict_unreferenced(PrefixIndex::kAllPages);
  CHECK(index.stats().cached_pages == 0);
  CHECK(pool.pages_in_use() == 0);
}
