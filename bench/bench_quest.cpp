// kvpack_bench_quest: select::Quest against dense decode attention through KVCache::attend, one
// Llama-3.1-8B layer (8 KV heads, 4 query heads each, head_dim 128) at a 32K-token context in fp16,
// q8_0 and q4_0 pages of 32 tokens.
//
// BM_Dense attends a KVCache<GQA, Q> (every page). BM_Quest/budget:B attends a
// KVCache<GQA, Q, KeepAll, select::Quest> holding the same tokens, with token_budget B and no
// dense layers: each step scores every page's summary for the KV head's 4 query heads (max over
// the group), keeps the top B/32 pages and reads only those — scoring and selection included.
// Budgets are 1/1 (every page: the cost of scoring the boxes), 1/4, 1/16 and 1/64 of the
// context per KV head.
//
// BM_DenseInterleaved is BM_Dense over a stream whose pages are not adjacent in the pool, as
// decoding leaves them (the same tokens prefilled 32 at a time, so the 8 streams' pages
// alternate): what dense attention costs without the hardware prefetcher running across pages.
// Quest's selected pages are scattered the same way; the speed-ups stay against BM_Dense.
//
// Every iteration starts from DRAM: the caches are flushed (a 256 MiB read, not timed) before
// each step, as a decode loop that visits 32 layers between two steps of one layer would see.
// Without it a 1/64 budget's 10 MB (fp16) would stay in L3 and the speed-up would be an L3 number.
//
// BM_PageBounds scores 8 streams' summaries alone (select::group_page_bounds, 4 query heads each,
// per-head bounds kept), from 8192 boxes laid out at the Quest cache's metadata stride, as its
// pages hold them; BM_ReadSummaries reads the same boxes and only sums them: the memory's share of
// the scan. Both start every step from DRAM.
//
// KVPACK_BENCH_PAGE_SIZE=64 (or any page size the cache takes) runs every row but the box scan
// with that page size instead of 32 tokens.
//
// Counters: bytes_per_step (page payloads read + the summaries' boxes scanned, all KV heads), GBps
// (those bytes per second), byte_ratio (dense bytes / these bytes), speedup (dense time / this
// time, same codec, same run) and efficiency (speedup / byte_ratio; the goal is >= 0.8).

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_codecs.hpp"
#include "kvpack/kvpack.hpp"
#include "kvpack/select/quest.hpp"
#include "shared_fixture.hpp"

namespace {

using namespace kvpack;

constexpr ModelShape kLayerShape{1, 32, 8, 128};  // one Llama-3.1-8B layer
constexpr index_t kContext = 32768;
constexpr std::size_t kFlushBytes = std::size_t{256} << 20;

/// Reads a buffer larger than the last-level cache so the next step's KV bytes come from DRAM.
void flush_caches() {
  static std::vector<std::uint64_t> buffer = [] {
    std::vector<std::uint64_t> b(kFlushBytes / sizeof(std::uint64_t));
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = i;
    return b;
  }();
  std::uint64_t a = 0, b = 0;
  for (std::size_t i = 0; i + 2 <= buffer.size(); i += 2) {
    a += buffer[i];
    b += buffer[i + 1];
  }
  benchmark::DoNotOptimize(a + b);
}

/// Runs `step` once per iteration, each from DRAM (flush_caches, not timed): seconds per step.
template <class Step>
double seconds_per_cold_step(benchmark::State& state, const Step& step) {
  double seconds = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    flush_caches();
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    step();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return seconds / static_cast<double>(state.iterations());
}

/// The caches' configuration: the default (32-token pages) unless KVPACK_BENCH_PAGE_SIZE names
/// another page size. Quest reads whole pages scattered over the pool, so the page size is the
/// length of each sequential run it reads. main checks the value before any benchmark runs.
CacheConfig bench_config() {
  CacheConfig config;
  if (const char* text = std::getenv("KVPACK_BENCH_PAGE_SIZE")) {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    config.page_size = *text != '\0' && *end == '\0' && value > 0 && value <= 4096 ? static_cast<index_t>(value) : 0;
  }
  return config;
}

struct Fixture {
  virtual ~Fixture() = default;
  /// One decode step of the layer through KVCache::attend: Quest with token budget `budget`,
  /// or kDense (the dense cache) or kInterleaved (the dense cache with scattered pages).
  virtual void step(index_t budget) = 0;
  static constexpr index_t kDense = -1, kInterleaved = -2;
  index_t pages = 0;              // per KV head
  std::size_t payload_bytes = 0;  // per page, K and V planes
  std::size_t box_bytes = 0;      // per page: the summary's min and max rows Quest scans
};

template <class Quantizer>
struct QuestFixture final : Fixture {
  using Dense = KVCache<layout::GQA, Quantizer>;
  using Selective = KVCache<layout::GQA, Quantizer, evict::KeepAll, select::Quest>;

  std::vector<half> keys, values;
  std::unique_ptr<Dense> dense;
  std::map<index_t, std::unique_ptr<Selective>> selective;  // by token budget
  std::vector<float> query;  // [q_heads][head_dim]
  std::vector<float> out;    // [q_heads][head_dim]
  static constexpr float kScale = 0.0883883f;  // 1/sqrt(128)

  QuestFixture() {
    const index_t d = kLayerShape.head_dim;
    const std::size_t elements = static_cast<std::size_t>(kContext) * kLayerShape.kv_heads * d;
    keys.resize(elements);
    values.resize(elements);
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < elements; ++i) {
      keys[i] = half(normal(rng) * (i % d < 4 ? 8.0f : 1.0f));  // a few large channels, as real keys
      values[i] = half(normal(rng));
    }
    dense = std::make_unique<Dense>(kLayerShape, bench_config(), bench::make_quantizer<Quantizer>(kLayerShape));
    const SeqId seq = dense->add_sequence();
    dense->prefill(seq, 0, std::span<const half>(keys), std::span<const half>(values));
    // The default config has no tail window: all 32K tokens must sit in pages.
    pages = static_cast<index_t>(dense->pages(seq, 0, 0).size());
    if (pages * dense->config().page_size != kContext) {
      throw std::runtime_error(fmt::format("a stream holds {} pages, expected {}", pages, kContext / dense->config().page_size));
    }
    payload_bytes = dense->page_format_info().payload_bytes;
    box_bytes = 2 * static_cast<std::size_t>(d) * sizeof(float);
    query.resize(static_cast<std::size_t>(kLayerShape.q_heads) * d);
    for (float& x : query) x = normal(rng);
    out.resize(query.size());
  }

  Selective& with_budget(index_t budget) {
    auto& cache = selective[budget];
    if (!cache) {
      select::Quest quest;
      quest.token_budget = budget;
      quest.dense_layers = 0;
      cache = std::make_unique<Selective>(kLayerShape, bench_config(), bench::make_quantizer<Quantizer>(kLayerShape),
                                          layout::GQA{}, evict::KeepAll{}, quest);
      const SeqId seq = cache->add_sequence();
      cache->prefill(seq, 0, std::span<const half>(keys), std::span<const half>(values));
    }
    return *cache;
  }

  std::unique_ptr<Dense> interleaved;  // built on first use

  void step(index_t budget) override {
    if (budget == kInterleaved) {
      if (!interleaved) {
        interleaved = std::make_unique<Dense>(kLayerShape, bench_config(), bench::make_quantizer<Quantizer>(kLayerShape));
        const SeqId seq = interleaved->add_sequence();
        const std::size_t row = static_cast<std::size_t>(kLayerShape.kv_heads) * kLayerShape.head_dim;
        for (index_t t = 0; t < kContext; t += 32) {
          interleaved->prefill(seq, 0, std::span<const half>(keys).subspan(t * row, 32 * row),
                               std::span<const half>(values).subspan(t * row, 32 * row));
        }
      }
      interleaved->attend(1, 0, std::span<const float>(query), std::span<float>(out), kScale);
    } else if (budget == kDense) {
      dense->attend(1, 0, std::span<const float>(query), std::span<float>(out), kScale);
    } else {
      with_budget(budget).attend(1, 0, std::span<const float>(query), std::span<float>(out), kScale);
    }
  }
};

/// 8 streams × 1024 page summaries (random boxes around 0) at the Quest cache's metadata stride.
struct SummaryFixture {
  std::vector<std::byte> metadata;
  std::vector<const float*> summaries;  // [kv_heads][pages]
  std::vector<float> queries;           // [group][head_dim]
  std::vector<float> head_bounds, page_bounds;
  index_t pages = kContext / 32, group = kLayerShape.q_heads / kLayerShape.kv_heads;

  SummaryFixture() {
    using Selective = KVCache<layout::GQA, quant::Float<half>, evict::KeepAll, select::Quest>;
    const Selective probe(kLayerShape, CacheConfig{}, {}, layout::GQA{}, evict::KeepAll{}, select::Quest{});
    const std::size_t stride = probe.page_format_info().metadata_bytes;
    const index_t d = kLayerShape.head_dim;
    const std::size_t streams = kLayerShape.kv_heads;
    metadata.resize(streams * pages * stride);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < streams * pages; ++i) {
      float* box = reinterpret_cast<float*>(metadata.data() + i * stride);
      for (index_t c = 0; c < d; ++c) {
        const float a = normal(rng), b = normal(rng);
        box[c] = std::min(a, b);
        box[d + c] = std::max(a, b);
      }
      summaries.push_back(box);
    }
    queries.resize(static_cast<std::size_t>(group) * d);
    for (float& x : queries) x = normal(rng);
    head_bounds.resize(static_cast<std::size_t>(group) * pages);
    page_bounds.resize(pages);
  }
  [[nodiscard]] double box_bytes() const {
    return static_cast<double>(summaries.size()) * 2 * kLayerShape.head_dim * sizeof(float);
  }
};

/// read_only: sum the boxes instead of scoring them.
void summaries_benchmark(benchmark::State& state, bool read_only) {
  static SummaryFixture fixture;
  const index_t d = kLayerShape.head_dim;
  const double per_step = seconds_per_cold_step(state, [&] {
    float total = 0.0f;
    for (index_t stream = 0; stream < kLayerShape.kv_heads; ++stream) {
      const std::span<const float* const> boxes(fixture.summaries.data() + stream * fixture.pages, fixture.pages);
      if (read_only) {
        for (const float* box : boxes) {
          float partial[16] = {};
          for (index_t i = 0; i < 2 * d; i += 16) {
            for (int lane = 0; lane < 16; ++lane) partial[lane] += box[i + lane];
          }
          for (const float x : partial) total += x;
        }
      } else {
        select::group_page_bounds(fixture.queries, fixture.group, d, boxes, fixture.head_bounds, fixture.page_bounds);
        total += fixture.page_bounds[0];
      }
    }
    benchmark::DoNotOptimize(total);
  });
  state.counters["bytes_per_step"] = fixture.box_bytes();
  state.counters["GBps"] = fixture.box_bytes() / per_step / 1e9;
}

/// Dense seconds per step, by codec: the baseline of speedup.
std::map<std::string, double>& dense_seconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

/// budget_tokens: a Quest token budget, or Fixture::kDense / kInterleaved (negative).
template <class Quantizer>
void quest_benchmark(benchmark::State& state, index_t budget_tokens) {
  const std::string key = Quantizer::name();
  Fixture& fixture = bench::shared_fixture<Fixture>(key, [] { return std::make_unique<QuestFixture<Quantizer>>(); });
  select::Quest quest;
  quest.token_budget = budget_tokens;
  const index_t page_size = kContext / fixture.pages;
  const index_t pages_per_head = budget_tokens < 0 ? -1 : quest.pages_to_read(fixture.pages, page_size);
  fixture.step(budget_tokens);  // builds the Quest cache outside the timing
  const double per_step = seconds_per_cold_step(state, [&] { fixture.step(budget_tokens); });
  const double heads = kLayerShape.kv_heads;
  const double dense_bytes = heads * fixture.pages * static_cast<double>(fixture.payload_bytes);
  const double bytes = budget_tokens < 0 ? dense_bytes
                                         : heads * (pages_per_head * static_cast<double>(fixture.payload_bytes) +
                                                    fixture.pages * static_cast<double>(fixture.box_bytes));
  if (budget_tokens == Fixture::kDense) dense_seconds()[key] = per_step;
  state.counters["bytes_per_step"] = bytes;
  state.counters["GBps"] = bytes / per_step / 1e9;
  state.counters["pages_per_head"] = budget_tokens < 0 ? fixture.pages : pages_per_head;
  if (budget_tokens >= 0) {
    state.counters["byte_ratio"] = dense_bytes / bytes;
    if (const auto it = dense_seconds().find(key); it != dense_seconds().end()) {
      const double speedup = it->second / per_step;
      state.counters["speedup"] = speedup;
      state.counters["efficiency"] = speedup / (dense_bytes / bytes);
    }
  }
}

template <class Quantizer>
void register_codec() {
  const std::string name = bench::row_name<Quantizer>();
  benchmark::RegisterBenchmark(fmt::format("BM_Dense<{}>/ctx:{}", name, kContext).c_str(),
                               [](benchmark::State& s) { quest_benchmark<Quantizer>(s, Fixture::kDense); })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark(fmt::format("BM_DenseInterleaved<{}>/ctx:{}", name, kContext).c_str(),
                               [](benchmark::State& s) { quest_benchmark<Quantizer>(s, Fixture::kInterleaved); })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  for (const index_t fraction : {1, 4, 16, 64}) {
    const index_t budget = kContext / fraction;
    benchmark::RegisterBenchmark(fmt::format("BM_Quest<{}>/ctx:{}/budget:{}", name, kContext, budget).c_str(),
                                 [budget](benchmark::State& s) { quest_benchmark<Quantizer>(s, budget); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (const char* text = std::getenv("KVPACK_BENCH_PAGE_SIZE")) {
    const CacheConfig config = bench_config();
    try {
      config.validate();
    } catch (const Error& e) {
      fmt::print(stderr, "kvpack_bench_quest: KVPACK_BENCH_PAGE_SIZE='{}' is not a page size: {}\n", text, e.what());
      return 2;
    }
    if (kContext % config.page_size != 0) {
      fmt::print(stderr, "kvpack_bench_quest: KVPACK_BENCH_PAGE_SIZE={} does not divide the {}-token context\n",
                 config.page_size, kContext);
      return 2;
    }
  }
  fmt::print(stderr, "kvpack_bench_quest: kernels for {} (KVPACK_ISA overrides)\n", dispatch::active_cpu_isa());
  register_codec<quant::Float<half>>();
  register_codec<quant::Q8_0>();
  register_codec<quant::Q4_0>();
  for (const bool read_only : {false, true}) {
    benchmark::RegisterBenchmark(read_only ? "BM_ReadSummaries/pages:8x1024" : "BM_PageBounds/pages:8x1024",
                                 [read_only](benchmark::State& s) { summaries_benchmark(s, read_only); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
