// libFuzzer target (clang -fsanitize=fuzzer): random operation sequences on evicting caches —
// add (with a pinned span), prefill with observation queries, append, attend, fork, release —
// decoded from the fuzzer's bytes, on one of four caches picked by the first byte: H2O over q8_0;
// SnapKV with a Pyramid budget over fp16 with select::Quest, a tail and an exact prefix;
// StreamingLLM over q4_0 with Quest and pre-RoPE keys; StreamingLLM with in-cache positions over
// q8_0. After every operation: each stream's live count equals what read_back holds, memory()
// counts exactly those tokens, every pinned position written is still live, and an attend equals
// exact attention over the tokens it read (support/eviction_check.hpp) with a certified bound in
// [0, 1]. At the end everything is released and no page or byte may remain.
// Built and run by cmake/run_sanitizers.sh over the seed corpus in tests/fuzz/corpus/eviction_ops.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "fuzz/fuzz_values.hpp"
#include "kvpack/kvpack.hpp"
#include "support/eviction_check.hpp"

namespace {

using namespace kvpack;
using fuzz::values_from;
const ModelShape kShape{2, 4, 2, 32};
constexpr index_t kPage = 16;
constexpr std::size_t kMaxLive = 5;
constexpr float kScale = 0.17677669f;


/// Relative error allowed against exact attention over the tokens read, beyond the kernels' error
/// bound (support/eviction_check.hpp): the kernels read the same decoded keys and values as
/// read_back, so this is slack for what the bound does not model (the rotation of pre-RoPE keys),
/// small enough that a token read wrongly still breaks it. The quantized codecs keep the 3e-2
/// they had before the bound covered their integer paths (1e-3 passed the property test on AVX2, not tried on AVX-512).
template <class Cache>
double tolerance() {
  using Key = typename Cache::quantizer_type::key_codec;
  return std::is_same_v<Key, typename quant::Float<half>::key_codec> ? 1e-3 : 3e-2;
}

template <class Cache>
void run(Cache& cache, FuzzedDataProvider& in) {
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  const std::size_t query_row = static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim;
  std::vector<SeqId> live;
  std::map<SeqId, std::pair<std::int64_t, std::int64_t>> pins;  // at most one span, set before any write

  auto check_sequences = [&] {
    std::size_t elements = 0;
    for (SeqId seq : live) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        const std::int64_t last = cache.last_position(seq, layer);
        for (index_t s = 0; s < kShape.kv_heads; ++s) {
          const StoredTokens kept = cache.read_back(seq, layer, s);
          FUZZ_CHECK(cache.live_tokens(seq, layer, s) == kept.size());
          elements += static_cast<std::size_t>(kept.size()) * 2 * kShape.head_dim;
          const auto pin = pins.find(seq);
          if (pin == pins.end()) continue;
          const std::set<std::int32_t> positions(kept.positions.begin(), kept.positions.end());
          for (std::int64_t p = pin->second.first; p <= std::min(pin->second.second, last); ++p) {
            FUZZ_CHECK(positions.count(static_cast<std::int32_t>(p)) == 1);
          }
        }
      }
    }
    FUZZ_CHECK(cache.memory().stored_elements == elements);
  };

  for (int step = 0; step < 48 && in.remaining_bytes() > 0; ++step) {
    const int op = in.ConsumeIntegralInRange(0, 7);
    if (live.empty() || op == 0) {
      if (live.size() < kMaxLive) {
        live.push_back(cache.add_sequence());
        if (in.ConsumeBool()) {
          const auto first = in.ConsumeIntegralInRange<std::int64_t>(0, 150);
          pins[live.back()] = {first, first + in.ConsumeIntegralInRange<std::int64_t>(0, 30)};
          cache.pin(live.back(), pins[live.back()].first, pins[live.back()].second);
        }
      }
      continue;
    }
    const std::size_t pick = in.ConsumeIntegralInRange<std::size_t>(0, live.size() - 1);
    const SeqId id = live[pick];
    const index_t layer = in.ConsumeIntegralInRange<index_t>(0, kShape.layers - 1);
    try {
      switch (op) {
        case 1:
        case 2: {  // prefill, with an observation window (SnapKV and H2O score tokens with it)
          const auto tokens = in.ConsumeIntegralInRange<std::size_t>(1, 80);
          const auto keys = values_from(in, tokens * row);
          const auto values = values_from(in, tokens * row);
          const auto window = values_from(in, in.ConsumeIntegralInRange<std::size_t>(0, 8) * query_row);
          cache.prefill(id, layer, std::span<const float>(keys), std::span<const float>(values),
                        std::span<const float>(window));
          break;
        }
        case 3: {  // append
          const auto key = values_from(in, row);
          const auto value = values_from(in, row);
          cache.append(id, layer, std::span<const float>(key), std::span<const float>(value),
                       cache.last_position(id, layer) + 1);
          break;
        }
        case 4:
        case 5: {  // attend: exact attention over what was read, and a bound that is a probability
          if (cache.length(id, layer) == 0) break;
          const auto query = values_from(in, query_row);
          std::vector<float> out(query_row);
          AttendReport report;
          if constexpr (Cache::selector_type::kReadsAllPages) {
            cache.attend(id, layer, std::span<const float>(query), std::span<float>(out), kScale);
            test::every_page_read(cache, id, layer, report);
          } else {
            cache.attend(id, layer, std::span<const float>(query), std::span<float>(out), kScale, &report);
            for (const auto& head : report.heads) FUZZ_CHECK(head.mass >= 0.0 && head.mass <= 1.0);
          }
          FUZZ_CHECK(test::error_against_read_back(cache, id, layer, query, out, kScale, report) <= tolerance<Cache>());
          break;
        }
        case 6:  // fork: the copy keeps the pins
          if (live.size() < kMaxLive) {
            live.push_back(cache.fork(id));
            if (pins.count(id) != 0) pins[live.back()] = pins[id];
          }
          break;
        default:  // release
          cache.release(id);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(pick));
          pins.erase(id);
          break;
      }
    } catch (const OutOfPages&) {
      // A small pool: writes may be refused (all or none); the checks below still hold.
    }
    check_sequences();
  }
  for (SeqId id : live) cache.release(id);
  const MemoryUsage m = cache.memory();
  FUZZ_CHECK(m.pages_in_use == 0 && m.total() == 0 && m.stored_elements == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  CacheConfig config;
  config.page_size = kPage;
  config.max_pages = in.ConsumeIntegralInRange<std::size_t>(8, 120);
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0: {
      evict::H2O<> h2o;
      h2o.budget.tokens = 48;
      KVCache<layout::GQA, quant::Q8_0, evict::H2O<>> cache(kShape, config, {}, {}, h2o);
      run(cache, in);
      break;
    }
    case 1: {
      config.tail_tokens = 2 * kPage;
      config.exact_prefix_tokens = 2;
      evict::SnapKV<evict::Pyramid> snapkv;
      snapkv.window = 8;
      snapkv.budget = {60, 20};
      select::Quest quest;
      quest.token_budget = 32;
      quest.dense_layers = 1;
      KVCache<layout::GQA, quant::Float<half>, evict::SnapKV<evict::Pyramid>, select::Quest> cache(
          kShape, config, {}, {}, snapkv, quest);
      run(cache, in);
      break;
    }
    case 2: {
      config.key_rope = RopeSpec{};
      select::Quest quest;
      quest.token_budget = 32;
      quest.dense_layers = 0;
      KVCache<layout::GQA, quant::Q4_0, evict::StreamingLLM<>, select::Quest> cache(
          kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{40}}, quest);
      run(cache, in);
      break;
    }
    default: {
      config.key_rope = RopeSpec{};
      config.exact_prefix_tokens = in.ConsumeBool() ? 2 : 0;
      KVCache<layout::GQA, quant::Q8_0, evict::StreamingLLM<>> cache(
          kShape, config, {}, {}, evict::StreamingLLM<>{4, evict::Uniform{40}, true});
      run(cache, in);
      break;
    }
  }
  return 0;
}
