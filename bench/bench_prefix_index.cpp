// kvpack_bench_prefix_index: the prefix index's speed and the memory it saves.
// BM_Match: one 16-page (512-token) prompt looked up per iteration, all of it cached, in an index
//   holding 1K, 10K or 100K token pages; page_lookups_per_s counts token pages (page_size tokens
//   across every stream) found per second. Goal: at least 10^6.
// BM_InsertEvict: one new 16-page sequence inserted per iteration and the least recently used
//   16 pages evicted, so the index stays at its size (the steady state of a full pool).
// Both with 1 stream (the index alone) and 256 (Llama-3.1-8B: 32 layers x 8 KV heads, where
//   insert and evict touch one pool reference per stream).
// BM_SharedSystemPrompt: 64 sequences, each a shared 4096-token system prompt and 512 tokens of
//   their own, admitted as a batch at the Llama-3.1-8B shape with fp16 pages of 32 tokens, with
//   and without the index; pages are counted in the pool and bytes computed from the fp16 cache's
//   page format (the pool here has tiny pages: only the counts matter).
// BM_SharedSystemPromptCache: the same batch through a real KVCache<GQA, Float<half>>
//   (CacheConfig::prefix_sharing on or off) at 2 layers x 2 KV heads x 128, pages of 32 tokens:
//   every sequence is added with its prompt, prefills what add_sequence did not find (K/V
//   written for real), and the first one calls share_prefix after its prefill. memory() is
//   measured with all 64 alive; llama_GB scales the pool pages to Llama-3.1-8B's 256 streams
//   (the same fp16 page of head_dim 128). Time is the batch's admission and prefill.

#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "kvpack/paging/prefix_index.hpp"

namespace {

using namespace kvpack;
using paging::PageFormat;
using paging::PagePool;
using paging::PrefixIndex;
using paging::PrefixKey;
using paging::TokenId;

constexpr ModelShape kLlama{32, 32, 8, 128};
constexpr index_t kPageSize = 32;  // CacheConfig's default
constexpr std::size_t kLlamaStreams = 32 * 8;
constexpr std::size_t kPagesPerSequence = 16;
constexpr PageFormat kTinyPage{64, 8};  // the benches count pages; their bytes do not matter

PrefixKey llama_key() {
  PrefixKey key;
  key.model_id = "llama-3.1-8b-instruct";
  key.layout = std::string(layout::GQA::kName);
  key.shape = kLlama;
  key.page_size = kPageSize;
  key.codec = quant::Float<half>::name();
  return key;
}

std::vector<TokenId> random_tokens(std::mt19937& rng, std::size_t n) {
  std::uniform_int_distribution<TokenId> token(0, 128255);  // Llama 3's vocabulary
  std::vector<TokenId> out(n);
  for (TokenId& t : out) t = token(rng);
  return out;
}

// Inserts a sequence's pages as a cache would after prefill, then drops the sequence's own
// references and lease: the index keeps the pages.
void insert_finished(PrefixIndex& index, PagePool& pool, const PrefixKey& key,
                     std::span<const TokenId> tokens, std::vector<PageId>& scratch) {
  scratch.resize(tokens.size() / kPageSize * index.streams());
  pool.allocate(scratch);
  (void)index.insert(key, tokens, scratch);
  for (PageId id : scratch) pool.release(id);
}

void match_benchmark(benchmark::State& state) {
  const auto cached_pages = static_cast<std::size_t>(state.range(0));
  const auto streams = static_cast<std::size_t>(state.range(1));
  PagePool pool(kTinyPage, PagePool::kUnlimited);
  PrefixIndex index(pool, kPageSize, streams);
  const PrefixKey key = llama_key();
  std::mt19937 rng(1);
  std::vector<std::vector<TokenId>> sequences;
  std::vector<PageId> scratch;
  for (std::size_t i = 0; i < cached_pages / kPagesPerSequence; ++i) {
    sequences.push_back(random_tokens(rng, kPagesPerSequence * kPageSize));
    insert_finished(index, pool, key, sequences.back(), scratch);
  }
  std::vector<std::uint32_t> order(4096);
  for (auto& i : order) i = static_cast<std::uint32_t>(rng() % sequences.size());
  std::size_t next = 0;
  std::size_t found = 0;
  for (auto _ : state) {
    const auto match = index.match(key, sequences[order[next++ % order.size()]]);
    found += match.pages;
    benchmark::DoNotOptimize(match.page_ids.data());
  }
  if (found != state.iterations() * kPagesPerSequence)
    state.SkipWithError("a cached prompt was not found whole");
  state.counters["page_lookups_per_s"] =
      benchmark::Counter(static_cast<double>(found), benchmark::Counter::kIsRate);
  state.counters["index_MB"] = static_cast<double>(index.stats().index_bytes) / 1e6;
}

void insert_evict_benchmark(benchmark::State& state) {
  const auto cached_pages = static_cast<std::size_t>(state.range(0));
  const auto streams = static_cast<std::size_t>(state.range(1));
  PagePool pool(kTinyPage, PagePool::kUnlimited);
  PrefixIndex index(pool, kPageSize, streams);
  const PrefixKey key = llama_key();
  std::mt19937 rng(2);
  // A ring one longer than the index holds: the slot inserted next is always the one evicted.
  const std::size_t held = cached_pages / kPagesPerSequence;
  std::vector<std::vector<TokenId>> ring;
  for (std::size_t i = 0; i <= held; ++i)
    ring.push_back(random_tokens(rng, kPagesPerSequence * kPageSize));
  std::vector<PageId> scratch;
  for (std::size_t i = 0; i < held; ++i) insert_finished(index, pool, key, ring[i], scratch);
  std::size_t next = held;
  for (auto _ : state) {
    insert_finished(index, pool, key, ring[next++ % ring.size()], scratch);
    benchmark::DoNotOptimize(index.evict_unreferenced(kPagesPerSequence * streams));
  }
  const auto stats = index.stats();
  if (stats.cached_pages != held * kPagesPerSequence)
    state.SkipWithError("the index did not stay at its size");
  state.counters["pages_inserted_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kPagesPerSequence), benchmark::Counter::kIsRate);
}

// Admits 64 sequences (system prompt + their own turn) and counts the pool pages they hold.
std::size_t admit_batch(PagePool& pool, PrefixIndex* index,
                        const std::vector<std::vector<TokenId>>& prompts, double& hit_rate) {
  const PrefixKey key = llama_key();
  std::vector<std::vector<PageId>> tables(prompts.size());
  std::vector<paging::PrefixLease> leases(prompts.size());
  for (std::size_t s = 0; s < prompts.size(); ++s) {
    const std::span<const TokenId> tokens(prompts[s]);
    std::vector<PageId>& table = tables[s];  // [page][stream]
    table.resize(tokens.size() / kPageSize * kLlamaStreams);
    std::size_t reused = 0;
    if (index != nullptr) {
      // All but the last token: the engine computes the last one to get its logits.
      const auto match = index->match(key, tokens.first(tokens.size() - 1));
      std::copy(match.page_ids.begin(), match.page_ids.end(), table.begin());
      for (PageId id : match.page_ids) pool.retain(id);
      reused = match.page_ids.size();
    }
    pool.allocate(std::span<PageId>(table).subspan(reused));  // prefill of the rest
    if (index != nullptr) leases[s] = index->insert(key, tokens, table);
  }
  const std::size_t pages = pool.pages_in_use();
  if (index != nullptr) hit_rate = index->stats().hit_rate();
  for (auto& table : tables) {
    for (PageId id : table) pool.release(id);
  }
  leases.clear();
  if (index != nullptr) index->evict_unreferenced(PrefixIndex::kAllPages);
  return pages;
}

void shared_system_prompt_benchmark(benchmark::State& state) {
  constexpr std::size_t kSequences = 64;
  constexpr std::size_t kSystemTokens = 4096;
  constexpr std::size_t kOwnTokens = 512;
  const bool sharing = state.range(0) != 0;
  std::mt19937 rng(3);
  const auto system = random_tokens(rng, kSystemTokens);
  std::vector<std::vector<TokenId>> prompts;
  for (std::size_t s = 0; s < kSequences; ++s) {
    prompts.push_back(system);
    const auto own = random_tokens(rng, kOwnTokens);
    prompts.back().insert(prompts.back().end(), own.begin(), own.end());
  }
  const KVCache<layout::GQA, quant::Float<half>> fp16(kLlama, CacheConfig{});
  const PageFormat format = fp16.page_format_info();
  const std::size_t page_bytes = format.payload_bytes + format.metadata_bytes;

  std::size_t pages = 0;
  double hit_rate = 0.0;
  for (auto _ : state) {
    PagePool pool(kTinyPage, PagePool::kUnlimited);
    if (sharing) {
      PrefixIndex index(pool, kPageSize, kLlamaStreams);
      pages = admit_batch(pool, &index, prompts, hit_rate);
    } else {
      pages = admit_batch(pool, nullptr, prompts, hit_rate);
    }
    if (pool.pages_in_use() != 0) state.SkipWithError("pages left in the pool after the batch");
  }
  state.counters["pages"] = static_cast<double>(pages);
  state.counters["GB"] = static_cast<double>(pages * page_bytes) / 1e9;
  state.counters["page_bytes"] = static_cast<double>(page_bytes);
  state.counters["hit_rate"] = hit_rate;
}

void shared_system_prompt_cache_benchmark(benchmark::State& state) {
  constexpr std::size_t kSequences = 64;
  constexpr std::size_t kSystemTokens = 4096;
  constexpr std::size_t kOwnTokens = 512;
  constexpr ModelShape kSmall{2, 8, 2, 128};
  constexpr std::size_t kRow = 2 * 128;  // kv_heads x head_dim
  const bool sharing = state.range(0) != 0;
  std::mt19937 rng(3);
  const auto system = random_tokens(rng, kSystemTokens);
  std::vector<std::vector<TokenId>> prompts;
  for (std::size_t s = 0; s < kSequences; ++s) {
    prompts.push_back(system);
    const auto own = random_tokens(rng, kOwnTokens);
    prompts.back().insert(prompts.back().end(), own.begin(), own.end());
  }
  // One set of K/V rows for every sequence: the bytes do not change what is stored where.
  std::normal_distribution<float> normal;
  std::vector<half> kv((kSystemTokens + kOwnTokens) * kRow);
  for (half& x : kv) x = half(normal(rng));
  CacheConfig config;
  if (sharing) config.prefix_sharing = PrefixSharing{"llama-3.1-8b-instruct"};

  MemoryUsage memory;
  paging::PrefixIndexStats stats;
  for (auto _ : state) {
    KVCache<layout::GQA, quant::Float<half>> cache(kSmall, config);
    std::vector<SeqId> sequences;
    for (std::size_t s = 0; s < kSequences; ++s) {
      std::size_t cached = 0;
      if (sharing) {
        const PrefixHit hit = cache.add_sequence(prompts[s]);
        sequences.push_back(hit.seq);
        cached = static_cast<std::size_t>(hit.cached_tokens);
      } else {
        sequences.push_back(cache.add_sequence());
      }
      const auto rest = std::span<const half>(kv).subspan(cached * kRow);
      for (index_t layer = 0; layer < kSmall.layers; ++layer) cache.prefill(sequences.back(), layer, rest, rest);
      if (sharing && s == 0) cache.share_prefix(sequences.back());
    }
    memory = cache.memory();
    stats = cache.prefix_stats();
  }
  const std::size_t page_bytes = memory.pages_in_use == 0 ? 0 : (memory.page_payload + memory.page_metadata) / memory.pages_in_use;
  state.counters["pages"] = static_cast<double>(memory.pages_in_use);
  state.counters["MB"] = static_cast<double>(memory.total()) / 1e6;
  state.counters["llama_GB"] =
      static_cast<double>(memory.pages_in_use) * (kLlamaStreams / 4) * static_cast<double>(page_bytes) / 1e9;
  state.counters["hit_rate"] = stats.hit_rate();
  state.counters["index_KB"] = static_cast<double>(stats.index_bytes) / 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  for (std::int64_t pages : {1000, 10000, 100000}) {
    benchmark::RegisterBenchmark("BM_Match", match_benchmark)
        ->Args({pages, 1})
        ->ArgNames({"pages", "streams"});
  }
  benchmark::RegisterBenchmark("BM_Match", match_benchmark)
      ->Args({1000, kLlamaStreams})
      ->ArgNames({"pages", "streams"});
  for (std::int64_t pages : {1000, 10000, 100000}) {
    benchmark::RegisterBenchmark("BM_InsertEvict", insert_evict_benchmark)
        ->Args({pages, 1})
        ->ArgNames({"pages", "streams"});
  }
  benchmark::RegisterBenchmark("BM_InsertEvict", insert_evict_benchmark)
      ->Args({1000, kLlamaStreams})
      ->ArgNames({"pages", "streams"});
  benchmark::RegisterBenchmark("BM_SharedSystemPrompt", shared_system_prompt_benchmark)
      ->Arg(0)
      ->Arg(1)
      ->ArgName("sharing")
      ->Unit(benchmark::kMillisecond)
      ->Iterations(3);
  benchmark::RegisterBenchmark("BM_SharedSystemPromptCache", shared_system_prompt_cache_benchmark)
      ->Arg(0)
      ->Arg(1)
      ->ArgName("sharing")
      ->Unit(benchmark::kMillisecond)
      ->Iterations(3);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
