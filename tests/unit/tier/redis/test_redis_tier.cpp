// RedisTier against a real redis-server on loopback (started by the test): entries round trip,
// key prefixes keep caches apart, a damaged value is reported; when the server is killed mid-run
// every call fails with kUnavailable naming the server, fetch_or_recompute falls back to the
// caller's prefill and the cache ends up exactly as a fetch would have left it; when the server
// comes back the same tier object reconnects.

#include <catch2/catch.hpp>

#include <hiredis/hiredis.h>

#include <functional>
#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "kvpack/tier.hpp"
#include "kvpack/tier/redis_tier.hpp"
#include "support/redis_server.hpp"
#include "unit/io/page_file_fixture.hpp"
#include "unit/io/thrown_error.hpp"
#include "unit/tier/tier_fixture.hpp"

using namespace kvpack;
using tier::RedisTier;
using tier::RedisTierOptions;

namespace {

RedisTierOptions options_for(const test::RedisServer& server, std::string prefix = "kvpack-test:") {
  RedisTierOptions options;
  options.port = server.port();
  options.timeout_ms = 500;
  options.key_prefix = std::move(prefix);
  return options;
}

/// Writes raw bytes under a key, bypassing the tier (another client, or damage).
void raw_set(int port, const std::string& key, const std::vector<std::byte>& bytes) {
  redisContext* context = redisConnect("127.0.0.1", port);
  REQUIRE(context != nullptr);
  REQUIRE(context->err == 0);
  auto* reply = static_cast<redisReply*>(redisCommand(context, "SET %b %b", key.data(), key.size(), bytes.data(), bytes.size()));
  REQUIRE(reply != nullptr);
  freeReplyObject(reply);
  redisFree(context);
}

}  // namespace

TEST_CASE("RedisTier stores, reads and erases entries in a redis-server", "[tier][redis]") {
  test::RedisServer server;
  RedisTier redis(options_for(server));
  const auto big = test::pattern_bytes(8 << 20, 1), small = test::pattern_bytes(33, 2);
  CHECK_FALSE(redis.get("a").has_value());
  redis.put("a", big);
  redis.put("b", small);
  CHECK(redis.get("a") == big);
  CHECK(redis.get("b") == small);
  redis.put("empty", {});
  CHECK(redis.get("empty") == std::vector<std::byte>{});
  CHECK(redis.erase("a"));
  CHECK_FALSE(redis.erase("a"));
  CHECK_FALSE(redis.get("a").has_value());
  const tier::TierStats stats = redis.stats();
  CHECK(stats.puts == 3);
  CHECK(stats.hits == 3);
  CHECK(stats.bytes_read == big.size() + small.size());

  SECTION("prefixes keep two caches' entries apart") {
    RedisTier other(options_for(server, "other-cache:"));
    CHECK_FALSE(other.get("b").has_value());
    other.put("b", big);
    CHECK(redis.get("b") == small);
  }
  SECTION("a damaged or foreign value is reported, not returned") {
    raw_set(server.port(), "kvpack-test:b", test::pattern_bytes(50, 3));
    const auto error = test::thrown_error([&] { (void)redis.get("b"); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("bad magic"));
  }
  SECTION("entries can expire") {
    RedisTierOptions expiring = options_for(server);
    expiring.expire_seconds = 100;
    RedisTier with_ttl(expiring);
    with_ttl.put("ttl", small);
    CHECK(with_ttl.get("ttl") == small);
  }
}

TEST_CASE("a Redis server killed mid-run: clear errors, recompute instead, reconnect when it is back",
          "[tier][redis]") {
  test::RedisServer server;
  RedisTier redis(options_for(server));
  RedisTier idle(options_for(server));  // connected now, not used again until after the restart
  CHECK_FALSE(idle.get("nothing").has_value());
  using Cache = KVCache<layout::GQA, quant::Q8_0>;
  Cache source(test::kPageFileShape, CacheConfig{});
  const SeqId seq = test::fill_sequence(source);
  const std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(source.config()));
  const std::string key = tier::sequence_key(source, tokens, "redis-test-model");
  (void)tier::store_sequence(redis, key, source, seq, tokens, "redis-test-model");
  const std::vector<std::byte> expected = io::write_page_file(source, seq, {"redis-test-model", tokens});

  server.kill();
  const std::string where = "redis 127.0.0.1:" + std::to_string(server.port());
  for (const auto& call : std::vector<std::function<void()>>{[&] { (void)redis.get(key); },
                                                             [&] { redis.put(key, expected); },
                                                             [&] { (void)redis.erase(key); }}) {
    const auto error = test::thrown_error(call);
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kUnavailable);
    CHECK_THAT(error->what(), Catch::Contains(where));
  }

  Cache target(test::kPageFileShape, CacheConfig{});
  bool recomputed = false;
  const tier::Restored restored = tier::fetch_or_recompute(redis, key, target, tokens, [&] {
    recomputed = true;
    return test::fill_sequence(target);
  });
  CHECK(recomputed);
  CHECK_FALSE(restored.fetched);
  CHECK_THAT(restored.why_recomputed, Catch::Contains(where));
  CHECK(target.sequence_count() == 1);
  CHECK(io::write_page_file(target, restored.seq, {"redis-test-model", tokens}) == expected);
  target.release(restored.seq);

  REQUIRE(server.start());  // empty: persistence is off, as after a crash of a cache-only server
  CHECK_FALSE(redis.get(key).has_value());
  // A large put on a connection the server reset: hiredis's write() would raise SIGPIPE, which
  // ends a process by default. It must be an error (or a success), and the next put must work.
  const std::vector<std::byte> big = test::pattern_bytes(8 << 20, 9);
  const auto stale = test::thrown_error([&] { idle.put("big", big); });
  if (stale) CHECK(stale->code() == ErrorCode::kUnavailable);
  idle.put("big", big);
  CHECK(idle.get("big") == big);
  (void)tier::store_sequence(redis, key, source, seq, tokens, "redis-test-model");
  const tier::Restored fetched = tier::fetch_or_recompute(redis, key, target, tokens, [&]() -> SeqId {
    FAIL("recomputed although the server is back");
    return {};
  });
  CHECK(fetched.fetched);
  CHECK(io::write_page_file(target, fetched.seq, {"redis-test-model", tokens}) == expected);
}

TEST_CASE("a RedisTier with no server answers kUnavailable, and bad options are refused", "[tier][redis]") {
  int free_port = 0;
  {
    test::RedisServer server;
    free_port = server.port();
  }  // stopped: nothing listens there now
  RedisTierOptions options;
  options.port = free_port;
  RedisTier redis(options);
  const auto error = test::thrown_error([&] { redis.put("k", test::pattern_bytes(1, 1)); });
  REQUIRE(error);
  CHECK(error->code() == ErrorCode::kUnavailable);
  CHECK_THAT(error->what(), Catch::Contains("cannot connect"));
  options.port = 0;
  CHECK(test::thrown_error([&] { RedisTier bad(options); }));
  options.port = 6379;
  options.timeout_ms = 0;
  CHECK(test::thrown_error([&] { RedisTier bad(options); }));
}

TEST_CASE("a prefix one process stored in Redis is found by another and loaded, not recomputed", "[tier][redis]") {
  test::RedisServer server;
  using Cache = KVCache<layout::GQA, quant::Q8_0>;
  // "Process" A: its own connection and cache; it stores its prompt's chunks.
  RedisTier writer_connection(options_for(server, "shared:"));
  Cache writer_cache(test::kPageFileShape, CacheConfig{});
  const SeqId seq = test::fill_sequence(writer_cache);  // 3 pages of 32 per stream
  const std::vector<std::int32_t> tokens = test::token_ids(test::page_file_tokens(writer_cache.config()));
  CHECK(tier::store_chunks(writer_connection, writer_cache, seq, tokens, "redis-test-model", 32) == 3);

  // "Process" B: another connection and cache, a longer prompt with the same start.
  RedisTier reader_connection(options_for(server, "shared:"));
  Cache reader_cache(test::kPageFileShape, CacheConfig{});
  std::vector<std::int32_t> longer = tokens;
  longer.insert(longer.end(), {1, 2, 3, 4, 5});
  const tier::PrefixFetch found = tier::fetch_prefix(reader_connection, reader_cache, longer, "redis-test-model", 32);
  CHECK(found.chunks == 3);
  CHECK(found.tokens == 96);
  CHECK(io::write_page_file(reader_cache, found.seq, {"redis-test-model", {}}) ==
        io::write_page_file(writer_cache, seq, {"redis-test-model", {}}));

  server.kill();  // the next lookup finds nothing, says why, and leaves an empty sequence
  Cache late(test::kPageFileShape, CacheConfig{});
  const tier::PrefixFetch after = tier::fetch_prefix(reader_connection, late, longer, "redis-test-model", 32);
  CHECK(after.tokens == 0);
  CHECK_THAT(after.stopped_because, Catch::Contains("redis 127.0.0.1"));
  CHECK(late.memory().pages_in_use == 0);
}
