#pragma once
/// \file fetch_planner.hpp
/// \brief Fetch or recompute? Loading a sequence's K/V from a tier costs the tier's latency, the
///        transfer, and restoring the pages into the cache; recomputing it costs a prefill. The
///        planner compares the two from measured numbers and says which is cheaper, with every
///        input in the answer so a caller can log or override the decision.
///
///   fetch_s     = latency + bytes / tier bandwidth + bytes / restore bandwidth
///   recompute_s = tokens · prefill seconds per token
///
/// With bytes = tokens · b (b: bytes per token), fetching wins from
///   tokens > latency / (p − b / tier bandwidth − b / restore bandwidth)
/// on, and never when the denominator is ≤ 0 (moving a token costs more than computing it).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvpack/error.hpp"
#include "kvpack/tier/tier.hpp"

namespace kvpack::inline v0::tier {

/// What one get from a tier costs: latency + bytes / bytes_per_s.
struct TierCost {
  double latency_s = 0;
  double bytes_per_s = 0;
};

/// The costs a plan is made from (all measured on the machine that decides).
struct FetchCosts {
  TierCost tier;
  double restore_bytes_per_s = 0;  ///< parsing a page file and loading it into a cache
  double prefill_s_per_token = 0;  ///< the model's prefill, per token, at the context in question
};

struct FetchPlan {
  bool fetch = false;           ///< true: fetching is expected to be faster than recomputing
  std::uint64_t bytes = 0;      ///< the entry's size
  std::uint64_t tokens = 0;     ///< the tokens a recompute would prefill
  double fetch_s = 0;           ///< expected seconds to fetch and restore
  double recompute_s = 0;       ///< expected seconds to recompute
  FetchCosts costs;             ///< the inputs, as given
};

namespace planner_detail {
inline void check_costs(const FetchCosts& c) {
  KVPACK_CHECK(c.tier.latency_s >= 0 && c.tier.bytes_per_s > 0 && c.restore_bytes_per_s > 0 &&
                   c.prefill_s_per_token > 0,
               kInvalidArgument,
               detail::message("FetchCosts: latency must be >= 0 and bandwidths and the prefill cost > 0; got "
                               "latency ",
                               c.tier.latency_s, " s, tier ", c.tier.bytes_per_s, " B/s, restore ",
                               c.restore_bytes_per_s, " B/s, prefill ", c.prefill_s_per_token, " s/token"));
}
}  // namespace planner_detail

[[nodiscard]] inline FetchPlan plan_fetch(const FetchCosts& costs, std::uint64_t bytes, std::uint64_t tokens) {
  planner_detail::check_costs(costs);
  FetchPlan plan;
  plan.bytes = bytes;
  plan.tokens = tokens;
  plan.costs = costs;
  const double b = static_cast<double>(bytes);
  plan.fetch_s = costs.tier.latency_s + b / costs.tier.bytes_per_s + b / costs.restore_bytes_per_s;
  plan.recompute_s = static_cast<double>(tokens) * costs.prefill_s_per_token;
  plan.fetch = plan.fetch_s < plan.recompute_s;
  return plan;
}

/// The context length from which fetching beats recomputing, for entries of `bytes_per_token`
/// per token; nullopt when it never does.
[[nodiscard]] inline std::optional<double> crossover_tokens(const FetchCosts& costs, double bytes_per_token) {
  planner_detail::check_costs(costs);
  KVPACK_CHECK(bytes_per_token > 0, kInvalidArgument, "crossover_tokens: bytes_per_token must be > 0");
  const double margin = costs.prefill_s_per_token - bytes_per_token / costs.tier.bytes_per_s -
                        bytes_per_token / costs.restore_bytes_per_s;
  if (margin <= 0) return std::nullopt;
  return costs.tier.latency_s / margin;
}

/// Measures a tier's get: latency as the median of `repeats` gets of a 64-byte entry, bandwidth
/// from the median get of a `large_bytes` entry once that latency is taken off. Writes, reads and
/// erases two entries under `key_stem` (replacing entries of those names; a bounded tier may
/// drop others to make room, and a call that throws may leave them): measure a scratch tier
/// object on the same store where that matters.
/// \throws kvpack::Error as the tier does; kInvalidArgument for large_bytes < 1 MiB or repeats < 1.
[[nodiscard]] inline TierCost measure_tier(Tier& tier, std::size_t large_bytes = std::size_t{8} << 20,
                                           int repeats = 5, const std::string& key_stem = "kvpack-probe") {
  KVPACK_CHECK(large_bytes >= (std::size_t{1} << 20), kInvalidArgument,
               "measure_tier: large_bytes must be at least 1 MiB (smaller gets measure latency, not bandwidth)");
  KVPACK_CHECK(repeats >= 1, kInvalidArgument, "measure_tier: repeats must be >= 1");
  const auto median_get = [&](const std::string& key, std::size_t size) {
    std::vector<std::byte> bytes(size);
    for (std::size_t i = 0; i < size; ++i) bytes[i] = static_cast<std::byte>(i * 131 + 7);
    tier.put(key, bytes);
    std::vector<double> seconds;
    for (int r = 0; r < repeats; ++r) {
      const auto start = std::chrono::steady_clock::now();
      const auto got = tier.get(key);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      KVPACK_CHECK(got && got->size() == size, kUnavailable,
                   detail::message("measure_tier: ", tier.describe(), " lost its probe entry '", key, "'"));
    }
    tier.erase(key);
    std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
    return seconds[seconds.size() / 2];
  };
  TierCost cost;
  cost.latency_s = median_get(key_stem + "-small", 64);
  const double large_s = median_get(key_stem + "-large", large_bytes);
  // At least a tenth of the large get is charged to the transfer, so noise cannot make it free.
  cost.bytes_per_s = static_cast<double>(large_bytes) / std::max(large_s - cost.latency_s, large_s / 10);
  return cost;
}

}  // namespace kvpack::inline v0::tier
