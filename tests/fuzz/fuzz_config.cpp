// libFuzzer target (clang -fsanitize=fuzzer): KVCache construction from arbitrary ModelShape and
// CacheConfig fields (page_size, tail_tokens, exact_prefix_tokens, max_pages, check_inputs,
// key_rope with any theta bits, pairing byte and max_position) and codec options (FP8's static
// scale bits), for fp16, q4_0, int8, KIVI-2, KVQuant without a calibration, FP8 E4M3 and
// TurboQuant-4. The constructor must throw kvpack::Error (kInvalidConfig or kUnsupported) exactly
// when one of the validators (ModelShape, CacheConfig, RopeSpec, the codecs) rejects the
// config, and nothing else; a cache it builds must take one prefill (OutOfPages or a position
// beyond key_rope.max_position leaving it empty) and give a finite attend.
// Valid sizes are drawn small (a few layers and heads, head_dim mostly up to 200 and a few up to
// 2080, tails of a few pages, RoPE tables to 2^16 positions) so that no accepted config allocates
// gigabytes; rejected values (negative, zero, INT32_MIN/MAX, NaN, Inf) come from the whole range.
// Built and run by cmake/run_sanitizers.sh over the seed corpus in tests/fuzz/corpus/config.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "fuzz/fuzz_values.hpp"
#include "kvpack/kvpack.hpp"

namespace {

using namespace kvpack;
using fuzz::values_from;

constexpr index_t kIntMin = std::numeric_limits<index_t>::min();
constexpr index_t kIntMax = std::numeric_limits<index_t>::max();

/// Mostly a value in [lo, hi]; one time in eight one of `edges` (values a validator must reject).
template <class T>
T draw(FuzzedDataProvider& in, T lo, T hi, std::initializer_list<T> edges) {
  if (edges.size() > 0 && in.ConsumeIntegralInRange(0, 7) == 0) {
    return edges.begin()[in.ConsumeIntegralInRange<std::size_t>(0, edges.size() - 1)];
  }
  return in.ConsumeIntegralInRange(lo, hi);
}

/// A double from a list of awkward values, or any bit pattern.
double draw_theta(FuzzedDataProvider& in) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double picks[] = {10000.0, 500000.0, 1.0, 0.5, 0.0, -2.0, kNaN, -kNaN, kInf, -kInf,
                          std::nextafter(1.0, 2.0), std::numeric_limits<double>::max(),
                          std::numeric_limits<double>::denorm_min()};
  const auto i = in.ConsumeIntegralInRange<std::size_t>(0, std::size(picks));
  return i < std::size(picks) ? picks[i] : std::bit_cast<double>(in.ConsumeIntegral<std::uint64_t>());
}


/// True when `check` returns; false when it throws kvpack::Error.
template <class F>
bool accepts(F check) {
  try {
    check();
    return true;
  } catch (const Error&) {
    return false;
  }
}

template <class Quantizer>
void run(FuzzedDataProvider& in, const Quantizer& quantizer, index_t head_dim_hi) {
  ModelShape shape;
  shape.layers = draw<index_t>(in, -1, 3, {kIntMin, 0});
  shape.kv_heads = draw<index_t>(in, -1, 4, {kIntMin, 0});
  shape.q_heads = shape.kv_heads > 0 && in.ConsumeBool() ? shape.kv_heads * in.ConsumeIntegralInRange(1, 4)
                                                         : draw<index_t>(in, -1, 16, {kIntMin, 0});
  // Mostly small: the run's speed is the prefill's size. Large head_dims around q4_0's 2048
  // limit come as edges.
  if (in.ConsumeBool()) {
    shape.head_dim = 8 * in.ConsumeIntegralInRange<index_t>(1, std::min<index_t>(head_dim_hi, 128) / 8);
  } else if (head_dim_hi > 2048) {
    shape.head_dim = draw<index_t>(in, -1, 200, {kIntMin, 0, 2048, 2056, 2080});
  } else {
    shape.head_dim = draw<index_t>(in, -1, std::min<index_t>(head_dim_hi, 200), {kIntMin, 0});
  }

  CacheConfig config;
  config.page_size = in.ConsumeBool() ? 16 * in.ConsumeIntegralInRange(1, 16)
                                      : draw<index_t>(in, 0, 272, {kIntMin, -16, kIntMax});
  const bool page_ok = config.page_size >= 16 && config.page_size <= 256;
  config.tail_tokens = page_ok && in.ConsumeBool()
                           ? config.page_size * in.ConsumeIntegralInRange(-1, 3)
                           : draw<index_t>(in, -1, 600, {kIntMin, kIntMax, CacheConfig::kMaxTailTokens + 16});
  config.exact_prefix_tokens = draw<index_t>(in, -1, 40, {kIntMin, kIntMax, 4097});
  config.max_pages = draw<std::size_t>(in, 0, 64, {paging::PagePool::kUnlimited, std::numeric_limits<std::size_t>::max()});
  config.check_inputs = in.ConsumeBool();
  // One time in four: the tables (1024 rows of cos and sin) dominate a run's time.
  if (in.ConsumeIntegralInRange(0, 3) == 0) {
    RopeSpec rope;
    rope.theta = draw_theta(in);
    rope.pairing = static_cast<RopePairing>(in.ConsumeIntegral<std::uint8_t>());  // any byte, not only the two names
    rope.max_position = draw<std::int64_t>(in, -2, 200,
                                           {std::int64_t{1} << 16, std::numeric_limits<std::int64_t>::min(),
                                            std::int64_t{1} << 31, std::numeric_limits<std::int64_t>::max()});
    config.key_rope = rope;
  }

  // The oracle: every validator, in the order the constructor can reach them.
  const quant::PageGeometry geometry{config.page_size, shape.head_dim};
  const bool valid = accepts([&] { shape.validate(); }) && accepts([&] { config.validate(); }) &&
                     accepts([&] { quantizer.key.validate(geometry); }) &&
                     accepts([&] { quantizer.value.validate(geometry); }) &&
                     (!config.key_rope || accepts([&] { config.key_rope->validate(shape.head_dim); }));
  std::optional<KVCache<layout::GQA, Quantizer>> cache;
  try {
    cache.emplace(shape, config, quantizer);
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidConfig || e.code() == ErrorCode::kUnsupported);
    FUZZ_CHECK(!valid);
    return;
  }
  FUZZ_CHECK(valid);

  const MemoryUsage empty = cache->memory();  // codec parameters only
  const SeqId id = cache->add_sequence();
  const index_t layer = in.ConsumeIntegralInRange<index_t>(0, shape.layers - 1);
  const std::size_t row = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;
  const auto tokens = in.ConsumeIntegralInRange<std::size_t>(1, 48);
  const auto keys = values_from(in, tokens * row);
  const auto values = values_from(in, tokens * row);
  try {
    cache->prefill(id, layer, std::span<const float>(keys), std::span<const float>(values));
  } catch (const Error& e) {
    // Nothing else may fail with finite, storable input; and a failed prefill leaves no trace.
    const bool beyond_rope = config.key_rope && static_cast<std::int64_t>(tokens) - 1 > config.key_rope->max_position;
    FUZZ_CHECK(e.code() == ErrorCode::kOutOfPages || (e.code() == ErrorCode::kOutOfRange && beyond_rope));
    FUZZ_CHECK(cache->length(id, layer) == 0 && cache->memory().pages_in_use == 0 &&
               cache->memory().stored_elements == 0);
    return;
  }
  FUZZ_CHECK(cache->length(id, layer) == static_cast<index_t>(tokens));

  const std::size_t query_row = static_cast<std::size_t>(shape.q_heads) * shape.head_dim;
  const auto query = values_from(in, query_row);
  std::vector<float> out(query_row, std::numeric_limits<float>::quiet_NaN());
  cache->attend(id, layer, std::span<const float>(query), std::span<float>(out),
                1.0f / std::sqrt(static_cast<float>(shape.head_dim)));
  for (const float x : out) FUZZ_CHECK(std::isfinite(x));
  cache->release(id);
  FUZZ_CHECK(cache->memory().pages_in_use == 0 && cache->memory().total() == empty.total());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange(0, 6)) {
    case 0: run(in, quant::Float<half>{}, 2080); break;
    case 1: run(in, quant::Q4_0{}, 2080); break;
    case 2: run(in, quant::Int8{}, 2080); break;
    case 3: run(in, quant::KIVI<2>{}, 2080); break;
    case 4: run(in, quant::KVQuant<4>{}, 256); break;  // no calibration: always kInvalidConfig
    case 5: {
      quant::FP8Options options;
      options.calibrate = in.ConsumeBool();
      options.static_scale = in.ConsumeBool() ? 0.5f : std::bit_cast<float>(in.ConsumeIntegral<std::uint32_t>());
      run(in, quant::FP8<quant::E4M3FN>(options), 2080);
      break;
    }
    default: {
      // One quantizer for the whole run: its rotation tables are built once per head_dim and
      // layer, as a server building many caches of one model would see.
      static const quant::TurboQuant<8> turbo{};
      run(in, turbo, 160);
      break;
    }
  }
  return 0;
}
