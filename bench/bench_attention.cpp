// kvpack_bench_attention: decode attention at the Llama-3.1-8B shape (32 query heads, 8 KV heads,
// head_dim 128) for 4K, 32K and 128K contexts, every codec, 1 and 2 threads, next to a plain
// streaming read of 1 GiB (BM_StreamRead) so the fraction of the memory limit is visible in one
// run. Each iteration attends one layer; iterations rotate over enough layers that the KV bytes
// read (>= 512 MiB) cannot stay in any cache, so the numbers are DRAM numbers.
// BM_AttendInCache repeats one 1K-token layer (0.6–4 MiB: L2/L3-resident) instead: its kv_GBps is
// the kernel's compute ceiling. A codec whose in-cache rate is near its DRAM rate is compute-bound.
// BM_AttendPreRope stores the keys before RoPE (CacheConfig::key_rope, as the kvquant-* policies
// do) and rotates them as they are read; its speedup_vs_fp16 is against fp16 stored after RoPE.
// BM_AttendPreRopeGapsInCache does so for pages whose positions have gaps (evict::SnapKV kept 1K
// of 4K prompt tokens per KV head): every page is decoded to rows and each row rotated on its own.
//
// BM_AttendPaged runs the same step as one kernels::attend_paged launch over the cache's own
// page tables (what an engine with its own block tables calls); speedup_vs_cache_attend is
// KVCache::attend's time on the same cache over its own.
//
// BM_IntegerDotPeak is the other ceiling, the integer multiply-add rate (integer_dot_peak.hpp):
// an integer kernel's GMACps against it shows how much of its time goes to work besides products.
//
// Counters: kv_GBps (encoded bytes read per second: pages with their scales; every row keeps
// no fp32 tail, KIVI too, so its rows are R = 0, not the kivi-* policies' R = 128; slot
// metadata is not counted), bytes_per_token (those bytes per token of one layer, all KV heads),
// GMACps (score and value multiply-adds per second), tokens_per_s (decode steps per second of a
// 32-layer model at this context, attention only), speedup_vs_fp16 (fp16's time per layer /
// this codec's, same run; with repetitions, against fp16's latest repetition, so compare medians
// of the time column for the ratio of medians).

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

#include "bench_codecs.hpp"
#include "integer_dot_peak.hpp"
#include "shared_fixture.hpp"
#include "kvpack/kernels/cache_launch.hpp"
#include "kvpack/kvpack.hpp"
#include "kvpack/paging/huge_pages.hpp"

namespace {

using namespace kvpack;

constexpr ModelShape kLayerShape{1, 32, 8, 128};  // one Llama-3.1-8B layer
constexpr std::size_t kWorkingSetBytes = std::size_t{512} << 20;
constexpr int kModelLayers = 32;
constexpr float kScale = 0.0884f;  // ≈ 1/sqrt(head_dim)

/// One pool of threads per thread count, shared by every benchmark.
ThreadPool& pool_of(int threads) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& pool = pools[threads];
  if (!pool) pool = std::make_unique<ThreadPool>(static_cast<std::size_t>(threads));
  return *pool;
}

// --- BM_StreamRead ----------------------------------------------------------------------------

/// Sums 64-bit words with four independent accumulators: the loop is load-bound, so its rate is
/// the memory system's, whatever vector width the compiler picks.
std::uint64_t sum_words(const std::uint64_t* p, std::size_t n) {
  std::uint64_t a = 0, b = 0, c = 0, d = 0;
  for (std::size_t i = 0; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  return a + b + c + d;
}

void stream_read(benchmark::State& state, int threads) {
  constexpr std::size_t kBytes = std::size_t{1} << 30;
  constexpr std::size_t kWords = kBytes / sizeof(std::uint64_t);
  // On 2 MiB pages where the kernel grants them, as the page pool asks for its slabs: on 4 KiB
  // pages (THP "madvise" hosts) the TLB misses made this ceiling lower than the one the kernels
  // read against. Advised before the first touch, which is when pages are chosen.
  static const std::unique_ptr<std::uint64_t[]> buffer = [] {
    std::unique_ptr<std::uint64_t[]> b(new std::uint64_t[kWords]);
    (void)paging::advise_huge_pages(b.get(), kBytes);
    for (std::size_t i = 0; i < kWords; ++i) b[i] = i * 0x9E3779B97F4A7C15ull;  // touch every page
    return b;
  }();
  ThreadPool& pool = pool_of(threads);
  std::atomic<std::uint64_t> sink{0};
  for (auto _ : state) {
    const std::size_t share = kWords / threads;
    pool(threads, [&](index_t t) { sink += sum_words(buffer.get() + t * share, share); });
  }
  benchmark::DoNotOptimize(sink.load());
  state.counters["GBps"] = benchmark::Counter(static_cast<double>(state.iterations()) * kBytes / 1e9,
                                              benchmark::Counter::kIsRate);
}

// --- BM_Attend ----------------------------------------------------------------------------------

/// A cache holding `layers` copies of one random context, built once per (codec, context) and
/// shared by the 1- and 2-thread rows.
struct AttendFixture {
  virtual ~AttendFixture() = default;
  /// One decode step of one layer; `pool` (nullptr: serial) spreads the KV streams.
  virtual void attend(index_t layer, const std::vector<float>& q, std::vector<float>& out, ThreadPool* pool) = 0;
  /// The same step as one kernels::attend_paged launch over the cache's own page tables, serial.
  virtual void attend_paged(index_t layer, const std::vector<float>& q, std::vector<float>& out) = 0;
  index_t layers = 0;
  std::size_t bytes_per_layer = 0;
};

/// How a fixture stores its keys: after RoPE; before RoPE at positions 0 .. context - 1; or
/// before RoPE with gaps, evict::SnapKV keeping `context` of 4 · context prompt tokens per KV head.
enum class KeyStorage { kPostRope, kPreRope, kPreRopeGaps };

template <class Quantizer, class Evictor = evict::KeepAll>
struct CacheFixture final : AttendFixture {
  using Cache = KVCache<layout::GQA, Quantizer, Evictor>;
  static constexpr index_t kGapFactor = 4;  // prompt tokens per kept token with kPreRopeGaps
  ThreadPool* pool = nullptr;  // read by the cache's executor on every attend
  std::unique_ptr<Cache> cache;
  SeqId seq = 0;

  /// `in_cache`: one layer, read again and again; otherwise enough layers to exceed the caches.
  CacheFixture(index_t context, bool in_cache, KeyStorage storage) {
    const bool gaps = storage == KeyStorage::kPreRopeGaps;
    const index_t prompt = gaps ? kGapFactor * context : context;
    // One layer's K and V: keys with a few large channels, as real models have.
    const std::size_t elements = static_cast<std::size_t>(prompt) * kLayerShape.kv_heads * kLayerShape.head_dim;
    std::vector<half> keys(elements), values(elements);
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < elements; ++i) {
      keys[i] = half(normal(rng) * (i % 128 < 4 ? 8.0f : 1.0f));
      values[i] = half(normal(rng));
    }
    CacheConfig config;
    if (storage != KeyStorage::kPostRope) config.key_rope = RopeSpec{};
    config.executor = [this](index_t count, const std::function<void(index_t)>& task) {
      if (pool != nullptr) {
        (*pool)(count, task);
      } else {
        for (index_t i = 0; i < count; ++i) task(i);
      }
    };
    ModelShape shape = kLayerShape;
    {
      const Cache probe(shape, config, bench::make_quantizer<Quantizer>(shape));
      const std::size_t pages = static_cast<std::size_t>(context / probe.config().page_size) * shape.kv_heads;
      bytes_per_layer = pages * probe.page_format_info().payload_bytes;
    }
    shape.layers = in_cache ? 1
                            : static_cast<index_t>(std::max<std::size_t>(
                                  2, (kWorkingSetBytes + bytes_per_layer - 1) / bytes_per_layer));
    layers = shape.layers;
    Evictor evictor;
    std::vector<half> observation;  // the last prompt queries, which SnapKV ranks the tokens by
    if constexpr (!std::is_same_v<Evictor, evict::KeepAll>) {
      evictor.budget.tokens = context;
      observation.resize(static_cast<std::size_t>(evictor.window) * kLayerShape.q_heads * kLayerShape.head_dim);
      for (half& x : observation) x = half(normal(rng));
    }
    cache = std::make_unique<Cache>(shape, config, bench::make_quantizer<Quantizer>(shape), layout::GQA{}, evictor);
    seq = cache->add_sequence();
    for (index_t layer = 0; layer < shape.layers; ++layer) {
      cache->prefill(seq, layer, std::span<const half>(keys), std::span<const half>(values),
                     std::span<const half>(observation));
    }
  }

  void attend(index_t layer, const std::vector<float>& q, std::vector<float>& out, ThreadPool* threads) override {
    pool = threads;
    cache->attend(seq, layer, std::span<const float>(q), std::span<float>(out), kScale);
  }

  /// The cache's layers as raw launches over their own page tables, as an engine hands them over
  /// (caches that kernels::CacheLayerLaunch takes; nothing for the others).
  using K = typename Quantizer::key_codec;
  using V = typename Quantizer::value_codec;
  static constexpr bool kLaunchable = kernels::PagedAttendable<K, V> && kernels::kHostParams<K, V> &&
                                      std::is_same_v<Evictor, evict::KeepAll>;
  std::conditional_t<kLaunchable, std::vector<kernels::CacheLayerLaunch<Cache>>, std::monostate> launches;
  std::vector<float> scaled;
  kernels::PagedWorkspace workspace;

  void attend_paged(index_t layer, const std::vector<float>& q, std::vector<float>& out) override {
    if constexpr (kLaunchable) {
      if (launches.empty()) {
        for (index_t l = 0; l < layers; ++l) launches.emplace_back(*cache, seq, l);
      }
      scaled.resize(q.size());
      for (std::size_t i = 0; i < q.size(); ++i) scaled[i] = q[i] * kScale;
      kernels::CacheLayerLaunch<Cache>& launch = launches[static_cast<std::size_t>(layer)];
      launch.args().queries = scaled.data();
      launch.args().out = out.data();
      launch.attend(workspace);
    } else {
      throw Error(ErrorCode::kUnsupported, "BM_AttendPaged: codecs both backends decode, KeepAll only");
    }
  }
};

/// fp16's seconds per layer, by "context/threads": the baseline of speedup_vs_fp16.
std::map<std::string, double>& fp16_seconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

/// KVCache::attend's seconds per layer by "codec/context/threads/in_cache" (post-RoPE keys): the
/// baseline of BM_AttendPaged's speedup_vs_cache_attend.
std::map<std::string, double>& cache_attend_seconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

/// `paged`: the step as one kernels::attend_paged launch over the cache's page tables instead of
/// KVCache::attend (one thread, post-RoPE keys).
template <class Quantizer>
void attend_benchmark(benchmark::State& state, index_t context, int threads, bool in_cache,
                      KeyStorage storage = KeyStorage::kPostRope, bool paged = false) {
  const std::string key = fmt::format("{}/{}/{}/{}", Quantizer::name(), context, in_cache, static_cast<int>(storage));
  AttendFixture& fixture = bench::shared_fixture<AttendFixture>(key, [&]() -> std::unique_ptr<AttendFixture> {
    if (storage == KeyStorage::kPreRopeGaps) {
      return std::make_unique<CacheFixture<Quantizer, evict::SnapKV<>>>(context, in_cache, storage);
    }
    return std::make_unique<CacheFixture<Quantizer>>(context, in_cache, storage);
  });
  std::vector<float> q(static_cast<std::size_t>(kLayerShape.q_heads) * kLayerShape.head_dim);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : q) x = normal(rng);
  std::vector<float> out(q.size());
  ThreadPool* pool = threads > 1 ? &pool_of(threads) : nullptr;
  index_t layer = 0;
  if (paged) fixture.attend_paged(layer, q, out);  // takes the page tables from the cache, untimed
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (paged) {
      fixture.attend_paged(layer, q, out);
    } else {
      fixture.attend(layer, q, out, pool);
    }
    benchmark::DoNotOptimize(out.data());
    layer = layer + 1 == fixture.layers ? 0 : layer + 1;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double iterations = static_cast<double>(state.iterations());
  const std::string baseline_key = fmt::format("{}/{}/{}", context, threads, in_cache);
  if (storage == KeyStorage::kPostRope && paged) {
    if (const auto it = cache_attend_seconds().find(key); it != cache_attend_seconds().end()) {
      state.counters["speedup_vs_cache_attend"] = it->second / (seconds / iterations);
    }
  } else if (storage == KeyStorage::kPostRope && threads == 1) {
    cache_attend_seconds()[key] = seconds / iterations;
  }
  if constexpr (std::is_same_v<Quantizer, quant::Float<half>>) {
    if (storage == KeyStorage::kPostRope && !paged) fp16_seconds()[baseline_key] = seconds / iterations;
  }
  if (const auto it = fp16_seconds().find(baseline_key); it != fp16_seconds().end() && !paged) {
    state.counters["speedup_vs_fp16"] = it->second / (seconds / iterations);
  }
  const double bytes = static_cast<double>(fixture.bytes_per_layer);
  const double macs = 2.0 * context * kLayerShape.q_heads * kLayerShape.head_dim;
  state.counters["kv_GBps"] = benchmark::Counter(iterations * bytes / 1e9, benchmark::Counter::kIsRate);
  state.counters["GMACps"] = benchmark::Counter(iterations * macs / 1e9, benchmark::Counter::kIsRate);
  state.counters["bytes_per_token"] = bytes / context;
  state.counters["tokens_per_s"] =
      benchmark::Counter(iterations / kModelLayers, benchmark::Counter::kIsRate);
  state.counters["layers_in_rotation"] = fixture.layers;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  fmt::print(stderr, "kvpack_bench_attention: kernels for {} (KVPACK_ISA overrides)\n",
             dispatch::active_cpu_isa());
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark(fmt::format("BM_StreamRead/threads:{}", threads).c_str(),
                                 [threads](benchmark::State& s) { stream_read(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_IntegerDotPeak<int16>", bench::integer_dot_peak<true>)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("BM_IntegerDotPeak<int8>", bench::integer_dot_peak<false>)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  for (index_t context : {4096, 32768, 131072}) {
    bench::for_each_quantizer([&](auto quantizer) {
      using Q = decltype(quantizer);
      for (int threads : {1, 2}) {
        benchmark::RegisterBenchmark(
            fmt::format("BM_Attend<{}>/ctx:{}/threads:{}", bench::row_name<Q>(), context, threads).c_str(),
            [context, threads](benchmark::State& s) { attend_benchmark<Q>(s, context, threads, false); })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    });
  }
  bench::for_each_quantizer([&](auto quantizer) {
    using Q = decltype(quantizer);
    benchmark::RegisterBenchmark(fmt::format("BM_AttendInCache<{}>/ctx:1024/threads:1", bench::row_name<Q>()).c_str(),
                                 [](benchmark::State& s) { attend_benchmark<Q>(s, 1024, 1, true); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  });
  // The same caches' pages as one kernels::attend_paged launch (registered after the rows that
  // give its baseline); codecs without a residual window, whose caches keep no tail rows here.
  auto register_paged = [](auto quantizer) {
    using Q = decltype(quantizer);
    const std::string name = bench::row_name<Q>();
    benchmark::RegisterBenchmark(
        fmt::format("BM_AttendPaged<{}>/ctx:32768/threads:1", name).c_str(),
        [](benchmark::State& s) { attend_benchmark<Q>(s, 32768, 1, false, KeyStorage::kPostRope, true); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(
        fmt::format("BM_AttendPagedInCache<{}>/ctx:1024/threads:1", name).c_str(),
        [](benchmark::State& s) { attend_benchmark<Q>(s, 1024, 1, true, KeyStorage::kPostRope, true); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  };
  register_paged(quant::Float<half>{});
  register_paged(quant::Q4_0{});
  // f16 and the KVQuant widths (the kvquant-* policies store keys pre-RoPE); bf16 and FP8 are
  // precompiled as well and read the same element path as f16, so they have no rows of their own.
  auto register_pre_rope = [](auto quantizer) {
    using Q = decltype(quantizer);
    const std::string name = bench::row_name<Q>();
    benchmark::RegisterBenchmark(
        fmt::format("BM_AttendPreRope<{}>/ctx:32768/threads:1", name).c_str(),
        [](benchmark::State& s) { attend_benchmark<Q>(s, 32768, 1, false, KeyStorage::kPreRope); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(
        fmt::format("BM_AttendPreRopeInCache<{}>/ctx:1024/threads:1", name).c_str(),
        [](benchmark::State& s) { attend_benchmark<Q>(s, 1024, 1, true, KeyStorage::kPreRope); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(
        fmt::format("BM_AttendPreRopeGapsInCache<{}>/ctx:1024/threads:1", name).c_str(),
        [](benchmark::State& s) { attend_benchmark<Q>(s, 1024, 1, true, KeyStorage::kPreRopeGaps); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  };
  std::apply([&](auto... q) { (register_pre_rope(q), ...); },
             std::tuple<quant::Float<half>, quant::KVQuant<4>, quant::KVQuant<3>, quant::KVQuant<2>>{});
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
