// Every decode-attention kernel on every instruction set this CPU runs, against the scalar
// reference (kernels/reference.hpp) on the same page bytes: random data, outlier channels,
// zero rows, NaN/Inf (formats that can hold them), dead slots, tails of any length.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "kvpack/kernels/attend_stream.hpp"
#include "kvpack/kernels/reference.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

/// Pages of one stream built with the codecs' own scalar encoders, exactly as the cache lays
/// them out (K plane at 0, V plane 64-byte aligned after it).
template <class Quantizer>
struct StreamFixture {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;

  Quantizer quantizer{};
  quant::PageGeometry geometry;
  std::size_t value_offset = 0;
  std::size_t payload_bytes = 0;
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte[], Free> arena;
  std::vector<const std::byte*> pages;
  std::vector<std::vector<std::uint64_t>> masks;
  std::vector<const std::uint64_t*> mask_pointers;
  std::vector<float> tail_keys, tail_values;
  typename KeyCodec::params_type key_params{};
  typename ValueCodec::params_type value_params{};

  StreamFixture(index_t page_size, index_t head_dim, index_t page_count, index_t tail_count,
                const std::vector<float>& keys, const std::vector<float>& values) {
    geometry = {page_size, head_dim};
    value_offset = (quantizer.key.plane_bytes(geometry) + 63) / 64 * 64;
    payload_bytes = (value_offset + quantizer.value.plane_bytes(geometry) + 63) / 64 * 64;
    key_params = quantizer.key.initial_params(0, 0);
    value_params = quantizer.value.initial_params(0, 0);
    arena.reset(static_cast<std::byte*>(
        ::operator new[](payload_bytes * std::max<index_t>(page_count, 1), std::align_val_t{64})));
    for (index_t i = 0; i < page_count; ++i) {
      std::byte* page = arena.get() + i * payload_bytes;
      const std::size_t first = static_cast<std::size_t>(i) * page_size * head_dim;
      quantizer.key.encode(geometry, keys.data() + first, head_dim, key_params, page);
      quantizer.value.encode(geometry, values.data() + first, head_dim, value_params, page + value_offset);
      pages.push_back(page);
    }
    const std::size_t paged = static_cast<std::size_t>(page_count) * page_size * head_dim;
    tail_keys.assign(keys.begin() + paged, keys.begin() + paged + tail_count * head_dim);
    tail_values.assign(values.begin() + paged, values.begin() + paged + tail_count * head_dim);
  }

  /// Marks slots dead with probability ~1/4 on every other page (a fully dead page included).
  void kill_some_slots(std::uint32_t seed) {
    std::mt19937 rng(seed);
    masks.assign(pages.size(), std::vector<std::uint64_t>((geometry.page_size + 63) / 64, ~std::uint64_t{0}));
    for (std::size_t i = 0; i < pages.size(); i += 2) {
      for (index_t t = 0; t < geometry.page_size; ++t) {
        if (i == 2 || rng() % 4 == 0) masks[i][t / 64] &= ~(std::uint64_t{1} << (t % 64));
      }
    }
    mask_pointers.clear();
    for (auto& m : masks) mask_pointers.push_back(m.data());
  }

  [[nodiscard]] kernels::PageRun run() const {
    return {pages.data(), mask_pointers.empty() ? nullptr : mask_pointers.data(),
            static_cast<index_t>(pages.size()), 0, geometry.page_size, geometry.head_dim,
            value_offset, payload_bytes};
  }
  [[nodiscard]] kernels::TailView tail() const {
    return {tail_keys.data(), tail_values.data(),
            static_cast<index_t>(tail_keys.size() / geometry.head_dim)};
  }
};

template <class Codec>
constexpr bool kIntegerCodec = !std::is_same_v<typename Codec::params_type, quant::FP8Params> &&
                               !std::is_same_v<Codec, quant::FloatCodec<float, Plane::kKey>> &&
                               !std::is_same_v<Codec, quant::FloatCodec<float, Plane::kValue>> &&
                               !std::is_same_v<Codec, quant::FloatCodec<half, Plane::kKey>> &&
                               !std::is_same_v<Codec, quant::FloatCodec<half, Plane::kValue>> &&
                               !std::is_same_v<Codec, quant::FloatCodec<bfloat16, Plane::kKey>> &&
                               !std::is_same_v<Codec, quant::FloatCodec<bfloat16, Plane::kValue>>;

/// The bound on |SIMD - reference| per output element, from the kernels' arithmetic:
/// - fp32 accumulation in a different order: relative 1e-5 of the largest value;
/// - on the AVX-512 integer path, the int16 query moves each score by at most
///   δ = max|q|/65534 · Σ_c |k̂_c| (rounding to ±0.5 of a step), which moves each normalised
///   weight by a factor within e^{±2δ}: output error ≤ 2(e^{2δ} - 1)·max|v̂|;
/// - and the int16 weights: each off by ≤ half a step of (page max of w·s)/32767; summed over a
///   page of P slots and over pages (Σ_pages max_p ≤ Σ p = l) this is ≤ P/65534 · max|v̂|·1.01.
template <class Fixture>
double error_bound(const Fixture& f, const std::vector<float>& queries, index_t group, bool int16_path) {
  using KeyCodec = typename Fixture::KeyCodec;
  using ValueCodec = typename Fixture::ValueCodec;
  const index_t d = f.geometry.head_dim;
  std::vector<float> decoded(static_cast<std::size_t>(f.geometry.page_size) * d);
  double max_value = 0.0;
  double max_key_l1 = 0.0;
  auto visit = [&](const float* k, const float* v) {
    double l1 = 0.0;
    for (index_t c = 0; c < d; ++c) {
      l1 += std::fabs(k[c]);
      max_value = std::max(max_value, static_cast<double>(std::fabs(v[c])));
    }
    max_key_l1 = std::max(max_key_l1, l1);
  };
  std::vector<float> decoded_v(decoded.size());
  for (const std::byte* page : f.pages) {
    f.quantizer.key.decode(f.geometry, page, f.key_params, decoded.data());
    f.quantizer.value.decode(f.geometry, page + f.value_offset, f.value_params, decoded_v.data());
    for (index_t t = 0; t < f.geometry.page_size; ++t) visit(&decoded[t * d], &decoded_v[t * d]);
  }
  for (std::size_t t = 0; t < f.tail_keys.size() / d; ++t) visit(&f.tail_keys[t * d], &f.tail_values[t * d]);
  double max_query = 0.0;
  for (float q : queries) max_query = std::max(max_query, static_cast<double>(std::fabs(q)));
  (void)group;
  double bound = 1e-5 * max_value + 1e-6;
  if (int16_path && kIntegerCodec<KeyCodec>) {
    const double delta = max_query / 65534.0 * max_key_l1;
    bound += 2.0 * std::expm1(2.0 * delta) * max_value;
  }
  if (int16_path && kIntegerCodec<ValueCodec>) bound += f.geometry.page_size / 65534.0 * max_value * 1.01;
  return bound;
}

template <class Quantizer>
void check_all_isas(index_t page_size, index_t head_dim, index_t page_count, index_t tail_count,
                    index_t group, std::vector<float> keys, std::vector<float> values,
                    std::vector<float> queries, bool dead_slots) {
  using KeyCodec = typename Quantizer::key_codec;
  using ValueCodec = typename Quantizer::value_codec;
  StreamFixture<Quantizer> f(page_size, head_dim, page_count, tail_count, keys, values);
  if (dead_slots && page_count > 0) f.kill_some_slots(7);
  std::vector<float> expected(static_cast<std::size_t>(group) * head_dim);
  kernels::reference::attend_stream(f.quantizer.key, f.quantizer.value, f.run(), f.key_params,
                                    f.value_params, f.tail(), queries.data(), group, expected.data());
  kernels::Workspace workspace;
  workspace.prepare(group, head_dim, page_size, tail_count);
  int isas = 0;
  kernels::cpu::cpu_archs::for_each([&](auto arch) {
    using Arch = decltype(arch);
    if (!kernels::cpu::cpu_supports<Arch>()) return;
    ++isas;
    const auto kernel_set = kernels::KernelSet<KeyCodec, ValueCodec>::template for_arch<Arch>();
    std::vector<float> out(expected.size(), -1.0f);
    kernels::attend_stream<KeyCodec, ValueCodec>(f.run(), f.key_params, f.value_params, f.tail(),
                                                 queries.data(), group, out.data(), workspace, kernel_set);
    const bool int16_path = std::is_same_v<Arch, xsimd::avx512bw>;
    const double bound = error_bound(f, queries, group, int16_path);
    DYNAMIC_SECTION("isa " << kernels::cpu::isa_name<Arch>() << " P=" << page_size << " d=" << head_dim
                           << " pages=" << page_count << " tail=" << tail_count << " g=" << group) {
      for (std::size_t i = 0; i < out.size(); ++i) {
        if (!std::isfinite(expected[i])) {
          // Which non-finite value comes out can differ: a weight that underflows to 0 in fp32
          // but not in double turns inf·w into NaN. It must not come out finite.
          CHECK(!std::isfinite(out[i]));
        } else {
          INFO("element " << i << " bound " << bound);
          CHECK(std::fabs(out[i] - expected[i]) <= bound);
        }
      }
    }
  });
  CHECK(isas >= 1);
}

// Llama-like shapes and the awkward ones: head_dim 8 (stories260K), one page, tail only,
// page counts that do not fill a 512-token chunk, group sizes 1..8 and 5.
#define KVPACK_ALL_QUANTIZERS                                                             \
  quant::Float<float>, quant::Float<half>, quant::Float<bfloat16>, quant::FP8<quant::E4M3FN>, \
      quant::FP8<quant::E5M2>, quant::Int8, quant::Q8_0, quant::Q4_0, (quant::Mixed<quant::Q8_0, quant::Q4_0>)

TEMPLATE_TEST_CASE("every ISA matches the reference on random data", "[kernels][cpu]",
                   KVPACK_ALL_QUANTIZERS) {
  struct Case {
    index_t page_size, head_dim, pages, tail, group;
  };
  const Case cases[] = {{32, 128, 20, 0, 4},  {32, 128, 3, 17, 8}, {16, 64, 5, 0, 1},
                        {64, 128, 2, 63, 2},  {32, 32, 1, 0, 5},   {32, 256, 4, 3, 4},
                        {16, 128, 0, 9, 4},   {256, 128, 2, 1, 4}, {48, 96, 3, 5, 3}};
  for (const Case& c : cases) {
    const std::size_t rows = static_cast<std::size_t>(c.pages) * c.page_size + c.tail;
    const auto keys = test::random_rows(rows, c.head_dim, 11, 4);
    const auto values = test::random_rows(rows, c.head_dim, 12);
    auto queries = test::random_rows(c.group, c.head_dim, 13, 4, 3.0f);
    for (float& q : queries) q /= std::sqrt(static_cast<float>(c.head_dim));
    check_all_isas<TestType>(c.page_size, c.head_dim, c.pages, c.tail, c.group, keys, values, queries, false);
  }
}

TEMPLATE_TEST_CASE("every ISA matches the reference with dead slots", "[kernels][cpu]", KVPACK_ALL_QUANTIZERS) {
  const index_t page_size = 32, head_dim = 128, pages = 9, tail = 5, group = 4;
  const std::size_t rows = static_cast<std::size_t>(pages) * page_size + tail;
  check_all_isas<TestType>(page_size, head_dim, pages, tail, group, test::random_rows(rows, head_dim, 21, 4),
                           test::random_rows(rows, head_dim, 22), test::random_rows(group, head_dim, 23), true);
}

TEMPLATE_TEST_CASE("every ISA matches the reference on adversarial rows", "[kernels][cpu]", KVPACK_ALL_QUANTIZERS) {
  const index_t page_size = 32, head_dim = 64, pages = 4, tail = 7, group = 4;
  const std::size_t rows = static_cast<std::size_t>(pages) * page_size + tail;
  auto keys = test::random_rows(rows, head_dim, 31, 8, 100.0f);  // strong outlier channels
  auto values = test::random_rows(rows, head_dim, 32);
  for (int c = 0; c < head_dim; ++c) {  // zero vectors, a constant row, one huge element
    keys[5 * head_dim + c] = 0.0f;
    values[6 * head_dim + c] = 0.0f;
    keys[40 * head_dim + c] = 0.25f;
  }
  values[70 * head_dim + 3] = 3000.0f;
  auto queries = test::random_rows(group, head_dim, 33);
  queries[0] = 0.0f;
  check_all_isas<TestType>(page_size, head_dim, pages, tail, group, keys, values, queries, false);
}

TEMPLATE_TEST_CASE("element-wise formats propagate NaN and Inf like the reference", "[kernels][cpu]",
                   quant::Float<float>, quant::Float<half>, quant::Float<bfloat16>, quant::FP8<quant::E5M2>) {
  const index_t page_size = 16, head_dim = 32, pages = 3, tail = 2, group = 2;
  const std::size_t rows = static_cast<std::size_t>(pages) * page_size + tail;
  auto keys = test::random_rows(rows, head_dim, 41);
  auto values = test::random_rows(rows, head_dim, 42);
  values[20 * head_dim + 1] = std::numeric_limits<float>::quiet_NaN();
  values[21 * head_dim + 2] = std::numeric_limits<float>::infinity();
  check_all_isas<TestType>(page_size, head_dim, pages, tail, group, keys, values,
                           test::random_rows(group, head_dim, 43), false);
}

TEMPLATE_TEST_CASE("element-wise formats handle head_dim that is not a multiple of the vector width",
                   "[kernels][cpu]", quant::Float<float>, quant::Float<half>, quant::Float<bfloat16>,
                   quant::FP8<quant::E4M3FN>, quant::Int8) {
  for (index_t head_dim : {8, 24, 40}) {
    const index_t page_size = 16, pages = 5, tail = 11, group = 2;
    const std::size_t rows = static_cast<std::size_t>(pages) * page_size + tail;
    check_all_isas<TestType>(page_size, head_dim, pages, tail, group, test::random_rows(rows, head_dim, 51, 1),
                             test::random_rows(rows, head_dim, 52), test::random_rows(group, head_dim, 53), false);
  }
}

}  // namespace
