// HostTier: entries round trip, replace and erase; the least recently used go first when a put
// needs room, and the byte budget is never exceeded; bad keys and oversized entries are refused
// without changing anything.

#include <catch2/catch.hpp>

#include <string>

#include "kvpack/tier/host_tier.hpp"
#include "unit/io/thrown_error.hpp"
#include "unit/tier/tier_fixture.hpp"

using namespace kvpack;
using tier::HostTier;

TEST_CASE("HostTier stores, replaces, reads and erases entries", "[tier]") {
  HostTier host(1 << 20);
  const auto a = test::pattern_bytes(1000, 1), b = test::pattern_bytes(77, 2);
  CHECK_FALSE(host.get("a").has_value());
  host.put("a", a);
  CHECK(host.get("a") == a);
  host.put("a", b);  // replaces
  CHECK(host.get("a") == b);
  CHECK(host.used_bytes() == b.size());
  host.put("empty", {});
  CHECK(host.get("empty") == std::vector<std::byte>{});
  CHECK(host.erase("a"));
  CHECK_FALSE(host.erase("a"));
  CHECK_FALSE(host.get("a").has_value());
  const tier::TierStats stats = host.stats();
  CHECK(stats.puts == 3);
  CHECK(stats.gets == 5);
  CHECK(stats.hits == 3);
  CHECK(stats.bytes_written == a.size() + b.size());
  CHECK(stats.bytes_read == a.size() + b.size());
  CHECK(stats.evictions == 0);
}

TEST_CASE("HostTier drops the least recently used entries to stay within its budget", "[tier]") {
  HostTier host(100);
  host.put("a", test::pattern_bytes(40, 1));
  host.put("b", test::pattern_bytes(40, 2));
  CHECK(host.get("a").has_value());  // a is now more recent than b
  host.put("c", test::pattern_bytes(40, 3));
  CHECK_FALSE(host.get("b").has_value());
  CHECK(host.get("a") == test::pattern_bytes(40, 1));
  CHECK(host.get("c") == test::pattern_bytes(40, 3));
  CHECK(host.used_bytes() == 80);
  host.put("d", test::pattern_bytes(100, 4));  // needs everything
  CHECK(host.used_bytes() == 100);
  CHECK_FALSE(host.get("a").has_value());
  CHECK_FALSE(host.get("c").has_value());
  CHECK(host.stats().evictions == 3);
}

TEST_CASE("HostTier refuses bad keys and entries larger than its budget, changing nothing", "[tier]") {
  HostTier host(100);
  host.put("kept", test::pattern_bytes(60, 1));
  const auto too_big = test::thrown_error([&] { host.put("big", test::pattern_bytes(101, 2)); });
  REQUIRE(too_big);
  CHECK(too_big->code() == ErrorCode::kOutOfRange);
  CHECK_THAT(too_big->what(), Catch::Contains("101 bytes exceeds the capacity of 100"));
  CHECK(host.get("kept") == test::pattern_bytes(60, 1));
  for (const std::string& key : {std::string(), std::string("../x"), std::string(".hidden"), std::string("a b"),
                                std::string(201, 'k')}) {
    INFO("key '" << key << "'");
    const auto error = test::thrown_error([&] { host.put(key, test::pattern_bytes(1, 3)); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error->what(), Catch::Contains("HostTier::put: a tier key"));
  }
  CHECK(host.used_bytes() == 60);
  CHECK(tier::tier_key_problem(std::string(200, 'k')).empty());
  CHECK(tier::tier_key_problem("kvpack-0123:abc_DEF.x").empty());
}
