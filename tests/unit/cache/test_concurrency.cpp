// Concurrency stress: what the cache promises threads (cache.hpp, README "Behaviour a caller can
// rely on"): different sequences may be written and read from different threads at once, one
// sequence is mutated by one thread at a time, memory() may be called from any thread, and the
// pool is thread-safe. Sequences nobody mutates (the shared prompts here) are only read: attended
// and forked from several threads at once. The pool is kept near capacity so OutOfPages happens
// under contention; every failed call must leave its sequence as it was, the results must equal a
// serial replay bit for bit, and after everything is released no page may be left in use.
// The build that runs this under ThreadSanitizer is cmake/run_sanitizers.sh ("[threads]" tests).

#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

const ModelShape kShape{2, 4, 2, 32};
constexpr index_t kPage = 16;
constexpr index_t kPromptTokens = 40;  // 2 pages and an 8-token tail per stream and layer
constexpr int kPrompts = 2;
constexpr float kScale = 0.17677669f;

std::span<const float> view(const std::vector<float>& v) { return std::span<const float>(v); }
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Seeded token rows: key and value of token `step` of stream `who`, layer `layer`.
std::vector<float> token(std::uint32_t who, std::uint32_t step, index_t layer, std::uint32_t plane) {
  return test::random_rows(kShape.kv_heads, kShape.head_dim, who * 1000003u + step * 8u + layer * 2u + plane);
}

template <class Cache>
std::vector<float> attend(const Cache& cache, SeqId seq, index_t layer, const std::vector<float>& query) {
  std::vector<float> out(query.size());
  cache.attend(seq, layer, view(query), std::span<float>(out), kScale);
  return out;
}

template <class Cache>
void prefill_prompts(Cache& cache, std::vector<SeqId>& prompts) {
  for (int p = 0; p < kPrompts; ++p) {
    prompts.push_back(cache.add_sequence());
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const auto k = test::random_rows(kPromptTokens * kShape.kv_heads, kShape.head_dim, 50 + 10 * p + layer);
      const auto v = test::random_rows(kPromptTokens * kShape.kv_heads, kShape.head_dim, 70 + 10 * p + layer);
      cache.prefill(prompts.back(), layer, view(k), view(v));
    }
  }
}

/// What a writer's last sequence holds: a fork of prompt `prompt` plus `steps` appended tokens.
struct WriterResult {
  SeqId seq = 0;
  int prompt = 0;
  std::uint32_t who = 0;
  std::uint32_t first_step = 0;
  std::uint32_t steps = 0;
};

template <class Quantizer>
void stress(std::size_t max_pages) {
  using Cache = KVCache<layout::GQA, Quantizer>;
  CacheConfig config;
  config.page_size = kPage;
  config.max_pages = max_pages;
  Cache cache(kShape, config);
  std::vector<SeqId> prompts;
  prefill_prompts(cache, prompts);
  const auto query = test::random_rows(kShape.q_heads, kShape.head_dim, 9);
  std::vector<std::vector<float>> prompt_outputs;
  for (SeqId p : prompts) {
    for (index_t layer = 0; layer < kShape.layers; ++layer) prompt_outputs.push_back(attend(cache, p, layer, query));
  }
  const std::size_t prompt_pages = cache.pool().pages_in_use();
  REQUIRE(prompt_pages == static_cast<std::size_t>(kPrompts * kShape.layers * kShape.kv_heads * 2));

  constexpr int kWriters = 3;
  constexpr int kForkers = 2;
  constexpr int kReaders = 1;
  constexpr std::uint32_t kWriterSteps = 3000;
  constexpr int kForkerRounds = 600;
  constexpr int kReaderRounds = 2000;
  std::atomic<int> out_of_pages{0};
  std::atomic<int> failures{0};  // checks made off the main thread (Catch2 2 is not thread-safe)
  std::vector<WriterResult> results(kWriters);

  // A writer owns one sequence at a time: a fork of a prompt it appends to. On OutOfPages it checks
  // that the failed append changed nothing, releases the sequence and starts over.
  auto writer = [&](int w) {
    WriterResult r{cache.fork(prompts[w % kPrompts]), w % kPrompts, static_cast<std::uint32_t>(w), 0, 0};
    for (std::uint32_t step = 0; step < kWriterSteps; ++step) {
      bool failed = false;
      for (index_t layer = 0; layer < kShape.layers && !failed; ++layer) {
        const index_t length = cache.length(r.seq, layer);
        const std::int64_t last = cache.last_position(r.seq, layer);
        try {
          cache.append(r.seq, layer, view(token(r.who, step, layer, 0)), view(token(r.who, step, layer, 1)), last + 1);
        } catch (const OutOfPages&) {
          out_of_pages.fetch_add(1, std::memory_order_relaxed);
          if (cache.length(r.seq, layer) != length || cache.last_position(r.seq, layer) != last) failures.fetch_add(1);
          failed = true;
        }
      }
      if (failed) {
        cache.release(r.seq);
        r.prompt = (r.prompt + 1) % kPrompts;
        r.seq = cache.fork(prompts[r.prompt]);
        r.first_step = step + 1;
        r.steps = 0;
        continue;
      }
      ++r.steps;
      if (step % 16 == 0) {
        for (float x : attend(cache, r.seq, static_cast<index_t>(step % 2), query)) {
          if (!std::isfinite(x)) failures.fetch_add(1);
        }
      }
    }
    results[w] = r;
  };

  // A forker forks the shared prompts (and its own forks), grows them a little, reads them and
  // releases them in varying order.
  auto forker = [&](int f) {
    for (int round = 0; round < kForkerRounds; ++round) {
      const SeqId a = cache.fork(prompts[(f + round) % kPrompts]);
      const SeqId b = cache.fork(a);
      const auto before = attend(cache, b, 0, query);
      bool grown = true;
      try {
        for (std::uint32_t i = 0; i < 20; ++i) {
          const auto k = token(100 + f, round * 20 + i, 0, 0);
          cache.append(a, 0, view(k), view(k), cache.last_position(a, 0) + 1);
        }
      } catch (const OutOfPages&) {
        out_of_pages.fetch_add(1, std::memory_order_relaxed);
        grown = false;
      }
      // b shares a's pages but not its appends: it reads exactly as before.
      if (!same_bits(attend(cache, b, 0, query), before)) failures.fetch_add(1);
      if (grown && cache.length(a, 0) != kPromptTokens + 20) failures.fetch_add(1);
      if (round % 2 == 0) {
        cache.release(a);
        cache.release(b);
      } else {
        cache.release(b);
        cache.release(a);
      }
    }
  };

  // A reader attends over the prompts, which nobody mutates: the output never changes, whatever
  // else happens. It also watches memory() from its thread.
  auto reader = [&](int) {
    for (int round = 0; round < kReaderRounds; ++round) {
      const int p = round % kPrompts;
      const index_t layer = static_cast<index_t>(round / kPrompts % kShape.layers);
      if (!same_bits(attend(cache, prompts[p], layer, query), prompt_outputs[p * kShape.layers + layer])) {
        failures.fetch_add(1);
      }
      const MemoryUsage m = cache.memory();
      if (m.pages_in_use > max_pages || m.pages_in_use < prompt_pages) failures.fetch_add(1);
    }
  };

  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i) threads.emplace_back(writer, i);
  for (int i = 0; i < kForkers; ++i) threads.emplace_back(forker, i);
  for (int i = 0; i < kReaders; ++i) threads.emplace_back(reader, i);
  for (auto& t : threads) t.join();

  CHECK(failures.load() == 0);
  // The pool is sized so that one writer alone outgrows it: OutOfPages must have happened.
  CHECK(out_of_pages.load() > 0);
  CHECK(cache.sequence_count() == static_cast<std::size_t>(kPrompts + kWriters));

  // Each writer's last sequence equals a serial replay of its fork and appends, bit for bit.
  Cache serial(kShape, [&] {
    CacheConfig c = config;
    c.max_pages = paging::PagePool::kUnlimited;
    return c;
  }());
  std::vector<SeqId> serial_prompts;
  prefill_prompts(serial, serial_prompts);
  for (const WriterResult& r : results) {
    INFO("writer " << r.who << ": " << r.steps << " steps from step " << r.first_step);
    const SeqId replay = serial.fork(serial_prompts[r.prompt]);
    for (std::uint32_t step = r.first_step; step < r.first_step + r.steps; ++step) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        serial.append(replay, layer, view(token(r.who, step, layer, 0)), view(token(r.who, step, layer, 1)),
                      serial.last_position(replay, layer) + 1);
      }
    }
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      CHECK(cache.length(r.seq, layer) == kPromptTokens + static_cast<index_t>(r.steps));
      CHECK(same_bits(attend(cache, r.seq, layer, query), attend(serial, replay, layer, query)));
      for (index_t stream = 0; stream < kShape.kv_heads; ++stream) {
        const StoredTokens got = cache.read_back(r.seq, layer, stream);
        const StoredTokens want = serial.read_back(replay, layer, stream);
        CHECK(got.positions == want.positions);
        CHECK(same_bits(got.keys, want.keys));
        CHECK(same_bits(got.values, want.values));
      }
    }
  }

  // No lost pages: releasing everything returns every page and every byte.
  for (const WriterResult& r : results) cache.release(r.seq);
  CHECK(cache.pool().pages_in_use() == prompt_pages);
  for (SeqId p : prompts) cache.release(p);
  CHECK(cache.pool().pages_in_use() == 0);
  CHECK(cache.pool().pages_available() == max_pages);
  const MemoryUsage m = cache.memory();
  CHECK(m.pages_in_use == 0);
  CHECK(m.total() == m.codec_params);  // only the per-(layer, stream) codec parameters remain
  CHECK(m.stored_elements == 0);
  CHECK(cache.sequence_count() == 0);
}

}  // namespace

// 48 pages: the prompts take 16; 32 appends to a fork of a prompt need 2 layers x 2 streams x 2 more
// pages, so a writer's 3000 appends exhaust the pool even alone (about 600 OutOfPages per run here).
TEST_CASE("threads append, attend, fork and release with the pool near capacity", "[cache][threads][stress]") {
  SECTION("q8_0") { stress<quant::Q8_0>(48); }
  SECTION("fp8 (calibrated scales, read by every write)") { stress<quant::FP8<quant::E4M3FN>>(48); }
}

// FP8 calibrates each layer's scale on its first page. Several sequences' first pages of a layer
// race to calibrate it (one wins, the others use its scale) while other sequences, whose tokens
// are still all in the tail, are attended.
TEST_CASE("first prefills race to calibrate a layer while other sequences are read", "[cache][threads][stress]") {
  using Cache = KVCache<layout::GQA, quant::FP8<quant::E4M3FN>>;
  CacheConfig config;
  config.page_size = kPage;
  Cache cache(kShape, config);
  const auto query = test::random_rows(kShape.q_heads, kShape.head_dim, 9);
  std::vector<SeqId> tails;
  for (int i = 0; i < 2; ++i) {
    tails.push_back(cache.add_sequence());
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const auto k = test::random_rows(5 * kShape.kv_heads, kShape.head_dim, 30 + i);
      cache.prefill(tails.back(), layer, view(k), view(k));
    }
  }
  std::vector<std::vector<float>> expected;
  for (SeqId s : tails) expected.push_back(attend(cache, s, 1, query));
  constexpr int kWriters = 4;
  std::vector<SeqId> seqs;
  std::vector<std::vector<float>> inputs;
  for (int i = 0; i < kWriters; ++i) {
    seqs.push_back(cache.add_sequence());
    inputs.push_back(test::random_rows(3 * kPage * kShape.kv_heads, kShape.head_dim, 40 + i));
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i) {
    threads.emplace_back([&, i] { cache.prefill(seqs[i], 1, view(inputs[i]), view(inputs[i])); });
  }
  threads.emplace_back([&] {
    for (int round = 0; round < 200; ++round) {
      const int t = round % 2;
      if (!same_bits(attend(cache, tails[t], 1, query), expected[t])) failures.fetch_add(1);
    }
  });
  for (auto& t : threads) t.join();
  CHECK(failures.load() == 0);

  // The layer's scale is the one a single first prefill calibrates (per tensor: every stream shares
  // it). Replaying that prefill first and the others after, serially, gives the same bytes.
  const auto scale = cache.codec_params(1, 0);
  CHECK(cache.codec_params(1, 1) == scale);
  int winner = -1;
  for (int i = 0; i < kWriters; ++i) {
    Cache alone(kShape, config);
    const SeqId s = alone.add_sequence();
    alone.prefill(s, 1, view(inputs[i]), view(inputs[i]));
    if (alone.codec_params(1, 0) == scale) winner = i;
  }
  REQUIRE(winner >= 0);
  Cache serial(kShape, config);
  std::vector<SeqId> replay(kWriters);
  replay[winner] = serial.add_sequence();
  serial.prefill(replay[winner], 1, view(inputs[winner]), view(inputs[winner]));
  for (int i = 0; i < kWriters; ++i) {
    if (i == winner) continue;
    replay[i] = serial.add_sequence();
    serial.prefill(replay[i], 1, view(inputs[i]), view(inputs[i]));
  }
  for (int i = 0; i < kWriters; ++i) {
    CHECK(cache.length(seqs[i], 1) == 3 * kPage);
    for (index_t stream = 0; stream < kShape.kv_heads; ++stream) {
      CHECK(same_bits(cache.read_back(seqs[i], 1, stream).keys, serial.read_back(replay[i], 1, stream).keys));
      CHECK(same_bits(cache.read_back(seqs[i], 1, stream).values, serial.read_back(replay[i], 1, stream).values));
    }
  }
  for (SeqId s : seqs) cache.release(s);
  for (SeqId s : tails) cache.release(s);
  CHECK(cache.memory().total() == cache.memory().codec_params);
  CHECK(cache.pool().pages_in_use() == 0);
}
