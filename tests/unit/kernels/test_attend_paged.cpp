// kernels::attend_paged over host memory: an engine's own page tables (several streams of
// different lengths in one launch, tails of any length, tail-only streams) through the CPU
// kernels, each stream against the scalar reference on the same page bytes; a KVCache's own pages
// and full-precision rows (CacheLayerLaunch), equal to KVCache::attend; and every argument it
// rejects, with nothing written to `out`.

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "kvpack/kernels/attend_paged.hpp"
#include "kvpack/kernels/cache_launch.hpp"
#include "kvpack/kvpack.hpp"
#include "support/host_launch.hpp"

namespace {

using namespace kvpack;
using test::HostLaunch;
using test::StreamLength;

template <class Quantizer>
void check_launch(index_t page_size, index_t head_dim, index_t group, const std::vector<StreamLength>& shapes,
                  std::uint32_t seed) {
  HostLaunch<Quantizer> launch(page_size, head_dim, group, shapes, seed);
  kernels::PagedWorkspace workspace;
  kernels::attend_paged<typename Quantizer::key_codec, typename Quantizer::value_codec>(launch.args(), launch.max_pages,
                                                                                        workspace);
  launch.check_outputs(launch.out, dispatch::active_cpu_isa());
}

}  // namespace

TEST_CASE("attend_paged over host memory matches the reference for every stream of a launch", "[kernels]") {
  STATIC_REQUIRE_FALSE(dispatch::kHasCudaBackend);  // this module does not link kvpack::cuda
  const std::vector<StreamLength> mixed{{9, 31}, {1, 0}, {0, 7}, {4, 13}};
  check_launch<quant::Float<half>>(32, 128, 4, mixed, 100);
  check_launch<quant::Q4_0>(32, 128, 4, mixed, 200);
  check_launch<quant::KIVI<4, 32>>(32, 128, 4, mixed, 300);
  check_launch<quant::KIVI<2, 32>>(64, 64, 2, {{3, 5}, {2, 0}}, 400);
  check_launch<quant::Int8>(16, 96, 3, {{5, 0}, {0, 16}}, 500);
  check_launch<quant::Float<float>>(32, 64, 1, {{2, 0}}, 600);  // no tails at all: tail arrays null
}

TEST_CASE("attend_paged rejects bad launches before writing anything", "[kernels]") {
  using Q = quant::Q4_0;
  using K = Q::key_codec;
  using V = Q::value_codec;
  HostLaunch<Q> launch(32, 64, 2, {{3, 5}, {1, 2}}, 700);
  kernels::PagedWorkspace workspace;
  const std::vector<float> untouched = launch.out;
  auto rejects = [&](kernels::PagedArgs<K, V> a, ErrorCode code, const char* needle, index_t max_pages = -1) {
    INFO(needle);
    try {
      kernels::attend_paged<K, V>(a, max_pages < 0 ? launch.max_pages : max_pages, workspace);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == code);
      CHECK_THAT(e.what(), Catch::Matchers::Contains(needle));
    }
    CHECK(launch.out == untouched);
  };
  auto with = [&](auto change) {
    kernels::PagedArgs<K, V> a = launch.args();
    change(a);
    return a;
  };
  using A = kernels::PagedArgs<K, V>;
  rejects(with([](A& a) { a.group = 0; }), ErrorCode::kInvalidArgument, "must be positive");
  rejects(with([](A& a) { a.tail_stride = -1; }), ErrorCode::kInvalidArgument, "non-negative");
  rejects(with([](A& a) { a.head_dim = 48; }), ErrorCode::kUnsupported, "q4_0");  // not a multiple of 32
  // q4_0 encodes pages of 40 tokens, but the CPU kernels step through 8 or 16 at a time.
  rejects(with([](A& a) {
            a.page_size = 40;
            a.payload_bytes = 64 * 64;
            a.value_offset = 32 * 64;
          }),
          ErrorCode::kInvalidArgument, "multiple of 16 tokens, as a cache's do; got page_size 40");
  rejects(with([](A& a) { a.value_offset = 64; }), ErrorCode::kInvalidArgument, "overlaps the K plane");
  rejects(with([](A& a) { a.payload_bytes -= 64; }), ErrorCode::kInvalidArgument, "runs past the payload");
  // value_offset + the V plane's bytes wraps around to a small number: still past the payload.
  rejects(with([](A& a) { a.value_offset = std::numeric_limits<std::size_t>::max() - 63; }),
          ErrorCode::kInvalidArgument, "runs past the payload");
  rejects(with([](A& a) { a.payload_bytes += 32; }), ErrorCode::kInvalidArgument, "multiple of 64");
  rejects(with([](A& a) { a.queries = nullptr; }), ErrorCode::kInvalidArgument, "queries is null");
  rejects(with([](A& a) { a.pages = nullptr; }), ErrorCode::kInvalidArgument, "pages is null, but stream 0 has 3");
  rejects(with([](A& a) { a.tail_count = nullptr; }), ErrorCode::kInvalidArgument, "tail_count is null");
  rejects(launch.args(), ErrorCode::kInvalidArgument, "max_pages 2", 2);  // stream 0 holds 3 pages

  const std::vector<index_t> decreasing{0, 3, 2};
  rejects(with([&](A& a) { a.first_page = decreasing.data(); }), ErrorCode::kInvalidArgument, "must not decrease");
  // A difference that overflows 32 bits (undefined before; the sanitizer run checks) is rejected.
  const std::vector<index_t> wrapping{0, 3, std::numeric_limits<index_t>::min()};
  rejects(with([&](A& a) { a.first_page = wrapping.data(); }), ErrorCode::kInvalidArgument, "must not decrease");
  const std::vector<index_t> too_many_rows{6, 2};
  rejects(with([&](A& a) { a.tail_count = too_many_rows.data(); }), ErrorCode::kInvalidArgument, "tail_stride 5");
  const std::vector<index_t> no_rows{5, 0};
  const std::vector<index_t> no_pages{0, 3, 3};
  rejects(with([&](A& a) {
            a.tail_count = no_rows.data();
            a.first_page = no_pages.data();
          }),
          ErrorCode::kInvalidArgument, "each stream needs a token");
  std::vector<const std::byte*> shifted = launch.pages;
  shifted[1] += 16;
  rejects(with([&](A& a) { a.pages = shifted.data(); }), ErrorCode::kInvalidArgument, "page 1 is null or not 64-byte");

  // Launches that carry KVQuant's device parameters cannot run on the CPU.
  using KVQ = quant::KVQuant<4>;
  kernels::PagedArgs<KVQ::key_codec, KVQ::value_codec> device_params;
  device_params.pages = launch.pages.data();
  device_params.first_page = launch.first_page.data();
  const std::vector<kernels::cuda::device_params_t<KVQ::key_codec>> kp(2);
  const std::vector<kernels::cuda::device_params_t<KVQ::value_codec>> vp(2);
  device_params.key_params = kp.data();
  device_params.value_params = vp.data();
  device_params.queries = launch.queries.data();
  device_params.out = launch.out.data();
  device_params.streams = 2;
  device_params.group = 2;
  device_params.page_size = 32;
  device_params.head_dim = 64;
  device_params.value_offset = 4096;
  device_params.payload_bytes = 8192;
  try {
    kernels::attend_paged<KVQ::key_codec, KVQ::value_codec>(device_params, 3, workspace);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK_THAT(e.what(), Catch::Matchers::Contains("attend through a KVCache"));
  }
  CHECK(launch.out == untouched);
}

namespace {

/// A host cache's own pages and full-precision rows as one launch over all KV streams of a layer
/// (kernels::CacheLayerLaunch, through the cache's public accessors), against KVCache::attend on
/// the same cache.
template <class Quantizer>
void check_cache_launch(index_t tokens, CacheConfig config = {}) {
  const ModelShape shape{1, 8, 2, 128};
  config.page_size = 32;
  KVCache<layout::GQA, Quantizer> cache(shape, config);
  const SeqId seq = cache.add_sequence();
  const std::vector<float> keys =
      test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim, 41, 4, 10.0f);
  const std::vector<float> values = test::random_rows(keys.size() / shape.head_dim, shape.head_dim, 42);
  cache.prefill(seq, 0, std::span<const float>(keys), std::span<const float>(values));
  const std::vector<float> query = test::random_rows(static_cast<std::size_t>(shape.q_heads), shape.head_dim, 43);
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  std::vector<float> expected(query.size());
  cache.attend(seq, 0, std::span<const float>(query), std::span<float>(expected), scale);

  kernels::CacheLayerLaunch launch(cache, seq, 0);
  std::vector<float> scaled(query.size()), out(query.size(), -7.0f);
  for (std::size_t i = 0; i < query.size(); ++i) scaled[i] = query[i] * scale;  // as KVCache::attend scales
  launch.args().queries = scaled.data();
  launch.args().out = out.data();
  kernels::PagedWorkspace workspace;
  launch.attend(workspace);
  INFO(Quantizer::name() << ", " << tokens << " tokens, " << launch.args().tail_stride << "-row tail stride");
  CHECK(out == expected);  // the same kernels over the same bytes in the same order
}

}  // namespace

TEST_CASE("attend_paged over a KVCache's own pages and rows equals KVCache::attend", "[kernels]") {
  check_cache_launch<quant::Float<half>>(8 * 32);  // whole pages, no rows
  check_cache_launch<quant::Float<half>>(8 * 32 + 5);
  check_cache_launch<quant::Q4_0>(33 * 32 + 31);  // more than one 512-token chunk of pages
  check_cache_launch<quant::Int8>(3 * 32 + 1);
  check_cache_launch<quant::KIVI<4, 32>>(20 * 32 + 7);  // the residual window's rows too
  check_cache_launch<quant::KIVI<2, 32>>(9 * 32 + 12);
  CacheConfig with_prefix;
  with_prefix.exact_prefix_tokens = 4;  // exact rows first, then the tail
  check_cache_launch<quant::Q8_0>(6 * 32 + 3, with_prefix);
  CacheConfig tail;
  tail.tail_tokens = 64;  // the newest 64 tokens and more stay in fp32
  check_cache_launch<quant::Float<bfloat16>>(5 * 32 + 9, tail);
  check_cache_launch<quant::Float<half>>(20, tail);  // rows only, no page

  CacheConfig pre_rope;
  pre_rope.key_rope = RopeSpec{};
  KVCache<layout::GQA, quant::Float<half>> rotated({1, 8, 2, 128}, pre_rope);
  const SeqId seq = rotated.add_sequence();
  CHECK_THROWS_WITH(kernels::CacheLayerLaunch(rotated, seq, 0), Catch::Matchers::Contains("before RoPE"));
}
