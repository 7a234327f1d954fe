#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "kvpack/paging/page_pool.hpp"

using kvpack::PageId;
using kvpack::paging::PageFormat;
using kvpack::paging::PagePool;

TEST_CASE("pages are distinct, aligned and keep their bytes while the pool grows", "[paging]") {
  PagePool pool(PageFormat{4096, 136}, 10000);
  std::vector<PageId> ids(3000);  // spans several doubling slabs (the first holds 64 pages)
  pool.allocate(ids);
  std::set<PageId> unique(ids.begin(), ids.end());
  CHECK(unique.size() == ids.size());
  std::set<const std::byte*> payloads;
  for (PageId id : ids) {
    CHECK(reinterpret_cast<std::uintptr_t>(pool.payload(id)) % 64 == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(pool.metadata(id)) % 8 == 0);
    payloads.insert(pool.payload(id));
    std::memset(pool.payload(id), static_cast<int>(id % 251), 4096);
    std::memset(pool.metadata(id), static_cast<int>(id % 241), 136);
  }
  CHECK(payloads.size() == ids.size());
  std::vector<PageId> more(5000);
  pool.allocate(more);  // growth must not move earlier pages
  for (PageId id : ids) {
    const auto* p = pool.payload(id);
    CHECK(std::all_of(p, p + 4096, [&](std::byte b) { return b == std::byte(id % 251); }));
    const auto* m = pool.metadata(id);
    CHECK(std::all_of(m, m + 136, [&](std::byte b) { return b == std::byte(id % 241); }));
  }
  CHECK(pool.pages_in_use() == 8000);
  CHECK(pool.bytes_in_use() == 8000u * (4096 + 136));
}

TEST_CASE("exhaustion throws OutOfPages and takes nothing", "[paging]") {
  PagePool pool(PageFormat{64, 8}, 10);
  std::vector<PageId> seven(7);
  pool.allocate(seven);
  std::vector<PageId> five(5);
  CHECK_THROWS_AS(pool.allocate(five), kvpack::OutOfPages);
  try {
    pool.allocate(five);
  } catch (const kvpack::Error& e) {
    CHECK(e.code() == kvpack::ErrorCode::kOutOfPages);
    CHECK(std::string(e.what()).find("5 pages requested, 3 available of 10") != std::string::npos);
  }
  CHECK(pool.pages_in_use() == 7);
  CHECK(pool.pages_available() == 3);
  std::vector<PageId> three(3);
  pool.allocate(three);
  CHECK(pool.pages_available() == 0);
  CHECK_THROWS_AS(pool.allocate_one(), kvpack::OutOfPages);
}

TEST_CASE("reference counts free a page on the last release, and freed pages are reused", "[paging]") {
  PagePool pool(PageFormat{128, 8}, 4);
  const PageId a = pool.allocate_one();
  CHECK(pool.ref_count(a) == 1);
  pool.retain(a);
  pool.retain(a);
  CHECK(pool.ref_count(a) == 3);
  pool.release(a);
  pool.release(a);
  CHECK(pool.pages_in_use() == 1);
  pool.release(a);
  CHECK(pool.pages_in_use() == 0);
  CHECK(pool.pages_available() == 4);
  const PageId b = pool.allocate_one();
  CHECK(b == a);  // LIFO free list: the warmest page comes back first
  CHECK(pool.ref_count(b) == 1);
}

TEST_CASE("a pool rejects formats it cannot align", "[paging]") {
  CHECK_THROWS_AS(PagePool(PageFormat{100, 8}, 4), kvpack::Error);
  CHECK_THROWS_AS(PagePool(PageFormat{128, 12}, 4), kvpack::Error);
  CHECK_THROWS_AS(PagePool(PageFormat{128, 8}, 0), kvpack::Error);
}

TEST_CASE("concurrent allocate, retain and release balance to zero", "[paging][threads]") {
  PagePool pool(PageFormat{256, 16}, 2000);
  std::mutex held_mutex;
  std::multiset<PageId> held;  // every page currently owned by some thread
  auto worker = [&](unsigned seed) {
    std::vector<PageId> mine;
    for (int round = 0; round < 2000; ++round) {
      seed = seed * 1664525u + 1013904223u;
      if ((seed % 3 != 0 && mine.size() < 100) || mine.empty()) {
        std::vector<PageId> got(1 + seed % 4);
        pool.allocate(got);
        std::lock_guard lock(held_mutex);
        for (PageId id : got) {
          CHECK(held.count(id) == 0);  // nobody else owns a page we were just given
          held.insert(id);
          mine.push_back(id);
        }
      } else {
        const PageId id = mine.back();
        mine.pop_back();
        pool.retain(id);
        pool.release(id);
        {
          std::lock_guard lock(held_mutex);
          held.erase(held.find(id));
        }
        pool.release(id);
      }
    }
    for (PageId id : mine) {
      {
        std::lock_guard lock(held_mutex);
        held.erase(held.find(id));
      }
      pool.release(id);
    }
  };
  std::thread a(worker, 1u), b(worker, 2u), c(worker, 3u);
  a.join();
  b.join();
  c.join();
  CHECK(pool.pages_in_use() == 0);
  CHECK(pool.pages_available() == 2000);
}

TEST_CASE("huge-page advice covers exactly the whole 2 MiB pages inside a slab", "[paging]") {
  using kvpack::paging::kHugePageBytes;
  using kvpack::paging::whole_huge_pages;
  constexpr std::uintptr_t kHuge = kHugePageBytes;
  // Aligned start and end: all of it.
  CHECK(whole_huge_pages(4 * kHuge, 3 * kHuge).begin == 4 * kHuge);
  CHECK(whole_huge_pages(4 * kHuge, 3 * kHuge).end == 7 * kHuge);
  // Unaligned at both ends: rounded inward.
  CHECK(whole_huge_pages(4 * kHuge + 4096, 3 * kHuge).begin == 5 * kHuge);
  CHECK(whole_huge_pages(4 * kHuge + 4096, 3 * kHuge).end == 7 * kHuge);
  // Under one whole huge page: none, even when the range crosses a boundary.
  const auto none = whole_huge_pages(kHuge - 4096, kHuge);
  CHECK(none.begin == none.end);
  CHECK(whole_huge_pages(0, 0).begin == whole_huge_pages(0, 0).end);
  // A range reaching the top of the address space does not wrap.
  const auto top = whole_huge_pages(UINTPTR_MAX - 100, 50);
  CHECK(top.begin == top.end);
#if defined(__linux__)
  // The kernel accepts the advice wherever it supports transparent huge pages at all.
  if (std::FILE* thp = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    std::fclose(thp);
    std::vector<std::byte> buffer(4 * kHugePageBytes);
    CHECK(kvpack::paging::advise_huge_pages(buffer.data(), buffer.size()));
  }
#endif
  std::byte small[64];
  CHECK_FALSE(kvpack::paging::advise_huge_pages(small, sizeof(small)));
}

TEST_CASE("a large slab's metadata starts zeroed, as small slabs' does", "[paging]") {
  // Slabs past 4 MiB of metadata, which is advised before it is zeroed. Two pools dirty their
  // metadata and go first, so the allocator hands their memory out again (fresh pages from the
  // kernel would be zero whether the pool zeroes them or not).
  for (int round = 0; round < 2; ++round) {
    PagePool dirty(PageFormat{64, 4096}, 8192);
    std::vector<PageId> taken(8000);
    dirty.allocate(taken);
    for (const PageId id : taken) std::memset(dirty.metadata(id), 0xA5, 4096);
  }
  PagePool pool(PageFormat{64, 4096}, 8192);
  std::vector<PageId> ids(8000);
  pool.allocate(ids);
  std::size_t nonzero = 0;
  for (const PageId id : ids) {
    const std::byte* meta = pool.metadata(id);
    const auto is_set = [](std::byte b) { return b != std::byte{0}; };
    nonzero += static_cast<std::size_t>(std::count_if(meta, meta + 4096, is_set));
  }
  CHECK(nonzero == 0);
}
