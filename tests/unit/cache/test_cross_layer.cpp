// layout::CrossLayer: K adjacent layers share one cache. The bytes divide by K, every layer of a
// group reads exactly what its first layer wrote, a write to another layer of a group is
// rejected without changing anything, and per-layer codec parameters are the writer's.

#include <catch2/catch.hpp>

#include <limits>
#include <vector>

#include "kvpack/io/page_file.hpp"
#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"

namespace {

using namespace kvpack;

std::vector<float> attend(const auto& cache, SeqId s, index_t layer, const std::vector<float>& q) {
  std::vector<float> out(q.size());
  cache.attend(s, layer, std::span<const float>(q), std::span<float>(out), 0.125f);
  return out;
}

/// Static FP8 scales per (layer, KV head) for 3 layers x 2 heads, [layers][kv_heads] row-major.
quant::FP8Options per_head_scales() {
  quant::FP8Options options;
  options.calibrate = false;
  options.granularity = quant::ScaleGranularity::kPerHead;
  options.kv_heads = 2;
  options.static_head_scales = {0.5f, 0.25f, 2.0f, 4.0f, 8.0f, 16.0f};
  return options;
}

}  // namespace

TEST_CASE("CrossLayer<GQA, 2> stores half the layers and every layer reads its group's cache", "[cache][cross_layer]") {
  const ModelShape shape{5, 8, 2, 64};  // an odd layer count: the last group has one layer
  using Shared = KVCache<layout::CrossLayer<layout::GQA, 2>, quant::Float<half>>;
  using PerLayer = KVCache<layout::GQA, quant::Float<half>>;
  Shared shared(shape);
  PerLayer per_layer(shape);
  const SeqId a = shared.add_sequence();
  const SeqId b = per_layer.add_sequence();
  const index_t tokens = 100;
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    const auto k = test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim, 10 + layer);
    const auto v = test::random_rows(static_cast<std::size_t>(tokens) * shape.kv_heads, shape.head_dim, 20 + layer);
    per_layer.prefill(b, layer, std::span<const float>(k), std::span<const float>(v));
    if (layer % 2 == 0) shared.prefill(a, layer, std::span<const float>(k), std::span<const float>(v));
  }
  // 3 cache layers of 5: pages and tails in proportion.
  CHECK(shared.memory().page_payload * 5 == per_layer.memory().page_payload * 3);
  CHECK(shared.memory().tails * 5 == per_layer.memory().tails * 3);

  const auto q = test::random_rows(shape.q_heads, shape.head_dim, 30);
  for (index_t layer = 0; layer < shape.layers; ++layer) {
    const index_t writer = layer - layer % 2;
    CHECK(shared.length(a, layer) == tokens);
    CHECK(attend(shared, a, layer, q) == attend(per_layer, b, writer, q));
    CHECK(shared.read_back(a, layer, 1).keys == per_layer.read_back(b, writer, 1).keys);
  }
}

TEST_CASE("a write to a reading layer of a group is rejected and changes nothing", "[cache][cross_layer]") {
  const ModelShape shape{4, 4, 2, 32};
  KVCache<layout::CrossLayer<layout::GQA, 2>, quant::Q8_0> cache(shape);
  const SeqId seq = cache.add_sequence();
  const auto k = test::random_rows(40 * 2, 32, 1);
  const auto v = test::random_rows(40 * 2, 32, 2);
  cache.prefill(seq, 2, std::span<const float>(k), std::span<const float>(v));
  const MemoryUsage before = cache.memory();
  CHECK_THROWS_WITH(cache.prefill(seq, 3, std::span<const float>(k), std::span<const float>(v)),
                    Catch::Contains("layer 3 reads the cache layer 2 writes") && Catch::Contains("write layer 2"));
  CHECK_THROWS_AS(cache.append(seq, 1, std::span<const float>(k.data(), 64), std::span<const float>(v.data(), 64), 40),
                  Error);
  CHECK(cache.length(seq, 2) == 40);
  CHECK(cache.length(seq, 3) == 40);
  CHECK(cache.length(seq, 0) == 0);
  CHECK(cache.memory().total() == before.total());
  CHECK_THROWS_AS(cache.length(seq, 4), Error);  // past the model's layers, not the cache's
}

TEST_CASE("one cache for the whole model (YOCO) and per-layer parameters of the writer", "[cache][cross_layer]") {
  const ModelShape shape{3, 4, 2, 32};
  // Per-head static FP8 scales, [layers][kv_heads]: cache layer 1 of CrossLayer<…, 2> is written
  // by model layer 2, so it takes layer 2's scales.
  const quant::FP8Options options = per_head_scales();
  KVCache<layout::CrossLayer<layout::GQA, 2>, quant::FP8<quant::E4M3FN>> pairs(shape, {}, quant::FP8<quant::E4M3FN>(options));
  CHECK(pairs.codec_params(1, 0).first.scale == 0.5f);
  CHECK(pairs.codec_params(2, 0).first.scale == 8.0f);
  CHECK(pairs.codec_params(2, 1).second.scale == 16.0f);

  KVCache<layout::CrossLayer<layout::GQA, 8>, quant::Float<float>> yoco(shape);
  const SeqId seq = yoco.add_sequence();
  const auto k = test::random_rows(50 * 2, 32, 3);
  const auto v = test::random_rows(50 * 2, 32, 4);
  yoco.prefill(seq, 0, std::span<const float>(k), std::span<const float>(v));
  CHECK_THROWS_AS(yoco.prefill(seq, 2, std::span<const float>(k), std::span<const float>(v)), Error);
  const auto q = test::random_rows(4, 32, 5);
  CHECK(attend(yoco, seq, 2, q) == attend(yoco, seq, 0, q));

  // Any K of at least the layer count is YOCO, the largest included (⌈layers / K⌉ overflowed
  // there until 2026-12-07), and its page file loads (a K above the reader's layer limit was
  // written as it was, and refused on reading).
  using Widest = KVCache<layout::CrossLayer<layout::GQA, std::numeric_limits<index_t>::max()>, quant::Float<float>>;
  Widest widest(shape);
  KVCache<layout::CrossLayer<layout::GQA, 8>, quant::Float<float>> eight(shape);
  const SeqId one = widest.add_sequence(), other = eight.add_sequence();
  const auto whole_pages_k = test::random_rows(64 * 2, 32, 6), whole_pages_v = test::random_rows(64 * 2, 32, 7);
  widest.prefill(one, 0, std::span<const float>(whole_pages_k), std::span<const float>(whole_pages_v));
  eight.prefill(other, 0, std::span<const float>(whole_pages_k), std::span<const float>(whole_pages_v));
  CHECK(widest.memory().total() == eight.memory().total());
  CHECK(attend(widest, one, 2, q) == attend(eight, other, 0, q));
  const std::vector<std::byte> file = io::write_page_file(widest, one, {"yoco", {}});
  Widest loaded(shape);
  const SeqId back = io::load_page_file(loaded, io::PageFileView::parse(file, "yoco file"));
  CHECK(attend(loaded, back, 1, q) == attend(widest, one, 1, q));
}

TEST_CASE("per-head static FP8 scales must be rows of the model's shape", "[cache][cross_layer][errors]") {
  // [layers][kv_heads] row-major: rows of another length would hand a head the scale of another
  // head or layer. Both tables below are long enough for every index the cache asks for.
  const ModelShape shape{3, 4, 2, 32};
  const quant::FP8Options options = per_head_scales();
  using Cache = KVCache<layout::CrossLayer<layout::GQA, 2>, quant::FP8<quant::E4M3FN>>;
  CHECK_NOTHROW(Cache(shape, {}, quant::FP8<quant::E4M3FN>(options)));
  quant::FP8Options one_head_rows = options;  // 6 layers x 1 head
  one_head_rows.kv_heads = 1;
  CHECK_THROWS_WITH(Cache(shape, {}, quant::FP8<quant::E4M3FN>(one_head_rows)),
                    Catch::Contains("rows of 1") && Catch::Contains("3 layers x 2 KV heads"));
  quant::FP8Options four_layers = options;
  four_layers.static_head_scales.insert(four_layers.static_head_scales.end(), {1.0f, 1.0f});
  CHECK_THROWS_AS(Cache(shape, {}, quant::FP8<quant::E4M3FN>(four_layers)), Error);
}
