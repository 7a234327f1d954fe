// The needle with evict-to-tier and bound-driven recall (NeedleSpec::recall_from_tier): at the
// budget where the evictors lose middle needles, writing every token through to a tier and
// recalling when the certified bound fires brings recall to every depth, for every evictor over
// fp16, whether every token is written through or only the dropped ones written back (then
// exactly those bytes); recall fires only where the bound does, and the bytes it moves are counted.

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "kvpack/eval/needle.hpp"

using namespace kvpack;
using namespace kvpack::eval;

namespace {

/// As the detector tests: 2048 tokens, 2 KV heads of 4 query heads; the 512-token budgets keep a quarter.
NeedleSpec recall_spec(bool recall, bool by_demotion = false) {
  NeedleSpec spec;
  spec.workload.kv_heads = 2;
  spec.workload.q_heads = 8;
  spec.contexts = {2048};
  spec.recall_from_tier = recall;
  spec.recall_by_demotion = by_demotion;
  return spec;
}

}  // namespace

TEST_CASE("evict-to-tier with bound-driven recall recalls the needle at every depth", "[eval][needle][recall]") {
  const Policy policies[] = {find_policy("streaming-llm"), find_policy("h2o"), find_policy("snapkv"),
                             find_policy("pyramidkv")};
  const std::vector<NeedleReport> without = NeedleSuite(recall_spec(false)).run(policies);
  const std::vector<NeedleReport> through = NeedleSuite(recall_spec(true)).run(policies);
  const std::vector<NeedleReport> back = NeedleSuite(recall_spec(true, true)).run(policies);
  for (std::size_t p = 0; p < std::size(policies); ++p) {
    for (const std::vector<NeedleReport>* run : {&through, &back}) {
      const std::vector<NeedleReport>& with = *run;
      INFO(policies[p].name << ": without " << without[p].compact(2048) << ", with " << with[p].compact(2048)
                            << (run == &back ? " (write-back)" : " (write-through)"));
      CHECK(without[p].compact(2048) != "###########");  // the failure recall is for
      CHECK(with[p].compact(2048) == "###########");
      // Recall acts on the detector, so the report does not score it (it counted every head as
      // recalled until 2026-12-07, a detector that ran with no false alarm).
      CHECK_FALSE(with[p].detector().ran());
      CHECK(without[p].detector().ran());
      for (std::size_t c = 0; c < with[p].cells.size(); ++c) {
        const NeedleCell& cell = with[p].cells[c];
        INFO("depth " << cell.depth);
        // Write-back writes the dropped tokens only: the 1536 a 512-token budget drops of 2048 per
        // stream, all at prefill, so in 48 entries of a 32-token page (CacheConfig's default);
        // write-through all 2048 in 64 entries. An entry is an 8-byte header and `row` bytes a token.
        if (run == &back) {
          const std::uint64_t row = (through[p].cells[c].bytes_written / 2 - 64 * 8) / 2048;
          CHECK(cell.bytes_written == 2 * (48 * 8 + 1536 * row));
        }
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
}

TEST_CASE("a cache that drops nothing never recalls", "[eval][needle][recall]") {
  const NeedleReport report = NeedleSuite(recall_spec(true)).run(find_policy("f16"));
  for (const NeedleCell& cell : report.cells) {
    CHECK(cell.tier_recalls == 0);
    CHECK(cell.bytes_fetched == 0);
  }
  CHECK(report.compact(2048) == "###########");
}
