// Prompt prefixes in a tier: a sequence stored as chunks is found by another cache up to the
// longest prefix of a new prompt whose chunks are all there, byte for byte; a prompt that
// diverges, a missing or damaged chunk, a tier that is down or another model's keys end the
// prefix there, say why, and leave nothing behind.

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "kvpack/tier.hpp"
#include "support/random_kv.hpp"
#include "unit/io/thrown_error.hpp"
#include "unit/tier/tier_fixture.hpp"

using namespace kvpack;
using Cache = KVCache<layout::GQA, quant::Q8_0>;

namespace {

constexpr ModelShape kShape{2, 4, 2, 32};
constexpr index_t kChunk = 32;  // two pages of 16
constexpr const char* kModel = "chunk-test-model";

CacheConfig pages_of_16() {
  CacheConfig config;
  config.page_size = 16;
  return config;
}

/// A sequence of `tokens` random tokens (the same for the same seed) in every layer.
template <class AnyCache>
SeqId filled(AnyCache& cache, index_t tokens, std::uint32_t seed) {
  const SeqId seq = cache.add_sequence();
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    const std::size_t rows = static_cast<std::size_t>(tokens) * kShape.kv_heads;
    const std::vector<float> keys = test::random_rows(rows, kShape.head_dim, seed + 2 * layer);
    const std::vector<float> values = test::random_rows(rows, kShape.head_dim, seed + 2 * layer + 1);
    cache.prefill(seq, layer, std::span<const float>(keys), std::span<const float>(values));
  }
  return seq;
}

std::vector<std::int32_t> prompt(index_t tokens) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(7 + 3 * i);
  return ids;
}

/// The pages `target` holds for `loaded` equal the first `tokens` tokens of a source filled the same way.
void check_prefix(const Cache& target, const tier::PrefixFetch& loaded, index_t tokens) {
  REQUIRE(loaded.tokens == tokens);
  CHECK(target.sequence_count() == 1);
  if (tokens == 0) {
    CHECK(target.memory().pages_in_use == 0);
    return;
  }
  Cache reference(kShape, pages_of_16());
  const SeqId seq = filled(reference, tokens, 5);
  CHECK(io::write_page_file(target, loaded.seq, {kModel, {}}) == io::write_page_file(reference, seq, {kModel, {}}));
  CHECK(target.memory().pages_in_use == reference.memory().pages_in_use);
}

}  // namespace

TEST_CASE("a prefix stored as chunks is found again up to where the prompt or the tier stops", "[tier][prefix]") {
  Cache source(kShape, pages_of_16());
  const std::vector<std::int32_t> ids = prompt(5 * kChunk + 10);  // 5 whole chunks and 10 tokens more
  const SeqId seq = filled(source, 5 * kChunk, 5);
  tier::HostTier host(64 << 20);
  CHECK(tier::store_chunks(host, source, seq, std::span(ids).first(5 * kChunk), kModel, kChunk) == 5);
  const std::vector<std::string> keys = tier::chunk_keys(source, ids, kModel, kChunk);
  REQUIRE(keys.size() == 5);

  Cache target(kShape, pages_of_16());
  SECTION("every chunk of a longer prompt") {
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, ids, kModel, kChunk);
    CHECK(loaded.chunks == 5);
    CHECK(loaded.stopped_because.empty());
    check_prefix(target, loaded, 5 * kChunk);
  }
  SECTION("a prompt that diverges in chunk 2") {
    std::vector<std::int32_t> other = ids;
    other[2 * kChunk + 5] = -3;
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, other, kModel, kChunk);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("chunk 2") && Catch::Contains("is not in host"));
    check_prefix(target, loaded, 2 * kChunk);
  }
  SECTION("chunk 3 gone from the tier") {
    REQUIRE(host.erase(keys[3]));
    check_prefix(target, tier::fetch_prefix(host, target, ids, kModel, kChunk), 3 * kChunk);
  }
  SECTION("chunk 1 damaged") {
    host.put(keys[1], test::pattern_bytes(500, 1));
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, ids, kModel, kChunk);
    CHECK_FALSE(loaded.stopped_because.empty());
    check_prefix(target, loaded, kChunk);
  }
  SECTION("chunk 1 holding another chunk's pages") {
    host.put(keys[1], *host.get(keys[2]));
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, ids, kModel, kChunk);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("holds another prefix's tokens"));
    check_prefix(target, loaded, kChunk);
  }
  SECTION("another model's chunk under this model's key") {
    const std::vector<std::string> theirs = tier::chunk_keys(source, ids, "their-model", kChunk);
    host.put(theirs[0], *host.get(keys[0]));
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, ids, "their-model", kChunk);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("is model 'chunk-test-model', not 'their-model'"));
    check_prefix(target, loaded, 0);
  }
  SECTION("a tier that is down") {
    test::DownTier down;
    const tier::PrefixFetch loaded = tier::fetch_prefix(down, target, ids, kModel, kChunk);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("connection refused"));
    check_prefix(target, loaded, 0);
  }
  SECTION("another model or salt shares nothing") {
    check_prefix(target, tier::fetch_prefix(host, target, ids, "another-model", kChunk), 0);
    Cache other(kShape, pages_of_16());
    check_prefix(other, tier::fetch_prefix(host, other, ids, kModel, kChunk, "tenant-2"), 0);
  }
}

TEST_CASE("chunks are stored as far as the sequence's pages reach", "[tier][prefix]") {
  // An engine stores a prompt's chunks right after its prefill: the prompt rarely ends on a
  // page, and with a full-precision tail its newest tokens are not encoded yet.
  const std::vector<std::int32_t> ids = prompt(5 * kChunk + 10);
  tier::HostTier host(64 << 20);
  SECTION("a prompt that ends inside a page") {
    Cache source(kShape, pages_of_16());
    const SeqId seq = filled(source, 5 * kChunk + 10, 5);
    CHECK(tier::store_chunks(host, source, seq, ids, kModel, kChunk) == 5);
    Cache target(kShape, pages_of_16());
    check_prefix(target, tier::fetch_prefix(host, target, ids, kModel, kChunk), 5 * kChunk);
  }
  SECTION("a full-precision tail: the chunks before it, and the rest once it has moved on") {
    CacheConfig config = pages_of_16();
    config.tail_tokens = 2 * kChunk;
    Cache source(kShape, config);
    const SeqId seq = filled(source, 5 * kChunk + 10, 5);
    const std::size_t pages = source.pages(seq, 0, 0).size();
    REQUIRE(pages * 16 + static_cast<std::size_t>(source.full_precision_rows(seq, 0).count) == 5 * kChunk + 10);
    REQUIRE(pages / 2 < 5);
    const std::size_t stored = tier::store_chunks(host, source, seq, ids, kModel, kChunk);
    CHECK(stored == pages / 2);
    Cache target(kShape, config);
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, ids, kModel, kChunk);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("chunk " + std::to_string(stored)));
    check_prefix(target, loaded, static_cast<index_t>(stored) * kChunk);
  }
  SECTION("an exact prefix or evicted tokens: pages that do not start at token 0 or have gaps") {
    CacheConfig exact = pages_of_16();
    exact.exact_prefix_tokens = 1;
    Cache with_sink(kShape, exact);
    const SeqId a = filled(with_sink, 5 * kChunk, 5);
    const auto sink_error =
        test::thrown_error([&] { (void)tier::store_chunks(host, with_sink, a, ids, kModel, kChunk); });
    REQUIRE(sink_error);
    CHECK(sink_error->code() == ErrorCode::kUnsupported);
    CHECK_THAT(sink_error->what(), Catch::Contains("exact prefix, evicted tokens or positions that skip"));
    KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>> evicting(kShape, pages_of_16(), {}, {},
                                                                       evict::StreamingLLM<>{4, evict::Uniform{64}});
    const SeqId b = filled(evicting, 5 * kChunk, 5);
    REQUIRE(evicting.live_tokens(b, 0, 0) < evicting.length(b, 0));
    const auto evicted_error =
        test::thrown_error([&] { (void)tier::store_chunks(host, evicting, b, ids, kModel, kChunk); });
    REQUIRE(evicted_error);
    CHECK(evicted_error->code() == ErrorCode::kUnsupported);
    CHECK(host.used_bytes() == 0);
  }
  SECTION("positions that skip: a reader would continue the prompt at the wrong position") {
    Cache gapped(kShape, pages_of_16());
    const SeqId seq = gapped.add_sequence();
    const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const std::vector<float> rows = test::random_rows(5 * kChunk * kShape.kv_heads, kShape.head_dim, 9);
      gapped.append(seq, layer, std::span(rows).first(row), std::span(rows).first(row), 3);  // positions 3, 4, ...
      gapped.prefill(seq, layer, std::span<const float>(rows).subspan(row), std::span<const float>(rows).subspan(row));
    }
    const auto gap_error =
        test::thrown_error([&] { (void)tier::store_chunks(host, gapped, seq, ids, kModel, kChunk); });
    REQUIRE(gap_error);
    CHECK(gap_error->code() == ErrorCode::kUnsupported);
    CHECK_THAT(gap_error->what(), Catch::Contains("positions that skip"));
    CHECK(host.used_bytes() == 0);

    // Such a chunk from a writer that did not check (here a whole file of 2 pages at positions
    // 3 … 34 under chunk 0's key) is not loaded either.
    Cache old_writer(kShape, pages_of_16());
    const SeqId old_seq = old_writer.add_sequence();
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const std::vector<float> rows = test::random_rows(kChunk * kShape.kv_heads, kShape.head_dim, 9);
      old_writer.append(old_seq, layer, std::span(rows).first(row), std::span(rows).first(row), 3);
      old_writer.prefill(old_seq, layer, std::span<const float>(rows).subspan(row),
                         std::span<const float>(rows).subspan(row));
    }
    const std::span<const std::int32_t> first_chunk = std::span(ids).first(kChunk);
    host.put(tier::chunk_keys(old_writer, ids, kModel, kChunk)[0],
             io::write_page_file(old_writer, old_seq, {kModel, first_chunk}));
    Cache target(kShape, pages_of_16());
    const tier::PrefixFetch loaded = tier::fetch_prefix(host, target, ids, kModel, kChunk);
    CHECK(loaded.tokens == 0);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("ends at position 34, not 31"));
    CHECK(target.memory().pages_in_use == 0);
  }
}

TEST_CASE("chunk keys chain every token before them and need whole pages", "[tier][prefix]") {
  const Cache cache(kShape, pages_of_16());
  const std::vector<std::int32_t> ids = prompt(3 * kChunk);
  const std::vector<std::string> keys = tier::chunk_keys(cache, ids, kModel, kChunk);
  REQUIRE(keys.size() == 3);
  for (const std::string& key : keys) CHECK(tier::tier_key_problem(key).empty());
  std::vector<std::int32_t> changed = ids;
  changed[0] = 1000;  // the first token changes every key after it
  const std::vector<std::string> other = tier::chunk_keys(cache, changed, kModel, kChunk);
  for (std::size_t c = 0; c < 3; ++c) CHECK(other[c] != keys[c]);
  CHECK(tier::chunk_keys(cache, std::span(ids).first(2 * kChunk + 5), kModel, kChunk).size() == 2);
  const auto error = test::thrown_error([&] { (void)tier::chunk_keys(cache, ids, kModel, 24); });
  REQUIRE(error);
  CHECK(error->code() == ErrorCode::kInvalidArgument);
  CHECK_THAT(error->what(), Catch::Contains("multiple of the page size (16)"));
}

TEST_CASE("tier::add_sequence continues the cache's own prefix with the tier's chunks", "[tier][prefix]") {
  Cache source(kShape, pages_of_16());
  const std::vector<std::int32_t> ids = prompt(5 * kChunk + 10);
  const SeqId seq = filled(source, 5 * kChunk, 5);
  tier::HostTier host(64 << 20);
  REQUIRE(tier::store_chunks(host, source, seq, std::span(ids).first(5 * kChunk), kModel, kChunk) == 5);
  CacheConfig sharing = pages_of_16();
  sharing.prefix_sharing = PrefixSharing{kModel};
  Cache target(kShape, sharing);
  // Prefills the prompt's tokens [from, to) into `s` as `filled` would have written them.
  const auto prefill_rest = [&](SeqId s, index_t from, index_t to) {
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
      const std::vector<float> keys = test::random_rows(static_cast<std::size_t>(to) * kShape.kv_heads, kShape.head_dim, 5 + 2 * layer);
      const std::vector<float> values =
          test::random_rows(static_cast<std::size_t>(to) * kShape.kv_heads, kShape.head_dim, 5 + 2 * layer + 1);
      target.prefill(s, layer, std::span<const float>(keys).subspan(from * row),
                     std::span<const float>(values).subspan(from * row));
    }
  };

  SECTION("a cold cache takes every chunk from the tier; once released, the next request finds them in memory") {
    const tier::PrefixFetch first = tier::add_sequence(host, target, ids, kModel, kChunk);
    CHECK(first.cached_tokens == 0);
    CHECK(first.chunks == 5);
    check_prefix(target, first, 5 * kChunk);
    prefill_rest(first.seq, first.tokens, static_cast<index_t>(ids.size()));
    target.release(first.seq);  // caches the prompt's whole pages, those from the tier included
    const tier::PrefixFetch again = tier::add_sequence(host, target, ids, kModel, kChunk);
    CHECK(again.cached_tokens == 5 * kChunk);
    CHECK(again.tokens == 5 * kChunk);
    CHECK(again.chunks == 0);
    CHECK(again.bytes == 0);
  }
  SECTION("a prompt of exactly the tier's chunks leaves its last chunk to prefill") {
    const tier::PrefixFetch loaded =
        tier::add_sequence(host, target, std::span(ids).first(5 * kChunk), kModel, kChunk);
    CHECK(loaded.tokens == 4 * kChunk);
    CHECK(loaded.stopped_because.empty());
  }
  SECTION("the tier continues a cached prefix that ends on a chunk") {
    const tier::PrefixFetch two = tier::add_sequence(host, target, std::span(ids).first(2 * kChunk + 1), kModel, kChunk);
    REQUIRE(two.tokens == 2 * kChunk);
    target.release(two.seq);
    const tier::PrefixFetch all = tier::add_sequence(host, target, ids, kModel, kChunk);
    CHECK(all.cached_tokens == 2 * kChunk);
    CHECK(all.chunks == 3);
    CHECK(all.tokens == 5 * kChunk);
    Cache reference(kShape, pages_of_16());
    CHECK(io::write_page_file(target, all.seq, {kModel, {}}) ==
          io::write_page_file(reference, filled(reference, 5 * kChunk, 5), {kModel, {}}));
  }
  SECTION("but not one that ends inside a chunk") {
    const SeqId three_pages = target.add_sequence(std::span(ids).first(3 * 16 + 1)).seq;
    prefill_rest(three_pages, 0, 3 * 16 + 1);
    target.release(three_pages);
    const tier::PrefixFetch loaded = tier::add_sequence(host, target, ids, kModel, kChunk);
    CHECK(loaded.cached_tokens == 3 * 16);
    CHECK(loaded.chunks == 0);
    CHECK_THAT(loaded.stopped_because, Catch::Contains("ends inside chunk 1"));
  }
  SECTION("without prefix sharing only the tier is asked") {
    Cache plain(kShape, pages_of_16());
    const tier::PrefixFetch loaded = tier::add_sequence(host, plain, ids, kModel, kChunk);
    CHECK(loaded.cached_tokens == 0);
    check_prefix(plain, loaded, 5 * kChunk);
  }
}
