// The device page pool's bookkeeping (kernels/cuda/page_ledger.hpp), host-clean so that it runs
// without a GPU: pages handed out once until their last holder lets go, forks' extra holders
// counted, misuse refused with a message, and the counts right when two threads share the ledger.

#include <catch2/catch.hpp>

#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/kernels/cuda/page_ledger.hpp"
#include "support/expect_error.hpp"

namespace {

using kvpack::Error;
using kvpack::ErrorCode;
using kvpack::PageId;
using kvpack::kernels::cuda::PageLedger;
using kvpack::test::expect_error;

}  // namespace

TEST_CASE("a page ledger hands every page out once and refuses when none is left", "[cuda_plan]") {
  PageLedger ledger(5);
  std::set<PageId> taken;
  for (int i = 0; i < 5; ++i) taken.insert(ledger.allocate());
  CHECK(taken == std::set<PageId>{0, 1, 2, 3, 4});
  CHECK(ledger.pages_in_use() == 5);
  expect_error([&] { static_cast<void>(ledger.allocate()); }, ErrorCode::kOutOfPages, "all 5 pages in use");
  CHECK(ledger.release(3));
  CHECK(ledger.allocate() == 3);
  expect_error([] { PageLedger empty(0); }, ErrorCode::kInvalidConfig, "capacity must be in [1, ");
}

TEST_CASE("a shared page is free only after its last holder releases it", "[cuda_plan]") {
  PageLedger ledger(2);
  const PageId page = ledger.allocate();
  ledger.retain(page);
  ledger.retain(page);
  CHECK(ledger.holders(page) == 3);
  CHECK_FALSE(ledger.release(page));
  CHECK_FALSE(ledger.release(page));
  CHECK(ledger.pages_in_use() == 1);
  const PageId other = ledger.allocate();
  CHECK(other != page);
  expect_error([&] { static_cast<void>(ledger.allocate()); }, ErrorCode::kOutOfPages, "exhausted");
  CHECK(ledger.release(page));
  CHECK(ledger.holders(page) == 0);
  CHECK(ledger.pages_in_use() == 1);
  CHECK(ledger.allocate() == page);
}

TEST_CASE("a page ledger refuses to release or share a page nobody holds", "[cuda_plan]") {
  PageLedger ledger(3);
  const PageId page = ledger.allocate();
  CHECK(ledger.release(page));
  expect_error([&] { ledger.release(page); }, ErrorCode::kInvalidArgument, "release: page 0 is free");
  expect_error([&] { ledger.retain(page); }, ErrorCode::kInvalidArgument, "retain: page 0 is free");
  expect_error([&] { ledger.release(3); }, ErrorCode::kInvalidArgument, "page 3 is outside the pool");
  expect_error([&] { static_cast<void>(ledger.holders(7)); }, ErrorCode::kInvalidArgument, "outside the pool of 3");
  CHECK(ledger.pages_in_use() == 0);  // the refused calls changed nothing
  for (int i = 0; i < 3; ++i) static_cast<void>(ledger.allocate());
}

TEST_CASE("a page ledger agrees with a model over random allocations, forks and releases", "[cuda_plan]") {
  constexpr std::size_t kCapacity = 17;
  PageLedger ledger(kCapacity);
  std::map<PageId, std::uint32_t> model;  // holders of every page in use
  std::mt19937 rng(4100);
  for (int step = 0; step < 20000; ++step) {
    const int action = static_cast<int>(rng() % 3);
    if (action == 0) {
      if (model.size() == kCapacity) {
        CHECK_THROWS_AS(ledger.allocate(), Error);
        continue;
      }
      const PageId id = ledger.allocate();
      REQUIRE(id < kCapacity);
      REQUIRE(model.count(id) == 0);  // never a page somebody holds
      model[id] = 1;
    } else if (!model.empty()) {
      auto it = std::next(model.begin(), static_cast<std::ptrdiff_t>(rng() % model.size()));
      if (action == 1) {
        ledger.retain(it->first);
        ++it->second;
      } else {
        const bool freed = ledger.release(it->first);
        REQUIRE(freed == (it->second == 1));
        if (--it->second == 0) model.erase(it);
      }
    }
    REQUIRE(ledger.pages_in_use() == model.size());
  }
  for (PageId id = 0; id < kCapacity; ++id) CHECK(ledger.holders(id) == (model.count(id) ? model[id] : 0u));
}

TEST_CASE("two threads sharing a page ledger leave it consistent", "[cuda_plan]") {
  PageLedger ledger(64);
  auto work = [&ledger](std::uint32_t seed) {
    std::mt19937 rng(seed);
    for (int step = 0; step < 20000; ++step) {
      const PageId id = ledger.allocate();
      const int forks = static_cast<int>(rng() % 3);
      for (int f = 0; f < forks; ++f) ledger.retain(id);
      for (int f = 0; f <= forks; ++f) ledger.release(id);
    }
  };
  std::thread other(work, 4200u);
  work(4201u);
  other.join();
  CHECK(ledger.pages_in_use() == 0);

  // Both threads sharing and letting go of the same pages: every count must come back to one.
  std::vector<PageId> held(2);
  for (PageId& id : held) id = ledger.allocate();
  auto share = [&](std::uint32_t seed) {
    std::mt19937 rng(seed);
    for (int step = 0; step < 1000000; ++step) {
      const PageId id = held[rng() % held.size()];
      ledger.retain(id);
      ledger.release(id);
    }
  };
  std::thread sharer(share, 4300u);
  share(4301u);
  sharer.join();
  for (PageId id : held) CHECK(ledger.holders(id) == 1);
  for (PageId id : held) CHECK(ledger.release(id));
  std::set<PageId> all;
  for (int i = 0; i < 64; ++i) all.insert(ledger.allocate());
  CHECK(all.size() == 64);
}
