// Decode attention on the GPU at Llama-3.1-8B's attention shape (32 query heads, 8 KV heads,
// head_dim 128: GQA groups of 4), one layer, for every codec the device reads: 4 sequences of 32K
// tokens and 1 of 128K (134 to 537 MB of fp16 pages, several times the L2). Timed with CUDA
// events; reports the page bytes read per second, that rate as a fraction of the card's peak HBM
// bandwidth (from its memory clock and bus width), and, in the same run, a device-to-device copy
// of the same bytes (read plus written): what the memory system streams in practice.
//
// Pages hold codes encoded on the host by each codec's scalar encoder from random data with
// outlier channels (256 distinct pages, copied across the whole pool on the device). KVQuant is
// calibrated as in the CPU benches (bench_codecs.hpp), on draws of a similar distribution.
// TurboQuant-MSE (4 and 3 bits) runs on the generic kernel in its rotated space.
//
// BM_CudaDecodeStep is a decode step through DeviceKVCache: one token appended on the device
// (a page encoded every 32 steps) and attention over a 32K-token sequence, against attention
// alone in the same run.

#include <benchmark/benchmark.h>

#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvpack/kernels/cuda/device_cache.cuh"
#include "kvpack/kernels/cuda/device_memory.cuh"
#include "kvpack/kernels/cuda/device_params.cuh"
#include "kvpack/kernels/cuda/encode_pages.cuh"
#include "kvpack/kernels/cuda/paged_attention.cuh"
#include "kvpack/kvpack.hpp"

#include "../bench_codecs.hpp"

namespace {

using namespace kvpack;
namespace gpu = kvpack::kernels::cuda;

constexpr index_t kKvHeads = 8;
constexpr index_t kGroup = 4;
constexpr index_t kHeadDim = 128;
constexpr index_t kPageSize = 32;
constexpr index_t kDistinctPages = 256;

double peak_hbm_bytes_per_second() {
  int device = 0, clock_khz = 0, bus_bits = 0;
  gpu::check(cudaGetDevice(&device), "cudaGetDevice");
  gpu::check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device), "memory clock");
  gpu::check(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device), "bus width");
  return 2.0 * clock_khz * 1e3 * bus_bits / 8.0;  // double data rate
}

/// Rows drawn like the pages': keys with 4 outlier channels (10×), values plain normal.
std::vector<float> random_rows(std::mt19937& rng, std::size_t count, bool keys) {
  std::normal_distribution<float> normal;
  std::vector<float> rows(count * kHeadDim);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = normal(rng) * (keys && i % kHeadDim < 4 ? 10.0f : 1.0f);
  return rows;
}

/// The codec pair under test, built once: KVQuant calibrated as every CPU bench calibrates it.
template <class Quantizer>
const Quantizer& bench_quantizer() {
  static const Quantizer q = bench::make_quantizer<Quantizer>(ModelShape{1, kKvHeads * kGroup, kKvHeads, kHeadDim});
  return q;
}

/// A random page set for one codec pair, as the cache would lay it out.
template <class Quantizer>
struct HostPages {
  std::size_t value_offset = 0, payload_bytes = 0;
  std::vector<std::byte> bytes;
  HostPages() {
    const Quantizer& q = bench_quantizer<Quantizer>();
    const quant::PageGeometry g{kPageSize, kHeadDim};
    value_offset = (q.key.plane_bytes(g) + 63) / 64 * 64;
    payload_bytes = (value_offset + q.value.plane_bytes(g) + 63) / 64 * 64;
    bytes.assign(payload_bytes * kDistinctPages, std::byte{0});
    std::mt19937 rng(7);
    for (index_t p = 0; p < kDistinctPages; ++p) {
      std::byte* page = bytes.data() + p * payload_bytes;
      q.key.encode(g, random_rows(rng, kPageSize, true).data(), kHeadDim, q.key.initial_params(0, 0), page);
      q.value.encode(g, random_rows(rng, kPageSize, false).data(), kHeadDim, q.value.initial_params(0, 0),
                     page + value_offset);
    }
  }
};

template <class Quantizer, gpu::AttentionKernel Kernel = gpu::AttentionKernel::kBest>
void BM_CudaDecodeAttention(benchmark::State& state) {
  using KP = gpu::device_params_t<typename Quantizer::key_codec>;
  using VP = gpu::device_params_t<typename Quantizer::value_codec>;
  const index_t context = static_cast<index_t>(state.range(0));
  const index_t sequences = static_cast<index_t>(state.range(1));
  const index_t streams = sequences * kKvHeads;
  const index_t pages_per_stream = context / kPageSize;
  const std::size_t total_pages = static_cast<std::size_t>(streams) * pages_per_stream;

  static const HostPages<Quantizer> host;  // encoded once per codec
  gpu::DevicePagePool pool({host.payload_bytes, 0}, total_pages);
  const std::size_t distinct_bytes = host.bytes.size();
  gpu::check(cudaMemcpy(pool.payload(0), host.bytes.data(), distinct_bytes, cudaMemcpyHostToDevice), "upload");
  for (std::size_t first = kDistinctPages; first < total_pages; first += kDistinctPages) {
    const std::size_t count = std::min<std::size_t>(kDistinctPages, total_pages - first);
    gpu::check(cudaMemcpy(pool.payload(static_cast<PageId>(first)), pool.payload(0), count * host.payload_bytes,
                           cudaMemcpyDeviceToDevice),
                "replicate");
  }
  // Each stream's pages are scattered over the pool (a stride coprime with the page count), as a
  // block table of a long-running server would be.
  std::vector<const std::byte*> table(total_pages);
  std::size_t stride = 7919;
  while (std::gcd(stride, total_pages) != 1) stride += 2;
  for (std::size_t i = 0; i < total_pages; ++i) table[i] = pool.payload(static_cast<PageId>((i * stride) % total_pages));
  std::vector<index_t> first_page(streams + 1);
  for (index_t s = 0; s <= streams; ++s) first_page[s] = s * pages_per_stream;

  const Quantizer& q = bench_quantizer<Quantizer>();
  gpu::DeviceBuffer<const std::byte*> pages{std::span<const std::byte* const>(table)};
  gpu::DeviceBuffer<index_t> firsts{std::span<const index_t>(first_page)};
  gpu::DeviceParamTables tables;
  const quant::PageGeometry g{kPageSize, kHeadDim};
  const std::vector<KP> key_params(
      streams, tables.upload<typename Quantizer::key_codec>(q.key.initial_params(0, 0), g));
  const std::vector<VP> value_params(
      streams, tables.upload<typename Quantizer::value_codec>(q.value.initial_params(0, 0), g));
  gpu::DeviceBuffer<KP> device_key_params{std::span<const KP>(key_params)};
  gpu::DeviceBuffer<VP> device_value_params{std::span<const VP>(value_params)};
  const std::vector<index_t> no_rows(streams, 0);
  gpu::DeviceBuffer<index_t> tail_count{std::span<const index_t>(no_rows)};
  gpu::DeviceBuffer<float> tail(kHeadDim);
  std::vector<float> queries(static_cast<std::size_t>(streams) * kGroup * kHeadDim, 0.01f);
  gpu::DeviceBuffer<float> device_queries{std::span<const float>(queries)};
  gpu::DeviceBuffer<float> out(queries.size());

  gpu::PagedAttentionArgs<KP, VP> args;
  args.pages = pages.data();
  args.first_page = firsts.data();
  args.key_params = device_key_params.data();
  args.value_params = device_value_params.data();
  args.tail_keys = tail.data();
  args.tail_values = tail.data();
  args.tail_count = tail_count.data();
  args.tail_stride = 1;
  args.queries = device_queries.data();
  args.out = out.data();
  args.streams = streams;
  args.group = kGroup;
  args.page_size = kPageSize;
  args.head_dim = kHeadDim;
  args.value_offset = host.value_offset;
  args.payload_bytes = host.payload_bytes;
  gpu::AttentionWorkspace workspace;

  cudaEvent_t start, stop;
  gpu::check(cudaEventCreate(&start), "event");
  gpu::check(cudaEventCreate(&stop), "event");
  using KC = typename Quantizer::key_codec;
  using VC = typename Quantizer::value_codec;
  state.SetLabel(gpu::attends_on_tensor_cores<KC, VC>(args, Kernel) ? "tensor cores" : "generic");
  gpu::attend_paged<KC, VC>(args, pages_per_stream, workspace, nullptr, Kernel);
  gpu::check(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    cudaEventRecord(start);
    gpu::attend_paged<KC, VC>(args, pages_per_stream, workspace, nullptr, Kernel);
    cudaEventRecord(stop);
    gpu::check(cudaEventSynchronize(stop), "attention");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms * 1e-3);
  }
  const std::size_t bytes = total_pages * host.payload_bytes;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));

  // A device-to-device copy of the same bytes, timed in this run, counting bytes read and
  // written: what the memory system streams in practice.
  gpu::DeviceBuffer<unsigned char> scratch(bytes);
  float copy_ms = 0.0f;
  cudaEventRecord(start);
  for (int i = 0; i < 5; ++i) cudaMemcpyAsync(scratch.data(), pool.payload(0), bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(stop);
  gpu::check(cudaEventSynchronize(stop), "copy");
  cudaEventElapsedTime(&copy_ms, start, stop);
  const double copy_rate = 2.0 * 5.0 * static_cast<double>(bytes) / (copy_ms * 1e-3);

  state.counters["MB_read"] = static_cast<double>(bytes) / 1e6;
  state.counters["bits_per_element"] = 8.0 * host.payload_bytes / (2.0 * kPageSize * kHeadDim);
  state.counters["peak_GBps"] = peak_hbm_bytes_per_second() / 1e9;
  state.counters["copy_GBps"] = copy_rate / 1e9;
  state.counters["hbm_fraction"] =
      benchmark::Counter(static_cast<double>(bytes) / peak_hbm_bytes_per_second(), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(context) * sequences, benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

/// The append path: full pages encoded on the device from fp32 rows already there (4 sequences
/// × 32K tokens × 8 KV heads = 1 M rows per plane; both planes encode the same rows, drawn like
/// the keys of the pages above, which KVQuant's calibration saw). Reports the fp32 rows read per
/// second.
template <class Quantizer>
void BM_CudaEncodePages(benchmark::State& state) {
  const Quantizer& q = bench_quantizer<Quantizer>();
  const quant::PageGeometry g{kPageSize, kHeadDim};
  const std::size_t value_offset = (q.key.plane_bytes(g) + 63) / 64 * 64;
  const std::size_t payload = (value_offset + q.value.plane_bytes(g) + 63) / 64 * 64;
  const index_t pages = 4 * 32768 / kPageSize * kKvHeads;
  std::mt19937 rng(11);
  const std::vector<float> rows = random_rows(rng, static_cast<std::size_t>(pages) * kPageSize, true);
  const gpu::DeviceBuffer<float> device_rows{std::span<const float>(rows)};
  const auto host_key_params = q.key.initial_params(0, 0);
  const auto host_value_params = q.value.initial_params(0, 0);
  if constexpr (requires { q.key.prepare(g, host_key_params); }) {  // TurboQuant's rotation
    q.key.prepare(g, host_key_params);
    q.value.prepare(g, host_value_params);
  }
  gpu::DeviceParamTables tables;  // KVQuant's calibrated key ranges, TurboQuant's rotation, on the device
  const auto key_params = tables.upload<typename Quantizer::key_codec>(host_key_params, g);
  const auto value_params = tables.upload<typename Quantizer::value_codec>(host_value_params, g);
  gpu::DevicePagePool pool({payload, 0}, static_cast<std::size_t>(pages));
  std::vector<std::byte*> targets(pages);
  for (index_t i = 0; i < pages; ++i) targets[i] = pool.payload(static_cast<PageId>(i));
  const gpu::DeviceBuffer<std::byte*> device_targets{std::span<std::byte* const>(targets)};
  cudaEvent_t start, stop;
  gpu::check(cudaEventCreate(&start), "event");
  gpu::check(cudaEventCreate(&stop), "event");
  for (auto _ : state) {
    cudaEventRecord(start);
    gpu::encode_pages<typename Quantizer::key_codec, typename Quantizer::value_codec>(
        device_rows.data(), device_rows.data(), kHeadDim, pages, key_params, value_params, device_targets.data(), g,
        value_offset);
    cudaEventRecord(stop);
    gpu::check(cudaEventSynchronize(stop), "encode");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms * 1e-3);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * 2 * rows.size() * sizeof(float)));
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(pages) * kPageSize,
                                                      benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

/// A decode step on a cache created on the device: append one token (arg 1) or not (arg 0), then
/// attend, over one 32K-token sequence of one layer. Reports steps per second.
template <class Quantizer>
void BM_CudaDecodeStep(benchmark::State& state) {
  const bool append = state.range(0) != 0;
  const index_t context = 32768;
  const ModelShape shape{1, kKvHeads * kGroup, kKvHeads, kHeadDim};
  CacheConfig config;
  config.page_size = kPageSize;
  constexpr index_t kRoomPages = 1024;  // per KV head for appended tokens: 32K steps
  const std::size_t pages = static_cast<std::size_t>(context / kPageSize + kRoomPages) * kKvHeads;
  gpu::DeviceKVCache<Quantizer> cache(shape, config, pages);
  const SeqId seq = cache.add_sequence();
  std::mt19937 rng(13);
  const std::size_t row = static_cast<std::size_t>(kKvHeads) * kHeadDim;
  {
    const gpu::DeviceBuffer<float> keys{std::span<const float>(random_rows(rng, context * kKvHeads, true))};
    const gpu::DeviceBuffer<float> values{std::span<const float>(random_rows(rng, context * kKvHeads, false))};
    cache.prefill(seq, 0, {keys.data(), context * row}, {values.data(), context * row});
    gpu::check(cudaDeviceSynchronize(), "prefill");
  }
  const gpu::DeviceBuffer<float> key{std::span<const float>(random_rows(rng, kKvHeads, true))};
  const gpu::DeviceBuffer<float> value{std::span<const float>(random_rows(rng, kKvHeads, false))};
  const std::size_t heads = static_cast<std::size_t>(kKvHeads) * kGroup * kHeadDim;
  const gpu::DeviceBuffer<float> query{std::span<const float>(random_rows(rng, kKvHeads * kGroup, false))};
  gpu::DeviceBuffer<float> out(heads);
  std::int64_t position = context;
  cudaEvent_t start, stop;
  gpu::check(cudaEventCreate(&start), "event");
  gpu::check(cudaEventCreate(&stop), "event");
  for (auto _ : state) {
    if (append && position - context >= std::int64_t{kRoomPages} * kPageSize) {
      state.SkipWithError("the device pool's room for appended pages ran out");
      break;
    }
    cudaEventRecord(start);
    if (append) cache.append(seq, 0, {key.data(), row}, {value.data(), row}, position++);
    cache.attend(seq, 0, {query.data(), heads}, {out.data(), heads}, 1.0f / std::sqrt(float{kHeadDim}));
    cudaEventRecord(stop);
    gpu::check(cudaEventSynchronize(stop), "decode step");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms * 1e-3);
  }
  state.counters["steps_per_s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->Args({32768, 4})->Args({131072, 1})->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.3);
}

BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Float<kvpack::half>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Float<kvpack::half>, gpu::AttentionKernel::kGeneric)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Float<kvpack::bfloat16>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::FP8<quant::E4M3FN>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Int8)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Q8_0)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Q4_0)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::Q4_0, gpu::AttentionKernel::kGeneric)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::KIVI<4, 32>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::KIVI<2, 32>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::KVQuant<4>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::KVQuant<3>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::KVQuant<2>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::TurboQuant<8>)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_CudaDecodeAttention, quant::TurboQuant<6>)->Apply(shapes);

void encode_shape(benchmark::internal::Benchmark* b) { b->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2); }
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::Float<kvpack::half>)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::FP8<quant::E4M3FN>)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::Int8)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::Q4_0)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::KIVI<2, 32>)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::KVQuant<4>)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::KVQuant<2>)->Apply(encode_shape);
BENCHMARK_TEMPLATE(BM_CudaEncodePages, quant::TurboQuant<8>)->Apply(encode_shape);

void step_shape(benchmark::internal::Benchmark* b) {
  b->ArgName("append")->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
}
BENCHMARK_TEMPLATE(BM_CudaDecodeStep, quant::Float<kvpack::half>)->Apply(step_shape);
BENCHMARK_TEMPLATE(BM_CudaDecodeStep, quant::Q4_0)->Apply(step_shape);
BENCHMARK_TEMPLATE(BM_CudaDecodeStep, quant::KIVI<4, 32>)->Apply(step_shape);

}  // namespace

int main(int argc, char** argv) {
  const gpu::DeviceAvailability device = gpu::device_availability();
  if (device.count == 0) {
    std::printf("SKIPPED: the CUDA benchmark needs a GPU (%s)\n", device.reason.c_str());
    return 77;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
