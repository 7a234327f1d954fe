// kvpack_bench_tiers: tier read and write throughput, and restoring a sequence from a tier.
// BM_Get / BM_Put: one entry per iteration, a random one of `pages` entries of `page_bytes`
//   each, in a tier filled once before timing: host memory (HostTier), local disk (DiskTier
//   under /tmp, so the OS page cache serves reads), Redis on loopback (RedisTier against a
//   redis-server this bench starts; its rows are skipped without hiredis or redis-server).
//   8 KiB is one page of one (layer, KV head) stream of Llama-3.1-8B at 16 tokens in fp16.
// BM_Restore/check: fetch_sequence from a HostTier into a cache (parse every section's CRC32C,
//   copy the pages into the pool) at each PageCheck: 0 kReencode (decode, re-encode and compare
//   every page), 1 kFinite (decode every page), 2 kStructure (positions and masks only): the
//   restore bandwidth the planner (kvpack/tier/fetch_planner.hpp) charges on top of the tier's.

#include <benchmark/benchmark.h>

#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <unistd.h>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "kvpack/tier.hpp"
#ifdef KVPACK_BENCH_HAS_REDIS
#include "kvpack/tier/redis_tier.hpp"
#include "support/redis_server.hpp"
#endif

namespace {

using namespace kvpack;

enum TierKind : int { kHost = 0, kDisk = 1, kRedis = 2 };
constexpr const char* kTierNames[] = {"host", "disk", "redis"};

std::string key_of(std::size_t i) { return "page-" + std::to_string(i); }

/// A tier of one kind holding `pages` entries of `page_bytes`, built once per argument set.
struct FilledTier {
  std::unique_ptr<tier::Tier> store;
  std::string skip_reason;  ///< why this tier cannot run here; empty when it can
  std::vector<std::byte> entry;
  std::size_t pages = 0;
};

std::filesystem::path disk_directory() {
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("kvpack-bench-tiers-" + std::to_string(::getpid()));
  return path;
}

#ifdef KVPACK_BENCH_HAS_REDIS
test::RedisServer* redis_server(std::string& error) {
  static std::unique_ptr<test::RedisServer> server;
  static std::string start_error;
  static bool tried = false;
  if (!tried) {
    tried = true;
    try {
      server = std::make_unique<test::RedisServer>();
    } catch (const std::exception& e) {
      start_error = e.what();
    }
  }
  error = start_error;
  return server.get();
}
#endif

FilledTier& filled_tier(int kind, std::size_t page_bytes, std::size_t pages) {
  static std::map<std::tuple<int, std::size_t, std::size_t>, FilledTier> tiers;
  const auto found = tiers.find({kind, page_bytes, pages});
  if (found != tiers.end()) return found->second;
  FilledTier& t = tiers[{kind, page_bytes, pages}];
  t.entry.resize(page_bytes);
  std::mt19937 rng(7);
  for (std::byte& b : t.entry) b = static_cast<std::byte>(rng());
  t.pages = pages;
  const std::string scope = std::to_string(page_bytes) + "x" + std::to_string(pages);
  if (kind == kHost) {
    t.store = std::make_unique<tier::HostTier>(page_bytes * pages + (1 << 20));
  } else if (kind == kDisk) {
    std::filesystem::remove_all(disk_directory() / scope);
    t.store = std::make_unique<tier::DiskTier>(disk_directory() / scope);
  } else {
#ifdef KVPACK_BENCH_HAS_REDIS
    std::string error;
    test::RedisServer* server = redis_server(error);
    if (server == nullptr) {
      t.skip_reason = error;
      return t;
    }
    tier::RedisTierOptions options;
    options.port = server->port();
    options.key_prefix = scope + ":";
    t.store = std::make_unique<tier::RedisTier>(options);
#else
    t.skip_reason = "built without hiredis";
    return t;
#endif
  }
  for (std::size_t i = 0; i < pages; ++i) t.store->put(key_of(i), t.entry);
  return t;
}

void run(benchmark::State& state, bool write) {
  const int kind = static_cast<int>(state.range(0));
  const auto page_bytes = static_cast<std::size_t>(state.range(1));
  const auto pages = static_cast<std::size_t>(state.range(2));
  state.SetLabel(kTierNames[kind]);
  FilledTier& t = filled_tier(kind, page_bytes, pages);
  if (!t.skip_reason.empty()) {
    state.SkipWithError(t.skip_reason.c_str());
    return;
  }
  std::mt19937_64 rng(11);
  std::vector<std::string> keys(4096);
  for (std::string& key : keys) key = key_of(rng() % pages);
  std::size_t next = 0;
  for (auto _ : state) {
    const std::string& key = keys[next++ % keys.size()];
    if (write) {
      t.store->put(key, t.entry);
    } else {
      const auto got = t.store->get(key);
      benchmark::DoNotOptimize(got->data());
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(page_bytes * state.iterations()));
  state.SetItemsProcessed(state.iterations());  // pages per second
}

void BM_Get(benchmark::State& state) { run(state, false); }
void BM_Put(benchmark::State& state) { run(state, true); }

// {tier, page bytes, pages held}: 8 KiB pages for 1K, 10K and 100K pages held; 64 KiB and 1 MiB
// entries (a sequence's page file) at 1K.
void tier_args(benchmark::internal::Benchmark* b) {
  for (int kind : {kHost, kDisk, kRedis}) {
    for (std::int64_t pages : {1000, 10000, 100000}) b->Args({kind, 8 << 10, pages});
    b->Args({kind, 64 << 10, 1000});
    b->Args({kind, 1 << 20, 1000});
  }
}
// Wall time: a Redis get waits for another process, a disk put for the kernel.
BENCHMARK(BM_Get)->Apply(tier_args)->ArgNames({"tier", "page_bytes", "pages"})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Put)->Apply(tier_args)->ArgNames({"tier", "page_bytes", "pages"})->UseRealTime()->Unit(benchmark::kMicrosecond);

// A q8_0 sequence at Llama-3.1-8B's KV shape cut to 8 layers, 2048 tokens: a 34 MiB page file.
void BM_Restore(benchmark::State& state) {
  using Cache = KVCache<layout::GQA, quant::Q8_0>;
  const auto check = static_cast<PageCheck>(state.range(0));
  constexpr ModelShape shape{8, 32, 8, 128};
  constexpr index_t tokens = 2048;
  Cache source(shape);
  const SeqId seq = source.add_sequence();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> rows(static_cast<std::size_t>(tokens) * shape.kv_heads * shape.head_dim);
  for (float& x : rows) x = normal(rng);
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    source.prefill(seq, layer, std::span<const float>(rows), std::span<const float>(rows));
  }
  std::vector<std::int32_t> ids(tokens);
  for (index_t i = 0; i < tokens; ++i) ids[i] = i;
  tier::HostTier host(std::size_t{256} << 20);
  const std::string key = tier::sequence_key(source, ids, "bench");
  const std::size_t bytes = tier::store_sequence(host, key, source, seq, ids, "bench");
  Cache target(shape);
  for (auto _ : state) {
    const std::optional<SeqId> loaded = tier::fetch_sequence(host, key, target, ids, check);
    state.PauseTiming();
    target.release(*loaded);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * state.iterations()));
  state.counters["file_MiB"] = static_cast<double>(bytes) / (1 << 20);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(tokens) * state.iterations(),
                                                      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Restore)->ArgName("check")->DenseRange(0, 2)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::error_code ignored;
  std::filesystem::remove_all(disk_directory(), ignored);
  return 0;
}
