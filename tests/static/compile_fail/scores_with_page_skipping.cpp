// Must not compile: an Evictor that ranks tokens by attention scores with a Selector that skips
// pages (unread tokens would never be scored). Expected: KVCache's static_assert on the pair.
// With KVPACK_COMPILE_FAIL_CONTROL the selector reads every page and the file must compile.

#include <cstddef>
#include <string_view>

#include "kvpack/kvpack.hpp"

namespace kv = kvpack;

namespace mock {

struct ScoreRanking {
  static constexpr std::string_view kName = "score_ranking";
  static constexpr bool kNeedsScores = true;
  static constexpr bool kDropsTokens = false;  // keeps the failure down to the combination
};
static_assert(kv::evict::Evictor<ScoreRanking>, "the mock itself is an Evictor");

struct SkipsPages {
  static constexpr std::string_view kName = "skips_pages";
#ifdef KVPACK_COMPILE_FAIL_CONTROL
  static constexpr bool kReadsAllPages = true;
#else
  static constexpr bool kReadsAllPages = false;
#endif
  [[nodiscard]] std::size_t summary_bytes(kv::index_t, kv::index_t) const noexcept { return 0; }
};
static_assert(kv::select::PageSelector<SkipsPages>, "the mock itself is a PageSelector");

}  // namespace mock

static_assert(sizeof(kv::KVCache<kv::layout::GQA, kv::quant::Int8, mock::ScoreRanking, mock::SkipsPages>) > 0);
