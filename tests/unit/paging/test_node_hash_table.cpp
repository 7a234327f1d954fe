#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "kvpack/paging/detail/node_hash_table.hpp"

using kvpack::detail::NodeHashTable;

TEST_CASE("the node hash table finds exactly the ids present through colliding probe runs",
          "[paging][prefix]") {
  // Few distinct hashes, some near the table's end: long runs that wrap around, and erasures in
  // their middle (the backward shift must keep every later id reachable).
  std::vector<std::uint64_t> hash_of_id(500);
  std::mt19937 rng(5);
  for (auto& h : hash_of_id) h = (rng() % 6) * 0x1000 + (rng() % 2 ? 1023 : 3);
  const auto hash_of = [&](std::uint32_t id) { return hash_of_id[id]; };
  NodeHashTable table;
  std::set<std::uint32_t> present;
  for (int step = 0; step < 20000; ++step) {
    const auto id = static_cast<std::uint32_t>(rng() % hash_of_id.size());
    if (present.count(id)) {
      table.erase(id, hash_of(id), hash_of);
      present.erase(id);
    } else {
      table.reserve(table.size() + 1, hash_of);
      table.insert(id, hash_of(id));
      present.insert(id);
    }
    if (step % 97 == 0) {
      for (std::uint32_t probe = 0; probe < hash_of_id.size(); ++probe) {
        const auto found = table.find(hash_of(probe), [&](std::uint32_t x) { return x == probe; });
        REQUIRE(found == (present.count(probe) ? probe : NodeHashTable::kNone));
      }
    }
    REQUIRE(table.size() == present.size());
  }
  CHECK(table.bytes() >= 2 * present.size() * sizeof(std::uint32_t));
}
