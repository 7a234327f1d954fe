// KVPACK_ISA is read once per process, so these cases run in processes of their own, each
// started by tests/CMakeLists.txt with the variable set (hidden tags keep them out of the
// module's ordinary run): a bad value is refused when a cache is built, before any write could
// pick an encoder half-way through, and the names are taken in any case.

#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

using namespace kvpack;

namespace {

using Cache = KVCache<layout::GQA, quant::Int8>;
constexpr ModelShape kShape{1, 2, 1, 16};

}  // namespace

TEST_CASE("an unknown KVPACK_ISA is refused when a cache is built, each time", "[.isa_unknown]") {
  const char* setting = std::getenv("KVPACK_ISA");
  REQUIRE(setting != nullptr);
  REQUIRE(std::string(setting) == "Avx3");
  for (int attempt = 0; attempt < 2; ++attempt) {  // a failed choice is not remembered as made
    try {
      Cache cache(kShape);
      FAIL("the cache was built");
    } catch (const Error& error) {
      CHECK(error.code() == ErrorCode::kInvalidConfig);
      CHECK_THAT(error.what(), Catch::Contains("KVPACK_ISA=Avx3 is not one of avx512, avx2, sse2"));
    }
  }
}

TEST_CASE("KVPACK_ISA names are taken in any case", "[.isa_upper_case]") {
  const char* setting = std::getenv("KVPACK_ISA");
  REQUIRE(setting != nullptr);
  REQUIRE(std::string(setting) == "SSE2");  // every x86-64 CPU runs it
  Cache cache(kShape);
  CHECK(dispatch::active_cpu_isa() == "sse2");
  const SeqId seq = cache.add_sequence();
  const std::vector<float> rows = test::random_rows(40, kShape.head_dim, 1);  // a page and a part
  cache.prefill(seq, 0, std::span<const float>(rows), std::span<const float>(rows));
  CHECK(cache.length(seq, 0) == 40);
}
