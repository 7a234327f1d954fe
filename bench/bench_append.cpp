// kvpack_bench_append: how fast each codec encodes, in GB/s of fp16 input (keys and values).
// BM_Prefill: 4096 prompt tokens of one Llama-3.1-8B layer (8 KV heads, head_dim 128) per
// iteration. BM_AppendToken: one decoded token per iteration, as a decode loop appends (most
// land in the fp32 tail; every page_size-th fills and encodes a page per KV head).

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <random>
#include <vector>

#include "bench_codecs.hpp"
#include "kvpack/kvpack.hpp"

namespace {

using namespace kvpack;

constexpr ModelShape kShape{1, 32, 8, 128};

std::vector<half> random_halves(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<half> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = half(normal(rng) * (i % 128 < 4 ? 8.0f : 1.0f));
  return out;
}

template <class Quantizer>
void prefill_benchmark(benchmark::State& state, index_t tokens) {
  KVCache<layout::GQA, Quantizer> cache(kShape, {}, bench::make_quantizer<Quantizer>(kShape));
  const std::size_t elements = static_cast<std::size_t>(tokens) * kShape.kv_heads * kShape.head_dim;
  const auto keys = random_halves(elements, 1);
  const auto values = random_halves(elements, 2);
  for (auto _ : state) {
    const SeqId s = cache.add_sequence();
    cache.prefill(s, 0, std::span<const half>(keys), std::span<const half>(values));
    cache.release(s);
  }
  state.counters["input_GBps"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * 2 * elements * sizeof(half) / 1e9, benchmark::Counter::kIsRate);
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * tokens, benchmark::Counter::kIsRate);
}

template <class Quantizer>
void append_token_benchmark(benchmark::State& state) {
  KVCache<layout::GQA, Quantizer> cache(kShape, {}, bench::make_quantizer<Quantizer>(kShape));
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  constexpr std::size_t kDistinctTokens = 256;
  const auto keys = random_halves(kDistinctTokens * row, 3);
  const auto values = random_halves(kDistinctTokens * row, 4);
  SeqId s = cache.add_sequence();
  std::int64_t position = 0;
  for (auto _ : state) {
    const std::size_t i = static_cast<std::size_t>(position) % kDistinctTokens;
    cache.append(s, 0, std::span<const half>(keys.data() + i * row, row),
                 std::span<const half>(values.data() + i * row, row), position);
    if (++position == 65536) {  // keep memory bounded on long runs
      state.PauseTiming();
      cache.release(s);
      s = cache.add_sequence();
      position = 0;
      state.ResumeTiming();
    }
  }
  state.counters["input_GBps"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * 2 * row * sizeof(half) / 1e9, benchmark::Counter::kIsRate);
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  bench::for_each_quantizer([](auto quantizer) {
    using Q = decltype(quantizer);
    benchmark::RegisterBenchmark(fmt::format("BM_Prefill<{}>/tokens:4096", bench::row_name<Q>()).c_str(),
                                 [](benchmark::State& s) { prefill_benchmark<Q>(s, 4096); })
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(fmt::format("BM_AppendToken<{}>", bench::row_name<Q>()).c_str(),
                                 [](benchmark::State& s) { append_token_benchmark<Q>(s); })
        ->Unit(benchmark::kMicrosecond);
  });
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
