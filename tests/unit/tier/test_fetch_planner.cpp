// The fetch-or-recompute planner: its estimates are the formulas in fetch_planner.hpp, its
// decision flips at the crossover crossover_tokens computes, it never fetches when moving a token
// costs more than computing it, and measure_tier measures a real tier without leaving entries.

#include <catch2/catch.hpp>

#include <cmath>

#include "kvpack/tier/fetch_planner.hpp"
#include "kvpack/tier/host_tier.hpp"
#include "unit/io/thrown_error.hpp"

using namespace kvpack;
using namespace kvpack::tier;

namespace {
// A disk-like tier: 2 ms per get, 2 GB/s; restoring at 4 GB/s; a prefill of 50 µs per token.
constexpr FetchCosts kCosts{TierCost{2e-3, 2e9}, 4e9, 50e-6};
}  // namespace

TEST_CASE("plan_fetch estimates both sides by the documented formulas", "[tier]") {
  const FetchPlan plan = plan_fetch(kCosts, 1'000'000, 100);
  CHECK(plan.fetch_s == Approx(2e-3 + 1e6 / 2e9 + 1e6 / 4e9).epsilon(1e-12));
  CHECK(plan.recompute_s == Approx(100 * 50e-6).epsilon(1e-12));
  CHECK(plan.fetch == (plan.fetch_s < plan.recompute_s));
  CHECK(plan.bytes == 1'000'000);
  CHECK(plan.tokens == 100);
  CHECK(plan.costs.tier.latency_s == kCosts.tier.latency_s);
}

TEST_CASE("the decision flips at the crossover", "[tier]") {
  const double bytes_per_token = 4096;  // 4 KiB of K/V per token
  const std::optional<double> crossover = crossover_tokens(kCosts, bytes_per_token);
  REQUIRE(crossover);
  // By hand: 2e-3 / (50e-6 − 4096/2e9 − 4096/4e9) = 2e-3 / 46.928e-6 ≈ 42.6 tokens.
  CHECK(*crossover == Approx(2e-3 / (50e-6 - 4096 / 2e9 - 4096 / 4e9)));
  const auto plan_at = [&](double tokens) {
    return plan_fetch(kCosts, static_cast<std::uint64_t>(tokens * bytes_per_token), static_cast<std::uint64_t>(tokens));
  };
  CHECK_FALSE(plan_at(std::floor(*crossover)).fetch);
  CHECK(plan_at(std::ceil(*crossover)).fetch);
  CHECK(plan_at(100000).fetch);
}

TEST_CASE("fetching never wins when moving a token costs more than computing it", "[tier]") {
  const FetchCosts slow_tier{TierCost{1e-4, 1e8}, 4e9, 1e-5};  // 100 MB/s: 1 MiB per token takes 10 ms
  CHECK_FALSE(crossover_tokens(slow_tier, 1 << 20).has_value());
  CHECK_FALSE(plan_fetch(slow_tier, std::uint64_t{1} << 40, std::uint64_t{1} << 20).fetch);
}

TEST_CASE("planner inputs that cannot be costs are refused", "[tier]") {
  for (const FetchCosts bad : {FetchCosts{TierCost{-1, 1e9}, 1e9, 1e-5}, FetchCosts{TierCost{0, 0}, 1e9, 1e-5},
                               FetchCosts{TierCost{0, 1e9}, 0, 1e-5}, FetchCosts{TierCost{0, 1e9}, 1e9, 0}}) {
    const auto error = test::thrown_error([&] { (void)plan_fetch(bad, 1, 1); });
    REQUIRE(error);
    CHECK(error->code() == ErrorCode::kInvalidArgument);
  }
  CHECK(test::thrown_error([&] { (void)crossover_tokens(kCosts, 0); }));
}

TEST_CASE("measure_tier measures a tier's latency and bandwidth and cleans up", "[tier]") {
  HostTier host(64 << 20);
  host.put("kept", std::vector<std::byte>(10));
  const TierCost cost = measure_tier(host, 4 << 20, 3);
  CHECK(cost.latency_s > 0);
  CHECK(cost.latency_s < 0.1);
  CHECK(cost.bytes_per_s > 1e7);  // a 4 MiB copy in memory: far above 10 MB/s on any machine
  CHECK_FALSE(host.get("kvpack-probe-small").has_value());
  CHECK_FALSE(host.get("kvpack-probe-large").has_value());
  CHECK(host.get("kept").has_value());
  CHECK(test::thrown_error([&] { (void)measure_tier(host, 1000); }));
}
