// libFuzzer target (clang -fsanitize=fuzzer): random operation sequences on a q8_0 cache with
// prefix sharing and a small pool, against a twin without sharing (unbounded pool) given the same
// writes: add_sequence(tokens) with prompts drawn from three stems and random suffixes and salts,
// prefill in chunks from where the hit ends, share_prefix, fork, release, attend and
// evict_prefix_cache. A token's K/V are a function of (token id, position), so two prompts that
// agree on a prefix write the same K/V there, as a model would. Checked: every hit is whole pages
// of the prompt and leaves max(1, tail_tokens) tokens; attention is bit-identical to the twin's
// once tail_tokens tokens after the hit are written (before that, some of them are fp32 tail rows
// in the twin but encoded in the hit's pages);
// a write that runs out of pages (after the cache reclaimed what it could) changes no sequence;
// lengths follow the twin; at the end, releasing everything and evicting leaves no page or byte.
// Built by cmake/run_sanitizers.sh (KVPACK_BUILD_FUZZERS, with ASan + UBSan).

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "fuzz/fuzz_values.hpp"
#include "kvpack/kvpack.hpp"

namespace {

using namespace kvpack;
using paging::TokenId;
using Cache = KVCache<layout::GQA, quant::Q8_0>;
const ModelShape kShape{2, 4, 2, 32};
constexpr index_t kPage = 16;
constexpr std::size_t kRow = 2 * 32;  // kv_heads x head_dim
constexpr std::size_t kMaxLive = 6;

/// The K (plane 0) or V (plane 1) row of `token` at `position` in `layer`: values on a 1/16 grid
/// in [-8, 8), which q8_0 stores for any mix.
void kv_row(TokenId token, std::size_t position, index_t layer, int plane, float* out) {
  std::uint32_t x = static_cast<std::uint32_t>(token) * 2654435761u ^ static_cast<std::uint32_t>(position) * 40503u ^
                    static_cast<std::uint32_t>(layer * 2 + plane) * 2246822519u;
  for (std::size_t i = 0; i < kRow; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<float>(static_cast<std::int8_t>(x >> 24)) / 16.0f;
  }
}

struct Live {
  SeqId shared = 0;  // in the cache with prefix sharing
  SeqId twin = 0;    // in the twin
  std::vector<TokenId> prompt;
  std::size_t cached = 0;                          // add_sequence's hit
  std::vector<std::size_t> written = {0, 0};       // tokens per layer (a failed write stops midway)
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  CacheConfig config;
  config.page_size = kPage;
  config.tail_tokens = in.ConsumeBool() ? kPage : 0;
  config.max_pages = in.ConsumeIntegralInRange<std::size_t>(24, 160);
  CacheConfig twin_config = config;
  twin_config.max_pages = paging::PagePool::kUnlimited;
  config.prefix_sharing = PrefixSharing{"fuzz-model"};
  Cache cache(kShape, config);
  Cache twin(kShape, twin_config);
  const std::size_t left = std::max<std::size_t>(1, static_cast<std::size_t>(config.tail_tokens));
  const std::size_t query_row = static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim;
  std::vector<Live> live;

  // Writes every layer of `s` up to token `to` in both caches; on OutOfPages in the shared cache
  // (its twin never runs out) that layer is left as it was and the later ones are not written.
  auto write = [&](Live& s, std::size_t to) {
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      const std::size_t from = s.written[static_cast<std::size_t>(layer)];
      if (from >= to) continue;
      std::vector<float> keys((to - from) * kRow), values(keys.size());
      for (std::size_t t = from; t < to; ++t) {
        kv_row(s.prompt[t], t, layer, 0, keys.data() + (t - from) * kRow);
        kv_row(s.prompt[t], t, layer, 1, values.data() + (t - from) * kRow);
      }
      const index_t before = cache.length(s.shared, layer);
      try {
        cache.prefill(s.shared, layer, std::span<const float>(keys), std::span<const float>(values));
      } catch (const OutOfPages&) {
        FUZZ_CHECK(cache.length(s.shared, layer) == before);
        return;
      }
      twin.prefill(s.twin, layer, std::span<const float>(keys), std::span<const float>(values));
      s.written[static_cast<std::size_t>(layer)] = to;
    }
  };
  auto check_lengths = [&](const Live& s) {
    for (index_t layer = 0; layer < kShape.layers; ++layer) {
      FUZZ_CHECK(cache.length(s.shared, layer) == static_cast<index_t>(s.written[static_cast<std::size_t>(layer)]));
      FUZZ_CHECK(twin.length(s.twin, layer) == static_cast<index_t>(s.written[static_cast<std::size_t>(layer)]));
    }
  };

  for (int step = 0; step < 48 && in.remaining_bytes() > 0; ++step) {
    const int op = in.ConsumeIntegralInRange(0, 7);
    if (live.empty() || op == 0) {
      if (live.size() >= kMaxLive) continue;
      // A stem of about 1 to 5 pages shared by many prompts, then a random suffix.
      const TokenId stem = in.ConsumeIntegralInRange<TokenId>(0, 2);
      Live s;
      const std::size_t stem_tokens = in.ConsumeIntegralInRange<std::size_t>(1, 5) * kPage + 4 -
                                      in.ConsumeIntegralInRange<std::size_t>(0, 8);
      for (std::size_t t = 0; t < stem_tokens; ++t) s.prompt.push_back(stem * 1000 + static_cast<TokenId>(t));
      const std::size_t own = in.ConsumeIntegralInRange<std::size_t>(0, 40);
      for (std::size_t t = 0; t < own; ++t) s.prompt.push_back(in.ConsumeIntegralInRange<TokenId>(5000, 5003));
      if (s.prompt.empty()) s.prompt.push_back(7);
      const char* salt = in.ConsumeIntegralInRange(0, 3) == 0 ? "other" : "";
      const PrefixHit hit = cache.add_sequence(s.prompt, salt);
      const auto cached = static_cast<std::size_t>(hit.cached_tokens);
      FUZZ_CHECK(cached % kPage == 0);
      FUZZ_CHECK(cached == 0 || cached + left <= s.prompt.size());
      s.shared = hit.seq;
      s.twin = twin.add_sequence();
      s.cached = cached;
      // The twin writes the hit's tokens itself, in one prefill.
      if (cached > 0) {
        std::vector<float> keys(cached * kRow), values(keys.size());
        for (index_t layer = 0; layer < kShape.layers; ++layer) {
          for (std::size_t t = 0; t < cached; ++t) {
            kv_row(s.prompt[t], t, layer, 0, keys.data() + t * kRow);
            kv_row(s.prompt[t], t, layer, 1, values.data() + t * kRow);
          }
          twin.prefill(s.twin, layer, std::span<const float>(keys), std::span<const float>(values));
        }
        s.written = {cached, cached};
      }
      check_lengths(s);
      live.push_back(std::move(s));
      continue;
    }
    const std::size_t pick = in.ConsumeIntegralInRange<std::size_t>(0, live.size() - 1);
    Live& s = live[pick];
    switch (op) {
      case 1:
      case 2: {  // prefill a chunk of the prompt
        const std::size_t done = std::min(s.written[0], s.written[1]);
        if (done == s.prompt.size()) break;
        write(s, std::min(s.prompt.size(), done + in.ConsumeIntegralInRange<std::size_t>(1, 96)));
        break;
      }
      case 3: {  // share_prefix: whole written pages of the prompt
        const index_t shared = cache.share_prefix(s.shared);
        FUZZ_CHECK(shared % kPage == 0);
        FUZZ_CHECK(static_cast<std::size_t>(shared) <= std::min(s.written[0], s.written[1]));
        break;
      }
      case 4:  // fork
        if (live.size() < kMaxLive) {
          Live f = s;
          f.shared = cache.fork(s.shared);
          f.twin = twin.fork(s.twin);
          live.push_back(std::move(f));
        }
        break;
      case 5:  // release
        cache.release(s.shared);
        twin.release(s.twin);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(pick));
        break;
      case 6: {  // attend: bit-identical to the twin
        const index_t layer = in.ConsumeIntegralInRange<index_t>(0, kShape.layers - 1);
        const std::size_t n = s.written[static_cast<std::size_t>(layer)];
        if (n == 0 || (n < s.cached + static_cast<std::size_t>(config.tail_tokens))) break;
        const auto q = fuzz::values_from(in, query_row);
        std::vector<float> a(query_row), b(query_row);
        cache.attend(s.shared, layer, std::span<const float>(q), std::span<float>(a), 0.125f);
        twin.attend(s.twin, layer, std::span<const float>(q), std::span<float>(b), 0.125f);
        FUZZ_CHECK(a == b);
        break;
      }
      default: {  // evict cached pages; nothing a sequence holds may go
        const std::size_t before = cache.memory().pages_in_use;
        const paging::PrefixEviction done = cache.evict_prefix_cache(in.ConsumeIntegralInRange<std::size_t>(0, 16));
        FUZZ_CHECK(cache.memory().pages_in_use == before - done.pool_pages_freed);
        break;
      }
    }
    for (const Live& x : live) check_lengths(x);
    FUZZ_CHECK(cache.memory().pages_in_use <= config.max_pages);
  }

  for (const Live& s : live) {
    cache.release(s.shared);
    twin.release(s.twin);
  }
  cache.evict_prefix_cache();
  const MemoryUsage m = cache.memory();
  FUZZ_CHECK(m.pages_in_use == 0 && m.total() == 0 && m.stored_elements == 0);
  FUZZ_CHECK(cache.prefix_stats().cached_pages == 0);
  FUZZ_CHECK(cache.pool().pages_available() == config.max_pages);
  return 0;
}
