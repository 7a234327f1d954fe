// The KVCache API end to end: inputs in every element type, forks, memory, FP8 calibration,
// the executor, and concurrent use of distinct sequences.

#include <catch2/catch.hpp>

#include <cmath>
#include <thread>
#include <vector>

#include "kvpack/kvpack.hpp"
#include "support/random_kv.hpp"
#include "support/reference_cache.hpp"

namespace {

using namespace kvpack;

const ModelShape kShape{2, 8, 2, 64};

std::vector<float> attend(const auto& cache, SeqId s, index_t layer, const std::vector<float>& q, float scale = 0.125f) {
  std::vector<float> out(q.size());
  cache.attend(s, layer, std::span<const float>(q), std::span<float>(out), scale);
  return out;
}

}  // namespace

TEST_CASE("half and bfloat16 inputs are the same as their float values", "[cache]") {
  KVCache<layout::GQA, quant::Float<float>> from_float(kShape), from_half(kShape), from_bf16(kShape);
  const auto k = test::random_rows(40 * kShape.kv_heads, kShape.head_dim, 1);
  const auto v = test::random_rows(40 * kShape.kv_heads, kShape.head_dim, 2);
  std::vector<half> kh, vh;
  std::vector<bfloat16> kb, vb;
  std::vector<float> k_half_values, v_half_values, k_bf_values, v_bf_values;
  for (std::size_t i = 0; i < k.size(); ++i) {
    kh.push_back(half(k[i]));
    vh.push_back(half(v[i]));
    kb.push_back(bfloat16(k[i]));
    vb.push_back(bfloat16(v[i]));
    k_half_values.push_back(kh.back());
    v_half_values.push_back(vh.back());
    k_bf_values.push_back(kb.back());
    v_bf_values.push_back(vb.back());
  }
  const SeqId a = from_float.add_sequence(), b = from_half.add_sequence(), c = from_bf16.add_sequence();
  const SeqId a2 = from_float.add_sequence();
  from_float.prefill(a, 0, std::span<const float>(k_half_values), std::span<const float>(v_half_values));
  from_float.prefill(a2, 0, std::span<const float>(k_bf_values), std::span<const float>(v_bf_values));
  from_half.prefill(b, 0, std::span<const half>(kh), std::span<const half>(vh));
  from_bf16.prefill(c, 0, std::span<const bfloat16>(kb), std::span<const bfloat16>(vb));
  const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 3);
  std::vector<half> qh;
  for (float x : q) qh.push_back(half(x));
  std::vector<float> q_half_values(qh.begin(), qh.end());
  std::vector<float> out(q.size());
  from_half.attend(b, 0, std::span<const half>(qh), std::span<float>(out), 0.125f);
  CHECK(out == attend(from_float, a, 0, q_half_values));
  CHECK(attend(from_bf16, c, 0, q) == attend(from_float, a2, 0, q));
}

TEST_CASE("a fork shares pages, reads the same, and diverges without touching its parent", "[cache]") {
  CacheConfig config;
  config.page_size = 16;
  config.tail_tokens = 16;
  KVCache<layout::GQA, quant::Q4_0> cache(kShape, config);
  const SeqId parent = cache.add_sequence();
  for (index_t layer = 0; layer < kShape.layers; ++layer) {
    const auto k = test::random_rows(100 * kShape.kv_heads, kShape.head_dim, 10 + layer);
    const auto v = test::random_rows(100 * kShape.kv_heads, kShape.head_dim, 20 + layer);
    cache.prefill(parent, layer, std::span<const float>(k), std::span<const float>(v));
  }
  const MemoryUsage before = cache.memory();
  const SeqId child = cache.fork(parent);
  const MemoryUsage after = cache.memory();
  CHECK(after.pages_in_use == before.pages_in_use);  // shared, counted once
  CHECK(after.tails == 2 * before.tails);            // tails are copied
  CHECK(after.stored_elements == 2 * before.stored_elements);
  for (PageId p : cache.pages(child, 0, 0)) CHECK(cache.pool().ref_count(p) == 2);

  const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 30);
  const auto parent_out = attend(cache, parent, 1, q);
  CHECK(attend(cache, child, 1, q) == parent_out);
  for (int i = 0; i < 40; ++i) {  // the child fills new pages of its own
    const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 100 + i);
    cache.append(child, 1, std::span<const float>(k), std::span<const float>(k), 100 + i);
  }
  CHECK(attend(cache, parent, 1, q) == parent_out);
  CHECK(cache.length(parent, 1) == 100);
  CHECK(cache.length(child, 1) == 140);
  cache.release(parent);
  CHECK(attend(cache, child, 0, q) == attend(cache, child, 0, q));
  for (PageId p : cache.pages(child, 0, 0)) CHECK(cache.pool().ref_count(p) == 1);
  cache.release(child);
  CHECK(cache.memory().pages_in_use == 0);
}

TEST_CASE("measured bits per element match each codec's documented rate", "[cache][memory]") {
  // A long sequence amortises the fp32 tail; page payload alone must equal the codec's rate.
  auto check = [](auto quantizer, double documented) {
    using Q = decltype(quantizer);
    const ModelShape shape{1, 4, 1, 128};
    KVCache<layout::GQA, Q> cache(shape, CacheConfig{}, quantizer);
    const SeqId s = cache.add_sequence();
    const auto k = test::random_rows(4096, 128, 1);
    cache.prefill(s, 0, std::span<const float>(k), std::span<const float>(k));
    const MemoryUsage m = cache.memory();
    const double payload_bits = 8.0 * m.page_payload / (4096.0 * 2 * 128);
    INFO(Q::name() << " payload " << payload_bits << " all-in " << m.bits_per_element());
    CHECK(payload_bits == Approx(documented).epsilon(0.02));
    // Slot positions and masks (136 bytes per 32-slot page: 0.13 bits) and the fp32 tail and
    // tables of one short sequence add well under half a bit here.
    CHECK(m.bits_per_element() > documented);
    CHECK(m.bits_per_element() < documented + 0.5);
  };
  check(quant::Float<float>{}, 32.0);
  check(quant::Float<half>{}, 16.0);
  check(quant::Float<bfloat16>{}, 16.0);
  check(quant::FP8<quant::E4M3FN>{}, 8.0);
  check(quant::Int8{}, 8.125);
  check(quant::Q8_0{}, 8.5);
  check(quant::Q4_0{}, 4.5);
}

TEST_CASE("FP8 scales are calibrated from the first prefill, per tensor or per head", "[cache][fp8]") {
  const ModelShape shape{1, 2, 2, 32};
  auto keys = test::random_rows(64 * 2, 32, 1);
  auto values = test::random_rows(64 * 2, 32, 2);
  keys[5] = 40.0f;         // stream 0, token 0
  values[32 + 7] = -9.0f;  // stream 1, token 0
  float key_max[2] = {0, 0}, value_max[2] = {0, 0};
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::size_t s = (i / 32) % 2;
    key_max[s] = std::max(key_max[s], std::fabs(keys[i]));
    value_max[s] = std::max(value_max[s], std::fabs(values[i]));
  }
  SECTION("per tensor") {
    KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> cache(shape);
    const SeqId s = cache.add_sequence();
    cache.prefill(s, 0, std::span<const float>(keys), std::span<const float>(values));
    for (index_t stream = 0; stream < 2; ++stream) {
      CHECK(cache.codec_params(0, stream).first.scale == std::max(key_max[0], key_max[1]) / 200.0f);
      CHECK(cache.codec_params(0, stream).second.scale == std::max(value_max[0], value_max[1]) / 100.0f);
    }
    // A second sequence does not recalibrate.
    const SeqId t = cache.add_sequence();
    auto big = keys;
    big[0] = 1000.0f;
    cache.prefill(t, 0, std::span<const float>(big), std::span<const float>(values));
    CHECK(cache.codec_params(0, 0).first.scale == std::max(key_max[0], key_max[1]) / 200.0f);
  }
  SECTION("per head") {
    quant::FP8Options options;
    options.granularity = quant::ScaleGranularity::kPerHead;
    KVCache<layout::GQA, quant::FP8<quant::E4M3FN>> cache(shape, CacheConfig{}, quant::FP8<quant::E4M3FN>(options));
    const SeqId s = cache.add_sequence();
    cache.prefill(s, 0, std::span<const float>(keys), std::span<const float>(values));
    for (index_t stream = 0; stream < 2; ++stream) {
      CHECK(cache.codec_params(0, stream).first.scale == key_max[stream] / 200.0f);
      CHECK(cache.codec_params(0, stream).second.scale == value_max[stream] / 100.0f);
    }
  }
  SECTION("static") {
    quant::FP8Options options;
    options.calibrate = false;
    options.static_scale = 0.5f;
    KVCache<layout::GQA, quant::FP8<quant::E5M2>> cache(shape, CacheConfig{}, quant::FP8<quant::E5M2>(options));
    const SeqId s = cache.add_sequence();
    cache.prefill(s, 0, std::span<const float>(keys), std::span<const float>(values));
    CHECK(cache.codec_params(0, 1).first.scale == 0.5f);
    CHECK(cache.codec_params(0, 1).second.scale == 0.5f);
  }
}

TEST_CASE("the executor spreads streams over threads with identical results", "[cache][threads]") {
  ThreadPool pool(3);
  CacheConfig parallel;
  parallel.executor = std::ref(pool);
  const ModelShape shape{1, 32, 8, 128};
  KVCache<layout::GQA, quant::Q8_0> serial_cache(shape), parallel_cache(shape, parallel);
  const SeqId a = serial_cache.add_sequence(), b = parallel_cache.add_sequence();
  const auto k = test::random_rows(300 * 8, 128, 1);
  const auto v = test::random_rows(300 * 8, 128, 2);
  serial_cache.prefill(a, 0, std::span<const float>(k), std::span<const float>(v));
  parallel_cache.prefill(b, 0, std::span<const float>(k), std::span<const float>(v));
  for (int i = 0; i < 5; ++i) {
    const auto q = test::random_rows(32, 128, 10 + i);
    CHECK(attend(parallel_cache, b, 0, q) == attend(serial_cache, a, 0, q));
  }
}

TEST_CASE("distinct sequences can be written and read from different threads", "[cache][threads]") {
  CacheConfig config;
  config.page_size = 16;
  KVCache<layout::GQA, quant::Int8> cache(kShape, config);
  test::ReferenceCache<quant::Int8> model(kShape, 16, 0);
  constexpr int kThreads = 4;
  std::vector<SeqId> ids;
  for (int i = 0; i < kThreads; ++i) ids.push_back(cache.add_sequence());
  auto work = [&](int t) {
    for (int step = 0; step < 150; ++step) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 1000 * t + step * 2 + layer);
        cache.append(ids[t], layer, std::span<const float>(k), std::span<const float>(k), step);
      }
      if (step % 10 == 9) {
        const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 7 + t);
        (void)attend(cache, ids[t], step % 2, q);
      }
      if (step % 50 == 0) {  // others fork and release concurrently
        const SeqId f = cache.fork(ids[t]);
        cache.release(f);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& th : threads) th.join();
  // Every sequence holds exactly what its thread wrote.
  for (int t = 0; t < kThreads; ++t) {
    model.add(ids[t]);
    for (int step = 0; step < 150; ++step) {
      for (index_t layer = 0; layer < kShape.layers; ++layer) {
        const auto k = test::random_rows(kShape.kv_heads, kShape.head_dim, 1000 * t + step * 2 + layer);
        model.write(ids[t], layer, k, k, step);
      }
    }
    const auto q = test::random_rows(kShape.q_heads, kShape.head_dim, 99);
    std::vector<double> bounds;
    const auto expected = model.attend(cache.quantizer(), ids[t], 1, q, 0.125f,
                                       [&](index_t s) { return cache.codec_params(1, s); }, &bounds,
                                       test::active_operands<quant::Int8Codec<Plane::kKey>>(),
                                       test::active_operands<quant::Int8Codec<Plane::kValue>>());
    const auto out = attend(cache, ids[t], 1, q);
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::fabs(out[i] - expected[i]) <= bounds[i / kShape.head_dim]);
  }
  for (SeqId id : ids) cache.release(id);
  CHECK(cache.memory().total() == 0);
}
