// libFuzzer target (clang -fsanitize=fuzzer): one page of K and V rows with arbitrary bit patterns
// (NaN, ±Inf, subnormals, -0, values at and just past each codec's max_abs_input, raw bits)
// through every codec, three ways:
//   1. the codec's scalar encode then decode: never UB (UBSan catches float-to-int overflow);
//      with finite input within max_abs_input the decode is finite, exact for fp32/fp16/bf16
//      (the input rounded to the format) and within the documented rounding for int8, q8_0, q4_0
//      and FP8; KIVI, KVQuant and TurboQuant are only checked finite.
//   2. a cache with check_inputs on: prefill of the page after a valid first one. It must throw
//      kNonFinite or kOutOfRange, by the first offending element (keys before values), and leave
//      the length, memory() and an attend output bit-for-bit as they were; otherwise it succeeds
//      and attend stays finite.
//   3. a cache with check_inputs off: the same prefill and an attend never fail nor crash.
//   In 2 and 3, when every value is storable and within 2^20, the attend (the SIMD kernels of the best ISA
//   here) must match exact attention over the codecs' scalar round trip within the kernels'
//   error bound (tests/support/reference_cache.hpp, as the cache property tests).
// Built and run by cmake/run_sanitizers.sh over the seed corpus in tests/fuzz/corpus/codec_spans.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "kvpack/kvpack.hpp"
#include "support/reference_cache.hpp"
#include "support/stream_fixture.hpp"

namespace {

using namespace kvpack;

constexpr float kInf = std::numeric_limits<float>::infinity();

template <class C>
struct IsFloatCodec : std::false_type {};
template <class T, Plane P>
struct IsFloatCodec<quant::FloatCodec<T, P>> : std::true_type {};
template <class C>
struct IsFP8Codec : std::false_type {};
template <class F, Plane P>
struct IsFP8Codec<quant::FP8Codec<F, P>> : std::true_type {};
template <class C>
constexpr bool kIsInt8Like = std::is_same_v<C, quant::Int8Codec<C::kPlane>> || std::is_same_v<C, quant::Q8_0Codec<C::kPlane>>;

/// How the page's values are drawn.
enum class Mode { kRawBits, kStorable, kStorableWithSpecials };

/// `n` floats: any bit pattern, or values a codec with limit `max_abs` stores (a signed 1/16
/// grid scaled by 2^e, e from -150 to 40, so subnormals and values near the limit come up),
/// optionally with special values planted at chosen places.
std::vector<float> draw_values(FuzzedDataProvider& in, std::size_t n, Mode mode, float max_abs) {
  std::vector<float> out(n);
  if (mode == Mode::kRawBits) {
    for (float& x : out) x = std::bit_cast<float>(in.ConsumeIntegral<std::uint32_t>());
    return out;
  }
  const int exponent = in.ConsumeIntegralInRange(-150, 40);
  for (float& x : out) {
    x = std::ldexp(static_cast<float>(in.ConsumeIntegral<std::int8_t>()) / 16.0f, exponent);
    if (!(std::fabs(x) <= max_abs)) x = std::copysign(max_abs, x);
  }
  if (mode == Mode::kStorableWithSpecials) {
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), kInf, -kInf, -0.0f,
                              std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::min(),
                              std::numeric_limits<float>::max(), max_abs, -max_abs,
                              std::nextafter(max_abs, kInf), -std::nextafter(max_abs, kInf)};
    for (int k = in.ConsumeIntegralInRange(1, 4); k > 0; --k) {
      out[in.ConsumeIntegralInRange<std::size_t>(0, n - 1)] =
          specials[in.ConsumeIntegralInRange<std::size_t>(0, std::size(specials) - 1)];
    }
  }
  return out;
}

bool storable(const std::vector<float>& data, float max_abs) {
  for (const float x : data) {
    if (!(std::fabs(x) <= max_abs)) return false;
  }
  return true;
}

/// Scalar encode then decode of one plane (rows of head_dim), checked as the file comment says.
template <class Codec>
void round_trip(const Codec& codec, quant::PageGeometry g, const std::vector<float>& src) {
  typename Codec::params_type params = codec.initial_params(0, 0);
  float absmax = 0.0f;
  for (const float x : src) {
    if (std::isfinite(x)) absmax = std::max(absmax, std::fabs(x));
  }
  if constexpr (quant::CalibratedCodec<Codec>) {
    if (codec.calibrates()) params = codec.params_from_absmax(absmax);
  }
  std::vector<std::byte> plane(codec.plane_bytes(g));
  std::vector<float> out(src.size());
  codec.encode(g, src.data(), g.head_dim, params, plane.data());
  codec.decode(g, plane.data(), params, out.data());
  if (!storable(src, codec.max_abs_input())) return;  // anything but a crash or UB
  for (index_t t = 0; t < g.page_size; ++t) {
    float row_max = 0.0f;
    for (index_t c = 0; c < g.head_dim; ++c) row_max = std::max(row_max, std::fabs(src[t * g.head_dim + c]));
    for (index_t c = 0; c < g.head_dim; ++c) {
      const std::size_t i = static_cast<std::size_t>(t) * g.head_dim + c;
      const double x = src[i];
      const double err = std::fabs(out[i] - x);
      FUZZ_CHECK(std::isfinite(out[i]));
      if constexpr (IsFloatCodec<Codec>::value) {
        // The input rounded to the storage type, nothing else.
        FUZZ_CHECK(out[i] == static_cast<float>(static_cast<typename Codec::storage_type>(src[i])));
      } else if constexpr (kIsInt8Like<Codec>) {
        // Rounding to a code (half a step of max/127), the fp16 scale's rounding (2^-11 relative,
        // 2^-25 absolute when subnormal) times up to 127.
        FUZZ_CHECK(err <= row_max * (0.5 / 127 + 0x1p-11) * 1.01 + 127 * 0x1p-25);
      } else if constexpr (std::is_same_v<Codec, quant::Q4_0Codec<Codec::kPlane>>) {
        // Steps of max/8; the block's largest magnitude of the other sign clamps to 7 steps.
        FUZZ_CHECK(err <= row_max * (1.0 / 8) * (1 + 0x1p-6) + 16 * 0x1p-25);
      } else if constexpr (IsFP8Codec<Codec>::value) {
        // Calibrated: no saturation; half an ulp of 2 or 3 mantissa bits, or of the subnormal step.
        FUZZ_CHECK(err <= std::fabs(x) * 0x1p-3 + static_cast<double>(params.scale) * 0x1p-9);
      }
    }
  }
}

template <class Quantizer>
const Quantizer& quantizer_for(index_t head_dim) {
  // Built once per head_dim: KVQuant's calibration and TurboQuant's rotations take milliseconds.
  static std::map<index_t, Quantizer> built;
  auto it = built.find(head_dim);
  if (it == built.end()) it = built.emplace(head_dim, test::make_quantizer<Quantizer>(head_dim)).first;
  return it->second;
}

template <class Quantizer>
void run(FuzzedDataProvider& in) {
  const index_t page = in.ConsumeBool() ? 32 : 64;
  const index_t head_dim = in.ConsumeBool() ? 32 : 64;
  const quant::PageGeometry g{page, head_dim};
  const Quantizer& quantizer = quantizer_for<Quantizer>(head_dim);
  const auto mode = static_cast<Mode>(in.ConsumeIntegralInRange(0, 2));
  const std::size_t n = static_cast<std::size_t>(page) * head_dim;
  const auto keys = draw_values(in, n, mode, quantizer.key.max_abs_input());
  const auto values = draw_values(in, n, mode, quantizer.value.max_abs_input());

  round_trip(quantizer.key, g, keys);
  round_trip(quantizer.value, g, values);

  // One KV head, two query heads, the page as `page` tokens.
  const ModelShape shape{1, 2, 1, head_dim};
  std::vector<float> query(2 * static_cast<std::size_t>(head_dim));
  for (float& x : query) x = static_cast<float>(in.ConsumeIntegral<std::int8_t>()) / 16.0f;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const auto attend = [&](const auto& cache, SeqId id) {
    std::vector<float> out(query.size());
    cache.attend(id, 0, std::span<const float>(query), std::span<float>(out), scale);
    return out;
  };
  for (const bool check_inputs : {true, false}) {
    CacheConfig config;
    config.page_size = page;
    config.check_inputs = check_inputs;
    KVCache<layout::GQA, Quantizer> cache(shape, config, quantizer);
    const SeqId id = cache.add_sequence();
    const std::vector<float> first(n / 2, 0.5f);  // half a page, so the fuzzed page straddles two
    cache.prefill(id, 0, std::span<const float>(first), std::span<const float>(first));
    const MemoryUsage memory = cache.memory();
    const std::vector<float> before = attend(cache, id);

    // The first element check_values rejects, keys before values.
    std::optional<ErrorCode> expected;
    for (const auto* data : {&keys, &values}) {
      const float limit = data == &keys ? quantizer.key.max_abs_input() : quantizer.value.max_abs_input();
      for (const float x : *data) {
        if (!check_inputs || expected) break;
        if (!std::isfinite(x)) expected = ErrorCode::kNonFinite;
        else if (std::fabs(x) > limit) expected = ErrorCode::kOutOfRange;
      }
    }

    if (expected) {
      bool threw = false;
      try {
        cache.prefill(id, 0, std::span<const float>(keys), std::span<const float>(values));
      } catch (const Error& e) {
        threw = true;
        FUZZ_CHECK(e.code() == *expected);
      }
      FUZZ_CHECK(threw);
      FUZZ_CHECK(cache.length(id, 0) == page / 2);
      const MemoryUsage now = cache.memory();
      FUZZ_CHECK(now.total() == memory.total() && now.pages_in_use == memory.pages_in_use &&
                 now.stored_elements == memory.stored_elements);
      const std::vector<float> after = attend(cache, id);
      FUZZ_CHECK(std::memcmp(after.data(), before.data(), after.size() * sizeof(float)) == 0);
      continue;
    }
    cache.prefill(id, 0, std::span<const float>(keys), std::span<const float>(values));
    FUZZ_CHECK(cache.length(id, 0) == page / 2 + page);
    const std::vector<float> after = attend(cache, id);
    // Finite when every value is storable (check_inputs off lets others through) and nothing is
    // near overflow: a score or a sum of values can overflow fp32 for stored values beyond about
    // 10^37 (fp32, bf16 and FP8 store them).
    if (storable(keys, std::min(0x1p20f, quantizer.key.max_abs_input())) &&
        storable(values, std::min(0x1p20f, quantizer.value.max_abs_input()))) {
      for (const float x : after) FUZZ_CHECK(std::isfinite(x));
      // The cache's kernels (the best ISA here) against exact attention over the codecs' scalar
      // round trip, within the kernels' error bound (support/error_bound.hpp).
      test::ReferenceCache<Quantizer> model(shape, page, 0);
      model.add(id);
      model.write(id, 0, first, first, page / 2 - 1);
      model.write(id, 0, keys, values, page / 2 + page - 1);
      std::vector<double> bounds;
      const auto expected = model.attend(
          cache.quantizer(), id, 0, query, scale, [&](index_t s) { return cache.codec_params(0, s); }, &bounds,
          test::active_operands<typename Quantizer::key_codec>(),
          test::active_operands<typename Quantizer::value_codec>());
      for (std::size_t i = 0; i < after.size(); ++i) {
        FUZZ_CHECK(std::fabs(after[i] - expected[i]) <= bounds[i / head_dim]);
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange(0, 11)) {
    case 0: run<quant::Float<float>>(in); break;
    case 1: run<quant::Float<half>>(in); break;
    case 2: run<quant::Float<bfloat16>>(in); break;
    case 3: run<quant::FP8<quant::E4M3FN>>(in); break;
    case 4: run<quant::FP8<quant::E5M2>>(in); break;
    case 5: run<quant::Int8>(in); break;
    case 6: run<quant::Q8_0>(in); break;
    case 7: run<quant::Q4_0>(in); break;
    case 8: run<quant::KIVI<2>>(in); break;
    case 9: run<quant::KIVI<4>>(in); break;
    case 10: run<quant::KVQuant<4>>(in); break;
    default: run<quant::TurboQuant<8>>(in); break;
  }
  return 0;
}
