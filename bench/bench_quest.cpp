// kvpack_bench_quest: Quest page selection (select/quest.hpp) against dense decode attention, one
// Llama-3.1-8B layer (8 KV heads, 4 query heads each, head_dim 128) at a 32K-token context in fp16,
// q8_0 and q4_0 pages of 32 tokens. Summaries are built once at setup by decoding every key page
// with the codec's scalar decoder (what the cache will store in page metadata).
//
// BM_Dense attends every page of every KV head (kernels::attend_stream over all page pointers).
// BM_Quest/budget:B scores every page's bound for the KV head's 4 query heads (max over the
// group), keeps the top B/32 pages and attends only those pointers; scoring and selection are
// inside the timed step. Budgets are 1/4, 1/16 and 1/64 of the context per KV head.
//
// Every iteration starts from DRAM: the caches are flushed (a 256 MiB read, not timed) before
// each step, as a decode loop that visits 32 layers between two steps of one layer would see.
// Without it a 1/64 budget's 10 MB (fp16) would stay in L3 and the speed-up would be an L3 number.
//
// Counters: bytes_per_step (page payloads read + Quest summaries scanned, all KV heads), GBps
// (those bytes per second), byte_ratio (dense bytes / these bytes), speedup (dense time / this
// time, same codec, same run), efficiency (speedup / byte_ratio; the goal is >= 0.8) and
// select_share (fraction of the step spent scoring and selecting pages).

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <chrono>
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

struct Fixture {
  virtual ~Fixture() = default;
  /// One decode step of the layer: every KV head, all pages (pages_per_head < 0) or the top ones.
  virtual void step(index_t pages_per_head, double& select_seconds) = 0;
  index_t pages = 0;                // per KV head
  std::size_t payload_bytes = 0;    // per page, K and V planes
  std::size_t summary_bytes = 0;    // per page
};

template <class Quantizer>
struct QuestFixture final : Fixture {
  using Cache = KVCache<layout::GQA, Quantizer>;
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;

  std::unique_ptr<Cache> cache;
  index_t page_size = 0;
  std::size_t value_offset = 0;
  std::vector<std::vector<const std::byte*>> page_pointers;  // [kv_heads][pages]
  std::vector<std::vector<float>> summaries;                 // [kv_heads][pages][2][head_dim]
  std::vector<std::vector<const float*>> summary_pointers;   // [kv_heads][pages]
  std::vector<std::pair<typename KeyCodec::params_type, typename ValueCodec::params_type>> params;
  kernels::KernelSet<KeyCodec, ValueCodec> kernel_set = kernels::KernelSet<KeyCodec, ValueCodec>::selected();
  kernels::Workspace workspace;
  std::vector<float> queries;  // [q_heads][head_dim], scale applied
  std::vector<float> out;      // [q_heads][head_dim]
  std::vector<float> page_bounds;
  std::vector<index_t> chosen;
  std::vector<const std::byte*> chosen_pointers;
  select::Quest quest;

  QuestFixture() {
    const index_t d = kLayerShape.head_dim;
    const std::size_t elements = static_cast<std::size_t>(kContext) * kLayerShape.kv_heads * d;
    std::vector<half> keys(elements), values(elements);
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < elements; ++i) {
      keys[i] = half(normal(rng) * (i % d < 4 ? 8.0f : 1.0f));  // a few large channels, as real keys
      values[i] = half(normal(rng));
    }
    cache = std::make_unique<Cache>(kLayerShape, CacheConfig{}, bench::make_quantizer<Quantizer>(kLayerShape));
    const SeqId seq = cache->add_sequence();
    cache->prefill(seq, 0, std::span<const half>(keys), std::span<const half>(values));
    page_size = cache->config().page_size;
    value_offset = cache->value_plane_offset();
    payload_bytes = cache->page_format_info().payload_bytes;
    summary_bytes = quest.summary_bytes(page_size, d);
    std::vector<float> decoded(static_cast<std::size_t>(page_size) * d);
    for (index_t s = 0; s < kLayerShape.kv_heads; ++s) {
      const std::span<const PageId> ids = cache->pages(seq, 0, s);
      // The default config has no tail window: all 32K tokens must sit in pages.
      if (static_cast<index_t>(ids.size()) * page_size != kContext) {
        throw std::runtime_error(fmt::format("stream {} holds {} pages, expected {}", s, ids.size(), kContext / page_size));
      }
      pages = static_cast<index_t>(ids.size());
      params.push_back(cache->codec_params(0, s));
      auto& pointers = page_pointers.emplace_back();
      auto& summary = summaries.emplace_back(static_cast<std::size_t>(pages) * 2 * d);
      auto& summary_of = summary_pointers.emplace_back();
      for (index_t p = 0; p < pages; ++p) {
        const std::byte* payload = cache->pool().payload(ids[p]);
        pointers.push_back(payload);
        cache->quantizer().key.decode(quant::PageGeometry{page_size, d}, payload, params.back().first, decoded.data());
        float* min = summary.data() + static_cast<std::size_t>(p) * 2 * d;
        select::summarize_page(decoded.data(), nullptr, page_size, d, min, min + d);
        summary_of.push_back(min);
      }
    }
    queries.resize(static_cast<std::size_t>(kLayerShape.q_heads) * d);
    for (float& x : queries) x = normal(rng) * 0.0883883f;  // 1/sqrt(128)
    out.resize(queries.size());
    workspace.prepare(kLayerShape.group_size(), d, page_size, 0);
    page_bounds.resize(pages);
    chosen.resize(pages);
    chosen_pointers.resize(pages);
  }

  void step(index_t pages_per_head, double& select_seconds) override {
    const index_t group = kLayerShape.group_size();
    const index_t d = kLayerShape.head_dim;
    for (index_t s = 0; s < kLayerShape.kv_heads; ++s) {
      const std::size_t offset = static_cast<std::size_t>(s) * group * d;
      const std::byte* const* run_pages = page_pointers[s].data();
      index_t count = pages;
      if (pages_per_head >= 0) {
        const auto start = std::chrono::steady_clock::now();
        select::group_page_bounds(std::span<const float>(queries).subspan(offset, static_cast<std::size_t>(group) * d),
                                  group, d, summary_pointers[s], {}, page_bounds, quest.group_bound);
        count = select::select_top_pages(page_bounds, pages_per_head, chosen);
        for (index_t i = 0; i < count; ++i) chosen_pointers[i] = page_pointers[s][chosen[i]];
        run_pages = chosen_pointers.data();
        select_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      const kernels::PageRun run{run_pages, nullptr, count, 0, page_size, d, value_offset, payload_bytes};
      kernels::attend_stream<KeyCodec, ValueCodec>(run, params[s].first, params[s].second, kernels::TailView{},
                                                   queries.data() + offset, group, out.data() + offset, workspace,
                                                   kernel_set);
    }
  }
};

std::unique_ptr<Fixture>& current_fixture() {
  static std::unique_ptr<Fixture> fixture;
  return fixture;
}
std::string& current_key() {
  static std::string key;
  return key;
}
/// Dense seconds per step, by codec: the baseline of speedup.
std::map<std::string, double>& dense_seconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

/// budget_tokens < 0: dense.
template <class Quantizer>
void quest_benchmark(benchmark::State& state, index_t budget_tokens) {
  const std::string key = Quantizer::name();
  if (current_key() != key) {
    current_fixture().reset();  // free the previous codec's pages first
    current_fixture() = std::make_unique<QuestFixture<Quantizer>>();
    current_key() = key;
  }
  Fixture& fixture = *current_fixture();
  select::Quest quest;
  quest.token_budget = budget_tokens;
  const index_t page_size = kContext / fixture.pages;
  const index_t pages_per_head = budget_tokens < 0 ? -1 : quest.pages_to_read(fixture.pages, page_size);
  double select_seconds = 0.0;
  double step_seconds = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    flush_caches();
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    fixture.step(pages_per_head, select_seconds);
    step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double iterations = static_cast<double>(state.iterations());
  const double per_step = step_seconds / iterations;
  const double heads = kLayerShape.kv_heads;
  const double dense_bytes = heads * fixture.pages * static_cast<double>(fixture.payload_bytes);
  const double bytes = budget_tokens < 0 ? dense_bytes
                                         : heads * (pages_per_head * static_cast<double>(fixture.payload_bytes) +
                                                    fixture.pages * static_cast<double>(fixture.summary_bytes));
  if (budget_tokens < 0) dense_seconds()[key] = per_step;
  state.counters["bytes_per_step"] = bytes;
  state.counters["GBps"] = bytes / per_step / 1e9;
  state.counters["pages_per_head"] = budget_tokens < 0 ? fixture.pages : pages_per_head;
  if (budget_tokens >= 0) {
    state.counters["byte_ratio"] = dense_bytes / bytes;
    state.counters["select_share"] = select_seconds / step_seconds;
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
                               [](benchmark::State& s) { quest_benchmark<Quantizer>(s, -1); })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  for (const index_t fraction : {4, 16, 64}) {
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
  fmt::print(stderr, "kvpack_bench_quest: kernels for {} (KVPACK_ISA overrides)\n", dispatch::active_cpu_isa());
  register_codec<quant::Float<half>>();
  register_codec<quant::Q8_0>();
  register_codec<quant::Q4_0>();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
