// The needle with evict-to-tier and bound-driven recall (NeedleSpec::recall_from_tier): at the
// budget where the evictors lose middle needles, writing every token through to a tier and
// recalling when the certified bound fires brings recall to every depth, for every evictor over
// fp16; recall fires only where the bound does, and the bytes it moves are counted.

#include <catch2/catch.hpp>

#include <vector>

#include "kvpack/eval/needle.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

/// As the detector tests: 2048 tokens, 2 KV heads of 4 query heads; the 512-token budgets keep a quarter.
NeedleSpec recall_spec(bool recall) {
  NeedleSpec spec;
  spec.workload.kv_heads = 2;
  spec.workload.q_heads = 8;
  spec.contexts = {2048};
  spec.recall_from_tier = recall;
  return spec;
}

}  // namespace

TEST_CASE("evict-to-tier with bound-driven recall recalls the needle at every depth", "[eval][needle][recall]") {
  const Policy policies[] = {find_policy("streaming-llm"), find_policy("h2o"), find_policy("snapkv"),
                             find_policy("pyramidkv")};
  const std::vector<NeedleReport> without = NeedleSuite(recall_spec(false)).run(policies);
  const std::vector<NeedleReport> with = NeedleSuite(recall_spec(true)).run(policies);
  for (std::size_t p = 0; p < std::size(policies); ++p) {
    INFO(policies[p].name << ": without " << without[p].compact(2048) << ", with " << with[p].compact(2048));
    CHECK(without[p].compact(2048) != "###########");  // the failure recall is for
    CHECK(with[p].compact(2048) == "###########");
    for (std::size_t c = 0; c < with[p].cells.size(); ++c) {
      const NeedleCell& cell = with[p].cells[c];
      INFO("depth " << cell.depth);
      // Recall runs once per question, when some head fired; no fire, no bytes moved; a recall
      // fetches only what the bound implicates, at most everything written.
      CHECK(cell.tier_recalls <= 1);
      CHECK((cell.tier_recalls == 0) == (cell.fired == 0));
      if (cell.tier_recalls == 0) CHECK(cell.bytes_fetched == 0);
      CHECK(cell.bytes_fetched <= cell.bytes_written);
      // Where the plain cache failed, the bound fired and recall fetched the dropped needle.
      if (without[p].cells[c].recalled < without[p].cells[c].trials) {
        CHECK(cell.tier_recalls == 1);
        CHECK(cell.bytes_fetched > 0);
      }
    }
  }
}

TEST_CASE("a cache that drops nothing never recalls", "[eval][needle][recall]") {
  const NeedleReport report = NeedleSuite(recall_spec(true)).run(find_policy("f16"));
  for (const NeedleCell& cell : report.cells) {
    CHECK(cell.tier_recalls == 0);
    CHECK(cell.bytes_fetched == 0);
  }
  CHECK(report.compact(2048) == "###########");
}
