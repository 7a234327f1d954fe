// PagePrefetcher: which bytes a page loop requests ahead, whole payloads or one plane each
// (PageRun::planes_apart), observed through step()'s request hook.

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "kvpack/kernels/cpu/prefetch.hpp"

namespace {

using namespace kvpack;
using kvpack::kernels::PageRun;
using kvpack::kernels::cpu::PagePrefetcher;

constexpr std::size_t kLine = 64;

/// Lines requested by a kernel's page loop over `run` (a prefetcher per page, `steps` steps
/// each, or `taken` steps and then finish()), by page index and offset from the payload's start;
/// each page owns `reach` bytes.
std::map<index_t, std::set<std::size_t>> requested(const PageRun& run, Plane plane, index_t steps, std::size_t reach,
                                                   index_t taken = -1) {
  std::map<index_t, std::set<std::size_t>> lines;
  auto record = [&](const std::byte* line) {
    for (index_t p = 0; p < run.count + run.prefetch; ++p) {
      if (line >= run.pages[p] && line < run.pages[p] + reach) {
        lines[p].insert(static_cast<std::size_t>(line - run.pages[p]));
        return;
      }
    }
    FAIL("a request outside every page");
  };
  for (index_t i = 0; i < run.count; ++i) {
    PagePrefetcher prefetcher(run, i, 1, steps, plane);
    if (taken >= 0) {
      for (index_t s = 0; s < taken; ++s) prefetcher.step(record);
      prefetcher.finish(record);
      continue;
    }
    for (index_t s = 0; s < steps + 2; ++s) prefetcher.step(record);  // extra steps are no-ops
  }
  return lines;
}

std::set<std::size_t> lines_of(std::size_t from, std::size_t to) {
  std::set<std::size_t> lines;
  for (std::size_t at = from; at < to; at += kLine) lines.insert(at);
  return lines;
}

}  // namespace

TEST_CASE("PagePrefetcher requests each page ahead once, whole or by plane") {
  // 16 KiB payloads with a 10 KiB key plane, 4 KiB apart: a step's few lines past a plane's end
  // land in the next plane or that gap, anything further in no page and fails the test.
  constexpr std::size_t kPayload = 16 << 10, kValueOffset = 10 << 10, kGap = 4 << 10;
  constexpr index_t kCount = 8, kAhead = 8;
  std::vector<std::byte> arena((kCount + kAhead) * (kPayload + kGap) + kLine);
  std::byte* base = arena.data() + (kLine - reinterpret_cast<std::uintptr_t>(arena.data()) % kLine) % kLine;
  std::vector<const std::byte*> pages;
  for (index_t p = 0; p < kCount + kAhead; ++p) pages.push_back(base + p * (kPayload + kGap));
  PageRun run;
  run.pages = pages.data();
  run.count = kCount;
  run.prefetch = kAhead;
  run.value_offset = kValueOffset;
  run.payload_bytes = kPayload;

  const bool apart = GENERATE(false, true);
  // One burst per page, a line per step, and a step count that leaves a partial last step.
  const index_t steps = GENERATE(index_t{1}, index_t{7}, static_cast<index_t>(kPayload / kLine));
  run.planes_apart = apart;
  CAPTURE(apart, steps);

  const auto keys = requested(run, Plane::kKey, steps, kPayload + kGap);
  const auto values = requested(run, Plane::kValue, steps, kPayload + kGap);
  const std::set<std::size_t> key_lines = apart ? lines_of(0, kValueOffset) : lines_of(0, kPayload);
  // kCount consecutive pages, all ahead of the first (the loop reads page 0 itself).
  auto check_pages = [&](const std::map<index_t, std::set<std::size_t>>& got, const std::set<std::size_t>& want) {
    REQUIRE(got.size() == static_cast<std::size_t>(kCount));
    CHECK(got.begin()->first >= 1);
    CHECK(got.rbegin()->first - got.begin()->first == kCount - 1);
    for (const auto& [page, lines] : got) {
      // A step may run past the plane's end by less than a step's lines; everything else is exact.
      std::set<std::size_t> within;
      for (std::size_t at : lines) {
        if (at < *want.rbegin() + kLine) within.insert(at);
      }
      CHECK(within == want);
      CHECK(lines.size() - within.size() < (kPayload / kLine + steps - 1) / steps);
    }
  };
  check_pages(keys, key_lines);
  if (apart) {
    check_pages(values, lines_of(kValueOffset, kPayload));
  } else {
    CHECK(values.empty());  // the key loop requested whole payloads
  }

  // A loop that leaves after a few steps (a kernel's fp32 fallback) finishes with the same lines.
  for (const index_t taken : {index_t{0}, steps / 2}) {
    CAPTURE(taken);
    CHECK(requested(run, Plane::kKey, steps, kPayload + kGap, taken) == keys);
    CHECK(requested(run, Plane::kValue, steps, kPayload + kGap, taken) == values);
  }
}
