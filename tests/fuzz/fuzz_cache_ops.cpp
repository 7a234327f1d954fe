// libFuzzer target (clang -fsanitize=fuzzer): random operation sequences on a q8_0 cache with a
// small pool, decoded from the fuzzer's bytes: add, prefill, append, fork, release and attend,
// checked against the reference model (tests/support/reference_cache.hpp) after every attend, and
// bad calls (unknown or released sequences, NaN/Inf, positions that do not grow, wrong sizes)
// whose exact error code and strong guarantee (lengths and memory() unchanged) are checked, as
// after every OutOfPages. At the end everything is released and no page or byte may remain.
// Built by cmake/run_sanitizers.sh (KVPACK_BUILD_FUZZERS, with ASan + UBSan), which runs it for a
// bounded time over the seed corpus in tests/fuzz/corpus/cache_ops.

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "fuzz/fuzz_values.hpp"
#include "kvpack/kvpack.hpp"
#include "support/reference_cache.hpp"

namespace {

using namespace kvpack;
using fuzz::values_from;
using Quantizer = quant::Q8_0;
const ModelShape kShape{2, 4, 2, 32};
constexpr index_t kPage = 16;
constexpr std::size_t kMaxLive = 6;


struct State {
  std::vector<index_t> lengths;
  std::size_t pages = 0;
  std::size_t bytes = 0;
  std::size_t elements = 0;
  bool operator==(const State&) const = default;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  CacheConfig config;
  config.page_size = kPage;
  config.tail_tokens = in.ConsumeBool() ? kPage : 0;
  config.max_pages = in.ConsumeIntegralInRange<std::size_t>(4, 48);
  KVCache<layout::GQA, Quantizer> cache(kShape, config);
  test::ReferenceCache<Quantizer> model(kShape, kPage, config.tail_tokens);
  const std::size_t row = static_cast<std::size_t>(kShape.kv_heads) * kShape.head_dim;
  const std::size_t query_row = static_cast<std::size_t>(kShape.q_heads) * kShape.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kShape.head_dim));
  std::vector<SeqId> live;
  std::vector<SeqId> gone;  // released or never issued

  auto state = [&] {
    State s;
    for (SeqId id : live) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) s.lengths.push_back(cache.length(id, layer));
    }
    const MemoryUsage m = cache.memory();
    s.pages = m.pages_in_use;
    s.bytes = m.total();
    s.elements = m.stored_elements;
    return s;
  };
  // `call` must throw kvpack::Error with `code` and change nothing.
  auto expect_error = [&](auto call, ErrorCode code) {
    const State before = state();
    bool threw = false;
    try {
      call();
    } catch (const Error& e) {
      threw = true;
      FUZZ_CHECK(e.code() == code);
    }
    FUZZ_CHECK(threw);
    FUZZ_CHECK(state() == before);
  };
  // A write that may run out of pages: on OutOfPages nothing changed and the model is not told.
  auto write = [&](auto call) {
    const State before = state();
    try {
      call();
      return true;
    } catch (const OutOfPages&) {
      FUZZ_CHECK(state() == before);
      return false;
    }
  };

  for (int step = 0; step < 64 && in.remaining_bytes() > 0; ++step) {
    const int op = in.ConsumeIntegralInRange(0, 10);
    if (live.empty() || op == 0) {
      if (live.size() < kMaxLive) {
        live.push_back(cache.add_sequence());
        model.add(live.back());
      }
      continue;
    }
    const std::size_t pick = in.ConsumeIntegralInRange<std::size_t>(0, live.size() - 1);
    const SeqId id = live[pick];
    const index_t layer = in.ConsumeIntegralInRange<index_t>(0, kShape.layers - 1);
    const std::int64_t last = model.sequences().at(id)[layer].last_position;
    switch (op) {
      case 1: {  // prefill
        const auto tokens = in.ConsumeIntegralInRange<std::size_t>(1, 40);
        const auto keys = values_from(in, tokens * row);
        const auto values = values_from(in, tokens * row);
        if (write([&] { cache.prefill(id, layer, std::span<const float>(keys), std::span<const float>(values)); })) {
          model.write(id, layer, keys, values, last + static_cast<std::int64_t>(tokens));
        }
        break;
      }
      case 2: {  // append, possibly skipping positions
        const std::int64_t position = last + 1 + in.ConsumeIntegralInRange(0, 3);
        const auto key = values_from(in, row);
        const auto value = values_from(in, row);
        if (write([&] { cache.append(id, layer, std::span<const float>(key), std::span<const float>(value), position); })) {
          model.write(id, layer, key, value, position);
        }
        break;
      }
      case 3:  // fork
        if (live.size() < kMaxLive) {
          live.push_back(cache.fork(id));
          model.fork(id, live.back());
        }
        break;
      case 4:  // release
        cache.release(id);
        model.release(id);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(pick));
        gone.push_back(id);
        break;
      case 5:
      case 6: {  // attend, against the reference model
        if (model.tokens(id, layer) == 0) {
          const auto query = values_from(in, query_row);
          std::vector<float> out(query_row);
          expect_error([&] { cache.attend(id, layer, std::span<const float>(query), std::span<float>(out), scale); },
                       ErrorCode::kInvalidArgument);
          break;
        }
        const auto query = values_from(in, query_row);
        std::vector<float> out(query_row);
        cache.attend(id, layer, std::span<const float>(query), std::span<float>(out), scale);
        std::vector<double> bounds;
        const auto expected = model.attend(
            cache.quantizer(), id, layer, query, scale, [&](index_t s) { return cache.codec_params(layer, s); },
            &bounds, test::active_operands<Quantizer::key_codec>(), test::active_operands<Quantizer::value_codec>());
        for (std::size_t i = 0; i < out.size(); ++i) {
          if (!(std::fabs(out[i] - expected[i]) <= bounds[i / kShape.head_dim])) {
            std::fprintf(stderr, "attend: element %zu of %zu tokens: %.9g, reference %.9g, bound %.3g\n", i,
                         static_cast<std::size_t>(model.tokens(id, layer)), out[i], expected[i],
                         bounds[i / kShape.head_dim]);
          }
          FUZZ_CHECK(std::fabs(out[i] - expected[i]) <= bounds[i / kShape.head_dim]);
        }
        break;
      }
      case 7: {  // an unknown or released sequence
        const SeqId bad = gone.empty() || in.ConsumeBool() ? SeqId{1000000} : gone[in.ConsumeIntegralInRange<std::size_t>(0, gone.size() - 1)];
        const auto key = values_from(in, row);
        switch (in.ConsumeIntegralInRange(0, 3)) {
          case 0:
            expect_error([&] { cache.append(bad, layer, std::span<const float>(key), std::span<const float>(key), 0); },
                         ErrorCode::kUnknownSequence);
            break;
          case 1: expect_error([&] { (void)cache.fork(bad); }, ErrorCode::kUnknownSequence); break;
          case 2: expect_error([&] { cache.release(bad); }, ErrorCode::kUnknownSequence); break;
          default: expect_error([&] { (void)cache.length(bad, layer); }, ErrorCode::kUnknownSequence); break;
        }
        break;
      }
      case 8: {  // NaN or Inf somewhere in a prefill
        const auto tokens = in.ConsumeIntegralInRange<std::size_t>(1, 40);
        auto keys = values_from(in, tokens * row);
        auto values = values_from(in, tokens * row);
        auto& target = in.ConsumeBool() ? keys : values;
        target[in.ConsumeIntegralInRange<std::size_t>(0, target.size() - 1)] =
            in.ConsumeBool() ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
        expect_error([&] { cache.prefill(id, layer, std::span<const float>(keys), std::span<const float>(values)); },
                     ErrorCode::kNonFinite);
        break;
      }
      case 9: {  // a position that does not grow
        const auto key = values_from(in, row);
        const std::int64_t position = last - in.ConsumeIntegralInRange(0, 5);
        expect_error([&] { cache.append(id, layer, std::span<const float>(key), std::span<const float>(key), position); },
                     ErrorCode::kInvalidArgument);
        break;
      }
      default: {  // sizes that are not whole rows
        const auto delta = in.ConsumeIntegralInRange<std::size_t>(1, row - 1);
        const auto keys = values_from(in, row + delta);
        expect_error([&] { cache.prefill(id, layer, std::span<const float>(keys), std::span<const float>(keys)); },
                     ErrorCode::kInvalidArgument);
        break;
      }
    }
    // Lengths always follow the model.
    for (SeqId s : live) {
      for (index_t l = 0; l < kShape.layers; ++l) FUZZ_CHECK(cache.length(s, l) == model.tokens(s, l));
    }
    FUZZ_CHECK(cache.memory().pages_in_use <= config.max_pages);
  }

  for (SeqId id : live) cache.release(id);
  const MemoryUsage m = cache.memory();
  FUZZ_CHECK(m.pages_in_use == 0 && m.total() == 0 && m.stored_elements == 0);
  FUZZ_CHECK(cache.pool().pages_available() == config.max_pages);
  return 0;
}
