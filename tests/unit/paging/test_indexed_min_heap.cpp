#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kvpack/paging/detail/indexed_min_heap.hpp"

using kvpack::detail::IndexedMinHeap;

TEST_CASE("the indexed heap keeps the least id on top through pushes and arbitrary erasures",
          "[paging][prefix]") {
  constexpr std::size_t kIds = 300;
  std::vector<std::uint64_t> key(kIds);  // the order: key, then id
  const auto less = [&](std::uint32_t a, std::uint32_t b) {
    return key[a] != key[b] ? key[a] < key[b] : a < b;
  };
  IndexedMinHeap heap;
  heap.reserve(kIds);
  std::set<std::pair<std::uint64_t, std::uint32_t>> reference;
  std::mt19937 rng(6);
  for (int step = 0; step < 20000; ++step) {
    const auto id = static_cast<std::uint32_t>(rng() % kIds);
    if (heap.contains(id)) {
      REQUIRE(reference.erase({key[id], id}) == 1);
      heap.erase(id, less);
    } else {
      key[id] = rng() % 50;  // many equal keys
      heap.push(id, less);
      reference.insert({key[id], id});
    }
    REQUIRE(heap.size() == reference.size());
    if (!reference.empty()) REQUIRE(heap.top() == reference.begin()->second);
  }
  while (!heap.empty()) {  // draining in order
    REQUIRE(heap.top() == reference.begin()->second);
    reference.erase(reference.begin());
    heap.erase(heap.top(), less);
  }
  CHECK(reference.empty());
}
