// kvpack_bench_mla: absorbed MLA decode attention at DeepSeek-V2's layer shape (128 query heads,
// latent 512, decoupled RoPE key 64, 64-token pages) for 4K and 32K contexts, latent codecs from
// fp16 to 4 bits, 1 and 2 threads; next to the same context held in multi-head form (128 KV
// heads of 128 channels, the per-head K and V an engine without absorption caches) at 4K.
// Iterations rotate over enough layers that >= 256 MiB of KV is read, so no layer stays in cache.
//
// Counters: kv_GBps (encoded bytes read per second), bytes_per_token (per token of one layer),
// GMACps (score and value multiply-adds per second: MLA 128·(576 + 512) per token, MHA
// 128·2·128), tokens_per_s (decode steps per second of a 60-layer model, attention only),
// speedup_vs_mha (the multi-head form's time per layer / this row's, same context and threads).

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "shared_fixture.hpp"

namespace {

using namespace kvpack;

constexpr index_t kHeads = 128;
constexpr index_t kLatent = 512;
constexpr index_t kRope = 64;
constexpr index_t kHeadDim = 128;  // the multi-head form's per-head K and V width
constexpr index_t kPage = 64;
constexpr int kModelLayers = 60;  // DeepSeek-V2
constexpr std::size_t kWorkingSetBytes = std::size_t{256} << 20;

ThreadPool& pool_of(int threads) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& pool = pools[threads];
  if (!pool) pool = std::make_unique<ThreadPool>(static_cast<std::size_t>(threads));
  return *pool;
}

/// A cache of `layers` copies of one random context, attended one layer per iteration.
struct Fixture {
  virtual ~Fixture() = default;
  virtual void attend(index_t layer, const std::vector<float>& q, std::vector<float>& out) = 0;
  ThreadPool* pool = nullptr;  // read by the cache's executor on every attend
  index_t layers = 0;
  std::size_t bytes_per_layer = 0;
  std::size_t query_floats = 0;
  std::size_t out_floats = 0;
  double macs_per_token = 0.0;

  CacheConfig config() {
    CacheConfig c;
    c.page_size = kPage;
    c.executor = [this](index_t count, const std::function<void(index_t)>& task) {
      if (pool != nullptr) {
        (*pool)(count, task);
      } else {
        for (index_t i = 0; i < count; ++i) task(i);
      }
    };
    return c;
  }
};

std::vector<half> normal_halves(std::size_t n, std::uint32_t seed) {
  std::vector<half> out(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (half& x : out) x = half(normal(rng));
  return out;
}

index_t layers_for(std::size_t bytes_per_layer) {
  return static_cast<index_t>(std::max<std::size_t>(2, (kWorkingSetBytes + bytes_per_layer - 1) / bytes_per_layer));
}

template <class Quantizer>
struct LatentFixture final : Fixture {
  using Cache = KVCache<layout::MLA, Quantizer>;
  std::unique_ptr<Cache> cache;
  SeqId seq = 0;

  explicit LatentFixture(index_t context) {
    const auto latents = normal_halves(static_cast<std::size_t>(context) * kLatent, 1);
    const auto rope_keys = normal_halves(static_cast<std::size_t>(context) * kRope, 2);
    {
      const Cache probe(ModelShape{1, kHeads, 1, kHeadDim}, config());
      bytes_per_layer = static_cast<std::size_t>(context / kPage) * probe.page_format_info().payload_bytes;
    }
    layers = layers_for(bytes_per_layer);
    cache = std::make_unique<Cache>(ModelShape{layers, kHeads, 1, kHeadDim}, config());
    seq = cache->add_sequence();
    for (index_t layer = 0; layer < layers; ++layer) {
      cache->prefill(seq, layer, std::span<const half>(rope_keys), std::span<const half>(latents));
    }
    query_floats = static_cast<std::size_t>(kHeads) * (kLatent + kRope);
    out_floats = static_cast<std::size_t>(kHeads) * kLatent;
    macs_per_token = static_cast<double>(kHeads) * (kLatent + kRope + kLatent);
  }
  void attend(index_t layer, const std::vector<float>& q, std::vector<float>& out) override {
    cache->attend(seq, layer, std::span<const float>(q), std::span<float>(out), 1.0f / 13.86f);  // 1/√192
  }
};

/// The same context without absorption: per head a 128-wide key and value, fp16.
struct MultiHeadFixture final : Fixture {
  using Cache = KVCache<layout::GQA, quant::Float<half>>;
  std::unique_ptr<Cache> cache;
  SeqId seq = 0;

  explicit MultiHeadFixture(index_t context) {
    const std::size_t elements = static_cast<std::size_t>(context) * kHeads * kHeadDim;
    const auto keys = normal_halves(elements, 3);
    const auto values = normal_halves(elements, 4);
    const ModelShape one{1, kHeads, kHeads, kHeadDim};
    {
      const Cache probe(one, config());
      bytes_per_layer = static_cast<std::size_t>(context / kPage) * kHeads * probe.page_format_info().payload_bytes;
    }
    layers = layers_for(bytes_per_layer);
    cache = std::make_unique<Cache>(ModelShape{layers, kHeads, kHeads, kHeadDim}, config());
    seq = cache->add_sequence();
    for (index_t layer = 0; layer < layers; ++layer) {
      cache->prefill(seq, layer, std::span<const half>(keys), std::span<const half>(values));
    }
    query_floats = out_floats = static_cast<std::size_t>(kHeads) * kHeadDim;
    macs_per_token = 2.0 * kHeads * kHeadDim;
  }
  void attend(index_t layer, const std::vector<float>& q, std::vector<float>& out) override {
    cache->attend(seq, layer, std::span<const float>(q), std::span<float>(out), 0.0884f);
  }
};

/// The multi-head form's seconds per layer, by "context/threads".
std::map<std::string, double>& mha_seconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

void run(benchmark::State& state, const std::string& name, index_t context, int threads,
         const std::function<std::unique_ptr<Fixture>()>& make) {
  const std::string key = fmt::format("{}/{}", name, context);
  Fixture& fixture = bench::shared_fixture<Fixture>(key, make);
  fixture.pool = threads > 1 ? &pool_of(threads) : nullptr;
  std::vector<float> q(fixture.query_floats);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : q) x = normal(rng);
  std::vector<float> out(fixture.out_floats);
  index_t layer = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    fixture.attend(layer, q, out);
    benchmark::DoNotOptimize(out.data());
    layer = layer + 1 == fixture.layers ? 0 : layer + 1;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double iterations = static_cast<double>(state.iterations());
  const std::string baseline = fmt::format("{}/{}", context, threads);
  if (name == "MHA_f16") mha_seconds()[baseline] = seconds / iterations;
  if (const auto it = mha_seconds().find(baseline); it != mha_seconds().end()) {
    state.counters["speedup_vs_mha"] = it->second / (seconds / iterations);
  }
  const double bytes = static_cast<double>(fixture.bytes_per_layer);
  state.counters["kv_GBps"] = benchmark::Counter(iterations * bytes / 1e9, benchmark::Counter::kIsRate);
  state.counters["GMACps"] =
      benchmark::Counter(iterations * fixture.macs_per_token * context / 1e9, benchmark::Counter::kIsRate);
  state.counters["bytes_per_token"] = bytes / context;
  state.counters["tokens_per_s"] = benchmark::Counter(iterations / kModelLayers, benchmark::Counter::kIsRate);
}

template <class Quantizer>
void register_latent(const std::string& name, index_t context) {
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark(fmt::format("BM_AttendMLA<{}>/ctx:{}/threads:{}", name, context, threads).c_str(),
                                 [=](benchmark::State& s) {
                                   run(s, name, context, threads,
                                       [context] { return std::make_unique<LatentFixture<Quantizer>>(context); });
                                 })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  fmt::print(stderr, "kvpack_bench_mla: kernels for {} (KVPACK_ISA overrides)\n", dispatch::active_cpu_isa());
  // The multi-head form first: it is the baseline of speedup_vs_mha (4K only: 32K would hold
  // 2 GiB per layer).
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark(fmt::format("BM_AttendMHA<f16>/ctx:4096/threads:{}", threads).c_str(),
                                 [threads](benchmark::State& s) {
                                   run(s, "MHA_f16", 4096, threads, [] { return std::make_unique<MultiHeadFixture>(4096); });
                                 })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (index_t context : {4096, 32768}) {
    register_latent<quant::MLA<quant::Float<half>>>("f16", context);
    register_latent<quant::MLA<quant::FP8<quant::E4M3FN>>>("e4m3", context);
    register_latent<quant::MLA<quant::Q8_0>>("q8_0", context);
    register_latent<quant::MLA<quant::Q4_0>>("q4_0", context);
    register_latent<quant::MLA<quant::KIVI<2>>>("kivi2", context);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
