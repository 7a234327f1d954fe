// kvpack_bench_page_file: page file write and read throughput, in bytes of file per second.
// One sequence of 2048 tokens at Llama-3.1-8B's KV shape cut to 8 layers (8 KV heads, head_dim
// 128), q8_0 pages of 32 tokens: 4096 pages of 8704 bytes, 34 MiB of file.
// BM_Write: write_page_file to a byte vector (copies every payload and checksums it).
// BM_WriteFd: write_page_file streamed to a descriptor (/dev/null, a file).
// BM_Parse: PageFileView::parse of those bytes (checks every section's CRC32C, every live slot;
//   copies no payload). BM_OpenMapped: PageFile on the file written to /tmp (in the page cache):
//   mmap, then the same checks, page faults included (bytes: the page payloads).
//   BM_Crc32c/0 and /1: the CRC alone, with the SSE4.2 instruction
//   and with the software tables.

#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"

namespace {

using namespace kvpack;
using Cache = KVCache<layout::GQA, quant::Q8_0>;
constexpr ModelShape kShape{8, 32, 8, 128};
constexpr index_t kTokens = 2048;

struct Fixture {
  Cache cache{kShape};
  SeqId seq = cache.add_sequence();
  Fixture() {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    std::vector<float> rows(static_cast<std::size_t>(kTokens) * kShape.kv_heads * kShape.head_dim);
    for (float& x : rows) x = normal(rng);
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      cache.prefill(seq, layer, std::span<const float>(rows), std::span<const float>(rows));
    }
  }
};
Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_Write(benchmark::State& state) {
  Fixture& f = fixture();
  std::size_t bytes = 0;
  for (auto _ : state) {
    const std::vector<std::byte> file = io::write_page_file(f.cache, f.seq);
    bytes = file.size();
    benchmark::DoNotOptimize(file.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * state.iterations()));
  state.counters["file_MiB"] = static_cast<double>(bytes) / (1 << 20);
}
BENCHMARK(BM_Write)->Unit(benchmark::kMillisecond);

// Streamed to a descriptor: /dev/null (the writer's own cost: checksums, gathering, write calls)
// or a file under /tmp (plus the kernel's copy into the page cache), truncated each time.
void BM_WriteFd(benchmark::State& state) {
  Fixture& f = fixture();
  const bool to_file = state.range(0) == 1;
  const std::string path = to_file ? "/tmp/kvpack_bench_page_file_fd.kvpages" : "/dev/null";
  std::uint64_t bytes = 0;
  for (auto _ : state) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    bytes = io::write_page_file(fd, f.cache, f.seq);
    ::close(fd);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * state.iterations()));
  state.SetLabel(to_file ? "file in /tmp" : "/dev/null");
  if (to_file) std::remove(path.c_str());
}
BENCHMARK(BM_WriteFd)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

void BM_Parse(benchmark::State& state) {
  Fixture& f = fixture();
  const std::vector<std::byte> file = io::write_page_file(f.cache, f.seq);
  for (auto _ : state) {
    const io::PageFileView view = io::PageFileView::parse(file);
    benchmark::DoNotOptimize(view.total_pages());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(file.size() * state.iterations()));
}
BENCHMARK(BM_Parse)->Unit(benchmark::kMillisecond);

void BM_OpenMapped(benchmark::State& state) {
  Fixture& f = fixture();
  const std::string path = "/tmp/kvpack_bench_page_file.kvpages";
  io::write_page_file(path, f.cache, f.seq);
  std::size_t bytes = 0;
  for (auto _ : state) {
    const io::PageFile file(path);
    bytes = file.view().total_pages() * file.header().payload_bytes;
    benchmark::DoNotOptimize(file.view().payload(0, 0, 0).data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * state.iterations()));
  std::remove(path.c_str());
}
BENCHMARK(BM_OpenMapped)->Unit(benchmark::kMillisecond);

void BM_Crc32c(benchmark::State& state) {
  const auto impl = state.range(0) == 0 ? io::Crc32cImpl::kAuto : io::Crc32cImpl::kSoftware;
  Fixture& f = fixture();
  const std::vector<std::byte> file = io::write_page_file(f.cache, f.seq);
  for (auto _ : state) benchmark::DoNotOptimize(io::crc32c(file, impl));
  state.SetBytesProcessed(static_cast<std::int64_t>(file.size() * state.iterations()));
  state.SetLabel(state.range(0) == 0 ? "auto (SSE4.2 where present)" : "software tables");
}
BENCHMARK(BM_Crc32c)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
