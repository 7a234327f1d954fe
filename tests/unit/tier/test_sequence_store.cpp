// Sequences through a tier: store_sequence then fetch_sequence gives back the same pages, byte for
// byte, in another cache (host and disk tiers); a fetch that cannot be trusted or cannot be done
// (other tokens, a damaged entry, a tier that is down, a miss, a planner that says recompute)
// leaves the cache unchanged and fetch_or_recompute runs the caller's recompute instead, saying why.

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"
#include "kvpack/tier.hpp"
#include "unit/io/page_file_fixture.hpp"
#include "unit/io/thrown_error.hpp"
#include "unit/tier/tier_fixture.hpp"

using namespace kvpack;
using Cache = KVCache<layout::GQA, quant::Q8_0>;

namespace {

constexpr const char* kModel = "test-model/3x4x2x64";

/// A cache holding one filled sequence, its tokens and its page file.
struct Source {
  Cache cache{test::kPageFileShape, CacheConfig{}};
  SeqId seq = test::fill_sequence(cache);
  std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(cache.config()));
  std::vector<std::byte> file() const { return io::write_page_file(cache, seq, io::PageFileOptions{kModel, tokens}); }
};

void check_same_sequence(const Source& source, const Cache& cache, SeqId seq) {
  CHECK(io::write_page_file(cache, seq, io::PageFileOptions{kModel, source.tokens}) == source.file());
}

}  // namespace

TEST_CASE("a sequence stored in a tier comes back byte for byte in another cache", "[tier]") {
  const Source source;
  const test::ScratchDirectory scratch("sequence-store");
  tier::HostTier host(64 << 20);
  tier::DiskTier disk(scratch.path());
  for (tier::Tier* store : {static_cast<tier::Tier*>(&host), static_cast<tier::Tier*>(&disk)}) {
    INFO(store->describe());
    const std::string key = tier::sequence_key(source.cache, source.tokens, kModel);
    const std::size_t bytes = tier::store_sequence(*store, key, source.cache, source.seq, source.tokens, kModel);
    CHECK(bytes == source.file().size());
    Cache target(test::kPageFileShape, CacheConfig{});
    const std::optional<SeqId> seq = tier::fetch_sequence(*store, key, target, source.tokens);
    REQUIRE(seq);
    check_same_sequence(source, target, *seq);
    CHECK_FALSE(tier::fetch_sequence(*store, "absent", target, source.tokens).has_value());
    CHECK(target.sequence_count() == 1);
  }
}

TEST_CASE("sequence keys name everything that decides the bytes", "[tier]") {
  const Source source;
  const std::string key = tier::sequence_key(source.cache, source.tokens, kModel);
  CHECK(tier::tier_key_problem(key).empty());
  CHECK(key.size() == 39);
  CHECK(key == tier::sequence_key(source.cache, source.tokens, kModel));
  std::vector<std::int32_t> other_tokens = source.tokens;
  other_tokens.back() += 1;
  CHECK(key != tier::sequence_key(source.cache, other_tokens, kModel));
  CHECK(key != tier::sequence_key(source.cache, std::span(source.tokens).first(10), kModel));
  CHECK(key != tier::sequence_key(source.cache, source.tokens, "another-model"));
  CHECK(key != tier::sequence_key(source.cache, source.tokens, kModel, "tenant-2"));
  const KVCache<layout::GQA, quant::Q4_0> q4(test::kPageFileShape, CacheConfig{});
  CHECK(key != tier::sequence_key(q4, source.tokens, kModel));
  CacheConfig pages_of_16;
  pages_of_16.page_size = 16;
  const Cache small_pages(test::kPageFileShape, pages_of_16);
  CHECK(key != tier::sequence_key(small_pages, source.tokens, kModel));
  // The layout's parameters decide the bytes too: CrossLayer's K, MLA's dims.
  const KVCache<layout::CrossLayer<layout::GQA, 2>, quant::Q8_0> share_2(test::kPageFileShape, CacheConfig{});
  const KVCache<layout::CrossLayer<layout::GQA, 3>, quant::Q8_0> share_3(test::kPageFileShape, CacheConfig{});
  CHECK(tier::sequence_key(share_2, source.tokens, kModel) != tier::sequence_key(share_3, source.tokens, kModel));
  using Mla = KVCache<layout::MLA, quant::MLA<quant::Float<float>, quant::Float<float>>>;
  const ModelShape mla_shape{2, 4, 1, 64};
  const Mla narrow(mla_shape, CacheConfig{}, {}, layout::MLA{64, 16});
  const Mla wide(mla_shape, CacheConfig{}, {}, layout::MLA{128, 16});
  CHECK(tier::sequence_key(narrow, source.tokens, kModel) != tier::sequence_key(wide, source.tokens, kModel));
}

TEST_CASE("a fetch that cannot be trusted leaves the cache unchanged", "[tier]") {
  const Source source;
  tier::HostTier host(64 << 20);
  const std::string key = tier::sequence_key(source.cache, source.tokens, kModel);
  (void)tier::store_sequence(host, key, source.cache, source.seq, source.tokens, kModel);
  Cache target(test::kPageFileShape, CacheConfig{});
  const auto unchanged = [&] {
    CHECK(target.sequence_count() == 0);
    CHECK(target.memory().pages_in_use == 0);
  };
  SECTION("the entry holds other tokens") {
    std::vector<std::int32_t> other = source.tokens;
    other[5] = -1;
    const auto error = test::thrown_error([&] { (void)tier::fetch_sequence(host, key, target, other); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("holds another token sequence"));
    unchanged();
  }
  SECTION("the entry is not a page file") {
    host.put(key, test::pattern_bytes(1000, 1));
    const auto error = test::thrown_error([&] { (void)tier::fetch_sequence(host, key, target, source.tokens); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    unchanged();
  }
  SECTION("the entry is from a cache of another codec") {
    KVCache<layout::GQA, quant::Q4_0> q4(test::kPageFileShape, CacheConfig{});
    const auto error = test::thrown_error([&] { (void)tier::fetch_sequence(host, key, q4, source.tokens); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnsupported);
    CHECK(q4.sequence_count() == 0);
  }
}

TEST_CASE("fetch_or_recompute recomputes when the tier cannot deliver, and says why", "[tier]") {
  const Source source;
  const std::string key = tier::sequence_key(source.cache, source.tokens, kModel);
  Cache target(test::kPageFileShape, CacheConfig{});
  int recomputes = 0;
  const auto recompute = [&] {
    ++recomputes;
    return test::fill_sequence(target);  // the same K/V the source holds: a prefill of the same prompt
  };
  const auto restored_equals_source = [&](const tier::Restored& restored) {
    check_same_sequence(source, target, restored.seq);
    target.release(restored.seq);
  };

  SECTION("a tier that is down") {
    test::DownTier down;
    const tier::Restored restored = tier::fetch_or_recompute(down, key, target, source.tokens, recompute);
    CHECK_FALSE(restored.fetched);
    CHECK_THAT(restored.why_recomputed, Catch::Contains("connection refused"));
    CHECK(recomputes == 1);
    restored_equals_source(restored);
  }
  SECTION("a miss") {
    tier::HostTier host(64 << 20);
    const tier::Restored restored = tier::fetch_or_recompute(host, key, target, source.tokens, recompute);
    CHECK_FALSE(restored.fetched);
    CHECK_THAT(restored.why_recomputed, Catch::Contains("no entry '" + key + "' in host"));
    restored_equals_source(restored);
  }
  SECTION("a half-written entry on disk") {
    const test::ScratchDirectory scratch("sequence-half-written");
    tier::DiskTier disk(scratch.path());
    (void)tier::store_sequence(disk, key, source.cache, source.seq, source.tokens, kModel);
    const auto size = std::filesystem::file_size(disk.path_of(key));
    std::filesystem::resize_file(disk.path_of(key), size / 2);
    const tier::Restored restored = tier::fetch_or_recompute(disk, key, target, source.tokens, recompute);
    CHECK_FALSE(restored.fetched);
    CHECK_THAT(restored.why_recomputed, Catch::Contains("did not finish"));
    restored_equals_source(restored);
  }
  SECTION("a planner that expects the recompute to be faster") {
    tier::HostTier host(64 << 20);
    (void)tier::store_sequence(host, key, source.cache, source.seq, source.tokens, kModel);
    const tier::FetchPlan plan = tier::plan_fetch({tier::TierCost{1.0, 1e9}, 1e9, 1e-6}, 1 << 20, 96);
    REQUIRE_FALSE(plan.fetch);
    const tier::Restored restored = tier::fetch_or_recompute(host, key, target, source.tokens, recompute, &plan);
    CHECK_FALSE(restored.fetched);
    CHECK_THAT(restored.why_recomputed, Catch::Contains("the planner expects a recompute"));
    CHECK(host.stats().gets == 0);
    restored_equals_source(restored);
  }
  SECTION("an entry that is there and whole") {
    tier::HostTier host(64 << 20);
    (void)tier::store_sequence(host, key, source.cache, source.seq, source.tokens, kModel);
    const tier::Restored restored = tier::fetch_or_recompute(host, key, target, source.tokens, recompute);
    CHECK(restored.fetched);
    CHECK(restored.why_recomputed.empty());
    CHECK(recomputes == 0);
    restored_equals_source(restored);
  }
  CHECK(target.sequence_count() == 0);
}
