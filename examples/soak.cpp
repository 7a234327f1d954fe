/// \file soak.cpp
/// \brief A long-running server's life in a few minutes: sequences added, prefilled, decoded,
/// forked and released at random on one cache near its page limit, with the process's resident
/// memory sampled as it goes. A cache that leaks pages, tails or tables, or a pool that keeps
/// growing, shows up as resident memory that climbs after the warm-up.
///
///   soak [--seconds S] [--report-every R] [--max-growth PERCENT] [--seed N]
///
/// The warm-up lasts a fifth of the run, and at least until the pool first refuses a page: the pool
/// keeps the slabs it grew, so until then its growth is expected. Exit status 0 when, after the
/// warm-up, the resident set never exceeds its warm-up peak by more than --max-growth percent and,
/// once every sequence is released, the pool has no page in use and memory() reports no page,
/// tail or table bytes; 1 otherwise, saying which.

#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/cli.hpp"
#include "kvpack/kvpack.hpp"

namespace {

namespace examples = kvpack::examples;
using namespace kvpack;
using Clock = std::chrono::steady_clock;

struct Options {
  double seconds = 180.0;
  double report_every = 15.0;
  double max_growth_percent = 5.0;
  std::uint32_t seed = 1;
};

/// The longest run or report interval (a typo such as 1e300 would otherwise never end).
constexpr double kWeek = 7 * 24 * 3600.0;

Options parse(int argc, char** argv) {
  Options o;
  examples::ArgReader args(argc, argv);
  while (args.next()) {
    if (args.is("--help") || args.is("-h")) {
      fmt::print("usage: soak [--seconds S] [--report-every R] [--max-growth PERCENT] [--seed N]\n"
                 "  --seconds S          run time, at most a week (default 180)\n"
                 "  --report-every R     seconds between resident-memory lines, at most a week (default 15)\n"
                 "  --max-growth P       allowed growth of resident memory over the warm-up peak, percent (default 5)\n"
                 "  --seed N             operation sequence seed, 0 to 4294967295 (default 1)\n");
      std::exit(0);
    } else if (args.is("--seconds")) {
      o.seconds = args.real_in(1e-3, kWeek);
    } else if (args.is("--report-every")) {
      o.report_every = args.real_in(1e-3, kWeek);
    } else if (args.is("--max-growth")) {
      o.max_growth_percent = args.real(examples::RealBound::kNonNegative);
    } else if (args.is("--seed")) {
      o.seed = args.number<std::uint32_t>(0, 0xFFFFFFFFu);
    } else {
      throw examples::UsageError{fmt::format("unknown argument '{}'", args.name())};
    }
  }
  return o;
}

/// Resident set size of this process in bytes (/proc/self/statm, second field). Throws where it
/// cannot be read: a growth check over zeros would pass without measuring anything.
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  double total_pages = 0, resident_pages = 0;
  if (!(statm >> total_pages >> resident_pages) || !(resident_pages > 0)) {
    throw std::runtime_error("cannot read the resident set size from /proc/self/statm");
  }
  return resident_pages * static_cast<double>(sysconf(_SC_PAGESIZE));
}

int run(const Options& o) {
  const ModelShape shape{4, 8, 2, 64};
  CacheConfig config;
  config.page_size = 32;
  config.tail_tokens = 32;
  config.exact_prefix_tokens = 2;
  config.max_pages = 6000;  // about 24 sequences of 1K tokens (248 pages each): the pool runs near its limit
  KVCache<layout::GQA, quant::Q8_0> cache(shape, config);

  std::mt19937 rng(o.seed);
  std::normal_distribution<float> normal;
  const std::size_t row = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;
  std::vector<float> keys, values;
  auto fill = [&](std::size_t tokens) {
    keys.resize(tokens * row);
    values.resize(tokens * row);
    for (float& x : keys) x = normal(rng);
    for (float& x : values) x = normal(rng);
  };
  std::vector<float> query(static_cast<std::size_t>(shape.q_heads) * shape.head_dim), out(query.size());
  for (float& x : query) x = normal(rng);

  constexpr std::size_t kMaxLive = 96;
  std::vector<SeqId> live;
  std::size_t operations = 0, out_of_pages = 0, adds = 0, forks = 0, releases = 0;
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  const double min_warm_up = o.seconds / 5.0;
  bool warm = false;  // past the warm-up
  double warm_peak = 0.0, later_peak = 0.0, next_report = 0.0;

  fmt::print("soak: {:.0f} s, Q8_0 cache of {} layers x {} KV heads x {}, at most {} pages; warm-up at least {:.0f} s\n",
             o.seconds, shape.layers, shape.kv_heads, shape.head_dim, config.max_pages, min_warm_up);
  while (elapsed() < o.seconds) {
    const unsigned op = rng() % 100;
    try {
      // At most kMaxLive sequences: past it, adds and forks turn into releases.
      if (live.size() >= kMaxLive && op < 22) {
        const std::size_t i = rng() % live.size();
        cache.release(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        ++releases;
      } else if (live.empty() || op < 15) {
        const SeqId seq = cache.add_sequence();
        live.push_back(seq);  // in the list before prefill, so a failed prefill is still released
        fill(64 + rng() % 960);
        for (index_t layer = 0; layer < shape.layers; ++layer) {
          cache.prefill(seq, layer, std::span<const float>(keys), std::span<const float>(values));
        }
        ++adds;
      } else if (op < 22) {
        live.push_back(cache.fork(live[rng() % live.size()]));
        ++forks;
      } else if (op < 40) {
        const std::size_t i = rng() % live.size();
        cache.release(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        ++releases;
      } else if (op < 80) {
        const SeqId seq = live[rng() % live.size()];
        fill(1);
        for (index_t layer = 0; layer < shape.layers; ++layer) {
          cache.append(seq, layer, std::span<const float>(keys), std::span<const float>(values),
                       cache.last_position(seq, layer) + 1);
        }
      } else {
        const SeqId seq = live[rng() % live.size()];
        for (index_t layer = 0; layer < shape.layers; ++layer) {
          if (cache.length(seq, layer) > 0) {
            cache.attend(seq, layer, std::span<const float>(query), std::span<float>(out), 0.125f);
          }
        }
      }
    } catch (const OutOfPages&) {
      ++out_of_pages;  // the strong guarantee: the failed call changed nothing; free some room
      if (!live.empty()) {
        cache.release(live.front());
        live.erase(live.begin());
        ++releases;
      }
    }
    ++operations;
    if (operations % 64 == 0) {
      const double rss = resident_bytes();
      const double now = elapsed();
      if (!warm && now >= min_warm_up && out_of_pages > 0) {
        warm = true;
        fmt::print("  {:6.1f} s  warm-up over (the pool has refused a page)\n", now);
      }
      if (warm) {
        later_peak = std::max(later_peak, rss);
      } else {
        warm_peak = std::max(warm_peak, rss);
      }
      if (now >= next_report) {
        fmt::print("  {:6.1f} s  resident {:8.1f} MiB  cache {:8.1f} MiB  {:5} pages  {:3} sequences  {} operations\n",
                   now, rss / (1 << 20), static_cast<double>(cache.memory().total()) / (1 << 20),
                   cache.memory().pages_in_use, live.size(), operations);
        next_report += o.report_every;
      }
    }
  }
  for (SeqId seq : live) cache.release(seq);
  const MemoryUsage after = cache.memory();
  fmt::print("soak: {} operations ({} sequences added, {} forked, {} released; {} writes refused for lack of pages)\n",
             operations, adds, forks, releases + live.size(), out_of_pages);
  if (!warm) {
    fmt::print("soak: FAILED: the pool never ran out of pages, so the run never left its warm-up (run longer)\n");
    return 1;
  }
  const double growth = 100.0 * (later_peak - warm_peak) / warm_peak;
  fmt::print("soak: resident peak {:.1f} MiB in the warm-up, {:.1f} MiB after it ({:+.2f} %)\n", warm_peak / (1 << 20),
             later_peak / (1 << 20), growth);
  fmt::print("soak: after releasing everything: {} pages in use, {} B of pages, tails and tables\n",
             cache.pool().pages_in_use(), after.page_payload + after.page_metadata + after.tails + after.tables);
  bool ok = true;
  if (growth > o.max_growth_percent) {
    fmt::print("soak: FAILED: resident memory grew {:.2f} % after the warm-up (limit {} %)\n", growth,
               o.max_growth_percent);
    ok = false;
  }
  if (cache.pool().pages_in_use() != 0 || after.page_payload + after.page_metadata + after.tails + after.tables != 0) {
    fmt::print("soak: FAILED: memory is still accounted after every sequence was released\n");
    ok = false;
  }
  if (ok) fmt::print("soak: passed\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const examples::UsageError& error) {
    fmt::print(stderr, "soak: {}\n", error.message);
    return examples::kUsageError;
  } catch (const std::exception& error) {
    fmt::print(stderr, "soak: error: {}\n", error.what());
    return 1;
  }
}
